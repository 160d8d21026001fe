#include "backend/memory.h"

#include <utility>

#include "common/error.h"

namespace malleus::backend {

namespace {

void raise_to(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

const char* memory_kind_name(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kParameters:
      return "parameters";
    case MemoryKind::kGradients:
      return "gradients";
    case MemoryKind::kOptimizer:
      return "optimizer";
    case MemoryKind::kActivations:
      return "activations";
    case MemoryKind::kWorkspace:
      return "workspace";
    case MemoryKind::kCommunication:
      return "communication";
  }
  return "unknown";
}

int64_t MemoryFigures::total() const {
  int64_t sum = 0;
  for (int64_t b : bytes) sum += b;
  return sum;
}

void MemoryLedger::add(MemoryKind kind, int64_t bytes) {
  const auto k = static_cast<size_t>(kind);
  raise_to(peak_[k], current_[k].fetch_add(bytes, std::memory_order_relaxed) + bytes);
  raise_to(peak_total_, total_.fetch_add(bytes, std::memory_order_relaxed) + bytes);
}

void MemoryLedger::remove(MemoryKind kind, int64_t bytes) {
  current_[static_cast<size_t>(kind)].fetch_sub(bytes, std::memory_order_relaxed);
  total_.fetch_sub(bytes, std::memory_order_relaxed);
}

MemoryFigures MemoryLedger::current() const {
  MemoryFigures f;
  for (size_t k = 0; k < f.bytes.size(); ++k) f.bytes[k] = current_[k].load();
  return f;
}

MemoryFigures MemoryLedger::peak() const {
  MemoryFigures f;
  for (size_t k = 0; k < f.bytes.size(); ++k) f.bytes[k] = peak_[k].load();
  return f;
}

void MemoryLedger::reset_peak() {
  for (size_t k = 0; k < peak_.size(); ++k) peak_[k].store(current_[k].load());
  peak_total_.store(total_.load());
}

MemoryLedger& memory_ledger() {
  static MemoryLedger ledger;
  return ledger;
}

MemoryBooking& MemoryBooking::operator=(MemoryBooking&& other) noexcept {
  if (this != &other) {
    resize(0);
    kind_ = other.kind_;
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void MemoryBooking::resize(int64_t bytes) {
  if (bytes == bytes_) return;
  if (bytes_ > 0) memory_ledger().remove(kind_, bytes_);
  bytes_ = bytes;
  if (bytes_ > 0) memory_ledger().add(kind_, bytes_);
}

void Allocations::add(const void* data, int64_t span, int64_t bytes, MemoryKind kind) {
  std::lock_guard lock(mutex_);
  Entry& entry = entries_[static_cast<const char*>(data)];
  entry.span = span;
  entry.bytes = bytes;
  entry.kind = kind;
  entry.booking = MemoryBooking(kind, deferring_ ? 0 : bytes);
}

void Allocations::remove(const void* data) {
  std::lock_guard lock(mutex_);
  entries_.erase(static_cast<const char*>(data));
}

Allocations::Entry& Allocations::containing(const void* data, int64_t span) {
  const char* begin = static_cast<const char*>(data);
  auto it = entries_.upper_bound(begin);
  check(it != entries_.begin(), "memory ledger: a range outside every allocation");
  --it;
  check(begin + span <= it->first + it->second.span,
        "memory ledger: a range runs past the end of its allocation");
  return it->second;
}

void Allocations::commit(const void* data, int64_t span) {
  std::lock_guard lock(mutex_);
  Entry& entry = containing(data, span);
  const int64_t bytes = entry.share(span);
  check(entry.booking.bytes() + bytes <= entry.bytes, "memory ledger: booked past an allocation");
  entry.booking.resize(entry.booking.bytes() + bytes);
}

void Allocations::uncommit(const void* data, int64_t span) {
  std::lock_guard lock(mutex_);
  Entry& entry = containing(data, span);
  const int64_t bytes = entry.share(span);
  check(entry.booking.bytes() >= bytes, "memory ledger: gave back more than was booked");
  entry.booking.resize(entry.booking.bytes() - bytes);
}

void Allocations::commit_all() {
  std::lock_guard lock(mutex_);
  for (auto& [address, entry] : entries_) entry.booking.resize(entry.bytes);
  deferring_ = false;
}

std::vector<Allocations::Allocation> Allocations::of_kind(MemoryKind kind) const {
  std::lock_guard lock(mutex_);
  std::vector<Allocation> found;
  for (const auto& [address, entry] : entries_) {
    if (entry.kind == kind && entry.booking.bytes() > 0) {
      found.push_back({const_cast<char*>(address), entry.span, entry.booking.bytes()});
    }
  }
  return found;
}

}  // namespace malleus::backend
