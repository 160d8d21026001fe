// The CUDA backend's buffers as the host and MPI reach them (common/device_memory.h): what the
// communicator stages around MPI and the runtime packs, migrates and checkpoints through.
#include "backend/cuda/backend_memory.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <string>

#include "backend/cuda/kernels.cuh"
#include "common/error.h"

namespace malleus::backend::cuda {

namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("cuda backend memory: ") + what +
                " failed: " + cudaGetErrorString(status));
  }
}

class BackendMemory final : public DeviceMemory {
 public:
  BackendMemory(std::shared_ptr<StorageMap> storage, std::shared_ptr<const DeviceMemory> device)
      : storage_(std::move(storage)), device_(std::move(device)) {}
  ~BackendMemory() override {
    if (staging_ != nullptr) cudaFree(staging_);
  }

  std::string name() const override { return device_->name(); }
  bool is_cuda() const override { return device_->is_cuda(); }
  bool holds(const void* data) const override {
    return storage_->holds(data) || device_->holds(data);
  }

  void to_host(void* host, const void* device, size_t row_bytes, size_t rows,
               size_t device_pitch) const override {
    if (row_bytes == 0 || rows == 0) return;
    if (!storage_->holds(device))
      return device_->to_host(host, device, row_bytes, rows, device_pitch);
    const size_t count = row_bytes / sizeof(float);
    check(count * sizeof(float) == row_bytes, "cuda backend memory: a copy of " +
                                                  std::to_string(row_bytes) +
                                                  " bytes is not whole floats");
    for (size_t row = 0; row < rows; ++row) {
      const auto* from = static_cast<const char*>(device) + row * device_pitch;
      auto* to = static_cast<char*>(host) + row * row_bytes;
      const Resolved r = storage_->resolve(from, count);
      if (r.buffer->storage == Storage::kFloat) {
        device_->to_host(to, r.address(), row_bytes);
        continue;
      }
      const std::lock_guard lock(mutex_);
      float* staged = staging(count);
      convert({staged, false}, {r.address(), true}, count);
      device_->to_host(to, staged, row_bytes);
    }
  }

  void from_host(void* device, const void* host, size_t row_bytes, size_t rows,
                 size_t device_pitch) const override {
    if (row_bytes == 0 || rows == 0) return;
    if (!storage_->holds(device)) {
      return device_->from_host(device, host, row_bytes, rows, device_pitch);
    }
    const size_t count = row_bytes / sizeof(float);
    check(count * sizeof(float) == row_bytes, "cuda backend memory: a copy of " +
                                                  std::to_string(row_bytes) +
                                                  " bytes is not whole floats");
    for (size_t row = 0; row < rows; ++row) {
      auto* to = static_cast<char*>(device) + row * device_pitch;
      const auto* from = static_cast<const char*>(host) + row * row_bytes;
      const Resolved r = storage_->resolve(to, count);
      if (r.buffer->storage == Storage::kFloat) {
        device_->from_host(r.address(), from, row_bytes);
        // A parameter's bf16 copy no longer matches it.
        if (r.buffer->shadow != nullptr) r.buffer->shadow_stale = true;
        continue;
      }
      const std::lock_guard lock(mutex_);
      float* staged = staging(count);
      device_->from_host(staged, from, row_bytes);
      convert({r.address(), true}, {staged, false}, count);
    }
  }

  void* allocate_host(size_t bytes) const override { return device_->allocate_host(bytes); }
  void release_host(void* data) const override { device_->release_host(data); }

 private:
  // A device buffer of at least `count` floats for the widening and rounding; the lock held.
  float* staging(size_t count) const {
    if (count > staging_count_) {
      if (staging_ != nullptr) check_cuda(cudaFree(staging_), "cudaFree");
      staging_ = nullptr;
      check_cuda(cudaMalloc(&staging_, count * sizeof(float)), "cudaMalloc");
      staging_count_ = count;
    }
    return staging_;
  }

  std::shared_ptr<StorageMap> storage_;
  std::shared_ptr<const DeviceMemory> device_;
  mutable std::mutex mutex_;
  mutable float* staging_ = nullptr;
  mutable size_t staging_count_ = 0;
};

}  // namespace

std::shared_ptr<const DeviceMemory> backend_memory(std::shared_ptr<StorageMap> storage,
                                                   std::shared_ptr<const DeviceMemory> device) {
  return std::make_shared<BackendMemory>(std::move(storage), std::move(device));
}

}  // namespace malleus::backend::cuda
