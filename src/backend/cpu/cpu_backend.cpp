// The CPU backend: OpenBLAS for every matrix product (the linear layers and the two products of
// attention), OpenMP loops for the rest.
//
// Determinism: bit-exact resume needs every kernel to give bit-identical results for a fixed
// thread count. So no atomics and no reductions whose order depends on scheduling: each output
// element is produced by exactly one thread, and every sum over tokens runs in a fixed order that
// does not depend on the thread count either. Only OpenBLAS's own multi-threaded products (the
// linear layers) make no promise across thread counts.
#include <cblas.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/vector_math.h"
#include "common/error.h"
#include "common/host_pages.h"

namespace malleus::backend {
namespace {

// Elementwise loops shorter than this run on the calling thread: waking the team costs more than
// the loop.
constexpr size_t kParallelThreshold = size_t{1} << 15;
constexpr size_t kElementChunk = size_t{1} << 12;

// sum_squares sums fixed-size chunks, then the chunk sums in order, so its result does not depend
// on how many threads share the chunks.
constexpr size_t kSumChunk = size_t{1} << 14;

// Attention is causal, so the score matrix is computed in row blocks that stop at the diagonal
// block: 5/8 of the flops of the full T×T product at T = 256, tending to 1/2 for long sequences,
// while the blocks stay large enough for BLAS to run near peak (32 and 64 measured within a few
// percent of each other; 128 was slower).
constexpr int kAttentionBlock = 64;

constexpr size_t kAlignment = 64;

void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, float alpha, const float* a,
          int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, double alpha,
          const double* a, int lda, const double* b, int ldb, double beta, double* c, int ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Allocations from this size on are mappings of their own (common/host_pages.h): zero pages the
// system provides when first touched (nothing is written up front, so an engine built for a
// migration takes memory only as its state arrives), huge where the kernel has them, and whose
// pages can be handed back one range at a time.
constexpr size_t kMappedFrom = size_t{1} << 20;

void* aligned_zeroed(size_t bytes) {
  // aligned_alloc wants a multiple of the alignment, and may return null for zero bytes.
  const size_t rounded = std::max(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
  void* pointer = std::aligned_alloc(kAlignment, rounded);
  if (pointer == nullptr) throw std::bad_alloc();
  std::memset(pointer, 0, rounded);
  return pointer;
}

// cos/sin of every (position, frequency) pair for one (head_dim, theta), grown to the longest
// sequence seen. Angles are computed in double so the float and double backends rotate by the
// same angles up to the final rounding.
template <typename T>
struct RopeTable {
  int head_dim = 0;
  float theta = 0;
  int seq = 0;
  std::vector<T> cos;  // [seq, head_dim / 2]
  std::vector<T> sin;

  void grow(int new_seq) {
    const int half = head_dim / 2;
    cos.resize(static_cast<size_t>(new_seq) * half);
    sin.resize(static_cast<size_t>(new_seq) * half);
    for (int i = 0; i < half; ++i) {
      const double frequency =
          std::pow(static_cast<double>(theta), -2.0 * i / static_cast<double>(head_dim));
      for (int t = seq; t < new_seq; ++t) {
        const double angle = t * frequency;
        cos[static_cast<size_t>(t) * half + i] = static_cast<T>(std::cos(angle));
        sin[static_cast<size_t>(t) * half + i] = static_cast<T>(std::sin(angle));
      }
    }
    seq = new_seq;
  }
};

template <typename T>
class CpuBackend final : public Backend<T> {
 public:
  explicit CpuBackend(int threads) { set_num_threads(threads); }

  std::string name() const override {
    return std::is_same_v<T, float> ? "cpu-float32" : "cpu-float64";
  }

  void set_num_threads(int threads) override {
    check(threads >= 1,
          "cpu backend: thread count must be at least 1, got " + std::to_string(threads));
    threads_ = threads;
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
  }
  int num_threads() const override { return threads_; }

  // ---- memory ------------------------------------------------------------------------------
  // Every buffer is stored in T: the compute format is T.
  T* allocate(size_t count, MemoryKind, Precision) override {
    return static_cast<T*>(zeroed(count * sizeof(T)));
  }
  int32_t* allocate_tokens(size_t count) override {
    return static_cast<int32_t*>(zeroed(count * sizeof(int32_t)));
  }
  void release(void* pointer) override {
    {
      std::lock_guard lock(mapped_mutex_);
      if (mapped_.erase(pointer) > 0) return;  // its PageBuffer unmaps it
    }
    std::free(pointer);
  }
  void discard_pages(void* data, size_t bytes) override {
    // Only whole pages inside the range: its neighbours may still be in use. MADV_DONTNEED on
    // private anonymous memory (mappings and the heap alike) frees the pages; they read as zero.
    const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
    if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }
  void copy_to_host(T* host, const T* source, size_t count) override {
    if (count > 0) std::memcpy(host, source, count * sizeof(T));
  }
  void copy_from_host(T* destination, const T* host, size_t count) override {
    if (count > 0) std::memcpy(destination, host, count * sizeof(T));
  }
  void copy_tokens_from_host(int32_t* destination, const int32_t* host, size_t count) override {
    if (count > 0) std::memcpy(destination, host, count * sizeof(int32_t));
  }

  // ---- elementwise and reductions ------------------------------------------------------------
  void fill_zero(T* x, size_t count) override {
    elementwise(count, [&](size_t begin, size_t end) {
#pragma omp simd
      for (size_t i = begin; i < end; ++i) x[i] = T(0);
    });
  }

  void copy(T* destination, const T* source, size_t count) override {
    elementwise(count, [&](size_t begin, size_t end) {
#pragma omp simd
      for (size_t i = begin; i < end; ++i) destination[i] = source[i];
    });
  }

  void add(T* y, const T* x, size_t count) override {
    elementwise(count, [&](size_t begin, size_t end) {
#pragma omp simd
      for (size_t i = begin; i < end; ++i) y[i] += x[i];
    });
  }

  void scale(T* x, T factor, size_t count) override {
    elementwise(count, [&](size_t begin, size_t end) {
#pragma omp simd
      for (size_t i = begin; i < end; ++i) x[i] *= factor;
    });
  }

  double sum_squares(const T* x, size_t count) override {
    const size_t chunks = (count + kSumChunk - 1) / kSumChunk;
    std::vector<double> partial(chunks);
#pragma omp parallel for schedule(static) num_threads(threads_) if (count >= kParallelThreshold)
    for (size_t chunk = 0; chunk < chunks; ++chunk) {
      const size_t begin = chunk * kSumChunk;
      const size_t end = std::min(count, begin + kSumChunk);
      double sum = 0;
#pragma omp simd reduction(+ : sum)
      for (size_t i = begin; i < end; ++i) sum += static_cast<double>(x[i]) * x[i];
      partial[chunk] = sum;
    }
    double total = 0;
    for (double p : partial) total += p;
    return total;
  }

  // ---- layers --------------------------------------------------------------------------------
  void embedding_forward(T* out, const int32_t* tokens, const T* table, int vocab_begin, int rows,
                         int n, int c) override {
    const size_t width = static_cast<size_t>(c);
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int i = 0; i < n; ++i) {
      T* y = out + i * width;
      const int row = tokens[i] - vocab_begin;
      if (row >= 0 && row < rows) {
        std::memcpy(y, table + static_cast<size_t>(row) * width, width * sizeof(T));
      } else {
        std::fill(y, y + width, T(0));
      }
    }
  }

  void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int vocab_begin,
                          int rows, int n, int c) override {
    // Each thread owns a range of columns and walks the tokens in order, so repeated tokens add
    // up in the same order whatever the thread count, without atomics. Tokens held by another
    // rank are skipped.
    const size_t width = static_cast<size_t>(c);
    const int blocks = column_blocks(c);
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int block = 0; block < blocks; ++block) {
      const size_t begin = static_cast<size_t>(block) * kColumnBlock;
      const size_t end = std::min(width, begin + kColumnBlock);
      for (int i = 0; i < n; ++i) {
        const int local = tokens[i] - vocab_begin;
        if (local < 0 || local >= rows) continue;
        T* row = dtable + static_cast<size_t>(local) * width;
        const T* grad = dout + i * width;
#pragma omp simd
        for (size_t j = begin; j < end; ++j) row[j] += grad[j];
      }
    }
  }

  void rmsnorm_forward(T* out, T* rstd, const T* in, const T* weight, int n, int c,
                       float eps) override {
    const size_t width = static_cast<size_t>(c);
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int i = 0; i < n; ++i) {
      const T* x = in + i * width;
      T* y = out + i * width;
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (size_t j = 0; j < width; ++j) sum += x[j] * x[j];
      const T r = T(1) / std::sqrt(sum / static_cast<T>(c) + static_cast<T>(eps));
      rstd[i] = r;
#pragma omp simd
      for (size_t j = 0; j < width; ++j) y[j] = x[j] * r * weight[j];
    }
  }

  void rmsnorm_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight,
                        const T* rstd, int n, int c) override {
    // y = x·r·w with r = (mean(x²) + eps)^(-1/2), so
    //   dx = r·w⊙dy − x·r³/c·Σ(dy⊙w⊙x),   dw += Σ_rows dy⊙x·r.
    const size_t width = static_cast<size_t>(c);
    const int blocks = column_blocks(c);
#pragma omp parallel num_threads(threads_)
    {
#pragma omp for schedule(static) nowait
      for (int i = 0; i < n; ++i) {
        const T* x = in + i * width;
        const T* dy = dout + i * width;
        T* dx = din + i * width;
        const T r = rstd[i];
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (size_t j = 0; j < width; ++j) dot += dy[j] * weight[j] * x[j];
        const T correction = dot * r * r * r / static_cast<T>(c);
#pragma omp simd
        for (size_t j = 0; j < width; ++j) dx[j] = r * weight[j] * dy[j] - x[j] * correction;
      }
      // The weight gradient sums over rows: columns are split between threads and each column
      // sums its rows in order (in double, as it adds up thousands of tokens), which keeps it
      // deterministic and independent of the thread count.
#pragma omp for schedule(static)
      for (int block = 0; block < blocks; ++block) {
        const size_t begin = static_cast<size_t>(block) * kColumnBlock;
        const size_t end = std::min(width, begin + kColumnBlock);
        double sums[kColumnBlock] = {};
        for (int i = 0; i < n; ++i) {
          const T* x = in + i * width;
          const T* dy = dout + i * width;
          const T r = rstd[i];
#pragma omp simd
          for (size_t j = begin; j < end; ++j)
            sums[j - begin] += static_cast<double>(dy[j]) * x[j] * r;
        }
        for (size_t j = begin; j < end; ++j) dweight[j] += static_cast<T>(sums[j - begin]);
      }
    }
  }

  void matmul_forward(T* out, const T* in, const T* weight, int n, int ic, int oc) override {
    if (n == 0 || oc == 0) return;
    if (ic == 0) return fill_zero(out, static_cast<size_t>(n) * oc);
    prepare_blas();
    gemm(CblasNoTrans, CblasTrans, n, oc, ic, T(1), in, ic, weight, ic, T(0), out, oc);
  }

  void matmul_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight, int n,
                       int ic, int oc) override {
    if (n == 0 || ic == 0) return;
    prepare_blas();
    if (din != nullptr) {
      if (oc == 0) {
        fill_zero(din, static_cast<size_t>(n) * ic);
      } else {
        gemm(CblasNoTrans, CblasNoTrans, n, ic, oc, T(1), dout, oc, weight, ic, T(0), din, ic);
      }
    }
    if (oc > 0) {
      gemm(CblasTrans, CblasNoTrans, oc, ic, n, T(1), dout, oc, in, ic, T(1), dweight, ic);
    }
  }

  void rope_forward(T* x, int batch, int seq, int heads, int head_dim, float theta,
                    int first_position) override {
    rope(x, batch, seq, heads, head_dim, theta, first_position, T(1));
  }

  void rope_backward(T* dx, int batch, int seq, int heads, int head_dim, float theta) override {
    // A rotation's transpose is the rotation by the opposite angle.
    rope(dx, batch, seq, heads, head_dim, theta, 0, T(-1));
  }

  // The state is the softmax itself, [batch, q_heads, seq, keys].
  size_t attention_state_size(int batch, int seq, int keys, int q_heads) const override {
    return static_cast<size_t>(batch) * q_heads * seq * keys;
  }

  void attention_forward(T* out, T* probs, const T* q, const T* k, const T* v, int batch, int seq,
                         int past, int q_heads, int kv_heads, int head_dim) override {
    check_heads(q_heads, kv_heads);
    check(past >= 0, "attention: past must not be negative, got " + std::to_string(past));
    if (batch == 0 || seq == 0 || q_heads == 0) return;
    const int group = q_heads / kv_heads;
    // q, k, v of one head are strided views of the [batch, seq, heads, head_dim] tensors: BLAS
    // reads them through the leading dimension, so nothing is copied.
    const int q_stride = q_heads * head_dim;
    const int kv_stride = kv_heads * head_dim;
    const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    const int keys = past + seq;  // per sequence
    const size_t rectangle = static_cast<size_t>(seq) * keys;
    const int items = batch * q_heads;
    prepare_blas();
    // One (sequence, head) per iteration. BLAS called inside the parallel region runs on the
    // calling thread (OpenBLAS checks omp_in_parallel), so the cores are not oversubscribed.
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int item = 0; item < items; ++item) {
      const int b = item / q_heads;
      const int h = item % q_heads;
      const size_t q_offset =
          static_cast<size_t>(b) * seq * q_stride + static_cast<size_t>(h) * head_dim;
      const size_t kv_offset =
          static_cast<size_t>(b) * keys * kv_stride + static_cast<size_t>(h / group) * head_dim;
      const T* qh = q + q_offset;
      const T* kh = k + kv_offset;
      const T* vh = v + kv_offset;
      T* oh = out + q_offset;
      T* ph = probs + static_cast<size_t>(item) * rectangle;
      for (int r0 = 0; r0 < seq; r0 += kAttentionBlock) {
        const int r1 = std::min(seq, r0 + kAttentionBlock);
        const int rows = r1 - r0;
        const int visible = past + r1;  // keys seen by the block's last query
        T* block = ph + static_cast<size_t>(r0) * keys;
        gemm(CblasNoTrans, CblasTrans, rows, visible, head_dim, scale,
             qh + static_cast<size_t>(r0) * q_stride, q_stride, kh, kv_stride, T(0), block, keys);
        for (int t = r0; t < r1; ++t) {
          T* row = ph + static_cast<size_t>(t) * keys;
          softmax_in_place(row, past + t + 1);
          std::fill(row + past + t + 1, row + keys, T(0));
        }
        gemm(CblasNoTrans, CblasNoTrans, rows, head_dim, visible, T(1), block, keys, vh, kv_stride,
             T(0), oh + static_cast<size_t>(r0) * q_stride, q_stride);
      }
    }
  }

  void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* /*out*/, const T* probs,
                          const T* q, const T* k, const T* v, int batch, int seq, int q_heads,
                          int kv_heads, int head_dim) override {
    check_heads(q_heads, kv_heads);
    if (batch == 0 || seq == 0 || q_heads == 0) return;
    const int group = q_heads / kv_heads;
    const int q_stride = q_heads * head_dim;
    const int kv_stride = kv_heads * head_dim;
    const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(head_dim)));
    const size_t square = static_cast<size_t>(seq) * seq;
    // The q heads of a group all add into the same dk/dv head: one thread takes the whole group,
    // in head order, so there is neither a race nor a scheduling-dependent sum.
    const int items = batch * kv_heads;
    if (scratch_.size() < square * threads_) scratch_.resize(square * threads_);
    prepare_blas();
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int item = 0; item < items; ++item) {
      const int b = item / kv_heads;
      const int g = item % kv_heads;
      T* ds = scratch_.data() + square * static_cast<size_t>(omp_get_thread_num());
      const size_t kv_offset =
          static_cast<size_t>(b) * seq * kv_stride + static_cast<size_t>(g) * head_dim;
      const T* kh = k + kv_offset;
      const T* vh = v + kv_offset;
      T* dkh = dk + kv_offset;
      T* dvh = dv + kv_offset;
      for (int member = 0; member < group; ++member) {
        const int h = g * group + member;
        const size_t q_offset =
            static_cast<size_t>(b) * seq * q_stride + static_cast<size_t>(h) * head_dim;
        const T* qh = q + q_offset;
        const T* doh = dout + q_offset;
        T* dqh = dq + q_offset;
        const T* ph = probs + (static_cast<size_t>(b) * q_heads + h) * square;
        // The first head of the group overwrites dk/dv, the others add to it.
        const T beta = member == 0 ? T(0) : T(1);
        for (int r0 = 0; r0 < seq; r0 += kAttentionBlock) {
          const int r1 = std::min(seq, r0 + kAttentionBlock);
          const int rows = r1 - r0;
          const size_t qr = static_cast<size_t>(r0) * q_stride;
          T* ds_block = ds + static_cast<size_t>(r0) * seq;
          // dP = dO·Vᵀ, only left of the diagonal block (P is zero beyond it).
          gemm(CblasNoTrans, CblasTrans, rows, r1, head_dim, T(1), doh + qr, q_stride, vh,
               kv_stride, T(0), ds_block, seq);
          // dS = P ⊙ (dP − rowsum(dP ⊙ P)), with the 1/sqrt(d) of the scores folded in. P is
          // zero above the diagonal, so dS is too, as the products below need.
          for (int t = r0; t < r1; ++t) {
            const T* p = ph + static_cast<size_t>(t) * seq;
            T* d = ds + static_cast<size_t>(t) * seq;
            const T dot = dot_product(p, d, static_cast<size_t>(t + 1));
#pragma omp simd
            for (int j = 0; j < r1; ++j) d[j] = p[j] * (d[j] - dot) * scale;
          }
          // dQ = dS·K
          gemm(CblasNoTrans, CblasNoTrans, rows, head_dim, r1, T(1), ds_block, seq, kh, kv_stride,
               T(0), dqh + qr, q_stride);
        }
        // dV = Pᵀ·dO and dK = dSᵀ·Q, by blocks of output rows: row j of dV/dK only receives
        // from query rows t >= j.
        for (int c0 = 0; c0 < seq; c0 += kAttentionBlock) {
          const int c1 = std::min(seq, c0 + kAttentionBlock);
          const size_t below = static_cast<size_t>(c0) * seq + c0;
          gemm(CblasTrans, CblasNoTrans, c1 - c0, head_dim, seq - c0, T(1), ph + below, seq,
               doh + static_cast<size_t>(c0) * q_stride, q_stride, beta,
               dvh + static_cast<size_t>(c0) * kv_stride, kv_stride);
          gemm(CblasTrans, CblasNoTrans, c1 - c0, head_dim, seq - c0, T(1), ds + below, seq,
               qh + static_cast<size_t>(c0) * q_stride, q_stride, beta,
               dkh + static_cast<size_t>(c0) * kv_stride, kv_stride);
        }
      }
    }
  }

  void swiglu_forward(T* out, const T* gate, const T* up, size_t count) override {
    elementwise(count, [&](size_t begin, size_t end) {
#pragma omp simd
      for (size_t i = begin; i < end; ++i) {
        const T g = gate[i];
        out[i] = g / (T(1) + vexp(-g)) * up[i];
      }
    });
  }

  void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                       size_t count) override {
    // silu'(g) = s·(1 + g·(1 − s)) with s = sigmoid(g).
    elementwise(count, [&](size_t begin, size_t end) {
#pragma omp simd
      for (size_t i = begin; i < end; ++i) {
        const T g = gate[i];
        const T s = T(1) / (T(1) + vexp(-g));
        const T dy = dout[i];
        dup[i] = dy * g * s;
        dgate[i] = dy * up[i] * s * (T(1) + g * (T(1) - s));
      }
    });
  }

  // Cross-entropy in three passes so that the vocabulary may be split between ranks: the row max
  // and the sum of exponentials are all-reduced by the caller between the passes. Every row is
  // handled by one thread, and the sums run in a fixed order.
  void logits_row_max(T* row_max_out, const T* logits, int n, int vocab) override {
    const size_t width = static_cast<size_t>(vocab);
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int i = 0; i < n; ++i) {
      // An empty slice contributes the identity of max.
      row_max_out[i] =
          width == 0 ? -std::numeric_limits<T>::infinity() : row_max(logits + i * width, width);
    }
  }

  void logits_softmax_sums(T* sum_exp, T* target_logit, const T* logits, const T* row_max_in,
                           const int32_t* targets, int vocab_begin, int n, int vocab) override {
    const size_t width = static_cast<size_t>(vocab);
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int i = 0; i < n; ++i) {
      const T* x = logits + i * width;
      const T top = row_max_in[i];
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (size_t j = 0; j < width; ++j) sum += vexp(x[j] - top);
      sum_exp[i] = sum;
      const int local = targets[i] - vocab_begin;
      target_logit[i] = local >= 0 && local < vocab ? x[local] : T(0);
    }
  }

  void cross_entropy_loss(T* losses, const T* row_max_in, const T* sum_exp, const T* target_logit,
                          int n) override {
#pragma omp parallel for schedule(static) num_threads(threads_) if (n >= 4096)
    for (int i = 0; i < n; ++i) losses[i] = std::log(sum_exp[i]) + row_max_in[i] - target_logit[i];
  }

  void cross_entropy_backward(T* dlogits, const T* logits, const T* row_max_in, const T* sum_exp,
                              const int32_t* targets, int vocab_begin, T loss_scale, int n,
                              int vocab) override {
    const size_t width = static_cast<size_t>(vocab);
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int i = 0; i < n; ++i) {
      const T* x = logits + i * width;
      T* dx = dlogits + i * width;
      const T top = row_max_in[i];
      const T factor = loss_scale / sum_exp[i];
#pragma omp simd
      for (size_t j = 0; j < width; ++j) dx[j] = vexp(x[j] - top) * factor;
      const int local = targets[i] - vocab_begin;
      if (local >= 0 && local < vocab) dx[local] -= loss_scale;
    }
  }

  // ---- optimizer -----------------------------------------------------------------------------
  void adamw_update(T* param, const T* grad, T* m, T* v, size_t count,
                    const AdamWStep& step) override {
    // PyTorch's AdamW order: decay the parameter first, then apply the Adam step.
    const double steps = static_cast<double>(step.step);
    const T decay = static_cast<T>(1.0 - static_cast<double>(step.lr) * step.weight_decay);
    const T beta1 = static_cast<T>(step.beta1);
    const T beta2 = static_cast<T>(step.beta2);
    const T one_minus_beta1 = static_cast<T>(1.0 - static_cast<double>(step.beta1));
    const T one_minus_beta2 = static_cast<T>(1.0 - static_cast<double>(step.beta2));
    const T grad_scale = static_cast<T>(step.grad_scale);
    const T step_size = static_cast<T>(static_cast<double>(step.lr) /
                                       (1.0 - std::pow(static_cast<double>(step.beta1), steps)));
    const T inv_sqrt_bias2 =
        static_cast<T>(1.0 / std::sqrt(1.0 - std::pow(static_cast<double>(step.beta2), steps)));
    const T eps = static_cast<T>(step.eps);
    elementwise(count, [&](size_t begin, size_t end) {
#pragma omp simd
      for (size_t i = begin; i < end; ++i) {
        const T g = grad[i] * grad_scale;
        const T mi = beta1 * m[i] + one_minus_beta1 * g;
        const T vi = beta2 * v[i] + one_minus_beta2 * g * g;
        m[i] = mi;
        v[i] = vi;
        const T p = param[i] * decay;
        param[i] = p - step_size * mi / (std::sqrt(vi) * inv_sqrt_bias2 + eps);
      }
    });
  }

 private:
  // Column blocks for the per-column sums over tokens: wide enough to vectorize, narrow enough
  // that a few hundred columns still spread over the threads.
  static constexpr int kColumnBlock = 32;
  // Runs body(begin, end) over fixed chunks of [0, count), spread over the threads when the range
  // is long enough to pay for waking them.
  template <typename Body>
  void elementwise(size_t count, const Body& body) {
    const size_t chunks = (count + kElementChunk - 1) / kElementChunk;
#pragma omp parallel for schedule(static) num_threads(threads_) if (count >= kParallelThreshold)
    for (size_t chunk = 0; chunk < chunks; ++chunk) {
      body(chunk * kElementChunk, std::min(count, (chunk + 1) * kElementChunk));
    }
  }

  static int column_blocks(int c) {
    return (c + kColumnBlock - 1) / kColumnBlock;
  }

  static void check_heads(int q_heads, int kv_heads) {
    check(kv_heads > 0 && q_heads % kv_heads == 0,
          "attention: q_heads (" + std::to_string(q_heads) +
              ") must be a positive multiple of kv_heads (" + std::to_string(kv_heads) + ")");
  }

  // Called before BLAS outside our own parallel regions: OpenBLAS sizes its team from the calling
  // thread's omp_get_max_threads, which another backend instance may have changed.
  void prepare_blas() {
    if (omp_get_max_threads() != threads_) omp_set_num_threads(threads_);
  }

  // Written with independent lanes because GCC 12 leaves the `omp simd reduction(max)` form of
  // this loop scalar here: a serial chain of dependent maxes that cost more than the exponentials
  // after it. Max is exact, so the lane split does not change the result.
  static T row_max(const T* x, size_t count) {
    constexpr size_t kLanes = 16;
    T lanes[kLanes];
    for (size_t l = 0; l < kLanes; ++l) lanes[l] = x[0];
    size_t j = 0;
    for (; j + kLanes <= count; j += kLanes) {
      for (size_t l = 0; l < kLanes; ++l) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
    }
    T top = x[0];
    for (; j < count; ++j) top = x[j] > top ? x[j] : top;
    for (size_t l = 0; l < kLanes; ++l) top = lanes[l] > top ? lanes[l] : top;
    return top;
  }

  static void softmax_in_place(T* x, int count) {
    const size_t width = static_cast<size_t>(count);
    const T top = row_max(x, width);
    T sum = 0;
#pragma omp simd reduction(+ : sum)
    for (size_t j = 0; j < width; ++j) {
      const T e = vexp(x[j] - top);
      x[j] = e;
      sum += e;
    }
    const T inverse = T(1) / sum;
#pragma omp simd
    for (size_t j = 0; j < width; ++j) x[j] *= inverse;
  }

  const RopeTable<T>& rope_table(int seq, int head_dim, float theta) {
    for (RopeTable<T>& table : rope_tables_) {
      if (table.head_dim == head_dim && table.theta == theta) {
        if (table.seq < seq) table.grow(seq);
        return table;
      }
    }
    RopeTable<T>& table = rope_tables_.emplace_back();
    table.head_dim = head_dim;
    table.theta = theta;
    table.grow(seq);
    return table;
  }

  // Rotates every (i, i + head_dim/2) pair by `direction` × its angle.
  void rope(T* x, int batch, int seq, int heads, int head_dim, float theta, int first_position,
            T direction) {
    check(head_dim % 2 == 0, "rope: head_dim must be even, got " + std::to_string(head_dim));
    check(first_position >= 0,
          "rope: first_position must not be negative, got " + std::to_string(first_position));
    const RopeTable<T>& table = rope_table(first_position + seq, head_dim, theta);
    const size_t half = static_cast<size_t>(head_dim / 2);
    const size_t row = static_cast<size_t>(heads) * head_dim;
    const int rows = batch * seq;
#pragma omp parallel for schedule(static) num_threads(threads_)
    for (int r = 0; r < rows; ++r) {
      const size_t t = static_cast<size_t>(first_position + r % seq);
      const T* cos = table.cos.data() + t * half;
      const T* sin = table.sin.data() + t * half;
      for (int h = 0; h < heads; ++h) {
        T* a = x + r * row + static_cast<size_t>(h) * head_dim;
        T* b = a + half;
#pragma omp simd
        for (size_t i = 0; i < half; ++i) {
          const T s = direction * sin[i];
          const T x0 = a[i];
          const T x1 = b[i];
          a[i] = x0 * cos[i] - x1 * s;
          b[i] = x1 * cos[i] + x0 * s;
        }
      }
    }
  }

  // Large allocations are mappings of their own (kMappedFrom); small ones come from the heap.
  void* zeroed(size_t bytes) {
    if (bytes < kMappedFrom) return aligned_zeroed(bytes);
    PageBuffer<std::byte> mapping(bytes);
    void* pointer = mapping.data();
    std::lock_guard lock(mapped_mutex_);
    mapped_.emplace(pointer, std::move(mapping));
    return pointer;
  }

  std::mutex mapped_mutex_;
  std::unordered_map<void*, PageBuffer<std::byte>> mapped_;  // by address, for release()
  int threads_ = 1;
  std::vector<T> scratch_;  // attention backward: one seq×seq dS matrix per thread
  std::vector<RopeTable<T>> rope_tables_;
};

}  // namespace

template <typename T>
std::unique_ptr<Backend<T>> make_cpu_backend(int threads) {
  return std::make_unique<CpuBackend<T>>(threads);
}

template std::unique_ptr<Backend<float>> make_cpu_backend<float>(int threads);
template std::unique_ptr<Backend<double>> make_cpu_backend<double>(int threads);

}  // namespace malleus::backend
