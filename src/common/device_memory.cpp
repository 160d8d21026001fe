#include "common/device_memory.h"

#include <cstdlib>
#include <new>

namespace malleus {

void* DeviceMemory::allocate_host(size_t bytes) const {
  void* data = std::malloc(bytes == 0 ? 1 : bytes);
  if (data == nullptr) throw std::bad_alloc();
  return data;
}

void DeviceMemory::release_host(void* data) const {
  std::free(data);
}

}  // namespace malleus
