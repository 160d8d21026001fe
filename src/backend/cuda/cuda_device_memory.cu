// A CUDA device's memory as the host and MPI reach it (common/device_memory.h).
#include <cuda_runtime.h>

#include <memory>
#include <new>
#include <string>

#include "backend/cuda/cuda_device.h"
#include "common/error.h"

namespace malleus::backend {

namespace {

void check_copy(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("cuda device memory: ") + what +
                " failed: " + cudaGetErrorString(status));
  }
}

class CudaDeviceMemory final : public DeviceMemory {
 public:
  explicit CudaDeviceMemory(int index) : index_(index) {}

  std::string name() const override { return "CUDA device " + std::to_string(index_); }
  bool is_cuda() const override { return true; }

  bool holds(const void* data) const override {
    if (data == nullptr) return false;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
      cudaGetLastError();  // an unknown host pointer, on older runtimes
      return false;
    }
    return attributes.type == cudaMemoryTypeDevice;
  }

  void to_host(void* host, const void* device, size_t row_bytes, size_t rows,
               size_t device_pitch) const override {
    if (row_bytes == 0 || rows == 0) return;
    if (rows == 1) {
      check_copy(cudaMemcpy(host, device, row_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
      return;
    }
    check_copy(cudaMemcpy2D(host, row_bytes, device, device_pitch, row_bytes, rows,
                            cudaMemcpyDeviceToHost),
               "cudaMemcpy2D");
  }

  void from_host(void* device, const void* host, size_t row_bytes, size_t rows,
                 size_t device_pitch) const override {
    if (row_bytes == 0 || rows == 0) return;
    // From pageable memory cudaMemcpy may return before the device has the bytes; from pinned
    // memory it returns after. Either way the host buffer may be reused at once, and the
    // backend's later work on the legacy default stream follows the copy.
    if (rows == 1) {
      check_copy(cudaMemcpy(device, host, row_bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
      return;
    }
    check_copy(cudaMemcpy2D(device, device_pitch, host, row_bytes, row_bytes, rows,
                            cudaMemcpyHostToDevice),
               "cudaMemcpy2D");
  }

  void* allocate_host(size_t bytes) const override {
    void* data = nullptr;
    if (cudaMallocHost(&data, bytes == 0 ? 1 : bytes) != cudaSuccess) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
    return data;
  }
  void release_host(void* data) const override { cudaFreeHost(data); }

 private:
  int index_;
};

}  // namespace

std::shared_ptr<const DeviceMemory> cuda_device_memory(int index) {
  return std::make_shared<CudaDeviceMemory>(index);
}

}  // namespace malleus::backend
