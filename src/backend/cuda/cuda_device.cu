#include "backend/cuda/cuda_device.h"

#include <cuda_runtime.h>

#include "common/error.h"

namespace malleus::backend {

CudaDevices cuda_devices() {
  CudaDevices found;
  const cudaError_t status = cudaGetDeviceCount(&found.count);
  if (status != cudaSuccess) {
    found.count = 0;
    found.why = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(status);
    cudaGetLastError();  // clear the sticky "no device" status
  } else if (found.count == 0) {
    found.why = "cudaGetDeviceCount: 0 devices";
  }
  return found;
}

void cuda_use_device(int index) {
  const cudaError_t status = cudaSetDevice(index);
  if (status != cudaSuccess) {
    throw Error("cuda: cudaSetDevice(" + std::to_string(index) +
                ") failed: " + cudaGetErrorString(status));
  }
}

}  // namespace malleus::backend
