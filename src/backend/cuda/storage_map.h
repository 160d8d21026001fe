// Where the CUDA backend keeps each buffer it handed out, in which format: the bookkeeping behind
// Precision::kCompute (backend.h). Plain C++ (no CUDA), so that the CPU build tests it.
//
// The model addresses every buffer as float*: slices are a pointer plus an offset in floats. A
// buffer stored in bf16 cannot be that pointer, since its element i is 2·i bytes in, not 4·i. So
// the backend hands out a *handle* instead: an address range of count floats that nothing ever
// reads (host address space reserved with no access, no memory behind it), and keeps the bf16
// array elsewhere. Any pointer into the handle's range resolves to (entry, element index), and
// the element index to the bf16 array. A buffer stored in fp32 is its own handle: the device
// pointer itself.
//
// A parameter buffer in bf16 mode has a bf16 shadow beside its fp32 values (the master weights):
// matrix products read the shadow, AdamW writes both, and any other write marks the shadow stale
// so that the next product converts it again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace malleus::backend::cuda {

enum class Storage : uint8_t { kFloat, kBf16 };

struct StoredBuffer {
  const void* handle = nullptr;  // what the backend handed out (first element)
  size_t count = 0;              // elements
  Storage storage = Storage::kFloat;
  void* data = nullptr;    // device memory: count floats, or count bf16 values
  void* shadow = nullptr;  // device bf16 copy of a fp32 buffer, or null
  bool shadow_stale = false;
};

// A pointer resolved: its buffer and the index of the element it points at.
struct Resolved {
  StoredBuffer* buffer = nullptr;
  size_t index = 0;
  // The device address of the element in the buffer's own storage.
  void* address() const;
  // The device address of the element in the shadow (which must exist).
  void* shadow_address() const;
};

// Safe to use from several threads (a background transfer resolves pointers while the step
// allocates): every call holds one lock; a Resolved stays valid until its own buffer is removed.
class StorageMap {
 public:
  void add(const StoredBuffer& buffer);
  // Removes the buffer whose handle is `handle` and returns it; throws when there is none.
  StoredBuffer remove(const void* handle);
  // The buffer that holds `pointer` and the element it points at, such that `count` elements from
  // there lie inside the buffer; throws (naming the address) otherwise.
  Resolved resolve(const void* pointer, size_t count);
  // Whether `pointer` lies inside one of the buffers.
  bool holds(const void* pointer);
  bool empty() const {
    const std::lock_guard lock(mutex_);
    return buffers_.empty();
  }
  template <typename F>
  void for_each(F&& f) {
    const std::lock_guard lock(mutex_);
    for (auto& [address, buffer] : buffers_) f(buffer);
  }

 private:
  // The buffer holding `pointer` and the element index, or a null buffer; the lock held.
  Resolved find(const void* pointer, size_t count);
  // What resolve's error says of `pointer`: the buffer below it, or a released one it lay in.
  std::string whereabouts(const void* pointer, size_t count);
  mutable std::mutex mutex_;
  std::map<uintptr_t, StoredBuffer> buffers_;  // by the handle's address
  // The handles and sizes of the last buffers removed, for the error of a pointer into one.
  static constexpr size_t kReleasedKept = 256;
  std::vector<std::pair<uintptr_t, size_t>> released_;
  size_t released_next_ = 0;
};

// Bytes one element takes in `storage`.
inline size_t element_bytes(Storage storage) {
  return storage == Storage::kBf16 ? 2 : 4;
}

}  // namespace malleus::backend::cuda
