#include "comm/staging.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>
#endif

namespace malleus::comm {

namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::shared_ptr<const DeviceMemory>> memories;
  std::atomic<bool> any{false};
  // Free host buffers of each memory, by capacity.
  std::map<const DeviceMemory*, std::multimap<size_t, void*>> free;
};

// Never destroyed: buffers may still be returned while the process exits, and a GPU's pinned
// buffers must not be freed after its runtime has shut down (the system takes them back).
Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

std::atomic<int64_t> staged_total{0};

// Capacities are powers of two from 4 KiB, so buffers of similar sizes are reused.
size_t capacity_for(size_t bytes) {
  size_t capacity = 4096;
  while (capacity < bytes) capacity *= 2;
  return capacity;
}

void* take_host(const DeviceMemory& memory, size_t capacity) {
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    auto& free = r.free[&memory];
    const auto it = free.find(capacity);
    if (it != free.end()) {
      void* host = it->second;
      free.erase(it);
      return host;
    }
  }
  return memory.allocate_host(capacity);
}

void give_host(const DeviceMemory& memory, void* host, size_t capacity) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.free[&memory].emplace(capacity, host);
}

}  // namespace

void register_device_memory(std::shared_ptr<const DeviceMemory> memory) {
  if (!memory) return;
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (const auto& m : r.memories) {
    if (m == memory) return;
  }
  r.memories.push_back(std::move(memory));
  r.any = true;
}

const DeviceMemory* device_memory_of(const void* data) {
  Registry& r = registry();
  if (!r.any || data == nullptr) return nullptr;
  std::lock_guard lock(r.mutex);
  for (const auto& m : r.memories) {
    if (m->holds(data)) return m.get();
  }
  return nullptr;
}

bool mpi_cuda_aware() {
  if (const char* forced = std::getenv("MALLEUS_MPI_CUDA_AWARE")) {
    if (std::string(forced) == "0") return false;
    if (std::string(forced) == "1") return true;
  }
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

std::string transport_text(const DeviceMemory& memory) {
  if (memory.is_cuda() && mpi_cuda_aware()) {
    return memory.name() + " memory passed to MPI directly (CUDA-aware MPI)";
  }
  std::string why;
  if (const char* forced = std::getenv("MALLEUS_MPI_CUDA_AWARE");
      forced != nullptr && std::string(forced) == "0") {
    why = "MALLEUS_MPI_CUDA_AWARE=0";
  } else if (!memory.is_cuda()) {
    why = "MPI never reads it";
  } else {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
    why = "this MPI is not CUDA-aware at run time: MPIX_Query_cuda_support() = 0";
#elif defined(MPIX_CUDA_AWARE_SUPPORT)
    why = "this MPI was built without CUDA support (mpi-ext.h: MPIX_CUDA_AWARE_SUPPORT 0)";
#else
    why = "this MPI's mpi-ext.h does not say it is CUDA-aware";
#endif
  }
  return memory.name() + " memory staged through " +
         (memory.is_cuda() ? "pinned host memory" : "host memory") + " around MPI (" + why + ")";
}

int64_t staged_bytes() {
  return staged_total.load(std::memory_order_relaxed);
}

StagedBuffer::StagedBuffer(const void* data, size_t bytes, Direction direction)
    : data_(data), bytes_(bytes), direction_(direction) {
  memory_ = bytes > 0 ? device_memory_of(data) : nullptr;
  if (memory_ == nullptr || (memory_->is_cuda() && mpi_cuda_aware())) {
    memory_ = nullptr;
    return;
  }
  capacity_ = capacity_for(bytes);
  host_ = take_host(*memory_, capacity_);
  if ((direction & kIn) != 0) {
    try {
      memory_->to_host(host_, data, bytes);
    } catch (...) {
      release();
      throw;
    }
    staged_total.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  }
}

StagedBuffer::~StagedBuffer() {
  release();
}

StagedBuffer::StagedBuffer(StagedBuffer&& other) noexcept {
  *this = std::move(other);
}

StagedBuffer& StagedBuffer::operator=(StagedBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = other.data_;
    bytes_ = other.bytes_;
    capacity_ = other.capacity_;
    direction_ = other.direction_;
    memory_ = other.memory_;
    host_ = other.host_;
    finished_ = other.finished_;
    other.host_ = nullptr;
    other.memory_ = nullptr;
  }
  return *this;
}

void StagedBuffer::finish() {
  if (host_ == nullptr || finished_) return;
  finished_ = true;
  if ((direction_ & kOut) == 0) return;
  memory_->from_host(const_cast<void*>(data_), host_, bytes_);
  staged_total.fetch_add(static_cast<int64_t>(bytes_), std::memory_order_relaxed);
}

void StagedBuffer::release() noexcept {
  if (host_ != nullptr) give_host(*memory_, host_, capacity_);
  host_ = nullptr;
}

}  // namespace malleus::comm
