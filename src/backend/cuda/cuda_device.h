// The CUDA device a process computes on (device/device.h chooses it): how many there are, making
// one current, its memory as the host and MPI reach it, and the event timer of compute regions.
// Separate from cuda_backend.h, the backend's own interface: device/device.h gives these to each
// CUDA backend it makes (Backend::set_device_memory, set_region_timer).
#pragma once

#include <memory>
#include <string>

#include "backend/region_timer.h"
#include "common/device_memory.h"

namespace malleus::backend {

struct CudaDevices {
  int count = 0;
  std::string why;  // when count is 0: what the runtime said (no driver, no device, ...)
};
CudaDevices cuda_devices();

// Makes device `index` current for the calling thread (cudaSetDevice); throws naming it.
void cuda_use_device(int index);

// The memory of CUDA device `index` (cuda_device_memory.cu): cudaMemcpy / cudaMemcpy2D to and
// from the host, pinned host buffers (cudaMallocHost), and device pointers told apart by
// cudaPointerGetAttributes. Copies run on the legacy default stream, after the backend's work.
std::shared_ptr<const DeviceMemory> cuda_device_memory(int index);

// A region timer of CUDA events (cuda_timer.cu) recorded on `stream` (a cudaStream_t; null: the
// legacy default stream, where cuda_backend.cu issues its kernels). Made on the current device.
std::unique_ptr<RegionTimer> make_cuda_event_timer(void* stream = nullptr);

}  // namespace malleus::backend
