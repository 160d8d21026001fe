// The CUDA backend (built with -DMALLEUS_BUILD_CUDA=ON): Backend<float> on one NVIDIA GPU, fp32
// storage, cuBLAS for every matrix product, plain CUDA kernels for the rest. See docs/cuda.md.
//
// Its pointers are device memory: the model, the optimizer and the trainer reach them only
// through the backend, as backend.h requires. Every kernel runs on the legacy default stream, so
// copy_to_host and sum_squares see all the work issued before them.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"

namespace malleus::backend {

// How cuBLAS multiplies the fp32 matrices (the storage is fp32 in every mode).
enum class CudaMath {
  kExact,  // fp32 arithmetic (CUBLAS_COMPUTE_32F, no tensor-core shortcut): the reference mode
  kTf32,   // tf32 tensor cores, fp32 accumulation (CUBLAS_COMPUTE_32F_FAST_TF32)
  kBf16,   // bf16 tensor cores, fp32 accumulation (CUBLAS_COMPUTE_32F_FAST_16BF)
};

// "exact", "tf32" or "bf16"; anything else throws naming the value.
CudaMath parse_cuda_math(const std::string& name);
std::string cuda_math_name(CudaMath math);

// The number of CUDA devices this process sees (0 without a driver or a device).
int cuda_device_count();
// The current device's name, e.g. "NVIDIA H100 80GB HBM3".
std::string cuda_device_name();

// A backend on the current device. Throws when no device can be used.
std::unique_ptr<Backend<float>> make_cuda_backend(CudaMath math);

// Waits until every kernel issued so far has finished (for timing from the host).
void cuda_synchronize();

}  // namespace malleus::backend
