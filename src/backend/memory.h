// What this process (one rank, one device) has allocated, by kind, now and at its peak: the
// runtime's own account of its memory, held against the cost model's prediction and written to
// the metrics. Every backend::Buffer books its bytes here under the kind it was given; host-side
// buffers that stand for device memory (communication staging, say) book through MemoryBooking.
//
// One ledger per process, not per backend: during a live migration the old and the new engine
// both exist, and the peak must see both. Counters are atomic; the ledger is safe to use from
// any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace malleus::backend {

enum class MemoryKind {
  kParameters,
  kGradients,
  kOptimizer,      // Adam moments
  kActivations,    // kept between a micro-batch's forward and its backward
  kWorkspace,      // scratch reused by every micro-batch (backward temporaries, probes)
  kCommunication,  // packing and staging buffers of collectives and transfers
};
inline constexpr int kMemoryKinds = 6;

// "parameters", "gradients", ...: the names used in metrics and reports.
const char* memory_kind_name(MemoryKind kind);

struct MemoryFigures {
  std::array<int64_t, kMemoryKinds> bytes{};  // by MemoryKind
  int64_t total() const;
  int64_t operator[](MemoryKind kind) const { return bytes[static_cast<size_t>(kind)]; }
};

class MemoryLedger {
 public:
  void add(MemoryKind kind, int64_t bytes);
  void remove(MemoryKind kind, int64_t bytes);

  MemoryFigures current() const;
  // Each kind's own highest value, and the highest total, since the last reset_peak().
  MemoryFigures peak() const;
  int64_t peak_total() const { return peak_total_.load(std::memory_order_relaxed); }
  // Starts a new measuring window at the current values.
  void reset_peak();

 private:
  std::array<std::atomic<int64_t>, kMemoryKinds> current_{};
  std::array<std::atomic<int64_t>, kMemoryKinds> peak_{};
  std::atomic<int64_t> total_{0}, peak_total_{0};
};

// The process's ledger.
MemoryLedger& memory_ledger();

// Books `bytes` of `kind` for the lifetime of the object (movable), for memory not held in a
// backend::Buffer. resize() rebooks.
class MemoryBooking {
 public:
  MemoryBooking() = default;
  MemoryBooking(MemoryKind kind, int64_t bytes) : kind_(kind) { resize(bytes); }
  ~MemoryBooking() { resize(0); }
  MemoryBooking(MemoryBooking&& other) noexcept { *this = std::move(other); }
  MemoryBooking& operator=(MemoryBooking&& other) noexcept;
  MemoryBooking(const MemoryBooking&) = delete;
  MemoryBooking& operator=(const MemoryBooking&) = delete;

  void resize(int64_t bytes);
  int64_t bytes() const { return bytes_; }

 private:
  MemoryKind kind_ = MemoryKind::kWorkspace;
  int64_t bytes_ = 0;
};

// The bookings of one backend's allocations, by address. A live migration moves state piece by
// piece: it gives back ranges of the old engine's buffers as soon as they have been sent and
// books ranges of the new engine's buffers as they are written, so the ledger follows it
// (layout/staged_redistribution.h).
//
// Ranges are addresses as the callers see them (count x sizeof(float) for a buffer of floats);
// what is booked is what the backend stores for them, which may differ (a GPU's bf16 storage
// books half, an fp32 buffer with a bf16 copy half as much again): a range books its share.
class Allocations {
 public:
  struct Allocation {
    void* data = nullptr;
    int64_t span = 0;    // bytes of address range
    int64_t booked = 0;  // bytes booked now
  };
  // Books the allocation of `span` bytes of address range at `data`, which stores `bytes`, under
  // `kind`, unless deferring.
  void add(const void* data, int64_t span, int64_t bytes, MemoryKind kind);
  // Unbooks what is still booked of the allocation at `data`.
  void remove(const void* data);
  // While deferring, added allocations are booked only by commit() and commit_all(): an engine
  // built for a migration holds nothing until the state arrives.
  void set_deferring(bool deferring) { deferring_ = deferring; }
  // Books / unbooks the share of the address range [data, data + span) inside one allocation
  // (the caller keeps the ranges disjoint).
  void commit(const void* data, int64_t span);
  void uncommit(const void* data, int64_t span);
  // Books every allocation in full and ends deferring.
  void commit_all();
  // Every allocation of `kind` with something booked.
  std::vector<Allocation> of_kind(MemoryKind kind) const;

 private:
  struct Entry {
    int64_t span = 0;
    int64_t bytes = 0;
    MemoryKind kind = MemoryKind::kWorkspace;
    MemoryBooking booking;
    int64_t share(int64_t range) const { return span == bytes ? range : range * bytes / span; }
  };
  Entry& containing(const void* data, int64_t span);
  mutable std::mutex mutex_;
  std::map<const char*, Entry> entries_;  // by first byte
  bool deferring_ = false;
};

}  // namespace malleus::backend
