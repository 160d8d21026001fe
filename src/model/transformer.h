// The LLaMA-style decoder, forward and backward, written only against backend::Backend<T> so it
// runs on any backend and in float (training) or double (gradient checks).
//
// Parameters, gradients and activations live in flat buffers owned here; the layout of the first
// two is model::ParameterLayout. Block-level entry points (embed / block / head) are public so a
// pipeline stage can run any contiguous range of layers.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/parameters.h"

namespace malleus::model {

template <typename T>
class Transformer {
 public:
  // Activations are sized for micro-batches of up to `micro_batch` sequences of `seq_len` tokens.
  Transformer(const ModelConfig& config, backend::Backend<T>& backend, int micro_batch,
              int seq_len);

  const ModelConfig& config() const { return config_; }
  const ParameterLayout& layout() const { return layout_; }
  backend::Backend<T>& backend() { return backend_; }
  int micro_batch() const { return micro_batch_; }
  int seq_len() const { return seq_len_; }
  int tokens_per_micro_batch() const { return micro_batch_ * seq_len_; }

  // Flat buffers of layout().total_size() elements (backend memory).
  T* params() { return params_.data(); }
  T* grads() { return grads_.data(); }
  T* param(int tensor) { return params_.data() + layout_.tensor(tensor).offset; }
  T* grad(int tensor) { return grads_.data() + layout_.tensor(tensor).offset; }

  // Deterministic initialisation: each tensor is drawn from its own stream seeded by (seed,
  // tensor name), so the values do not depend on how the parameters are later split up.
  void init_parameters(uint64_t seed);
  void zero_grads();

  // Runs the micro-batch inputs/targets [micro_batch × seq_len] (host memory) through the model.
  // Returns the SUM of the per-token cross-entropy losses (divide by token count for the mean).
  double forward(const int32_t* inputs, const int32_t* targets);
  // Backward of the last forward for the objective loss_scale × Σ token losses; ACCUMULATES into
  // grads(). With loss_scale = 1 / (tokens in the global batch) the summed gradient over all
  // micro-batches is the gradient of the global-batch mean loss.
  void backward(T loss_scale);

  // Host copy of the last forward's per-token losses.
  std::vector<T> token_losses();

 private:
  struct BlockActivations {
    backend::Buffer<T> ln1, rstd1, q, k, v, probs, attn, mid, ln2, rstd2, gate, up, act;
  };

  void embed_forward();
  void block_forward(int layer, const T* x, T* out);
  void head_forward(const T* x);
  void head_backward(T loss_scale, const T* x, T* dx);
  void block_backward(int layer, const T* x, T* dres);
  void embed_backward(const T* dx);

  ModelConfig config_;
  ParameterLayout layout_;
  backend::Backend<T>& backend_;
  int micro_batch_, seq_len_;

  backend::Buffer<T> params_, grads_;
  backend::Buffer<T, int32_t> inputs_, targets_;
  // residual_[l] is the input of block l; residual_[L] feeds the final norm.
  std::vector<backend::Buffer<T>> residual_;
  std::vector<BlockActivations> blocks_;
  backend::Buffer<T> final_ln_, final_rstd_, logits_, losses_;
  // Backward scratch, shared by all blocks.
  backend::Buffer<T> dres_, dnorm_, dnorm2_, dtmp_, dq_, dk_, dv_, dattn_, dgate_, dup_, dact_,
      dlogits_;
};

extern template class Transformer<float>;
extern template class Transformer<double>;

}  // namespace malleus::model
