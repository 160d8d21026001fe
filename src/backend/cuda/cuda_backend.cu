// The CUDA backend: cuBLAS for the linear layers, fused (flash) attention, one plain kernel per
// remaining operation (kernels.cuh). CudaMath picks the storage and how cuBLAS multiplies; in bf16
// mode, Precision::kCompute buffers are stored in bf16 behind handles (storage_map.h) and the
// parameters keep a bf16 copy for the products.
//
// Determinism: every kernel gives bit-identical results run to run on the same device (no
// atomics; fixed summation orders), and cuBLAS is deterministic on one stream.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "backend/cuda/backend_memory.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/flash_attention.cuh"
#include "backend/cuda/kernels.cuh"
#include "backend/cuda/storage_map.h"
#include "backend/cuda/tuned_gemm.cuh"

namespace malleus::backend {
namespace {

using cuda::bf16;
using cuda::cublas_check;
using cuda::cuda_check;
using cuda::Scratch;
using cuda::Span;
using cuda::Storage;
using cuda::StoredBuffer;

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

// One row-major product C[m, n] = alpha · op(A) · op(B) + beta · C of contiguous matrices.
struct Gemm {
  bool trans_a = false, trans_b = false;
  int m = 0, n = 0, k = 0;
  Span a, b, c;
  size_t a_count = 0, b_count = 0;  // elements of A and B (for conversion)
  int lda = 0, ldb = 0, ldc = 0;
  float beta = 0;
};

// Host address space with no access and no memory behind it: the handle of a bf16 buffer
// (storage_map.h).
size_t handle_bytes(size_t count) {
  const size_t page = 4096;
  return (std::max<size_t>(count * sizeof(float), 256) + page - 1) / page * page;
}

const void* reserve_handle(size_t count) {
  void* address = mmap(nullptr, handle_bytes(count), PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  check(address != MAP_FAILED,
        "cuda backend: reserving address space for " + std::to_string(count) + " elements failed");
  return address;
}

std::shared_ptr<cuda::StorageMap> process_storage() {
  static const auto storage = std::make_shared<cuda::StorageMap>();
  return storage;
}

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
    int device = 0;
    cuda_check(cudaGetDevice(&device), "cudaGetDevice");
    // Its buffers as MPI and the host reach them (bf16 handles widened and rounded on the way);
    // open_device keeps a backend's own device memory.
    set_device_memory(cuda::backend_memory(storage_, cuda_device_memory(device)));
    const char* profile = std::getenv("MALLEUS_CUDA_PROFILE");
    if (profile != nullptr && std::string(profile) == "1") profile_ = std::make_unique<Profile>();
    const char* tuning = std::getenv("MALLEUS_CUDA_GEMM_TUNING");
    if (bf16_storage() && tuning != nullptr && std::string(tuning) == "1") {
      tuned_ = std::make_unique<cuda::TunedGemm>();
    }
  }
  ~CudaBackend() override {
    // Buffers still registered (a leak elsewhere) are given back with the backend.
    for (const void* handle : owned_) {
      try {
        free_buffer(storage_->remove(handle));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
      }
    }
    if (handle_ != nullptr) cublasDestroy(handle_);
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override {
    return bf16_storage() ? "cuda-bf16" : "cuda-float32-" + cuda_math_name(math_);
  }
  // The GPU has no host thread count to set; kept so callers can read back what they set.
  void set_num_threads(int threads) override {
    check(threads >= 1,
          "cuda backend: thread count must be at least 1, got " + std::to_string(threads));
    threads_ = threads;
  }
  int num_threads() const override { return threads_; }

  // ---- memory ------------------------------------------------------------------------------
  float* allocate(size_t count, MemoryKind kind, Precision precision) override {
    StoredBuffer b;
    b.count = count;
    if (narrow(precision)) {
      b.storage = Storage::kBf16;
      b.data = zeroed(count * sizeof(bf16));
      b.handle = reserve_handle(count);
    } else {
      b.data = zeroed(count * sizeof(float));
      b.handle = b.data;
      if (shadowed(kind)) b.shadow = zeroed(count * sizeof(bf16));
    }
    storage_->add(b);
    owned_.insert(b.handle);
    return static_cast<float*>(const_cast<void*>(b.handle));
  }
  size_t allocation_bytes(size_t count, MemoryKind kind, Precision precision) const override {
    if (narrow(precision)) return count * sizeof(bf16);
    return count * (sizeof(float) + (shadowed(kind) ? sizeof(bf16) : 0));
  }
  int32_t* allocate_tokens(size_t count) override {
    auto* tokens = static_cast<int32_t*>(zeroed(count * sizeof(int32_t)));
    tokens_.emplace(reinterpret_cast<char*>(tokens), count * sizeof(int32_t));
    return tokens;
  }
  void release(void* pointer) override {
    // Called from destructors (Buffer's): reported, not thrown.
    if (tokens_.erase(static_cast<char*>(pointer)) > 0) return cuda::free_quietly(pointer);
    try {
      owned_.erase(pointer);
      StoredBuffer b = storage_->remove(pointer);
      free_buffer(b);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
    }
  }
  // The device memory stays allocated (plain cudaMalloc, no cuMemMap reservations); the range is
  // zeroed so that it reads as the CPU backend's discarded pages do.
  void discard_pages(void* data, size_t bytes) override {
    if (bytes == 0) return;
    // Token buffers are plain device memory, outside the storage map (a plan switch gives back
    // every activation buffer, the micro-batch's tokens included).
    if (in_token_buffer(data)) {
      cuda_check(cudaMemsetAsync(data, 0, bytes, nullptr), "cudaMemsetAsync");
      return;
    }
    const size_t count = bytes / sizeof(float);
    if (count == 0) return;
    const Span span = written(static_cast<float*>(data), count);
    cuda_check(cudaMemsetAsync(span.data, 0, stored_bytes(span, count), nullptr),
               "cudaMemsetAsync");
  }
  void copy_to_host(float* host, const float* source, size_t count) override {
    const Timed timed(profile_.get(), "copy_to_host");
    if (count == 0) return;
    Span from = span(source, count);
    if (from.bf16) {
      float* staged = staging_.at_least(count);
      cuda::convert({staged, false}, from, count);
      from = {staged, false};
    }
    cuda_check(cudaMemcpy(host, from.data, count * sizeof(float), cudaMemcpyDeviceToHost),
               "cudaMemcpy to host");
  }
  void copy_from_host(float* destination, const float* host, size_t count) override {
    const Timed timed(profile_.get(), "copy_from_host");
    if (count == 0) return;
    const Span to = written(destination, count);
    void* target = to.bf16 ? staging_.at_least(count) : to.data;
    cuda_check(cudaMemcpy(target, host, count * sizeof(float), cudaMemcpyHostToDevice),
               "cudaMemcpy from host");
    if (to.bf16) cuda::convert(to, {target, false}, count);
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
    if (count == 0) return;
    const Span to = written(x, count);
    cuda_check(cudaMemsetAsync(to.data, 0, stored_bytes(to, count), nullptr), "memset");
  }
  void copy(float* destination, const float* source, size_t count) override {
    const Timed timed(profile_.get(), "copy");
    if (count == 0) return;
    const Span from = span(source, count), to = written(destination, count);
    if (from.bf16 != to.bf16) return cuda::convert(to, from, count);
    cuda_check(cudaMemcpyAsync(to.data, from.data, stored_bytes(to, count),
                               cudaMemcpyDeviceToDevice, nullptr),
               "cudaMemcpyAsync");
  }
  void copy_rows(float* destination, const float* source, const Rows& shape) override {
    const Timed timed(profile_.get(), "copy_rows");
    if (shape.count == 0 || shape.rows == 0) return;
    const auto extent = [&](size_t stride) { return (shape.rows - 1) * stride + shape.count; };
    const Span from = span(source, extent(shape.source_stride));
    const Span to = written(destination, extent(shape.destination_stride));
    if (from.bf16 != to.bf16) {  // a conversion per run
      for (size_t r = 0; r < shape.rows; ++r) {
        cuda::convert(to.offset(r * shape.destination_stride), from.offset(r * shape.source_stride),
                      shape.count);
      }
      return;
    }
    const size_t element = stored_bytes(to, 1);
    cuda_check(cudaMemcpy2DAsync(to.data, shape.destination_stride * element, from.data,
                                 shape.source_stride * element, shape.count * element, shape.rows,
                                 cudaMemcpyDeviceToDevice, nullptr),
               "cudaMemcpy2DAsync");
  }
  void add(float* y, const float* x, size_t count) override {
    const Timed timed(profile_.get(), "add");
    if (count == 0) return;
    cuda::add(written(y, count), span(x, count), count);
  }
  void scale(float* x, float factor, size_t count) override {
    const Timed timed(profile_.get(), "scale");
    if (count == 0) return;
    cuda::scale(written(x, count), factor, count);
  }
  double sum_squares(const float* x, size_t count) override {
    const Timed timed(profile_.get(), "sum_squares");
    if (count == 0) return 0;
    return cuda::sum_squares(scratch_, span(x, count), count);
  }

  // ---- layers --------------------------------------------------------------------------------
  void embedding_forward(float* out, const int32_t* tokens, const float* table, int vocab_begin,
                         int rows, int n, int c) override {
    const Timed timed(profile_.get(), "embedding_forward");
    if (n == 0 || c == 0) return;
    const size_t nc = size_t(n) * c;
    cuda::embedding_forward(written(out, nc), tokens, span(table, size_t(rows) * c), vocab_begin,
                            rows, n, c);
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int vocab_begin,
                          int rows, int n, int c) override {
    const Timed timed(profile_.get(), "embedding_backward");
    if (n == 0 || c == 0) return;
    cuda::embedding_backward(written(dtable, size_t(rows) * c), span(dout, size_t(n) * c), tokens,
                             vocab_begin, rows, n, c);
  }

  void rmsnorm_forward(float* out, float* rstd, const float* in, const float* weight, int n, int c,
                       float eps) override {
    const Timed timed(profile_.get(), "rmsnorm_forward");
    if (n == 0) return;
    const size_t nc = size_t(n) * c;
    cuda::rmsnorm_forward(written(out, nc), written(rstd, n), span(in, nc), span(weight, c), n, c,
                          eps);
  }
  void add_rmsnorm_forward(float* sum, float* out, float* rstd, const float* residual,
                           const float* weight, int n, int c, float eps) override {
    const Timed timed(profile_.get(), "add_rmsnorm_forward");
    if (n == 0) return;
    const size_t nc = size_t(n) * c;
    cuda::add_rmsnorm_forward(written(sum, nc), written(out, nc), written(rstd, n),
                              span(residual, nc), span(weight, c), n, c, eps);
  }
  void rmsnorm_backward(float* din, float* dweight, const float* dout, const float* in,
                        const float* weight, const float* rstd, int n, int c) override {
    const Timed timed(profile_.get(), "rmsnorm_backward");
    if (n == 0 || c == 0) return;
    const size_t nc = size_t(n) * c;
    cuda::rmsnorm_backward(scratch_, written(din, nc), written(dweight, c), span(dout, nc),
                           span(in, nc), span(weight, c), span(rstd, n), n, c);
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
          .a = span(in, size_t(n) * ic),
          .b = weights(weight, size_t(oc) * ic),
          .c = written(out, size_t(n) * oc),
          .a_count = size_t(n) * ic,
          .b_count = size_t(oc) * ic,
          .lda = ic,
          .ldb = ic,
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
              .a = span(dout, size_t(n) * oc),
              .b = weights(weight, size_t(oc) * ic),
              .c = written(din, size_t(n) * ic),
              .a_count = size_t(n) * oc,
              .b_count = size_t(oc) * ic,
              .lda = oc,
              .ldb = ic,
              .ldc = ic});
      }
    }
    if (oc > 0) {
      gemm({.trans_a = true,
            .m = oc,
            .n = ic,
            .k = n,
            .a = span(dout, size_t(n) * oc),
            .b = span(in, size_t(n) * ic),
            .c = written(dweight, size_t(oc) * ic),
            .a_count = size_t(n) * oc,
            .b_count = size_t(n) * ic,
            .lda = oc,
            .ldb = ic,
            .ldc = ic,
            .beta = 1});
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

  // One log-sum-exp per query row (flash_attention.cuh).
  size_t attention_state_size(int batch, int seq, int /*keys*/, int q_heads) const override {
    return size_t(batch) * q_heads * seq;
  }
  void attention_forward(float* out, float* state, const float* q, const float* k, const float* v,
                         int batch, int seq, int past, int q_heads, int kv_heads,
                         int head_dim) override {
    const Timed timed(profile_.get(), "attention_forward");
    const cuda::AttentionShape s{batch, seq, past, q_heads, kv_heads, head_dim};
    cuda::check_attention_shape(s);
    if (batch == 0 || seq == 0 || q_heads == 0) return;
    const size_t qn = size_t(batch) * seq * q_heads * head_dim;
    const size_t kvn = size_t(batch) * s.keys() * kv_heads * head_dim;
    cuda::flash_attention_forward({.out = written(out, qn),
                                   .lse = lse(state, attention_state_size(batch, seq, 0, q_heads)),
                                   .q = span(q, qn),
                                   .k = span(k, kvn),
                                   .v = span(v, kvn),
                                   .shape = s});
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                          const float* state, const float* q, const float* k, const float* v,
                          int batch, int seq, int q_heads, int kv_heads, int head_dim) override {
    const Timed timed(profile_.get(), "attention_backward");
    const cuda::AttentionShape s{batch, seq, 0, q_heads, kv_heads, head_dim};
    cuda::check_attention_shape(s);
    if (batch == 0 || seq == 0 || q_heads == 0) return;
    const size_t qn = size_t(batch) * seq * q_heads * head_dim;
    const size_t kvn = size_t(batch) * seq * kv_heads * head_dim;
    const size_t rows = attention_state_size(batch, seq, 0, q_heads);
    cuda::flash_attention_backward(
        {.dq = written(dq, qn),
         .dk = written(dk, kvn),
         .dv = written(dv, kvn),
         .dout = span(dout, qn),
         .out = span(out, qn),
         .lse = lse(state, rows),
         .q = span(q, qn),
         .k = span(k, kvn),
         .v = span(v, kvn),
         .shape = s,
         .delta = delta_.at_least(rows),
         .partials = partials_.at_least(cuda::attention_partials_size(s))});
  }

  void swiglu_forward(float* out, const float* gate, const float* up, size_t count) override {
    const Timed timed(profile_.get(), "swiglu_forward");
    if (count == 0) return;
    cuda::swiglu_forward(written(out, count), span(gate, count), span(up, count), count);
  }
  void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                       const float* up, size_t count) override {
    const Timed timed(profile_.get(), "swiglu_backward");
    if (count == 0) return;
    cuda::swiglu_backward(written(dgate, count), written(dup, count), span(dout, count),
                          span(gate, count), span(up, count), count);
  }

  void logits_row_max(float* row_max, const float* logits, int n, int vocab) override {
    const Timed timed(profile_.get(), "logits_row_max");
    if (n == 0) return;
    cuda::logits_row_max(written(row_max, n), span(logits, size_t(n) * vocab), n, vocab);
  }
  void logits_softmax_sums(float* sum_exp, float* target_logit, const float* logits,
                           const float* row_max, const int32_t* targets, int vocab_begin, int n,
                           int vocab) override {
    const Timed timed(profile_.get(), "logits_softmax_sums");
    if (n == 0) return;
    cuda::logits_softmax_sums(written(sum_exp, n), written(target_logit, n),
                              span(logits, size_t(n) * vocab), span(row_max, n), targets,
                              vocab_begin, n, vocab);
  }
  void cross_entropy_loss(float* losses, const float* row_max, const float* sum_exp,
                          const float* target_logit, int n) override {
    const Timed timed(profile_.get(), "cross_entropy_loss");
    if (n == 0) return;
    cuda::cross_entropy_loss(written(losses, n), span(row_max, n), span(sum_exp, n),
                             span(target_logit, n), n);
  }
  void cross_entropy_backward(float* dlogits, const float* logits, const float* row_max,
                              const float* sum_exp, const int32_t* targets, int vocab_begin,
                              float loss_scale, int n, int vocab) override {
    const Timed timed(profile_.get(), "cross_entropy_backward");
    if (n == 0 || vocab == 0) return;
    const size_t nv = size_t(n) * vocab;
    cuda::cross_entropy_backward(written(dlogits, nv), span(logits, nv), span(row_max, n),
                                 span(sum_exp, n), targets, vocab_begin, loss_scale, n, vocab);
  }

  void adamw_update(float* param, const float* grad, float* m, float* v, size_t count,
                    const AdamWStep& step) override {
    const Timed timed(profile_.get(), "adamw_update");
    if (count == 0) return;
    // The same scalars as the CPU backend, computed the same way in double.
    const double steps = double(step.step);
    cuda::AdamWScalars s;
    s.decay = float(1.0 - double(step.lr) * step.weight_decay);
    s.beta1 = step.beta1;
    s.beta2 = step.beta2;
    s.one_minus_beta1 = float(1.0 - double(step.beta1));
    s.one_minus_beta2 = float(1.0 - double(step.beta2));
    s.grad_scale = step.grad_scale;
    s.step_size = float(double(step.lr) / (1.0 - std::pow(double(step.beta1), steps)));
    s.inv_sqrt_bias2 = float(1.0 / std::sqrt(1.0 - std::pow(double(step.beta2), steps)));
    s.eps = step.eps;
    // The update writes the bf16 copy too, so it does not go stale.
    const cuda::Resolved p = storage_->resolve(param, count);
    bf16* shadow = p.buffer->shadow ? static_cast<bf16*>(p.shadow_address()) : nullptr;
    cuda::adamw({p.address(), p.buffer->storage == Storage::kBf16}, shadow, span(grad, count),
                written(m, count), written(v, count), count, s);
  }

 private:
  bool bf16_storage() const { return math_ == CudaMath::kBf16; }
  bool in_token_buffer(const void* pointer) const {
    const auto* p = static_cast<const char*>(pointer);
    auto above = tokens_.upper_bound(const_cast<char*>(p));
    if (above == tokens_.begin()) return false;
    --above;
    return p < above->first + above->second;
  }
  // Whether a buffer of this precision is stored in bf16.
  bool narrow(Precision precision) const {
    return bf16_storage() && precision == Precision::kCompute;
  }
  // Whether an fp32 buffer of this kind keeps a bf16 copy for the products.
  bool shadowed(MemoryKind kind) const { return bf16_storage() && kind == MemoryKind::kParameters; }
  static size_t stored_bytes(const Span& span, size_t count) {
    return count * (span.bf16 ? sizeof(bf16) : sizeof(float));
  }

  // Where `count` elements from `pointer` are stored, for reading.
  Span span(const float* pointer, size_t count) {
    const cuda::Resolved r = storage_->resolve(pointer, count);
    return {r.address(), r.buffer->storage == Storage::kBf16};
  }
  // The same, for writing: a buffer with a bf16 copy has that copy go stale.
  Span written(float* pointer, size_t count) {
    const cuda::Resolved r = storage_->resolve(pointer, count);
    if (r.buffer->shadow != nullptr) r.buffer->shadow_stale = true;
    return {r.address(), r.buffer->storage == Storage::kBf16};
  }
  // A matrix product's weights: the bf16 copy where the buffer has one (converted again first
  // when stale).
  Span weights(const float* pointer, size_t count) {
    const cuda::Resolved r = storage_->resolve(pointer, count);
    StoredBuffer& b = *r.buffer;
    if (b.shadow == nullptr) return {r.address(), b.storage == Storage::kBf16};
    if (b.shadow_stale) {
      cuda::convert({b.shadow, true}, {b.data, false}, b.count);
      b.shadow_stale = false;
    }
    return {r.shadow_address(), true};
  }
  // Attention's state: fp32 storage (Precision::kExact), or the caller's mistake.
  float* lse(const float* state, size_t rows) {
    const Span s = span(state, rows);
    check(!s.bf16,
          "cuda backend: attention's state must be allocated with Precision::kExact (fp32)");
    return static_cast<float*>(s.data);
  }

  void gemm(const Gemm& g);
  void rope(float* x, int batch, int seq, int heads, int head_dim, float theta, int first_position,
            float direction);
  const RopeTable& rope_table(int seq, int head_dim, float theta);

  static void free_buffer(const StoredBuffer& b) {
    cuda::free_quietly(b.data);
    cuda::free_quietly(b.shadow);
    if (b.handle != b.data) munmap(const_cast<void*>(b.handle), handle_bytes(b.count));
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
  std::unique_ptr<Profile> profile_;        // null unless MALLEUS_CUDA_PROFILE=1
  std::unique_ptr<cuda::TunedGemm> tuned_;  // null unless bf16 and MALLEUS_CUDA_GEMM_TUNING=1
  // One map for every CUDA backend of the process: an engine's switch (Engine::switch_to) copies
  // from the old engine's buffers into the new one's, each made by its own backend.
  std::shared_ptr<cuda::StorageMap> storage_ = process_storage();
  std::set<const void*> owned_;     // the handles of the buffers this backend allocated
  std::map<char*, size_t> tokens_;  // token buffers (cudaMalloc'd, not mapped): start, bytes
  cuda::KernelScratch scratch_;
  Scratch<float> staging_;   // fp32 copies of bf16 ranges on their way to and from the host
  Scratch<float> delta_;     // attention backward's rowsum(dout ⊙ out)
  Scratch<float> partials_;  // attention backward's per-head dk, dv of grouped heads
  Scratch<bf16> convert_a_, convert_b_;  // product inputs not in the product's format
  std::vector<RopeTable> rope_tables_;
};

void CudaBackend::gemm(const Gemm& g) {
  // bf16 mode multiplies bf16 inputs (with fp32 accumulation, into a bf16 or fp32 C); the fp32
  // modes multiply fp32 inputs. An input in the other format is converted first.
  Span a = g.a, b = g.b;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t input = CUDA_R_16BF;
  if (bf16_storage()) {
    if (!a.bf16) {
      bf16* converted = convert_a_.at_least(g.a_count);
      cuda::convert({converted, true}, a, g.a_count);
      a = {converted, true};
    }
    if (!b.bf16) {
      bf16* converted = convert_b_.at_least(g.b_count);
      cuda::convert({converted, true}, b, g.b_count);
      b = {converted, true};
    }
  } else {
    check(!a.bf16 && !b.bf16, "cuda backend: a bf16 operand in an fp32 mode");
    input = CUDA_R_32F;
    compute = math_ == CudaMath::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F_PEDANTIC;
  }
  if (tuned_ != nullptr && tuned_->run({.trans_a = g.trans_a,
                                        .trans_b = g.trans_b,
                                        .m = g.m,
                                        .n = g.n,
                                        .k = g.k,
                                        .lda = g.lda,
                                        .ldb = g.ldb,
                                        .ldc = g.ldc,
                                        .c_bf16 = g.c.bf16,
                                        .beta = g.beta},
                                       a.data, b.data, g.c.data)) {
    return;
  }
  const float alpha = 1;
  const cublasOperation_t op_a = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // cuBLAS is column-major: Cᵀ = op(B)ᵀ · op(A)ᵀ.
  cublas_check(
      cublasGemmEx(handle_, op_b, op_a, g.n, g.m, g.k, &alpha, b.data, input, g.ldb, a.data, input,
                   g.lda, &g.beta, g.c.data, g.c.bf16 ? CUDA_R_16BF : CUDA_R_32F, g.ldc, compute,
                   CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

void CudaBackend::rope(float* x, int batch, int seq, int heads, int head_dim, float theta,
                       int first_position, float direction) {
  check(head_dim % 2 == 0, "rope: head_dim must be even, got " + std::to_string(head_dim));
  check(first_position >= 0,
        "rope: first_position must not be negative, got " + std::to_string(first_position));
  const size_t count = size_t(batch) * seq * heads * head_dim;
  if (count == 0) return;
  const RopeTable& table = rope_table(first_position + seq, head_dim, theta);
  cuda::rope(written(x, count), table.cos.data, table.sin.data, batch, seq, heads, head_dim / 2,
             first_position, direction);
}

const RopeTable& CudaBackend::rope_table(int seq, int head_dim, float theta) {
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
