// The compute-backend interface: every numeric operation of a training step goes through it, so a
// CUDA backend can replace the CPU one without touching the model, the optimizer or the trainer.
//
// Conventions, shared by every implementation:
//  - Tensors are dense and row-major. `n` is a number of token positions (micro-batch × sequence).
//  - Linear weights use the PyTorch / Hugging Face layout [out_features, in_features].
//  - Activations of attention are laid out [batch, seq, heads, head_dim].
//  - Parameter gradients (dweight, dtable) are ACCUMULATED (+=), so gradient accumulation over
//    micro-batches needs no extra buffer. Activation gradients (din, dq, ...) are OVERWRITTEN.
//  - Reductions (sum_squares) accumulate in double and are deterministic for a fixed thread count,
//    which bit-exact resume relies on.
//  - Pointers refer to memory obtained from the same backend (host memory for the CPU backend).
//  - A buffer allocated with Precision::kCompute may be stored in the backend's narrower compute
//    format (bf16 on the CUDA backend's bf16 mode): its values read back rounded to it. Pointer
//    arithmetic is in elements of T whatever the storage, so a slice of a buffer is its pointer
//    plus an offset, as always. kExact buffers (parameters, gradients, optimizer moments, norms'
//    rstd, losses) are stored in T everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/memory.h"
#include "backend/region_timer.h"
#include "common/device_memory.h"

namespace malleus::backend {

// Hyper-parameters of one AdamW update (decoupled weight decay, Loshchilov & Hutter 2019).
struct AdamWStep {
  float lr = 0;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0;
  float grad_scale = 1;  // multiplies the gradient first (global-norm clipping)
  int64_t step = 1;      // 1-based update count, for bias correction
};

// How a buffer is stored: in T, or in the backend's compute format (see the conventions above).
enum class Precision { kExact, kCompute };

// The precision a buffer of `kind` gets unless its owner says otherwise: activations and their
// gradients (workspace) in the compute format, everything else exact.
constexpr Precision default_precision(MemoryKind kind) {
  return kind == MemoryKind::kActivations || kind == MemoryKind::kWorkspace ? Precision::kCompute
                                                                            : Precision::kExact;
}

template <typename T>
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual void set_num_threads(int threads) = 0;
  virtual int num_threads() const = 0;

  // ---- memory ------------------------------------------------------------------------------
  // Zero-initialised storage for `count` elements of T (or of int32 tokens), of `kind` (a backend
  // may keep more for some kinds: the CUDA backend's bf16 copy of the parameters).
  virtual T* allocate(size_t count, MemoryKind kind, Precision precision) = 0;
  // The device bytes such an allocation takes: what the memory ledger books for it.
  virtual size_t allocation_bytes(size_t count, MemoryKind, Precision) const {
    return count * sizeof(T);
  }
  virtual int32_t* allocate_tokens(size_t count) = 0;
  virtual void release(void* pointer) = 0;
  // Returns the whole pages inside [data, data + bytes) of one allocation to the system; their
  // values are lost (zero when touched again). A GPU backend would unmap the physical chunks of a
  // reserved address range (cuMemUnmap), as CUDA's virtual memory management allows.
  virtual void discard_pages(void* data, size_t bytes) = 0;
  virtual void copy_to_host(T* host, const T* source, size_t count) = 0;
  virtual void copy_from_host(T* destination, const T* host, size_t count) = 0;
  virtual void copy_tokens_from_host(int32_t* destination, const int32_t* host, size_t count) = 0;

  // ---- elementwise and reductions ------------------------------------------------------------
  virtual void fill_zero(T* x, size_t count) = 0;
  virtual void copy(T* destination, const T* source, size_t count) = 0;
  // `rows` runs of `count` elements, run r from source + r × source_stride to destination + r ×
  // destination_stride (strides in elements): a strided piece of a tensor (a column shard) in one
  // call, which a GPU makes one 2-D copy. By default, a copy() per run.
  struct Rows {
    size_t count = 0, rows = 0, source_stride = 0, destination_stride = 0;
  };
  virtual void copy_rows(T* destination, const T* source, const Rows& shape) {
    for (size_t r = 0; r < shape.rows; ++r) {
      copy(destination + r * shape.destination_stride, source + r * shape.source_stride,
           shape.count);
    }
  }
  virtual void add(T* y, const T* x, size_t count) = 0;  // y += x
  virtual void scale(T* x, T factor, size_t count) = 0;  // x *= factor
  virtual double sum_squares(const T* x, size_t count) = 0;

  // ---- layers --------------------------------------------------------------------------------
  // Vocabulary-parallel embedding: `table` holds rows [vocab_begin, vocab_begin + rows) of the
  // full table. out[i, :] is the row of tokens[i] when this rank holds it and zero otherwise (the
  // tensor-parallel all-reduce then sums the ranks' outputs). With one rank, rows = vocabulary.
  virtual void embedding_forward(T* out, const int32_t* tokens, const T* table, int vocab_begin,
                                 int rows, int n, int c) = 0;
  // dtable[tokens[i] - vocab_begin, :] += dout[i, :] for the tokens held here.
  virtual void embedding_backward(T* dtable, const T* dout, const int32_t* tokens, int vocab_begin,
                                  int rows, int n, int c) = 0;

  // out = in / rms(in) * weight, row-wise; rstd[n] = 1 / sqrt(mean(in²) + eps) saved for backward.
  virtual void rmsnorm_forward(T* out, T* rstd, const T* in, const T* weight, int n, int c,
                               float eps) = 0;
  virtual void rmsnorm_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight,
                                const T* rstd, int n, int c) = 0;
  // The residual add and the norm after it, in one pass where the backend fuses them:
  // sum += residual, then out = rmsnorm(sum) · weight as rmsnorm_forward.
  virtual void add_rmsnorm_forward(T* sum, T* out, T* rstd, const T* residual, const T* weight,
                                   int n, int c, float eps) {
    add(sum, residual, static_cast<size_t>(n) * c);
    rmsnorm_forward(out, rstd, sum, weight, n, c, eps);
  }

  // out[n, oc] = in[n, ic] · weight[oc, ic]ᵀ
  virtual void matmul_forward(T* out, const T* in, const T* weight, int n, int ic, int oc) = 0;
  // din[n, ic] = dout · weight (skipped when din is null); dweight[oc, ic] += doutᵀ · in
  virtual void matmul_backward(T* din, T* dweight, const T* dout, const T* in, const T* weight,
                               int n, int ic, int oc) = 0;

  // Rotary position embedding, in place, on x[batch, seq, heads, head_dim], position =
  // first_position + seq index (first_position > 0 when new tokens follow cached ones).
  // Hugging Face Llama convention ("rotate_half"): element i pairs with i + head_dim/2, angle
  // pos * theta^(-2i/head_dim).
  virtual void rope_forward(T* x, int batch, int seq, int heads, int head_dim, float theta,
                            int first_position) = 0;
  // The transpose (inverse rotation), in place on the gradient; positions start at 0.
  virtual void rope_backward(T* dx, int batch, int seq, int heads, int head_dim, float theta) = 0;

  // Causal scaled-dot-product attention with grouped KV heads: query head h reads kv head
  // h / (q_heads / kv_heads). The `seq` queries of a sequence sit at positions past .. past +
  // seq - 1 and query t sees keys 0 .. past + t: training runs whole sequences (past = 0), cached
  // inference appends new positions to the keys and values of earlier ones (past > 0).
  // q, out: [batch, seq, q_heads, head_dim]; k, v: [batch, past + seq, kv_heads, head_dim].
  // `state` keeps what backward needs besides q, k, v and out (backward takes past = 0): its size
  // is the backend's, attention_state_size() elements for `batch` sequences, linear in batch so
  // that sequence b's state starts at attention_state_size(b, ...). The CPU backend keeps the
  // softmax [batch, q_heads, seq, past + seq]; a fused (flash) kernel keeps one log-sum-exp per
  // query row and recomputes the softmax in backward.
  virtual size_t attention_state_size(int batch, int seq, int keys, int q_heads) const = 0;
  virtual void attention_forward(T* out, T* state, const T* q, const T* k, const T* v, int batch,
                                 int seq, int past, int q_heads, int kv_heads, int head_dim) = 0;
  virtual void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* state,
                                  const T* q, const T* k, const T* v, int batch, int seq,
                                  int q_heads, int kv_heads, int head_dim) = 0;

  // SwiGLU: out = silu(gate) * up, elementwise over `count` values.
  virtual void swiglu_forward(T* out, const T* gate, const T* up, size_t count) = 0;
  virtual void swiglu_backward(T* dgate, T* dup, const T* dout, const T* gate, const T* up,
                               size_t count) = 0;

  // Cross-entropy over logits[n, vocab] that may be one rank's slice [vocab_begin, vocab_begin +
  // vocab) of the full vocabulary. Three passes, with an all-reduce across the vocabulary-parallel
  // group after the first (max) and the second (sum); with one rank no reduction is needed.
  // row_max[i] = max_j logits[i, j]
  virtual void logits_row_max(T* row_max, const T* logits, int n, int vocab) = 0;
  // sum_exp[i] = Σ_j exp(logits[i, j] - row_max[i]); target_logit[i] = the logit of targets[i]
  // when this slice holds it, else 0.
  virtual void logits_softmax_sums(T* sum_exp, T* target_logit, const T* logits, const T* row_max,
                                   const int32_t* targets, int vocab_begin, int n, int vocab) = 0;
  // losses[i] = log(sum_exp[i]) + row_max[i] - target_logit[i]
  virtual void cross_entropy_loss(T* losses, const T* row_max, const T* sum_exp,
                                  const T* target_logit, int n) = 0;
  // dlogits[i, j] = (exp(logits[i, j] - row_max[i]) / sum_exp[i] - [vocab_begin + j ==
  // targets[i]]) * loss_scale, from the reduced row_max and sum_exp.
  virtual void cross_entropy_backward(T* dlogits, const T* logits, const T* row_max,
                                      const T* sum_exp, const int32_t* targets, int vocab_begin,
                                      T loss_scale, int n, int vocab) = 0;

  // ---- memory the ledger follows piece by piece (a live migration) -------------------------
  // Every Buffer's booking, by address.
  Allocations& allocations() { return allocations_; }
  // Books [data, data + count) of an allocation made while deferring, before it is written.
  void commit_range(const T* data, size_t count) {
    allocations_.commit(data, static_cast<int64_t>(count * sizeof(T)));
  }
  // Gives back [data, data + count) of an allocation that will not be read again: unbooked, and
  // its pages returned to the system.
  void decommit_range(T* data, size_t count) {
    allocations_.uncommit(data, static_cast<int64_t>(count * sizeof(T)));
    discard_pages(data, count * sizeof(T));
  }
  // Gives back every allocation of `kind` (its values are lost).
  void decommit_all(MemoryKind kind) {
    for (const Allocations::Allocation& a : allocations_.of_kind(kind)) {
      allocations_.uncommit(a.data, a.span);
      discard_pages(a.data, static_cast<size_t>(a.span));
    }
  }

  // ---- optimizer -----------------------------------------------------------------------------
  // One AdamW update of `count` parameters with moments m, v (state kept in T).
  virtual void adamw_update(T* param, const T* grad, T* m, T* v, size_t count,
                            const AdamWStep& step) = 0;

  // ---- where its memory lies, how its compute is timed --------------------------------------
  // Set by whoever makes the backend (device/device.h for a CUDA device); the CPU backend keeps
  // the defaults.
  // Null when this backend's memory is host memory, which the host and MPI may read and write
  // directly (the CPU backend). Otherwise every use of it outside the backend's calls goes through
  // these copies: the communicator stages it around MPI (comm/staging.h), the runtime packs,
  // migrates and checkpoints through it.
  const std::shared_ptr<const DeviceMemory>& device_memory() const { return device_memory_; }
  void set_device_memory(std::shared_ptr<const DeviceMemory> memory) {
    device_memory_ = std::move(memory);
  }
  // Times the engine's compute regions for the straggler monitor: the host's steady clock unless
  // set.
  RegionTimer& region_timer() { return *region_timer_; }
  void set_region_timer(std::unique_ptr<RegionTimer> timer) { region_timer_ = std::move(timer); }

 private:
  Allocations allocations_;
  std::shared_ptr<const DeviceMemory> device_memory_;
  std::unique_ptr<RegionTimer> region_timer_ = std::make_unique<SteadyClockTimer>();
};

// The CPU backend: OpenBLAS sgemm/dgemm for matmuls, OpenMP for our own kernels.
template <typename T>
std::unique_ptr<Backend<T>> make_cpu_backend(int threads);

// Makes the backend an engine computes with (`threads`: CPU threads for a CPU backend). The CPU
// backend's by default; device/device.h makes one for a CUDA device.
using BackendFactory = std::function<std::unique_ptr<Backend<float>>(int threads)>;

// Owning handle for backend memory: values of T, or int32 tokens with Element = int32_t. Its
// bytes are booked in the process's memory ledger under `kind` while it lives, through the
// backend's Allocations (which a migration books and gives back range by range).
template <typename T, typename Element = T>
class Buffer {
  static_assert(std::is_same_v<Element, T> || std::is_same_v<Element, int32_t>);

 public:
  Buffer() = default;
  Buffer(Backend<T>& backend, size_t count, MemoryKind kind)
      : Buffer(backend, count, kind, default_precision(kind)) {}
  Buffer(Backend<T>& backend, size_t count, MemoryKind kind, Precision precision)
      : backend_(&backend), size_(count) {
    size_t bytes = count * sizeof(Element);
    if constexpr (std::is_same_v<Element, T>) {
      data_ = backend.allocate(count, kind, precision);
      bytes = backend.allocation_bytes(count, kind, precision);
    } else {
      data_ = backend.allocate_tokens(count);
    }
    backend.allocations().add(data_, static_cast<int64_t>(count * sizeof(Element)),
                              static_cast<int64_t>(bytes), kind);
  }
  ~Buffer() { reset(); }
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      backend_ = other.backend_;
      data_ = other.data_;
      size_ = other.size_;
      other.data_ = nullptr;
      other.size_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  Element* data() { return data_; }
  const Element* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void reset() {
    if (data_ != nullptr) {
      backend_->allocations().remove(data_);
      backend_->release(data_);
    }
    data_ = nullptr;
    size_ = 0;
  }
  Backend<T>* backend_ = nullptr;
  Element* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace malleus::backend
