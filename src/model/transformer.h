// The LLaMA-style decoder, forward and backward, written only against backend::Backend<T> so it
// runs on any backend and in float (training) or double (gradient checks).
//
// An instance holds one shard of the model (ShardSpec): a range of layers, with the embedding if
// it is the first pipeline stage and the final norm, LM head and loss if it is the last, and its
// share of heads, FFN columns and vocabulary rows under tensor parallelism (Megatron-LM's
// column/row-parallel split, with the collectives of TensorParallelGroup in between). The
// single-device model is the shard that holds everything.
//
// Activations are kept per "slot", so a pipeline stage can hold several micro-batches in flight
// (1F1B keeps up to pipeline depth − stage index of them). With recomputation (model/recompute.h)
// a slot keeps less of its recomputing blocks, and one scratch block (shared by all slots, as
// only one block runs at a time) holds what is computed again; or, to recompute a micro-batch
// ahead of its backward (the shifted schedule), one scratch block per recomputing block.
//
// Sub-pipelined tensor parallelism (Merak; set_tp_subpipeline): inside each block a micro-batch
// runs as two parts, so that the all-reduce of one part's activations (or their gradient) is in
// flight while the other part computes. The parts are halves of the micro-batch's sequences when
// it has two or more, otherwise halves of its token rows; split along token rows, only the
// row-independent work (norms, projections, MLP) runs per part, and the attention core, which
// mixes a sequence's positions, runs once for both.
//
// Inference (forward_cached) runs the same layer code on one sequence, keeping every layer's keys
// and values so that each new token costs one position instead of the whole sequence again.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/parameters.h"
#include "model/recompute.h"
#include "model/tensor_parallel.h"

namespace malleus::model {

template <typename T>
class Transformer {
 public:
  // The whole model on one device, one micro-batch in flight.
  Transformer(const ModelConfig& config, backend::Backend<T>& backend, int micro_batch,
              int seq_len);
  // One shard. `tp` may be null when the shard holds all heads, FFN columns and vocabulary rows.
  // `recompute.layers` is at most the shard's block count. `recompute_ahead`: every recomputing
  // block gets its own scratch, so recompute_ahead() can recompute them all before backward().
  Transformer(const ModelConfig& config, const ShardSpec& shard, backend::Backend<T>& backend,
              int micro_batch, int seq_len, int slots, TensorParallelGroup<T>* tp,
              Recompute recompute = {}, bool recompute_ahead = false);

  const ModelConfig& config() const { return config_; }
  const ShardSpec& shard() const { return layout_.shard(); }
  const ParameterLayout& layout() const { return layout_; }
  backend::Backend<T>& backend() { return backend_; }
  int micro_batch() const { return micro_batch_; }
  int seq_len() const { return seq_len_; }
  int slots() const { return static_cast<int>(slots_.size()); }
  int tokens_per_micro_batch() const { return micro_batch_ * seq_len_; }
  const Recompute& recompute() const { return recompute_; }
  // Sub-pipelined tensor parallelism (above): every rank of the group must set the same. Takes
  // effect only with a tensor-parallel group of two or more ranks. The numerics are those of the
  // whole micro-batch up to fp32 summation order (weight gradients are summed part by part).
  void set_tp_subpipeline(bool on) { subpipeline_ = on; }
  bool tp_subpipeline() const { return subpipeline_; }

  // Flat buffers of layout().total_size() elements (backend memory).
  T* params() { return params_.data(); }
  T* grads() { return grads_.data(); }
  T* param(int tensor) { return params_.data() + layout_.tensor(tensor).offset; }
  T* grad(int tensor) { return grads_.data() + layout_.tensor(tensor).offset; }

  // Deterministic initialisation: every tensor is drawn whole from its own stream seeded by
  // (seed, tensor name) and this shard keeps its slice, so the values do not depend on how the
  // model is split up.
  void init_parameters(uint64_t seed);
  void zero_grads();

  // ---- pipeline-stage interface -----------------------------------------------------------
  // Forward of one micro-batch into activation slot `slot`. `inputs` (host tokens) is read when
  // the shard has the embedding, `targets` when it has the head; otherwise the stage input must
  // already be in input_activation(slot). Returns the sum of the token losses when the shard has
  // the head (the same on every rank of the group), else 0.
  double forward(int slot, const int32_t* inputs, const int32_t* targets);
  // Backward of the micro-batch in `slot` for the objective loss_scale × Σ token losses; gradients
  // ACCUMULATE into grads(). Without the head, output_grad() must hold dLoss/d(stage output).
  // Afterwards input_grad() holds dLoss/d(stage input) (when the shard has no embedding).
  void backward(int slot, T loss_scale);
  // What the recomputing blocks of the micro-batch in `slot` recompute for its backward, done
  // now (the shifted critical path: while the gradient from the next stage is on its way); the
  // next backward(slot) then skips it. Needs `recompute_ahead`; nothing to do without
  // recomputation. The same operations on the same inputs, so the same values. `between_blocks`
  // (optional) runs after each recomputed block: the caller's chance to let MPI progress.
  void recompute_ahead(int slot, const std::function<void()>& between_blocks = {});
  bool recomputes_ahead() const { return recompute_ahead_; }

  T* input_activation(int slot);         // [micro_batch × seq_len × hidden]
  const T* output_activation(int slot);  // same shape
  T* output_grad() { return dres_.data(); }
  const T* input_grad() { return dres_.data(); }

  // ---- single-device conveniences (slot 0) --------------------------------------------------
  double forward(const int32_t* inputs, const int32_t* targets) {
    return forward(0, inputs, targets);
  }
  void backward(T loss_scale) { backward(0, loss_scale); }
  // Host copy of the last forward's per-token losses in `slot` (shards with the head).
  std::vector<T> token_losses(int slot = 0);
  // Host copy of the last forward's logits in `slot`, [micro_batch × seq_len × vocabulary share].
  std::vector<T> logits(int slot = 0);

  // ---- inference with a key/value cache (a shard holding the whole model) -------------------
  // Runs tokens[0 .. count) of one sequence at positions cached_positions() .. + count - 1, each
  // attending to every earlier position of the sequence through the cache (appended to), and
  // returns the logits of the last of them (host, vocab_size values). The sequence holds at most
  // seq_len() positions; clear_cache() starts a new one. Uses activation slot 0.
  std::vector<T> forward_cached(const int32_t* tokens, int count);
  int cached_positions() const { return cached_positions_; }
  void clear_cache() { cached_positions_ = 0; }

 private:
  struct BlockActivations {
    backend::Buffer<T> ln1, rstd1, q, k, v, state, attn, mid, ln2, rstd2, gate, up, act;
  };
  // Where one block's activations are, for one forward or backward: in the slot, or in the
  // recomputation scratch.
  struct BlockPointers {
    T *ln1, *rstd1, *q, *k, *v, *state, *attn, *mid, *ln2, *rstd2, *gate, *up, *act;
  };
  struct Slot {
    backend::Buffer<T, int32_t> inputs, targets;
    // residual[i] is the input of the shard's i-th block; residual[blocks] is the stage output.
    std::vector<backend::Buffer<T>> residual;
    std::vector<BlockActivations> blocks;
    backend::Buffer<T> final_ln, final_rstd, logits, losses, row_max, softmax_sums;
  };

  // Element counts of one micro-batch's activations on this shard: rows (tokens), hidden, FFN,
  // vocabulary, query and key/value widths, attention state (the backend's size); and its blocks.
  struct Sizes {
    size_t n, c, f, v, q, kv, state;
    int blocks;
  };
  // One activation slot's buffers: what a micro-batch keeps from its forward until its backward.
  Slot make_slot(const ShardSpec& shard, const Sizes& z);
  // A block's activations, all of them (kept, or recomputed in full).
  BlockActivations all_activations(const Sizes& z);
  // The recomputation scratch and the backward's workspace, shared by every slot.
  void allocate_scratch(const ShardSpec& shard, const Sizes& z);

  // The positions one forward pass runs, and where its keys and values go: training runs whole
  // sequences from position 0 with k and v in the slot's activations; cached inference appends
  // positions [past, past + seq) of one sequence to the cache and attends over all of them.
  struct Positions {
    int batch, seq, past;
    T *k, *v;  // [batch, past + seq, this shard's kv heads, head_dim]; rows from `past` are written
  };

  // One part of a micro-batch under sub-pipelined tensor parallelism, or the whole of it.
  struct Part {
    int batch_begin, batch;  // its sequences (all of them when split along token rows)
    int row_begin, rows;     // its token rows
  };
  // How a block runs `batch` sequences of `seq` positions: one part, or two split along
  // sequences (`by_sequence`) or along token rows.
  struct Parts {
    std::vector<Part> parts;
    bool by_sequence = false;
    bool split() const { return parts.size() > 1; }
  };
  Parts parts(int batch, int seq) const;
  using PendingSum = std::unique_ptr<typename TensorParallelGroup<T>::Pending>;
  // A sum over the group of one part's rows: blocking when the micro-batch is one part, started
  // (and finished by finish()) when it is split.
  PendingSum start_sum(T* data, size_t count, const Parts& parts);
  static void finish(PendingSum& sum);
  // Part p's rows of a [rows, width] buffer.
  template <typename D>
  static D* row(D* data, const Part& p, int width) {
    return data + static_cast<size_t>(p.row_begin) * width;
  }

  void all_reduce_sum(T* data, size_t count);
  std::vector<T> host_losses(const Slot& slot);
  void check_tokens(const int32_t* tokens, size_t n, const char* what) const;
  void embed(Slot& slot, const int32_t* tokens, int n);
  static BlockPointers pointers(BlockActivations& a);
  BlockPointers block_storage(Slot& slot, int index);
  // With `out` null, stops before the MLP's output projection: all that backward needs (full
  // recomputation).
  void block_forward(const BlockPointers& a, int index, const T* x, T* out, const Positions& at);
  // The part of block `index`'s forward that its recomputation repeats, into `a`.
  void block_recompute(const BlockPointers& a, int index, const T* x);
  void block_backward(Slot& slot, int index, const T* x, T* dres, bool recomputed);
  // block_backward's steps for part p's rows. The MLP branch, from dres = dLoss/d(block output):
  // this rank's share of dLoss/d(ln2) into dnorm_.
  void mlp_backward(const BlockPointers& a, const BlockTensors& w, const Part& p, const T* dres);
  // The attention core of `core`'s sequences: dq_, dk_ (rotated back) and dv_ from dattn_.
  void attention_core_backward(const BlockPointers& a, const Part& core);
  // The q/k/v projections: this rank's share of dLoss/d(ln1) into dnorm_.
  void qkv_backward(const BlockPointers& a, const BlockTensors& w, const Part& p);
  // A residual's RMSNorm: dres += d(norm input) from dnorm_ (its output's gradient, summed over
  // the group), with the norm's weight gradient accumulated.
  void norm_backward(int norm, const T* input, const T* rstd, const Part& p, T* dres);
  // Final norm and this shard's logits for n rows of the stage output x.
  void head_logits(Slot& slot, const T* x, int n);
  double head_forward(Slot& slot);
  void head_backward(Slot& slot, T loss_scale);

  ModelConfig config_;
  ParameterLayout layout_;
  backend::Backend<T>& backend_;
  TensorParallelGroup<T>* tp_;
  int micro_batch_, seq_len_;
  int heads_, kv_heads_, ffn_, vocab_;  // this shard's shares
  Recompute recompute_;
  bool recompute_ahead_ = false;
  int recomputed_slot_ = -1;  // the slot recompute_ahead() last filled, until its backward
  bool subpipeline_ = false;

  backend::Buffer<T> params_, grads_;
  std::vector<Slot> slots_;
  // The block being recomputed (only the parts that are): one for all recomputing blocks, or one
  // each with recompute_ahead.
  std::vector<BlockActivations> recomputed_;
  // Per block, keys and values of the cached sequence [seq_len × kv heads × head_dim]; allocated
  // by the first forward_cached.
  std::vector<backend::Buffer<T>> k_cache_, v_cache_;
  int cached_positions_ = 0;
  // Backward scratch, shared by all blocks and slots.
  backend::Buffer<T> dres_, dnorm_, dnorm2_, dtmp_, dq_, dk_, dv_, dattn_, dgate_, dup_, dact_,
      dlogits_;
};

extern template class Transformer<float>;
extern template class Transformer<double>;

}  // namespace malleus::model
