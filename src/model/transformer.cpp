#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string_view>

#include "common/error.h"
#include "common/hash.h"

namespace malleus::model {

namespace {

// Standard normal draws from Box–Muller on mt19937_64, so the values are the same with every
// standard library (std::normal_distribution's algorithm is implementation-defined).
class NormalStream {
 public:
  explicit NormalStream(uint64_t seed) : engine_(seed) {}
  double next() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double scale = 1.0 / 9007199254740992.0;                     // 2^-53
    double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * scale;  // (0, 1]
    double u2 = static_cast<double>(engine_() >> 11) * scale;
    double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * std::numbers::pi * u2);
    has_spare_ = true;
    return r * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace

template <typename T>
Transformer<T>::Transformer(const ModelConfig& config, backend::Backend<T>& backend,
                            int micro_batch, int seq_len)
    : Transformer(config, ShardSpec::full(config), backend, micro_batch, seq_len, 1, nullptr, {}) {}

template <typename T>
Transformer<T>::Transformer(const ModelConfig& config, const ShardSpec& shard,
                            backend::Backend<T>& backend, int micro_batch, int seq_len, int slots,
                            TensorParallelGroup<T>* tp, Recompute recompute, bool recompute_ahead)
    : config_(config),
      layout_(config, shard),
      backend_(backend),
      tp_(tp),
      micro_batch_(micro_batch),
      seq_len_(seq_len),
      heads_(shard.heads),
      kv_heads_(shard.kv_heads(config)),
      ffn_(shard.ffn),
      vocab_(shard.vocab),
      recompute_(recompute),
      recompute_ahead_(recompute_ahead) {
  config_.validate("model \"" + config.name + "\"");
  check(micro_batch > 0, "micro-batch size must be positive");
  check(slots > 0, "a model shard needs at least one activation slot");
  check(seq_len > 0 && seq_len <= config.max_seq_len,
        "sequence length " + std::to_string(seq_len) + " must be in [1, max_seq_len=" +
            std::to_string(config.max_seq_len) + "] of model \"" + config.name + "\"");
  const bool sharded =
      heads_ != config.num_heads || ffn_ != config.ffn_hidden_size || vocab_ != config.vocab_size;
  check(!sharded || tp != nullptr, "a tensor-parallel shard needs its group's collectives");
  const int blocks = shard.layer_end - shard.layer_begin;
  check(recompute.layers >= 0 && recompute.layers <= blocks,
        "recomputation of " + std::to_string(recompute.layers) + " layers on a shard of " +
            std::to_string(blocks));
  if (recompute.mode == RecomputeMode::kNone) recompute_.layers = 0;
  const size_t n = static_cast<size_t>(micro_batch) * seq_len;
  const Sizes z{n,
                static_cast<size_t>(config.hidden_size),
                static_cast<size_t>(ffn_),
                static_cast<size_t>(vocab_),
                static_cast<size_t>(heads_) * config.head_dim(),
                static_cast<size_t>(kv_heads_) * config.head_dim(),
                backend.attention_state_size(micro_batch, seq_len, seq_len, heads_),
                blocks};
  params_ = backend::Buffer<T>(backend, layout_.total_size(), backend::MemoryKind::kParameters);
  grads_ = backend::Buffer<T>(backend, layout_.total_size(), backend::MemoryKind::kGradients);
  for (int s = 0; s < slots; ++s) slots_.push_back(make_slot(shard, z));
  allocate_scratch(shard, z);
}

template <typename T>
typename Transformer<T>::BlockActivations Transformer<T>::all_activations(const Sizes& z) {
  auto buf = [&](size_t count) {
    return backend::Buffer<T>(backend_, count, backend::MemoryKind::kActivations);
  };
  // The norms' rstd and attention's state stay in T; the rest may take the compute format.
  auto exact = [&](size_t count) {
    return backend::Buffer<T>(backend_, count, backend::MemoryKind::kActivations,
                              backend::Precision::kExact);
  };
  const size_t n = z.n, c = z.c, f = z.f, q = z.q, kv = z.kv;
  return {buf(n * c), exact(n),   buf(n * q), buf(n * kv), buf(n * kv), exact(z.state), buf(n * q),
          buf(n * c), buf(n * c), exact(n),   buf(n * f),  buf(n * f),  buf(n * f)};
}

// Activation slots hold what a micro-batch keeps from its forward until its backward; the
// backward scratch (allocate_scratch) is shared by every slot and block.
template <typename T>
typename Transformer<T>::Slot Transformer<T>::make_slot(const ShardSpec& shard, const Sizes& z) {
  using backend::MemoryKind;
  auto buf = [&](size_t count) {
    return backend::Buffer<T>(backend_, count, MemoryKind::kActivations);
  };
  auto exact = [&](size_t count) {
    return backend::Buffer<T>(backend_, count, MemoryKind::kActivations,
                              backend::Precision::kExact);
  };
  const size_t n = z.n, c = z.c, f = z.f, q = z.q, kv = z.kv;
  Slot slot;
  if (shard.has_embedding) {
    slot.inputs = backend::Buffer<T, int32_t>(backend_, n, MemoryKind::kActivations);
  }
  for (int b = 0; b <= z.blocks; ++b) slot.residual.push_back(buf(n * c));
  for (int b = 0; b < z.blocks; ++b) {
    BlockActivations a;
    if (!recompute_.recomputes(b)) {
      a = all_activations(z);
    } else if (recompute_.mode == RecomputeMode::kSelective) {
      a = {buf(n * c), exact(n),   buf(n * q), buf(n * kv), buf(n * kv), {},        {},
           buf(n * c), buf(n * c), exact(n),   buf(n * f),  buf(n * f),  buf(n * f)};
    }  // full: the block keeps only its input, residual[b]
    slot.blocks.push_back(std::move(a));
  }
  if (shard.has_head) {
    slot.targets = backend::Buffer<T, int32_t>(backend_, n, MemoryKind::kActivations);
    slot.final_ln = buf(n * c);
    slot.final_rstd = exact(n);
    slot.logits = buf(n * z.v);
    slot.losses = exact(n);
    slot.row_max = exact(n);
    slot.softmax_sums = exact(2 * n);  // sum_exp then target_logit: one all-reduce for both
  }
  return slot;
}

template <typename T>
void Transformer<T>::allocate_scratch(const ShardSpec& shard, const Sizes& z) {
  // What a recomputing block computes again lives here, once for all slots (and all blocks,
  // unless they are recomputed ahead).
  const int scratch_blocks = recompute_.layers == 0 ? 0 : recompute_ahead_ ? recompute_.layers : 1;
  for (int b = 0; b < scratch_blocks; ++b) {
    BlockActivations a;
    if (recompute_.mode == RecomputeMode::kFull) {
      a = all_activations(z);
    } else {
      a.state = backend::Buffer<T>(backend_, z.state, backend::MemoryKind::kActivations,
                                   backend::Precision::kExact);
      a.attn = backend::Buffer<T>(backend_, z.n * z.q, backend::MemoryKind::kActivations);
    }
    recomputed_.push_back(std::move(a));
  }
  auto work = [&](size_t count) {
    return backend::Buffer<T>(backend_, count, backend::MemoryKind::kWorkspace);
  };
  const size_t n = z.n, c = z.c, f = z.f, q = z.q, kv = z.kv;
  dres_ = work(n * c);
  dnorm_ = work(n * c);
  dnorm2_ = work(n * c);
  dtmp_ = work(n * c);
  dq_ = work(n * q);
  dk_ = work(n * kv);
  dv_ = work(n * kv);
  dattn_ = work(n * q);
  dgate_ = work(n * f);
  dup_ = work(n * f);
  dact_ = work(n * f);
  if (shard.has_head) dlogits_ = work(n * z.v);
}

template <typename T>
void Transformer<T>::init_parameters(uint64_t seed) {
  // Residual-branch outputs are scaled down by 1/sqrt(2L) (GPT-2) so the residual stream's
  // variance does not grow with depth.
  const double residual_scale = 1.0 / std::sqrt(2.0 * config_.num_layers);
  std::vector<T> whole, part;
  for (const TensorSpec& t : layout_.tensors()) {
    int64_t whole_size = 1;
    for (int64_t d : t.full_shape) whole_size *= d;
    whole.assign(static_cast<size_t>(whole_size), T(1));
    if (t.full_shape.size() > 1) {
      NormalStream normal(mix64(seed ^ mix64(hash_text(t.name))));
      const bool residual_out =
          t.name.ends_with("o_proj.weight") || t.name.ends_with("down_proj.weight");
      const double std = config_.init_std * (residual_out ? residual_scale : 1.0);
      for (T& x : whole) x = static_cast<T>(std * normal.next());
    }
    part.resize(static_cast<size_t>(t.size));
    if (t.shard_axis == ShardAxis::kColumns) {
      const int64_t cols = t.full_shape[1], keep = t.shape[1];
      for (int64_t r = 0; r < t.shape[0]; ++r) {
        std::copy_n(whole.begin() + r * cols + t.shard_begin, keep, part.begin() + r * keep);
      }
    } else {
      const int64_t row = t.full_shape.size() > 1 ? t.full_shape[1] : 0;
      std::copy_n(whole.begin() + t.shard_begin * row, t.size, part.begin());
    }
    backend_.copy_from_host(params_.data() + t.offset, part.data(), part.size());
  }
}

template <typename T>
void Transformer<T>::zero_grads() {
  backend_.fill_zero(grads_.data(), grads_.size());
}

template <typename T>
void Transformer<T>::all_reduce_sum(T* data, size_t count) {
  if (tp_ != nullptr && tp_->size() > 1) tp_->all_reduce_sum(data, count);
}

template <typename T>
T* Transformer<T>::input_activation(int slot) {
  return slots_.at(slot).residual.front().data();
}

template <typename T>
const T* Transformer<T>::output_activation(int slot) {
  return slots_.at(slot).residual.back().data();
}

template <typename T>
void Transformer<T>::check_tokens(const int32_t* tokens, size_t n, const char* what) const {
  for (size_t i = 0; i < n; ++i) {
    check(tokens[i] >= 0 && tokens[i] < config_.vocab_size,
          std::string(what) + " token " + std::to_string(tokens[i]) + " at position " +
              std::to_string(i) + " is outside the vocabulary [0, " +
              std::to_string(config_.vocab_size) + ")");
  }
}

template <typename T>
void Transformer<T>::embed(Slot& slot, const int32_t* tokens, int n) {
  const size_t count = static_cast<size_t>(n);
  check_tokens(tokens, count, "input");
  backend_.copy_tokens_from_host(slot.inputs.data(), tokens, count);
  backend_.embedding_forward(slot.residual[0].data(), slot.inputs.data(),
                             param(layout_.embedding()), layout_.shard().vocab_begin, vocab_, n,
                             config_.hidden_size);
  all_reduce_sum(slot.residual[0].data(), count * config_.hidden_size);
}

template <typename T>
double Transformer<T>::forward(int slot_index, const int32_t* inputs, const int32_t* targets) {
  Slot& slot = slots_.at(slot_index);
  const ShardSpec& shard = layout_.shard();
  const size_t n = static_cast<size_t>(tokens_per_micro_batch());
  if (shard.has_embedding) embed(slot, inputs, tokens_per_micro_batch());
  for (size_t b = 0; b < slot.blocks.size(); ++b) {
    const BlockPointers a = block_storage(slot, static_cast<int>(b));
    block_forward(a, static_cast<int>(b), slot.residual[b].data(), slot.residual[b + 1].data(),
                  Positions{micro_batch_, seq_len_, 0, a.k, a.v});
  }
  if (!shard.has_head) return 0;
  check_tokens(targets, n, "target");
  backend_.copy_tokens_from_host(slot.targets.data(), targets, n);
  return head_forward(slot);
}

template <typename T>
std::vector<T> Transformer<T>::forward_cached(const int32_t* tokens, int count) {
  const ShardSpec& shard = layout_.shard();
  check(shard.has_embedding && shard.has_head && heads_ == config_.num_heads &&
            ffn_ == config_.ffn_hidden_size && vocab_ == config_.vocab_size &&
            shard.layer_begin == 0 && shard.layer_end == config_.num_layers,
        "cached inference needs the whole model on one rank");
  check(recompute_.layers == 0, "cached inference keeps every activation: no recomputation");
  check(count > 0, "cached inference: no tokens given");
  check(count <= seq_len_ - cached_positions_,
        "cached inference: " + std::to_string(cached_positions_) + " cached + " +
            std::to_string(count) + " new positions exceed the sequence length " +
            std::to_string(seq_len_));
  const size_t kv = static_cast<size_t>(kv_heads_) * config_.head_dim();
  if (k_cache_.empty()) {
    for (size_t b = 0; b < slots_[0].blocks.size(); ++b) {
      k_cache_.emplace_back(backend_, static_cast<size_t>(seq_len_) * kv,
                            backend::MemoryKind::kActivations);
      v_cache_.emplace_back(backend_, static_cast<size_t>(seq_len_) * kv,
                            backend::MemoryKind::kActivations);
    }
  }
  Slot& slot = slots_[0];
  embed(slot, tokens, count);
  for (size_t b = 0; b < slot.blocks.size(); ++b) {
    block_forward(pointers(slot.blocks[b]), static_cast<int>(b), slot.residual[b].data(),
                  slot.residual[b + 1].data(),
                  Positions{1, count, cached_positions_, k_cache_[b].data(), v_cache_[b].data()});
  }
  cached_positions_ += count;
  // Only the last position's next-token distribution is wanted.
  const size_t last = static_cast<size_t>(count - 1) * config_.hidden_size;
  head_logits(slot, slot.residual.back().data() + last, 1);
  std::vector<T> host(static_cast<size_t>(vocab_));
  backend_.copy_to_host(host.data(), slot.logits.data(), host.size());
  return host;
}

template <typename T>
void Transformer<T>::backward(int slot_index, T loss_scale) {
  Slot& slot = slots_.at(slot_index);
  const ShardSpec& shard = layout_.shard();
  if (shard.has_head) head_backward(slot, loss_scale);
  const bool recomputed = recomputed_slot_ == slot_index;
  recomputed_slot_ = -1;
  for (int b = static_cast<int>(slot.blocks.size()) - 1; b >= 0; --b) {
    block_backward(slot, b, slot.residual[static_cast<size_t>(b)].data(), dres_.data(), recomputed);
  }
  if (shard.has_embedding) {
    backend_.embedding_backward(grad(layout_.embedding()), dres_.data(), slot.inputs.data(),
                                shard.vocab_begin, vocab_, tokens_per_micro_batch(),
                                config_.hidden_size);
  }
}

template <typename T>
std::vector<T> Transformer<T>::token_losses(int slot) {
  return host_losses(slots_.at(slot));
}

template <typename T>
std::vector<T> Transformer<T>::logits(int slot) {
  const Slot& s = slots_.at(slot);
  std::vector<T> host(s.logits.size());
  backend_.copy_to_host(host.data(), s.logits.data(), host.size());
  return host;
}

template <typename T>
std::vector<T> Transformer<T>::host_losses(const Slot& slot) {
  std::vector<T> host(slot.losses.size());
  backend_.copy_to_host(host.data(), slot.losses.data(), host.size());
  return host;
}

template <typename T>
typename Transformer<T>::BlockPointers Transformer<T>::pointers(BlockActivations& a) {
  return {a.ln1.data(),   a.rstd1.data(), a.q.data(),   a.k.data(),   a.v.data(),
          a.state.data(), a.attn.data(),  a.mid.data(), a.ln2.data(), a.rstd2.data(),
          a.gate.data(),  a.up.data(),    a.act.data()};
}

template <typename T>
typename Transformer<T>::BlockPointers Transformer<T>::block_storage(Slot& slot, int index) {
  if (!recompute_.recomputes(index)) return pointers(slot.blocks[static_cast<size_t>(index)]);
  BlockActivations& scratch = recomputed_[recompute_ahead_ ? static_cast<size_t>(index) : 0];
  if (recompute_.mode == RecomputeMode::kFull) return pointers(scratch);
  BlockPointers a = pointers(slot.blocks[static_cast<size_t>(index)]);
  a.state = scratch.state.data();
  a.attn = scratch.attn.data();
  return a;
}

template <typename T>
void Transformer<T>::recompute_ahead(int slot_index, const std::function<void()>& between_blocks) {
  check(recompute_ahead_, "recompute_ahead: the shard was built without a scratch per block");
  Slot& slot = slots_.at(slot_index);
  for (int b = 0; b < recompute_.layers; ++b) {
    block_recompute(block_storage(slot, b), b, slot.residual[static_cast<size_t>(b)].data());
    if (between_blocks) between_blocks();
  }
  recomputed_slot_ = slot_index;
}

// Recomputation: the same operations on the same inputs as the forward, so the same values.
template <typename T>
void Transformer<T>::block_recompute(const BlockPointers& a, int index, const T* x) {
  if (!recompute_.recomputes(index)) return;
  if (recompute_.mode == RecomputeMode::kFull) {
    block_forward(a, index, x, nullptr, Positions{micro_batch_, seq_len_, 0, a.k, a.v});
  } else {
    backend_.attention_forward(a.attn, a.state, a.q, a.k, a.v, micro_batch_, seq_len_, 0, heads_,
                               kv_heads_, config_.head_dim());
  }
}

template <typename T>
typename Transformer<T>::Parts Transformer<T>::parts(int batch, int seq) const {
  Parts p;
  const bool split = subpipeline_ && tp_ != nullptr && tp_->size() > 1;
  if (split && batch >= 2) {
    const int half = batch / 2;
    p.by_sequence = true;
    p.parts = {{0, half, 0, half * seq}, {half, batch - half, half * seq, (batch - half) * seq}};
  } else if (split && batch == 1 && seq >= 2) {
    const int half = seq / 2;
    p.parts = {{0, 1, 0, half}, {0, 1, half, seq - half}};
  } else {
    p.parts = {{0, batch, 0, batch * seq}};
  }
  return p;
}

template <typename T>
typename Transformer<T>::PendingSum Transformer<T>::start_sum(T* data, size_t count,
                                                              const Parts& parts) {
  if (tp_ == nullptr || tp_->size() <= 1) return nullptr;
  if (!parts.split()) {
    tp_->all_reduce_sum(data, count);
    return nullptr;
  }
  return tp_->start_all_reduce_sum(data, count);
}

template <typename T>
void Transformer<T>::finish(PendingSum& sum) {
  if (sum) sum->wait();
  sum.reset();
}

// Under sub-pipelined tensor parallelism each step below runs part by part, each part's
// all-reduce started as soon as its rows are ready and waited for only before the next step of
// the same part: the reduction of the first part runs while the second computes.
template <typename T>
void Transformer<T>::block_forward(const BlockPointers& a, int index, const T* x, T* out,
                                   const Positions& at) {
  auto& be = backend_;
  const BlockTensors& w = layout_.block(layout_.shard().layer_begin + index);
  const int c = config_.hidden_size, hd = config_.head_dim();
  const int q = heads_ * hd, kv = kv_heads_ * hd;
  const int keys = at.past + at.seq;  // per sequence
  // New keys and values go after the `past` ones (only one sequence has past positions).
  T* k_new = at.k + static_cast<size_t>(at.past) * kv;
  T* v_new = at.v + static_cast<size_t>(at.past) * kv;
  const Part whole{0, at.batch, 0, at.batch * at.seq};
  // Cached inference runs one part: only whole training sequences (past 0) split.
  const Parts split = at.past == 0 ? parts(at.batch, at.seq) : Parts{{whole}, false};
  std::vector<PendingSum> sums(split.parts.size());

  // Attention: q/k/v are column-parallel (this rank's heads), o_proj row-parallel; the partial
  // outputs are summed over the group before the residual is added (once). Split along token
  // rows, the first part runs the attention (and what feeds it) for all rows.
  for (size_t i = 0; i < split.parts.size(); ++i) {
    const Part& p = split.parts[i];
    if (split.by_sequence || i == 0) {
      const Part& core = split.by_sequence ? p : whole;
      const size_t state_at = be.attention_state_size(core.batch_begin, at.seq, keys, heads_);
      be.rmsnorm_forward(row(a.ln1, core, c), row(a.rstd1, core, 1), row(x, core, c),
                         param(w.attn_norm), core.rows, c, config_.norm_eps);
      be.matmul_forward(row(a.q, core, q), row(a.ln1, core, c), param(w.q_proj), core.rows, c, q);
      be.matmul_forward(row(k_new, core, kv), row(a.ln1, core, c), param(w.k_proj), core.rows, c,
                        kv);
      be.matmul_forward(row(v_new, core, kv), row(a.ln1, core, c), param(w.v_proj), core.rows, c,
                        kv);
      be.rope_forward(row(a.q, core, q), core.batch, at.seq, heads_, hd, config_.rope_theta,
                      at.past);
      be.rope_forward(row(k_new, core, kv), core.batch, at.seq, kv_heads_, hd, config_.rope_theta,
                      at.past);
      be.attention_forward(row(a.attn, core, q), a.state + state_at, row(a.q, core, q),
                           row(at.k, core, kv), row(at.v, core, kv), core.batch, at.seq, at.past,
                           heads_, kv_heads_, hd);
    }
    be.matmul_forward(row(a.mid, p, c), row(a.attn, p, q), param(w.o_proj), p.rows, q, c);
    sums[i] = start_sum(row(a.mid, p, c), static_cast<size_t>(p.rows) * c, split);
  }

  // SwiGLU MLP: gate/up column-parallel, down row-parallel.
  for (size_t i = 0; i < split.parts.size(); ++i) {
    const Part& p = split.parts[i];
    const size_t pc = static_cast<size_t>(p.rows) * c;
    finish(sums[i]);
    // mid = x + o_proj(attention), then its norm, in one pass where the backend fuses them.
    be.add_rmsnorm_forward(row(a.mid, p, c), row(a.ln2, p, c), row(a.rstd2, p, 1), row(x, p, c),
                           param(w.mlp_norm), p.rows, c, config_.norm_eps);
    be.matmul_forward(row(a.gate, p, ffn_), row(a.ln2, p, c), param(w.gate_proj), p.rows, c, ffn_);
    be.matmul_forward(row(a.up, p, ffn_), row(a.ln2, p, c), param(w.up_proj), p.rows, c, ffn_);
    be.swiglu_forward(row(a.act, p, ffn_), row(a.gate, p, ffn_), row(a.up, p, ffn_),
                      static_cast<size_t>(p.rows) * ffn_);
    if (out == nullptr) continue;
    be.matmul_forward(row(out, p, c), row(a.act, p, ffn_), param(w.down_proj), p.rows, ffn_, c);
    sums[i] = start_sum(row(out, p, c), pc, split);
  }
  if (out == nullptr) return;  // all backward needs (full recomputation)
  for (size_t i = 0; i < split.parts.size(); ++i) {
    const Part& p = split.parts[i];
    finish(sums[i]);
    be.add(row(out, p, c), row(a.mid, p, c), static_cast<size_t>(p.rows) * c);  // out = mid + down
  }
}

// On entry dres holds dLoss/d(block output); on exit dLoss/d(block input x). Both are the same on
// every rank of the group: the partial input gradients of the column-parallel matmuls are summed
// before the (replicated) norms. Sub-pipelined as the forward.
template <typename T>
void Transformer<T>::block_backward(Slot& slot, int index, const T* x, T* dres, bool recomputed) {
  const BlockPointers a = block_storage(slot, index);
  const BlockTensors& w = layout_.block(layout_.shard().layer_begin + index);
  const int c = config_.hidden_size, q = heads_ * config_.head_dim();
  if (!recomputed) block_recompute(a, index, x);
  const Parts split = parts(micro_batch_, seq_len_);
  const Part whole{0, micro_batch_, 0, tokens_per_micro_batch()};
  std::vector<PendingSum> sums(split.parts.size());
  // Starts the sum over the group of part i's rows of dnorm_.
  auto start = [&](size_t i) {
    const Part& p = split.parts[i];
    sums[i] = start_sum(row(dnorm_.data(), p, c), static_cast<size_t>(p.rows) * c, split);
  };

  // MLP branch: out = mid + down(silu(gate(ln2)) * up(ln2)).
  for (size_t i = 0; i < split.parts.size(); ++i) {
    mlp_backward(a, w, split.parts[i], dres);
    start(i);
  }

  // Attention branch: mid = x + o(attention(rope(q(ln1)), rope(k(ln1)), v(ln1))).
  // The attention core of `core`'s sequences, then the q/k/v projections of part i's rows.
  auto projections = [&](size_t i) {
    qkv_backward(a, w, split.parts[i]);
    start(i);
  };
  for (size_t i = 0; i < split.parts.size(); ++i) {
    const Part& p = split.parts[i];
    finish(sums[i]);
    norm_backward(w.mlp_norm, a.mid, a.rstd2, p, dres);  // dres is now dLoss/d(mid)
    backend_.matmul_backward(row(dattn_.data(), p, q), grad(w.o_proj), row(dres, p, c),
                             row(a.attn, p, q), param(w.o_proj), p.rows, q, c);
    if (split.by_sequence) {
      attention_core_backward(a, p);
      projections(i);
    }
  }
  if (!split.by_sequence) {
    attention_core_backward(a, whole);
    for (size_t i = 0; i < split.parts.size(); ++i) projections(i);
  }
  for (size_t i = 0; i < split.parts.size(); ++i) {
    finish(sums[i]);
    norm_backward(w.attn_norm, x, a.rstd1, split.parts[i], dres);
  }  // dres is now dLoss/dx
}

template <typename T>
void Transformer<T>::mlp_backward(const BlockPointers& a, const BlockTensors& w, const Part& p,
                                  const T* dres) {
  auto& be = backend_;
  const int c = config_.hidden_size;
  T* dnorm = row(dnorm_.data(), p, c);
  be.matmul_backward(row(dact_.data(), p, ffn_), grad(w.down_proj), row(dres, p, c),
                     row(a.act, p, ffn_), param(w.down_proj), p.rows, ffn_, c);
  be.swiglu_backward(row(dgate_.data(), p, ffn_), row(dup_.data(), p, ffn_),
                     row(dact_.data(), p, ffn_), row(a.gate, p, ffn_), row(a.up, p, ffn_),
                     static_cast<size_t>(p.rows) * ffn_);
  be.matmul_backward(dnorm, grad(w.gate_proj), row(dgate_.data(), p, ffn_), row(a.ln2, p, c),
                     param(w.gate_proj), p.rows, c, ffn_);
  be.matmul_backward(row(dnorm2_.data(), p, c), grad(w.up_proj), row(dup_.data(), p, ffn_),
                     row(a.ln2, p, c), param(w.up_proj), p.rows, c, ffn_);
  be.add(dnorm, row(dnorm2_.data(), p, c), static_cast<size_t>(p.rows) * c);
}

template <typename T>
void Transformer<T>::attention_core_backward(const BlockPointers& a, const Part& core) {
  auto& be = backend_;
  const int hd = config_.head_dim();
  const int q = heads_ * hd, kv = kv_heads_ * hd;
  const size_t state_at = be.attention_state_size(core.batch_begin, seq_len_, seq_len_, heads_);
  be.attention_backward(
      row(dq_.data(), core, q), row(dk_.data(), core, kv), row(dv_.data(), core, kv),
      row(dattn_.data(), core, q), row(a.attn, core, q), a.state + state_at, row(a.q, core, q),
      row(a.k, core, kv), row(a.v, core, kv), core.batch, seq_len_, heads_, kv_heads_, hd);
  be.rope_backward(row(dq_.data(), core, q), core.batch, seq_len_, heads_, hd, config_.rope_theta);
  be.rope_backward(row(dk_.data(), core, kv), core.batch, seq_len_, kv_heads_, hd,
                   config_.rope_theta);
}

template <typename T>
void Transformer<T>::qkv_backward(const BlockPointers& a, const BlockTensors& w, const Part& p) {
  auto& be = backend_;
  const int c = config_.hidden_size, hd = config_.head_dim();
  const int q = heads_ * hd, kv = kv_heads_ * hd;
  const size_t pc = static_cast<size_t>(p.rows) * c;
  T* dnorm = row(dnorm_.data(), p, c);
  T* dnorm2 = row(dnorm2_.data(), p, c);
  be.matmul_backward(dnorm, grad(w.q_proj), row(dq_.data(), p, q), row(a.ln1, p, c),
                     param(w.q_proj), p.rows, c, q);
  be.matmul_backward(dnorm2, grad(w.k_proj), row(dk_.data(), p, kv), row(a.ln1, p, c),
                     param(w.k_proj), p.rows, c, kv);
  be.add(dnorm, dnorm2, pc);
  be.matmul_backward(dnorm2, grad(w.v_proj), row(dv_.data(), p, kv), row(a.ln1, p, c),
                     param(w.v_proj), p.rows, c, kv);
  be.add(dnorm, dnorm2, pc);
}

template <typename T>
void Transformer<T>::norm_backward(int norm, const T* input, const T* rstd, const Part& p,
                                   T* dres) {
  const int c = config_.hidden_size;
  backend_.rmsnorm_backward(row(dtmp_.data(), p, c), grad(norm), row(dnorm_.data(), p, c),
                            row(input, p, c), param(norm), row(rstd, p, 1), p.rows, c);
  backend_.add(row(dres, p, c), row(dtmp_.data(), p, c), static_cast<size_t>(p.rows) * c);
}

// Vocabulary-parallel head: each rank computes logits for its vocabulary rows; the softmax
// statistics are reduced over the group (max, then the two sums), so no rank ever holds the full
// logits.
template <typename T>
void Transformer<T>::head_logits(Slot& slot, const T* x, int n) {
  const int c = config_.hidden_size;
  backend_.rmsnorm_forward(slot.final_ln.data(), slot.final_rstd.data(), x,
                           param(layout_.final_norm()), n, c, config_.norm_eps);
  backend_.matmul_forward(slot.logits.data(), slot.final_ln.data(), param(layout_.lm_head()), n, c,
                          vocab_);
}

template <typename T>
double Transformer<T>::head_forward(Slot& slot) {
  const int n = tokens_per_micro_batch();
  head_logits(slot, slot.residual.back().data(), n);
  backend_.logits_row_max(slot.row_max.data(), slot.logits.data(), n, vocab_);
  if (tp_ != nullptr && tp_->size() > 1) tp_->all_reduce_max(slot.row_max.data(), n);
  T* sum_exp = slot.softmax_sums.data();
  T* target_logit = sum_exp + n;
  backend_.logits_softmax_sums(sum_exp, target_logit, slot.logits.data(), slot.row_max.data(),
                               slot.targets.data(), layout_.shard().vocab_begin, n, vocab_);
  all_reduce_sum(sum_exp, 2 * static_cast<size_t>(n));
  backend_.cross_entropy_loss(slot.losses.data(), slot.row_max.data(), sum_exp, target_logit, n);
  double sum = 0;
  for (T loss : host_losses(slot)) sum += static_cast<double>(loss);
  return sum;
}

template <typename T>
void Transformer<T>::head_backward(Slot& slot, T loss_scale) {
  const int n = tokens_per_micro_batch(), c = config_.hidden_size;
  backend_.cross_entropy_backward(dlogits_.data(), slot.logits.data(), slot.row_max.data(),
                                  slot.softmax_sums.data(), slot.targets.data(),
                                  layout_.shard().vocab_begin, loss_scale, n, vocab_);
  backend_.matmul_backward(dnorm_.data(), grad(layout_.lm_head()), dlogits_.data(),
                           slot.final_ln.data(), param(layout_.lm_head()), n, c, vocab_);
  all_reduce_sum(dnorm_.data(), static_cast<size_t>(n) * c);
  backend_.rmsnorm_backward(dres_.data(), grad(layout_.final_norm()), dnorm_.data(),
                            slot.residual.back().data(), param(layout_.final_norm()),
                            slot.final_rstd.data(), n, c);
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace malleus::model
