// The CUDA backend: cuBLAS for the linear layers and the two products of attention, one plain
// kernel per remaining operation. fp32 storage throughout; CudaMath picks how cuBLAS multiplies.
//
// Determinism: every kernel gives bit-identical results run to run on the same device. No
// atomics: each output element is written by one thread, and every sum has a fixed order
// (block reductions are fixed trees; sums over tokens run in token order or in fixed segments
// summed in order). cuBLAS is deterministic on one stream with its default atomics mode.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "common/error.h"

namespace malleus::backend {
namespace {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("cuda backend: ") + what + " failed: " + cudaGetErrorString(status));
  }
}

void cublas_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(std::string("cuda backend: ") + what + " failed: " + cublasGetStatusString(status));
  }
}

// After every launch: a bad configuration shows here, a fault in the kernel at the next sync.
void launched(const char* kernel) {
  cuda_check(cudaGetLastError(), kernel);
}

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;
// sum_squares: a fixed grid, so the order of its sum does not depend on the element count.
constexpr int kSumBlocks = 1024;
// rmsnorm's weight gradient: rows are summed in segments of this many, then the segments in order.
constexpr int kRowSegment = 64;
// embedding_backward: vocabulary rows are split over this many residue classes, each owned by
// one thread per column, which walks the tokens in order.
constexpr int kEmbeddingBuckets = 64;

int blocks_for(size_t count) {
  const size_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<int>(std::clamp<size_t>(blocks, 1, kMaxBlocks));
}

// ---- block reductions (fixed trees: the same order every run) ----------------------------------
template <typename A>
__device__ A warp_sum(A value) {
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_down_sync(0xffffffffu, value, offset);
  return value;
}

__device__ float warp_max(float value) {
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

__device__ float block_max(float value, float* shared) {
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

// ---- elementwise ---------------------------------------------------------------------------
__global__ void add_kernel(float* y, const float* x, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    y[i] += x[i];
  }
}

__global__ void scale_kernel(float* x, float factor, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] *= factor;
  }
}

__global__ void sum_squares_partial(double* partial, const float* x, size_t count) {
  __shared__ double shared[32];
  double sum = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const double v = x[i];
    sum += v * v;
  }
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

__global__ void sum_partials(double* out, const double* partial, int count) {
  __shared__ double shared[32];
  double sum = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) *out = sum;
}

// ---- embedding -------------------------------------------------------------------------------
__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* table,
                                         int vocab_begin, int rows, int c) {
  const int i = blockIdx.x;
  const int row = tokens[i] - vocab_begin;
  float* y = out + size_t(i) * c;
  const bool held = row >= 0 && row < rows;
  for (int j = threadIdx.x; j < c; j += blockDim.x) y[j] = held ? table[size_t(row) * c + j] : 0.f;
}

// Thread (column j, bucket b) adds, in token order, every token whose local row is ≡ b mod
// kEmbeddingBuckets: repeated tokens add up in the order the CPU backend uses, without atomics.
__global__ void embedding_backward_kernel(float* dtable, const float* dout, const int32_t* tokens,
                                          int vocab_begin, int rows, int n, int c) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  const int bucket = blockIdx.y;
  if (j >= c) return;
  for (int i = 0; i < n; ++i) {
    const int row = __ldg(tokens + i) - vocab_begin;
    if (row < 0 || row >= rows || row % kEmbeddingBuckets != bucket) continue;
    dtable[size_t(row) * c + j] += dout[size_t(i) * c + j];
  }
}

// ---- RMSNorm -------------------------------------------------------------------------------
__global__ void rmsnorm_forward_kernel(float* out, float* rstd, const float* in,
                                       const float* weight, int c, float eps) {
  __shared__ float shared[32];
  const float* x = in + size_t(blockIdx.x) * c;
  float sum = 0;
  for (int j = threadIdx.x; j < c; j += blockDim.x) sum += x[j] * x[j];
  sum = block_sum(sum, shared);
  const float r = 1.0f / sqrtf(sum / float(c) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  float* y = out + size_t(blockIdx.x) * c;
  for (int j = threadIdx.x; j < c; j += blockDim.x) y[j] = x[j] * r * weight[j];
}

// dx = r·w⊙dy − x·r³/c·Σ(dy⊙w⊙x), one row per block.
__global__ void rmsnorm_backward_input(float* din, const float* dout, const float* in,
                                       const float* weight, const float* rstd, int c) {
  __shared__ float shared[32];
  const size_t offset = size_t(blockIdx.x) * c;
  const float *x = in + offset, *dy = dout + offset;
  const float r = rstd[blockIdx.x];
  float dot = 0;
  for (int j = threadIdx.x; j < c; j += blockDim.x) dot += dy[j] * weight[j] * x[j];
  dot = block_sum(dot, shared);
  const float correction = dot * r * r * r / float(c);
  for (int j = threadIdx.x; j < c; j += blockDim.x) {
    din[offset + j] = r * weight[j] * dy[j] - x[j] * correction;
  }
}

// partial[segment, j] = Σ over the segment's rows of dy⊙x·r, in double.
__global__ void rmsnorm_weight_partial(double* partial, const float* dout, const float* in,
                                       const float* rstd, int n, int c) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  const int begin = blockIdx.y * kRowSegment, end = min(n, begin + kRowSegment);
  double sum = 0;
  for (int i = begin; i < end; ++i) {
    sum += double(dout[size_t(i) * c + j]) * in[size_t(i) * c + j] * rstd[i];
  }
  partial[size_t(blockIdx.y) * c + j] = sum;
}

__global__ void rmsnorm_weight_finish(float* dweight, const double* partial, int segments, int c) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  double sum = 0;
  for (int s = 0; s < segments; ++s) sum += partial[size_t(s) * c + j];
  dweight[j] += float(sum);
}

// ---- RoPE ------------------------------------------------------------------------------------
// Rotates every (i, i + head_dim/2) pair by `direction` × its angle; cos/sin: [position, half].
__global__ void rope_kernel(float* x, const float* cos_table, const float* sin_table, int seq,
                            int heads, int half, int first_position, float direction,
                            size_t pairs) {
  for (size_t p = blockIdx.x * size_t(blockDim.x) + threadIdx.x; p < pairs;
       p += size_t(gridDim.x) * blockDim.x) {
    const int i = int(p % half);
    const size_t head_row = p / half;  // (row, head)
    const size_t r = head_row / heads;
    const size_t t = first_position + r % seq;
    const float c = cos_table[t * half + i];
    const float s = direction * sin_table[t * half + i];
    float* a = x + head_row * 2 * half + i;
    const float x0 = a[0], x1 = a[half];
    a[0] = x0 * c - x1 * s;
    a[half] = x1 * c + x0 * s;
  }
}

// ---- attention's softmaxes -------------------------------------------------------------------
// Row (b, h, t) of the scores [.., seq, keys]: softmax over its past + t + 1 visible keys, zero
// beyond them.
__global__ void causal_softmax_kernel(float* probs, int seq, int keys, int past) {
  __shared__ float shared[32];
  float* row = probs + size_t(blockIdx.x) * keys;
  const int visible = past + int(blockIdx.x % seq) + 1;
  float top = -INFINITY;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) top = fmaxf(top, row[j]);
  top = block_max(top, shared);
  float sum = 0;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) {
    const float e = expf(row[j] - top);
    row[j] = e;
    sum += e;
  }
  sum = block_sum(sum, shared);
  const float inverse = 1.0f / sum;
  for (int j = threadIdx.x; j < keys; j += blockDim.x)
    row[j] = j < visible ? row[j] * inverse : 0.f;
}

// dS = P ⊙ (dP − rowsum(dP ⊙ P)) · scale, in place on dP, one row of [seq, seq] per block.
__global__ void softmax_backward_kernel(float* ds, const float* probs, int seq, float scale) {
  __shared__ float shared[32];
  const size_t offset = size_t(blockIdx.x) * seq;
  const float* p = probs + offset;
  float* d = ds + offset;
  const int visible = int(blockIdx.x % seq) + 1;
  float dot = 0;
  for (int j = threadIdx.x; j < visible; j += blockDim.x) dot += p[j] * d[j];
  dot = block_sum(dot, shared);
  for (int j = threadIdx.x; j < seq; j += blockDim.x)
    d[j] = j < visible ? p[j] * (d[j] - dot) * scale : 0.f;
}

// ---- SwiGLU ----------------------------------------------------------------------------------
__global__ void swiglu_forward_kernel(float* out, const float* gate, const float* up,
                                      size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
  }
}

__global__ void swiglu_backward_kernel(float* dgate, float* dup, const float* dout,
                                       const float* gate, const float* up, size_t count) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    const float s = 1.0f / (1.0f + expf(-g));
    const float dy = dout[i];
    const float u = up[i];
    dup[i] = dy * g * s;
    dgate[i] = dy * u * s * (1.0f + g * (1.0f - s));
  }
}

// ---- cross-entropy ---------------------------------------------------------------------------
__global__ void row_max_kernel(float* row_max, const float* logits, int vocab) {
  __shared__ float shared[32];
  const float* x = logits + size_t(blockIdx.x) * vocab;
  float top = -INFINITY;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) top = fmaxf(top, x[j]);
  top = block_max(top, shared);
  if (threadIdx.x == 0) row_max[blockIdx.x] = top;
}

__global__ void softmax_sums_kernel(float* sum_exp, float* target_logit, const float* logits,
                                    const float* row_max, const int32_t* targets, int vocab_begin,
                                    int vocab) {
  __shared__ float shared[32];
  const float* x = logits + size_t(blockIdx.x) * vocab;
  const float top = row_max[blockIdx.x];
  float sum = 0;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(x[j] - top);
  sum = block_sum(sum, shared);
  if (threadIdx.x == 0) {
    sum_exp[blockIdx.x] = sum;
    const int local = targets[blockIdx.x] - vocab_begin;
    target_logit[blockIdx.x] = local >= 0 && local < vocab ? x[local] : 0.f;
  }
}

__global__ void cross_entropy_loss_kernel(float* losses, const float* row_max, const float* sum_exp,
                                          const float* target_logit, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) losses[i] = logf(sum_exp[i]) + row_max[i] - target_logit[i];
}

__global__ void cross_entropy_backward_kernel(float* dlogits, const float* logits,
                                              const float* row_max, const float* sum_exp,
                                              const int32_t* targets, int vocab_begin,
                                              float loss_scale, int vocab) {
  const size_t offset = size_t(blockIdx.x) * vocab;
  const float top = row_max[blockIdx.x];
  const float factor = loss_scale / sum_exp[blockIdx.x];
  const int local = targets[blockIdx.x] - vocab_begin;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float d = expf(logits[offset + j] - top) * factor;
    dlogits[offset + j] = j == local ? d - loss_scale : d;
  }
}

// ---- AdamW -----------------------------------------------------------------------------------
struct AdamWScalars {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, grad_scale, step_size,
      inv_sqrt_bias2, eps;
};

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, size_t count,
                             AdamWScalars s) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    const float g = grad[i] * s.grad_scale;
    const float mi = s.beta1 * m[i] + s.one_minus_beta1 * g;
    const float vi = s.beta2 * v[i] + s.one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    const float p = param[i] * s.decay;
    param[i] = p - s.step_size * mi / (sqrtf(vi) * s.inv_sqrt_bias2 + s.eps);
  }
}

// ---- host side -------------------------------------------------------------------------------
// Frees device memory from a destructor, where nothing may throw: a failure is reported and
// cleared, so that it is not taken for the failure of the next launch.
void free_quietly(void* pointer) {
  if (pointer == nullptr) return;
  const cudaError_t status = cudaFree(pointer);
  if (status != cudaSuccess) {
    std::fprintf(stderr, "cuda backend: cudaFree failed: %s\n", cudaGetErrorString(status));
    cudaGetLastError();
  }
}

// Device memory that grows on demand (scratch of the kernels above). Movable, not copyable: it
// owns its pointer.
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
      free_quietly(data);
      data = nullptr;
      count = 0;
      cuda_check(cudaMalloc(&data, wanted * sizeof(E)), "cudaMalloc (scratch)");
      count = wanted;
    }
    return data;
  }
};

// Per-operation device time, when the environment sets MALLEUS_CUDA_PROFILE=1: CUDA events
// around every call, summed by operation and printed to stderr when the backend is destroyed
// (docs/cuda.md). Off, it costs one null check per call.
class Profile {
 public:
  Profile() = default;
  Profile(const Profile&) = delete;
  Profile& operator=(const Profile&) = delete;
  ~Profile() {
    fold();
    double all = 0;
    for (const auto& [name, total] : totals_) all += total.ms;
    std::vector<std::pair<std::string, Total>> rows(totals_.begin(), totals_.end());
    std::sort(rows.begin(), rows.end(),
              [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    std::fprintf(stderr, "cuda backend profile: %.1f ms of device time in backend calls\n", all);
    for (const auto& [name, total] : rows) {
      std::fprintf(stderr, "  %-24s %8ld calls %10.2f ms %6.1f%%\n", name.c_str(), total.calls,
                   total.ms, all > 0 ? 100.0 * total.ms / all : 0.0);
    }
  }
  size_t begin(const char* name) {
    if (marks_.size() >= 4096) fold();
    Mark mark{name, nullptr, nullptr};
    cudaEventCreate(&mark.start);
    cudaEventCreate(&mark.stop);
    cudaEventRecord(mark.start, nullptr);
    marks_.push_back(mark);
    return marks_.size() - 1;
  }
  void end(size_t index) { cudaEventRecord(marks_[index].stop, nullptr); }

 private:
  struct Mark {
    const char* name;
    cudaEvent_t start, stop;
  };
  struct Total {
    long calls = 0;
    double ms = 0;
  };
  void fold() {
    cudaDeviceSynchronize();
    for (const Mark& mark : marks_) {
      float ms = 0;
      if (cudaEventElapsedTime(&ms, mark.start, mark.stop) == cudaSuccess) {
        Total& total = totals_[mark.name];
        total.calls += 1;
        total.ms += ms;
      }
      cudaEventDestroy(mark.start);
      cudaEventDestroy(mark.stop);
    }
    cudaGetLastError();
    marks_.clear();
  }
  std::vector<Mark> marks_;
  std::map<std::string, Total> totals_;
};

// Times the enclosing call when profiling is on.
class Timed {
 public:
  Timed(Profile* profile, const char* name) : profile_(profile) {
    if (profile_ != nullptr) index_ = profile_->begin(name);
  }
  ~Timed() {
    if (profile_ != nullptr) profile_->end(index_);
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  Profile* profile_;
  size_t index_ = 0;
};

// cos/sin of every (position, frequency) pair for one (head_dim, theta), on the device, grown to
// the longest sequence seen. Angles in double on the host, as the CPU backend computes them.
struct RopeTable {
  int head_dim = 0;
  float theta = 0;
  int seq = 0;
  Scratch<float> cos, sin;

  void grow(int new_seq) {
    const int half = head_dim / 2;
    std::vector<float> c(size_t(new_seq) * half), s(c.size());
    for (int i = 0; i < half; ++i) {
      const double frequency = std::pow(double(theta), -2.0 * i / double(head_dim));
      for (int t = 0; t < new_seq; ++t) {
        c[size_t(t) * half + i] = float(std::cos(t * frequency));
        s[size_t(t) * half + i] = float(std::sin(t * frequency));
      }
    }
    cuda_check(cudaMemcpy(cos.at_least(c.size()), c.data(), c.size() * sizeof(float),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy (rope table)");
    cuda_check(cudaMemcpy(sin.at_least(s.size()), s.data(), s.size() * sizeof(float),
                          cudaMemcpyHostToDevice),
               "cudaMemcpy (rope table)");
    seq = new_seq;
  }
};

// One row-major product C[m, n] = alpha · op(A) · op(B) + beta · C, batched with strides, as
// cuBLAS (column-major) sees it: Cᵀ = op(B)ᵀ · op(A)ᵀ.
struct Gemm {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  float alpha = 1;
  const float* a = nullptr;
  int lda = 0;
  long long stride_a = 0;
  const float* b = nullptr;
  int ldb = 0;
  long long stride_b = 0;
  float beta = 0;
  float* c = nullptr;
  int ldc = 0;
  long long stride_c = 0;
  int batch = 1;
};

class CudaBackend final : public Backend<float> {
 public:
  explicit CudaBackend(CudaMath math) : math_(math) {
    check(cuda_device_count() > 0, "cuda backend: no CUDA device is available");
    cuda_check(cudaFree(nullptr), "creating the CUDA context");
    cublas_check(cublasCreate(&handle_), "cublasCreate");
    cublas_check(cublasSetStream(handle_, nullptr), "cublasSetStream");
    // Exact mode must not let cuBLAS round the inputs to tf32 behind our back.
    cublas_check(cublasSetMathMode(handle_, math == CudaMath::kExact ? CUBLAS_PEDANTIC_MATH
                                                                     : CUBLAS_DEFAULT_MATH),
                 "cublasSetMathMode");
    sum_partial_.at_least(kSumBlocks + 1);
    const char* profile = std::getenv("MALLEUS_CUDA_PROFILE");
    if (profile != nullptr && std::string(profile) == "1") profile_ = std::make_unique<Profile>();
  }
  ~CudaBackend() override {
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda-float32-" + cuda_math_name(math_); }
  // The GPU has no host thread count to set; kept so callers can read back what they set.
  void set_num_threads(int threads) override {
    check(threads >= 1,
          "cuda backend: thread count must be at least 1, got " + std::to_string(threads));
    threads_ = threads;
  }
  int num_threads() const override { return threads_; }

  // ---- memory ------------------------------------------------------------------------------
  float* allocate(size_t count) override {
    return static_cast<float*>(zeroed(count * sizeof(float)));
  }
  int32_t* allocate_tokens(size_t count) override {
    return static_cast<int32_t*>(zeroed(count * sizeof(int32_t)));
  }
  void release(void* pointer) override {
    // Called from destructors (Buffer's): reported, not thrown.
    free_quietly(pointer);
  }
  // The device memory stays allocated (no cuMemMap-backed reservations yet); the range is zeroed
  // so that it reads as the CPU backend's discarded pages do.
  void discard_pages(void* data, size_t bytes) override {
    if (bytes > 0) cuda_check(cudaMemsetAsync(data, 0, bytes, nullptr), "cudaMemsetAsync");
  }
  void copy_to_host(float* host, const float* source, size_t count) override {
    const Timed timed(profile_.get(), "copy_to_host");
    if (count > 0) {
      cuda_check(cudaMemcpy(host, source, count * sizeof(float), cudaMemcpyDeviceToHost),
                 "cudaMemcpy to host");
    }
  }
  void copy_from_host(float* destination, const float* host, size_t count) override {
    const Timed timed(profile_.get(), "copy_from_host");
    if (count > 0) {
      cuda_check(cudaMemcpy(destination, host, count * sizeof(float), cudaMemcpyHostToDevice),
                 "cudaMemcpy from host");
    }
  }
  void copy_tokens_from_host(int32_t* destination, const int32_t* host, size_t count) override {
    const Timed timed(profile_.get(), "copy_tokens_from_host");
    if (count > 0) {
      cuda_check(cudaMemcpy(destination, host, count * sizeof(int32_t), cudaMemcpyHostToDevice),
                 "cudaMemcpy tokens from host");
    }
  }

  // ---- elementwise and reductions ------------------------------------------------------------
  void fill_zero(float* x, size_t count) override {
    const Timed timed(profile_.get(), "fill_zero");
    if (count > 0) cuda_check(cudaMemsetAsync(x, 0, count * sizeof(float), nullptr), "memset");
  }
  void copy(float* destination, const float* source, size_t count) override {
    const Timed timed(profile_.get(), "copy");
    if (count == 0) return;
    cuda_check(cudaMemcpyAsync(destination, source, count * sizeof(float), cudaMemcpyDeviceToDevice,
                               nullptr),
               "cudaMemcpyAsync");
  }
  void add(float* y, const float* x, size_t count) override {
    const Timed timed(profile_.get(), "add");
    if (count == 0) return;
    add_kernel<<<blocks_for(count), kThreads>>>(y, x, count);
    launched("add");
  }
  void scale(float* x, float factor, size_t count) override {
    const Timed timed(profile_.get(), "scale");
    if (count == 0) return;
    scale_kernel<<<blocks_for(count), kThreads>>>(x, factor, count);
    launched("scale");
  }
  double sum_squares(const float* x, size_t count) override {
    const Timed timed(profile_.get(), "sum_squares");
    if (count == 0) return 0;
    double* partial = sum_partial_.data;
    sum_squares_partial<<<kSumBlocks, kThreads>>>(partial, x, count);
    launched("sum_squares");
    sum_partials<<<1, 1024>>>(partial + kSumBlocks, partial, kSumBlocks);
    launched("sum_squares (final)");
    double total = 0;
    cuda_check(cudaMemcpy(&total, partial + kSumBlocks, sizeof(double), cudaMemcpyDeviceToHost),
               "cudaMemcpy (sum_squares)");
    return total;
  }

  // ---- layers --------------------------------------------------------------------------------
  void embedding_forward(float* out, const int32_t* tokens, const float* table, int vocab_begin,
                         int rows, int n, int c) override {
    const Timed timed(profile_.get(), "embedding_forward");
    if (n == 0 || c == 0) return;
    embedding_forward_kernel<<<n, kThreads>>>(out, tokens, table, vocab_begin, rows, c);
    launched("embedding_forward");
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int vocab_begin,
                          int rows, int n, int c) override {
    const Timed timed(profile_.get(), "embedding_backward");
    if (n == 0 || c == 0) return;
    const dim3 grid((c + 127) / 128, kEmbeddingBuckets);
    embedding_backward_kernel<<<grid, 128>>>(dtable, dout, tokens, vocab_begin, rows, n, c);
    launched("embedding_backward");
  }

  void rmsnorm_forward(float* out, float* rstd, const float* in, const float* weight, int n, int c,
                       float eps) override {
    const Timed timed(profile_.get(), "rmsnorm_forward");
    if (n == 0) return;
    rmsnorm_forward_kernel<<<n, kThreads>>>(out, rstd, in, weight, c, eps);
    launched("rmsnorm_forward");
  }
  void rmsnorm_backward(float* din, float* dweight, const float* dout, const float* in,
                        const float* weight, const float* rstd, int n, int c) override {
    const Timed timed(profile_.get(), "rmsnorm_backward");
    if (n == 0 || c == 0) return;
    rmsnorm_backward_input<<<n, kThreads>>>(din, dout, in, weight, rstd, c);
    launched("rmsnorm_backward");
    const int segments = (n + kRowSegment - 1) / kRowSegment;
    double* partial = norm_partial_.at_least(size_t(segments) * c);
    const int column_blocks = (c + kThreads - 1) / kThreads;
    rmsnorm_weight_partial<<<dim3(column_blocks, segments), kThreads>>>(partial, dout, in, rstd, n,
                                                                        c);
    launched("rmsnorm_backward (weight)");
    rmsnorm_weight_finish<<<column_blocks, kThreads>>>(dweight, partial, segments, c);
    launched("rmsnorm_backward (weight sum)");
  }

  void matmul_forward(float* out, const float* in, const float* weight, int n, int ic,
                      int oc) override {
    const Timed timed(profile_.get(), "matmul_forward");
    if (n == 0 || oc == 0) return;
    if (ic == 0) return fill_zero(out, size_t(n) * oc);
    gemm({.trans_b = true,
          .m = n,
          .n = oc,
          .k = ic,
          .a = in,
          .lda = ic,
          .b = weight,
          .ldb = ic,
          .c = out,
          .ldc = oc});
  }
  void matmul_backward(float* din, float* dweight, const float* dout, const float* in,
                       const float* weight, int n, int ic, int oc) override {
    const Timed timed(profile_.get(), "matmul_backward");
    if (n == 0 || ic == 0) return;
    if (din != nullptr) {
      if (oc == 0) {
        fill_zero(din, size_t(n) * ic);
      } else {
        gemm({.m = n,
              .n = ic,
              .k = oc,
              .a = dout,
              .lda = oc,
              .b = weight,
              .ldb = ic,
              .c = din,
              .ldc = ic});
      }
    }
    if (oc > 0) {
      gemm({.trans_a = true,
            .m = oc,
            .n = ic,
            .k = n,
            .a = dout,
            .lda = oc,
            .b = in,
            .ldb = ic,
            .beta = 1,
            .c = dweight,
            .ldc = ic});
    }
  }

  void rope_forward(float* x, int batch, int seq, int heads, int head_dim, float theta,
                    int first_position) override {
    const Timed timed(profile_.get(), "rope_forward");
    rope(x, batch, seq, heads, head_dim, theta, first_position, 1.0f);
  }
  void rope_backward(float* dx, int batch, int seq, int heads, int head_dim, float theta) override {
    const Timed timed(profile_.get(), "rope_backward");
    rope(dx, batch, seq, heads, head_dim, theta, 0, -1.0f);
  }

  void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                         int batch, int seq, int past, int q_heads, int kv_heads,
                         int head_dim) override;
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* probs,
                          const float* q, const float* k, const float* v, int batch, int seq,
                          int q_heads, int kv_heads, int head_dim) override;

  void swiglu_forward(float* out, const float* gate, const float* up, size_t count) override {
    const Timed timed(profile_.get(), "swiglu_forward");
    if (count == 0) return;
    swiglu_forward_kernel<<<blocks_for(count), kThreads>>>(out, gate, up, count);
    launched("swiglu_forward");
  }
  void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                       const float* up, size_t count) override {
    const Timed timed(profile_.get(), "swiglu_backward");
    if (count == 0) return;
    swiglu_backward_kernel<<<blocks_for(count), kThreads>>>(dgate, dup, dout, gate, up, count);
    launched("swiglu_backward");
  }

  void logits_row_max(float* row_max, const float* logits, int n, int vocab) override {
    const Timed timed(profile_.get(), "logits_row_max");
    if (n == 0) return;
    row_max_kernel<<<n, kThreads>>>(row_max, logits, vocab);
    launched("logits_row_max");
  }
  void logits_softmax_sums(float* sum_exp, float* target_logit, const float* logits,
                           const float* row_max, const int32_t* targets, int vocab_begin, int n,
                           int vocab) override {
    const Timed timed(profile_.get(), "logits_softmax_sums");
    if (n == 0) return;
    softmax_sums_kernel<<<n, kThreads>>>(sum_exp, target_logit, logits, row_max, targets,
                                         vocab_begin, vocab);
    launched("logits_softmax_sums");
  }
  void cross_entropy_loss(float* losses, const float* row_max, const float* sum_exp,
                          const float* target_logit, int n) override {
    const Timed timed(profile_.get(), "cross_entropy_loss");
    if (n == 0) return;
    cross_entropy_loss_kernel<<<(n + kThreads - 1) / kThreads, kThreads>>>(losses, row_max, sum_exp,
                                                                           target_logit, n);
    launched("cross_entropy_loss");
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* row_max,
                              const float* sum_exp, const int32_t* targets, int vocab_begin,
                              float loss_scale, int n, int vocab) override {
    const Timed timed(profile_.get(), "cross_entropy_backward");
    if (n == 0 || vocab == 0) return;
    cross_entropy_backward_kernel<<<n, kThreads>>>(dlogits, logits, row_max, sum_exp, targets,
                                                   vocab_begin, loss_scale, vocab);
    launched("cross_entropy_backward");
  }

  void adamw_update(float* param, const float* grad, float* m, float* v, size_t count,
                    const AdamWStep& step) override {
    const Timed timed(profile_.get(), "adamw_update");
    if (count == 0) return;
    // The same scalars as the CPU backend, computed the same way in double.
    const double steps = double(step.step);
    AdamWScalars s;
    s.decay = float(1.0 - double(step.lr) * step.weight_decay);
    s.beta1 = step.beta1;
    s.beta2 = step.beta2;
    s.one_minus_beta1 = float(1.0 - double(step.beta1));
    s.one_minus_beta2 = float(1.0 - double(step.beta2));
    s.grad_scale = step.grad_scale;
    s.step_size = float(double(step.lr) / (1.0 - std::pow(double(step.beta1), steps)));
    s.inv_sqrt_bias2 = float(1.0 / std::sqrt(1.0 - std::pow(double(step.beta2), steps)));
    s.eps = step.eps;
    adamw_kernel<<<blocks_for(count), kThreads>>>(param, grad, m, v, count, s);
    launched("adamw_update");
  }

 private:
  void gemm(const Gemm& g) {
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F_PEDANTIC;
    if (math_ == CudaMath::kTf32) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    if (math_ == CudaMath::kBf16) compute = CUBLAS_COMPUTE_32F_FAST_16BF;
    const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublas_check(cublasGemmStridedBatchedEx(handle_, op_b, op_a, g.n, g.m, g.k, &g.alpha, g.b,
                                            CUDA_R_32F, g.ldb, g.stride_b, g.a, CUDA_R_32F, g.lda,
                                            g.stride_a, &g.beta, g.c, CUDA_R_32F, g.ldc, g.stride_c,
                                            g.batch, compute, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmStridedBatchedEx");
  }

  void rope(float* x, int batch, int seq, int heads, int head_dim, float theta, int first_position,
            float direction) {
    check(head_dim % 2 == 0, "rope: head_dim must be even, got " + std::to_string(head_dim));
    check(first_position >= 0,
          "rope: first_position must not be negative, got " + std::to_string(first_position));
    const size_t pairs = size_t(batch) * seq * heads * (head_dim / 2);
    if (pairs == 0) return;
    const RopeTable& table = rope_table(first_position + seq, head_dim, theta);
    rope_kernel<<<blocks_for(pairs), kThreads>>>(x, table.cos.data, table.sin.data, seq, heads,
                                                 head_dim / 2, first_position, direction, pairs);
    launched("rope");
  }

  const RopeTable& rope_table(int seq, int head_dim, float theta) {
    for (RopeTable& table : rope_tables_) {
      if (table.head_dim == head_dim && table.theta == theta) {
        if (table.seq < seq) table.grow(seq);
        return table;
      }
    }
    RopeTable& table = rope_tables_.emplace_back();
    table.head_dim = head_dim;
    table.theta = theta;
    table.grow(seq);
    return table;
  }

  static void check_heads(int q_heads, int kv_heads) {
    check(kv_heads > 0 && q_heads % kv_heads == 0,
          "attention: q_heads (" + std::to_string(q_heads) +
              ") must be a positive multiple of kv_heads (" + std::to_string(kv_heads) + ")");
  }

  void* zeroed(size_t bytes) {
    // At least one byte, so that every buffer has its own address for the ledger.
    void* pointer = nullptr;
    const size_t size = std::max<size_t>(bytes, 256);
    cuda_check(cudaMalloc(&pointer, size),
               ("cudaMalloc of " + std::to_string(size) + " bytes").c_str());
    cuda_check(cudaMemset(pointer, 0, size), "cudaMemset");
    return pointer;
  }

  CudaMath math_;
  int threads_ = 1;
  cublasHandle_t handle_ = nullptr;
  std::unique_ptr<Profile> profile_;  // null unless MALLEUS_CUDA_PROFILE=1
  Scratch<double> sum_partial_;
  Scratch<double> norm_partial_;
  Scratch<float> attention_scratch_;  // attention backward: dP/dS of one sequence's heads
  std::vector<RopeTable> rope_tables_;
};

// The scores of every query head are one strided-batched product per (sequence, member of the
// kv group): the batch runs over the kv heads, whose query heads sit `group` heads apart.
void CudaBackend::attention_forward(float* out, float* probs, const float* q, const float* k,
                                    const float* v, int batch, int seq, int past, int q_heads,
                                    int kv_heads, int head_dim) {
  const Timed timed(profile_.get(), "attention_forward");
  check_heads(q_heads, kv_heads);
  check(past >= 0, "attention: past must not be negative, got " + std::to_string(past));
  if (batch == 0 || seq == 0 || q_heads == 0) return;
  const int group = q_heads / kv_heads;
  const int q_stride = q_heads * head_dim, kv_stride = kv_heads * head_dim;
  const int keys = past + seq;
  const long long rectangle = static_cast<long long>(seq) * keys;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  for (int b = 0; b < batch; ++b) {
    for (int member = 0; member < group; ++member) {
      const size_t q_offset = size_t(b) * seq * q_stride + size_t(member) * head_dim;
      const size_t kv_offset = size_t(b) * keys * kv_stride;
      float* p = probs + (size_t(b) * q_heads + member) * size_t(rectangle);
      // S = scale · Q Kᵀ, the whole rectangle (the masked part is overwritten by the softmax).
      gemm({.trans_b = true,
            .m = seq,
            .n = keys,
            .k = head_dim,
            .alpha = scale,
            .a = q + q_offset,
            .lda = q_stride,
            .stride_a = group * head_dim,
            .b = k + kv_offset,
            .ldb = kv_stride,
            .stride_b = head_dim,
            .c = p,
            .ldc = keys,
            .stride_c = group * rectangle,
            .batch = kv_heads});
    }
  }
  causal_softmax_kernel<<<batch * q_heads * seq, kThreads>>>(probs, seq, keys, past);
  launched("attention softmax");
  for (int b = 0; b < batch; ++b) {
    for (int member = 0; member < group; ++member) {
      const size_t q_offset = size_t(b) * seq * q_stride + size_t(member) * head_dim;
      const size_t kv_offset = size_t(b) * keys * kv_stride;
      const float* p = probs + (size_t(b) * q_heads + member) * size_t(rectangle);
      gemm({.m = seq,
            .n = head_dim,
            .k = keys,
            .a = p,
            .lda = keys,
            .stride_a = group * rectangle,
            .b = v + kv_offset,
            .ldb = kv_stride,
            .stride_b = head_dim,
            .c = out + q_offset,
            .ldc = q_stride,
            .stride_c = group * head_dim,
            .batch = kv_heads});
    }
  }
}

void CudaBackend::attention_backward(float* dq, float* dk, float* dv, const float* dout,
                                     const float* probs, const float* q, const float* k,
                                     const float* v, int batch, int seq, int q_heads, int kv_heads,
                                     int head_dim) {
  const Timed timed(profile_.get(), "attention_backward");
  check_heads(q_heads, kv_heads);
  if (batch == 0 || seq == 0 || q_heads == 0) return;
  const int group = q_heads / kv_heads;
  const int q_stride = q_heads * head_dim, kv_stride = kv_heads * head_dim;
  const long long square = static_cast<long long>(seq) * seq;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  float* ds = attention_scratch_.at_least(size_t(q_heads) * size_t(square));
  for (int b = 0; b < batch; ++b) {
    const size_t kv_offset = size_t(b) * seq * kv_stride;
    const float* p_b = probs + size_t(b) * q_heads * size_t(square);
    for (int member = 0; member < group; ++member) {
      const size_t q_offset = size_t(b) * seq * q_stride + size_t(member) * head_dim;
      const size_t h_offset = size_t(member) * size_t(square);
      // dP = dO Vᵀ
      gemm({.trans_b = true,
            .m = seq,
            .n = seq,
            .k = head_dim,
            .a = dout + q_offset,
            .lda = q_stride,
            .stride_a = group * head_dim,
            .b = v + kv_offset,
            .ldb = kv_stride,
            .stride_b = head_dim,
            .c = ds + h_offset,
            .ldc = seq,
            .stride_c = group * square,
            .batch = kv_heads});
    }
    softmax_backward_kernel<<<q_heads * seq, kThreads>>>(ds, p_b, seq, scale);
    launched("attention softmax backward");
    for (int member = 0; member < group; ++member) {
      const size_t q_offset = size_t(b) * seq * q_stride + size_t(member) * head_dim;
      const size_t h_offset = size_t(member) * size_t(square);
      // dQ = dS K
      gemm({.m = seq,
            .n = head_dim,
            .k = seq,
            .a = ds + h_offset,
            .lda = seq,
            .stride_a = group * square,
            .b = k + kv_offset,
            .ldb = kv_stride,
            .stride_b = head_dim,
            .c = dq + q_offset,
            .ldc = q_stride,
            .stride_c = group * head_dim,
            .batch = kv_heads});
      // dV = Σ_members Pᵀ dO and dK = Σ_members dSᵀ Q: the first member overwrites, the others
      // add, in member order (one stream, so in sequence).
      const float beta = member == 0 ? 0.f : 1.f;
      gemm({.trans_a = true,
            .m = seq,
            .n = head_dim,
            .k = seq,
            .a = p_b + h_offset,
            .lda = seq,
            .stride_a = group * square,
            .b = dout + q_offset,
            .ldb = q_stride,
            .stride_b = group * head_dim,
            .beta = beta,
            .c = dv + kv_offset,
            .ldc = kv_stride,
            .stride_c = head_dim,
            .batch = kv_heads});
      gemm({.trans_a = true,
            .m = seq,
            .n = head_dim,
            .k = seq,
            .a = ds + h_offset,
            .lda = seq,
            .stride_a = group * square,
            .b = q + q_offset,
            .ldb = q_stride,
            .stride_b = group * head_dim,
            .beta = beta,
            .c = dk + kv_offset,
            .ldc = kv_stride,
            .stride_c = head_dim,
            .batch = kv_heads});
    }
  }
}

}  // namespace

CudaMath parse_cuda_math(const std::string& name) {
  if (name == "exact") return CudaMath::kExact;
  if (name == "tf32") return CudaMath::kTf32;
  if (name == "bf16") return CudaMath::kBf16;
  throw Error("cuda math mode \"" + name + "\" is not one of exact, tf32, bf16");
}

std::string cuda_math_name(CudaMath math) {
  switch (math) {
    case CudaMath::kExact:
      return "exact";
    case CudaMath::kTf32:
      return "tf32";
    case CudaMath::kBf16:
      return "bf16";
  }
  return "unknown";
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return count;
}

std::string cuda_device_name() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp properties{};
  cuda_check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  return properties.name;
}

std::unique_ptr<Backend<float>> make_cuda_backend(CudaMath math) {
  return std::make_unique<CudaBackend>(math);
}

void cuda_synchronize() {
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace malleus::backend
