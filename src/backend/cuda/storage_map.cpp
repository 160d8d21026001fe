#include "backend/cuda/storage_map.h"

#include <iterator>
#include <sstream>

#include "common/error.h"

namespace malleus::backend::cuda {
namespace {

std::string address_text(const void* pointer) {
  std::ostringstream text;
  text << pointer;
  return text.str();
}

}  // namespace

void* Resolved::address() const {
  return static_cast<char*>(buffer->data) + index * element_bytes(buffer->storage);
}

void* Resolved::shadow_address() const {
  return static_cast<char*>(buffer->shadow) + index * element_bytes(Storage::kBf16);
}

void StorageMap::add(const StoredBuffer& buffer) {
  const std::lock_guard lock(mutex_);
  const auto address = reinterpret_cast<uintptr_t>(buffer.handle);
  const bool fresh = buffers_.emplace(address, buffer).second;
  check(fresh, "cuda backend: buffer " + address_text(buffer.handle) + " is registered twice");
}

StoredBuffer StorageMap::remove(const void* handle) {
  const std::lock_guard lock(mutex_);
  const auto found = buffers_.find(reinterpret_cast<uintptr_t>(handle));
  check(found != buffers_.end(),
        "cuda backend: release of " + address_text(handle) + ", which it did not allocate");
  const std::pair<uintptr_t, size_t> entry{found->first, found->second.count};
  StoredBuffer buffer = found->second;
  buffers_.erase(found);
  if (released_.size() < kReleasedKept) {
    released_.push_back(entry);
  } else {
    released_[released_next_] = entry;
  }
  released_next_ = (released_next_ + 1) % kReleasedKept;
  return buffer;
}

Resolved StorageMap::find(const void* pointer, size_t count) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  auto above = buffers_.upper_bound(address);
  if (above != buffers_.begin()) {
    StoredBuffer& buffer = std::prev(above)->second;
    // Handles are float ranges: element i sits 4·i bytes past the handle.
    const uintptr_t offset = address - std::prev(above)->first;
    const size_t index = offset / sizeof(float);
    if (offset % sizeof(float) == 0 && index + count <= buffer.count &&
        (index < buffer.count || count == 0)) {
      return {&buffer, index};
    }
  }
  return {};
}

std::string StorageMap::whereabouts(const void* pointer, size_t count) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  for (const auto& [handle, elements] : released_) {
    if (address >= handle && address < handle + elements * sizeof(float)) {
      return "it lies in the released buffer " + address_text(reinterpret_cast<void*>(handle)) +
             " of " + std::to_string(elements) + " elements";
    }
  }
  auto above = buffers_.upper_bound(address);
  if (above == buffers_.begin()) return "no buffer lies below it";
  --above;
  const uintptr_t offset = address - above->first;
  return "the buffer below, " + address_text(reinterpret_cast<void*>(above->first)) + ", holds " +
         std::to_string(above->second.count) + " elements, and this reaches elements " +
         std::to_string(offset / sizeof(float)) + " to " +
         std::to_string(offset / sizeof(float) + count);
}

Resolved StorageMap::resolve(const void* pointer, size_t count) {
  const std::lock_guard lock(mutex_);
  const Resolved found = find(pointer, count);
  if (found.buffer != nullptr) return found;
  throw Error(
      "cuda backend: " + address_text(pointer) + " (" + std::to_string(count) +
      " elements) is not inside a buffer this backend allocated: " + whereabouts(pointer, count));
}

bool StorageMap::holds(const void* pointer) {
  const std::lock_guard lock(mutex_);
  return find(pointer, 1).buffer != nullptr;
}

}  // namespace malleus::backend::cuda
