// What the CUDA backend's sources share: error checks, launch sizes, block reductions, bf16
// helpers, and `Span`, a device range in fp32 or bf16 that a kernel reads and writes as float.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/error.h"

namespace malleus::backend::cuda {

using bf16 = __nv_bfloat16;

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("cuda backend: ") + what + " failed: " + cudaGetErrorString(status));
  }
}

inline void cublas_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(std::string("cuda backend: ") + what + " failed: " + cublasGetStatusString(status));
  }
}

// After every launch: a bad configuration shows here, a fault in the kernel at the next sync.
inline void launched(const char* kernel) {
  cuda_check(cudaGetLastError(), kernel);
}

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;

inline int blocks_for(size_t count) {
  const size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(std::clamp<size_t>(blocks, 1, kMaxBlocks));
}

// A device range of floats stored in fp32 or bf16. Kernels take Spans by value; the storage test
// is uniform across a launch, so its branch costs nothing measurable.
struct Span {
  void* data = nullptr;
  bool bf16 = false;

  __device__ float load(size_t i) const {
    return bf16 ? __bfloat162float(static_cast<const cuda::bf16*>(data)[i])
                : static_cast<const float*>(data)[i];
  }
  __device__ void store(size_t i, float value) const {
    if (bf16) {
      static_cast<cuda::bf16*>(data)[i] = __float2bfloat16(value);
    } else {
      static_cast<float*>(data)[i] = value;
    }
  }
  // The value as this storage keeps it (what a later load returns).
  __device__ float rounded(float value) const {
    return bf16 ? __bfloat162float(__float2bfloat16(value)) : value;
  }
  Span offset(size_t elements) const {
    return {static_cast<char*>(data) + elements * (bf16 ? 2 : 4), bf16};
  }

  // Four consecutive elements from i (a multiple of 4) in one load, where quad_aligned().
  __device__ float4 load4(size_t i) const {
    if (bf16) {
      const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const cuda::bf16*>(data) + i);
      const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      return make_float4(lo.x, lo.y, hi.x, hi.y);
    }
    return *reinterpret_cast<const float4*>(static_cast<const float*>(data) + i);
  }
  __device__ void store4(size_t i, float4 value) const {
    if (bf16) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(value.x, value.y);
      __nv_bfloat162 hi = __floats2bfloat162_rn(value.z, value.w);
      uint2 raw;
      raw.x = *reinterpret_cast<uint32_t*>(&lo);
      raw.y = *reinterpret_cast<uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(static_cast<cuda::bf16*>(data) + i) = raw;
    } else {
      *reinterpret_cast<float4*>(static_cast<float*>(data) + i) = value;
    }
  }
  // Whether element 0 sits where a four-element load may start.
  bool quad_aligned() const { return reinterpret_cast<uintptr_t>(data) % (bf16 ? 8 : 16) == 0; }
};

// Whether every span allows four-element loads and stores.
inline bool quad_aligned(std::initializer_list<Span> spans) {
  for (const Span& s : spans) {
    if (!s.quad_aligned()) return false;
  }
  return true;
}

// Grid-stride over `count` elements, four at a time where `quads` (every operand quad-aligned),
// with the remainder one at a time: single(i) for one element, quad(i) for i, i+1, i+2, i+3.
template <typename Single, typename Quad>
__device__ void elementwise(size_t count, bool quads, Single&& single, Quad&& quad) {
  const size_t id = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t done = 0;
  if (quads) {
    const size_t n = count / 4;
    for (size_t q = id; q < n; q += stride) quad(4 * q);
    done = 4 * n;
  }
  for (size_t i = done + id; i < count; i += stride) single(i);
}

// ---- block reductions (fixed trees: the same order every run) ----------------------------------
template <typename A>
__device__ A warp_sum(A value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  return value;
}

__device__ inline float warp_max(float value) {
  for (int offset = 16; offset > 0; offset /= 2) {
    value = fmaxf(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  return value;
}

// The sum over the block, returned to every thread. `shared` holds 32 values.
template <typename A>
__device__ A block_sum(A value, A* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  value = warp_sum(value);
  __syncthreads();  // `shared` may still be read from a previous call
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  value = threadIdx.x < warps ? shared[threadIdx.x] : A(0);
  if (warp == 0) value = warp_sum(value);
  if (threadIdx.x == 0) shared[0] = value;
  __syncthreads();
  return shared[0];
}

__device__ inline float block_max(float value, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  value = warp_max(value);
  __syncthreads();
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  value = threadIdx.x < warps ? shared[threadIdx.x] : -INFINITY;
  if (warp == 0) value = warp_max(value);
  if (threadIdx.x == 0) shared[0] = value;
  __syncthreads();
  return shared[0];
}

// Frees device memory from a destructor, where nothing may throw: a failure is reported and
// cleared, so that it is not taken for the failure of the next launch.
void free_quietly(void* pointer);

// Device memory that grows on demand (scratch of the kernels). Movable, not copyable.
template <typename E>
struct Scratch {
  E* data = nullptr;
  size_t count = 0;

  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  Scratch(Scratch&& other) noexcept : data(other.data), count(other.count) {
    other.data = nullptr;
    other.count = 0;
  }
  Scratch& operator=(Scratch&& other) noexcept {
    if (this != &other) {
      free_quietly(data);
      data = other.data;
      count = other.count;
      other.data = nullptr;
      other.count = 0;
    }
    return *this;
  }
  ~Scratch() { free_quietly(data); }

  E* at_least(size_t wanted) {
    if (wanted > count) {
      // Work queued on the stream may still read the old memory: cudaFree waits for it.
      free_quietly(data);
      data = nullptr;
      count = 0;
      cuda_check(cudaMalloc(&data, std::max<size_t>(wanted, 1) * sizeof(E)),
                 "cudaMalloc (scratch)");
      count = wanted;
    }
    return data;
  }
};

}  // namespace malleus::backend::cuda
