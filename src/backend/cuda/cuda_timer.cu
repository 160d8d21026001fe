// CUDA events around a compute region (backend/region_timer.h): the device's own clock, so the
// engine's measurements count the work a region queued, not the host's time to launch it.
#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "backend/cuda/cuda_device.h"
#include "common/error.h"

namespace malleus::backend {

namespace {

void check_event(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("cuda timer: ") + what + " failed: " + cudaGetErrorString(status));
  }
}

// Spins one thread on the device until its global timer has advanced `nanoseconds`: the kernels
// queued after it wait, as they would behind a slow device's own work.
__global__ void spin_for(unsigned long long nanoseconds) {
  unsigned long long start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

class CudaEventTimer final : public RegionTimer {
 public:
  explicit CudaEventTimer(cudaStream_t stream) : stream_(stream) {
    check_event(cudaEventCreate(&start_), "cudaEventCreate");
    const cudaError_t status = cudaEventCreate(&stop_);
    if (status != cudaSuccess) cudaEventDestroy(start_);
    check_event(status, "cudaEventCreate");
  }
  ~CudaEventTimer() override {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  CudaEventTimer(const CudaEventTimer&) = delete;
  CudaEventTimer& operator=(const CudaEventTimer&) = delete;

  void begin() override { check_event(cudaEventRecord(start_, stream_), "cudaEventRecord"); }

  void settle() override { check_event(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  void keep_busy(double seconds) override {
    if (seconds <= 0) return;
    spin_for<<<1, 1, 0, stream_>>>(static_cast<unsigned long long>(seconds * 1e9));
    check_event(cudaGetLastError(), "launching the busy kernel");
  }

  double elapsed() override {
    check_event(cudaEventRecord(stop_, stream_), "cudaEventRecord");
    check_event(cudaEventSynchronize(stop_), "cudaEventSynchronize");
    float ms = 0;
    check_event(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return static_cast<double>(ms) * 1e-3;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

}  // namespace

std::unique_ptr<RegionTimer> make_cuda_event_timer(void* stream) {
  return std::make_unique<CudaEventTimer>(static_cast<cudaStream_t>(stream));
}

}  // namespace malleus::backend
