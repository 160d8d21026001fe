// The CUDA backend's buffers as the host and MPI reach them (common/device_memory.h), for the
// communicator's staging around MPI and the runtime's packing, migration and checkpoints.
//
// A buffer the backend stores in bf16 is handed out as a handle (storage_map.h): an address
// range nothing may read. Through this DeviceMemory it looks like the float array it stands for:
// to_host widens its bf16 values to fp32, from_host rounds fp32 to bf16. A write into a parameter
// with a bf16 shadow marks the shadow stale, as the backend's own writes do. Memory the backend
// did not hand out as a buffer (token arrays) is plain device memory.
#pragma once

#include <memory>

#include "backend/cuda/storage_map.h"
#include "common/device_memory.h"

namespace malleus::backend::cuda {

// `device`: the GPU's own memory (cuda_device_memory), which copies the plain parts.
std::shared_ptr<const DeviceMemory> backend_memory(std::shared_ptr<StorageMap> storage,
                                                   std::shared_ptr<const DeviceMemory> device);

}  // namespace malleus::backend::cuda
