#include "model/transformer.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string_view>

#include "common/error.h"

namespace malleus::model {

namespace {

// splitmix64: a well-mixed 64-bit hash, to derive independent per-tensor seeds.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t hash_name(std::string_view name) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a: stable across platforms, unlike std::hash
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  return h;
}

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
    : config_(config),
      layout_(config),
      backend_(backend),
      micro_batch_(micro_batch),
      seq_len_(seq_len) {
  config_.validate("model \"" + config.name + "\"");
  check(micro_batch > 0, "micro-batch size must be positive");
  check(seq_len > 0 && seq_len <= config.max_seq_len,
        "sequence length " + std::to_string(seq_len) + " must be in [1, max_seq_len=" +
            std::to_string(config.max_seq_len) + "] of model \"" + config.name + "\"");
  const size_t n = static_cast<size_t>(micro_batch) * seq_len;
  const size_t c = config.hidden_size, f = config.ffn_hidden_size, v = config.vocab_size;
  const size_t q = static_cast<size_t>(config.num_heads) * config.head_dim(), kv = config.kv_dim();
  const size_t probs = static_cast<size_t>(micro_batch) * config.num_heads * seq_len * seq_len;
  auto buf = [&](size_t count) { return backend::Buffer<T>(backend, count); };

  params_ = buf(layout_.total_size());
  grads_ = buf(layout_.total_size());
  inputs_ = backend::Buffer<T, int32_t>(backend, n);
  targets_ = backend::Buffer<T, int32_t>(backend, n);
  for (int l = 0; l <= config.num_layers; ++l) residual_.push_back(buf(n * c));
  for (int l = 0; l < config.num_layers; ++l) {
    blocks_.push_back({buf(n * c), buf(n), buf(n * q), buf(n * kv), buf(n * kv), buf(probs),
                       buf(n * q), buf(n * c), buf(n * c), buf(n), buf(n * f), buf(n * f),
                       buf(n * f)});
  }
  final_ln_ = buf(n * c);
  final_rstd_ = buf(n);
  logits_ = buf(n * v);
  losses_ = buf(n);
  dres_ = buf(n * c);
  dnorm_ = buf(n * std::max(c, q));
  dnorm2_ = buf(n * c);
  dtmp_ = buf(n * c);
  dq_ = buf(n * q);
  dk_ = buf(n * kv);
  dv_ = buf(n * kv);
  dattn_ = buf(n * q);
  dgate_ = buf(n * f);
  dup_ = buf(n * f);
  dact_ = buf(n * f);
  dlogits_ = buf(n * v);
}

template <typename T>
void Transformer<T>::init_parameters(uint64_t seed) {
  // Residual-branch outputs are scaled down by 1/sqrt(2L) (GPT-2) so the residual stream's
  // variance does not grow with depth.
  const double residual_scale = 1.0 / std::sqrt(2.0 * config_.num_layers);
  std::vector<T> host;
  for (const TensorSpec& t : layout_.tensors()) {
    host.assign(static_cast<size_t>(t.size), T(1));
    if (t.shape.size() > 1) {
      NormalStream normal(mix(seed ^ mix(hash_name(t.name))));
      const bool residual_out =
          t.name.ends_with("o_proj.weight") || t.name.ends_with("down_proj.weight");
      const double std = config_.init_std * (residual_out ? residual_scale : 1.0);
      for (T& x : host) x = static_cast<T>(std * normal.next());
    }
    backend_.copy_from_host(params_.data() + t.offset, host.data(), host.size());
  }
}

template <typename T>
void Transformer<T>::zero_grads() {
  backend_.fill_zero(grads_.data(), grads_.size());
}

template <typename T>
double Transformer<T>::forward(const int32_t* inputs, const int32_t* targets) {
  const size_t n = static_cast<size_t>(tokens_per_micro_batch());
  for (size_t i = 0; i < n; ++i) {
    check(inputs[i] >= 0 && inputs[i] < config_.vocab_size && targets[i] >= 0 &&
              targets[i] < config_.vocab_size,
          "token id out of range [0, " + std::to_string(config_.vocab_size) + ") at position " +
              std::to_string(i));
  }
  backend_.copy_tokens_from_host(inputs_.data(), inputs, n);
  backend_.copy_tokens_from_host(targets_.data(), targets, n);
  embed_forward();
  for (int l = 0; l < config_.num_layers; ++l) {
    block_forward(l, residual_[l].data(), residual_[l + 1].data());
  }
  head_forward(residual_[config_.num_layers].data());
  double sum = 0;
  for (T loss : token_losses()) sum += static_cast<double>(loss);
  return sum;
}

template <typename T>
void Transformer<T>::backward(T loss_scale) {
  head_backward(loss_scale, residual_[config_.num_layers].data(), dres_.data());
  for (int l = config_.num_layers - 1; l >= 0; --l) {
    block_backward(l, residual_[l].data(), dres_.data());
  }
  embed_backward(dres_.data());
}

template <typename T>
std::vector<T> Transformer<T>::token_losses() {
  std::vector<T> host(losses_.size());
  backend_.copy_to_host(host.data(), losses_.data(), host.size());
  return host;
}

template <typename T>
void Transformer<T>::embed_forward() {
  backend_.embedding_forward(residual_[0].data(), inputs_.data(), param(layout_.embedding()),
                             tokens_per_micro_batch(), config_.hidden_size);
}

template <typename T>
void Transformer<T>::embed_backward(const T* dx) {
  backend_.embedding_backward(grad(layout_.embedding()), dx, inputs_.data(),
                              tokens_per_micro_batch(), config_.hidden_size);
}

template <typename T>
void Transformer<T>::block_forward(int layer, const T* x, T* out) {
  auto& be = backend_;
  BlockActivations& a = blocks_[layer];
  const BlockTensors& w = layout_.block(layer);
  const int n = tokens_per_micro_batch(), c = config_.hidden_size, f = config_.ffn_hidden_size;
  const int hq = config_.num_heads, hkv = config_.num_kv_heads, hd = config_.head_dim();
  const int q = hq * hd, kv = hkv * hd;

  be.rmsnorm_forward(a.ln1.data(), a.rstd1.data(), x, param(w.attn_norm), n, c, config_.norm_eps);
  be.matmul_forward(a.q.data(), a.ln1.data(), param(w.q_proj), n, c, q);
  be.matmul_forward(a.k.data(), a.ln1.data(), param(w.k_proj), n, c, kv);
  be.matmul_forward(a.v.data(), a.ln1.data(), param(w.v_proj), n, c, kv);
  be.rope_forward(a.q.data(), micro_batch_, seq_len_, hq, hd, config_.rope_theta);
  be.rope_forward(a.k.data(), micro_batch_, seq_len_, hkv, hd, config_.rope_theta);
  be.attention_forward(a.attn.data(), a.probs.data(), a.q.data(), a.k.data(), a.v.data(),
                       micro_batch_, seq_len_, hq, hkv, hd);
  // mid = x + o_proj(attn)
  be.matmul_forward(a.mid.data(), a.attn.data(), param(w.o_proj), n, q, c);
  be.add(a.mid.data(), x, static_cast<size_t>(n) * c);

  be.rmsnorm_forward(a.ln2.data(), a.rstd2.data(), a.mid.data(), param(w.mlp_norm), n, c,
                     config_.norm_eps);
  be.matmul_forward(a.gate.data(), a.ln2.data(), param(w.gate_proj), n, c, f);
  be.matmul_forward(a.up.data(), a.ln2.data(), param(w.up_proj), n, c, f);
  be.swiglu_forward(a.act.data(), a.gate.data(), a.up.data(), static_cast<size_t>(n) * f);
  // out = mid + down_proj(act)
  be.matmul_forward(out, a.act.data(), param(w.down_proj), n, f, c);
  be.add(out, a.mid.data(), static_cast<size_t>(n) * c);
}

// On entry dres holds dLoss/d(block output); on exit dLoss/d(block input x).
template <typename T>
void Transformer<T>::block_backward(int layer, const T* x, T* dres) {
  auto& be = backend_;
  BlockActivations& a = blocks_[layer];
  const BlockTensors& w = layout_.block(layer);
  const int n = tokens_per_micro_batch(), c = config_.hidden_size, f = config_.ffn_hidden_size;
  const int hq = config_.num_heads, hkv = config_.num_kv_heads, hd = config_.head_dim();
  const int q = hq * hd, kv = hkv * hd;
  const size_t nc = static_cast<size_t>(n) * c;

  // MLP branch: out = mid + down(silu(gate(ln2)) * up(ln2)).
  be.matmul_backward(dact_.data(), grad(w.down_proj), dres, a.act.data(), param(w.down_proj), n, f,
                     c);
  be.swiglu_backward(dgate_.data(), dup_.data(), dact_.data(), a.gate.data(), a.up.data(),
                     static_cast<size_t>(n) * f);
  be.matmul_backward(dnorm_.data(), grad(w.gate_proj), dgate_.data(), a.ln2.data(),
                     param(w.gate_proj), n, c, f);
  be.matmul_backward(dnorm2_.data(), grad(w.up_proj), dup_.data(), a.ln2.data(), param(w.up_proj),
                     n, c, f);
  be.add(dnorm_.data(), dnorm2_.data(), nc);
  be.rmsnorm_backward(dtmp_.data(), grad(w.mlp_norm), dnorm_.data(), a.mid.data(),
                      param(w.mlp_norm), a.rstd2.data(), n, c);
  be.add(dres, dtmp_.data(), nc);  // dres is now dLoss/d(mid)

  // Attention branch: mid = x + o(attention(rope(q(ln1)), rope(k(ln1)), v(ln1))).
  be.matmul_backward(dattn_.data(), grad(w.o_proj), dres, a.attn.data(), param(w.o_proj), n, q, c);
  be.attention_backward(dq_.data(), dk_.data(), dv_.data(), dattn_.data(), a.probs.data(),
                        a.q.data(), a.k.data(), a.v.data(), micro_batch_, seq_len_, hq, hkv, hd);
  be.rope_backward(dq_.data(), micro_batch_, seq_len_, hq, hd, config_.rope_theta);
  be.rope_backward(dk_.data(), micro_batch_, seq_len_, hkv, hd, config_.rope_theta);
  be.matmul_backward(dnorm_.data(), grad(w.q_proj), dq_.data(), a.ln1.data(), param(w.q_proj), n, c,
                     q);
  be.matmul_backward(dnorm2_.data(), grad(w.k_proj), dk_.data(), a.ln1.data(), param(w.k_proj), n,
                     c, kv);
  be.add(dnorm_.data(), dnorm2_.data(), nc);
  be.matmul_backward(dnorm2_.data(), grad(w.v_proj), dv_.data(), a.ln1.data(), param(w.v_proj), n,
                     c, kv);
  be.add(dnorm_.data(), dnorm2_.data(), nc);
  be.rmsnorm_backward(dtmp_.data(), grad(w.attn_norm), dnorm_.data(), x, param(w.attn_norm),
                      a.rstd1.data(), n, c);
  be.add(dres, dtmp_.data(), nc);  // dres is now dLoss/dx
}

template <typename T>
void Transformer<T>::head_forward(const T* x) {
  const int n = tokens_per_micro_batch(), c = config_.hidden_size, v = config_.vocab_size;
  backend_.rmsnorm_forward(final_ln_.data(), final_rstd_.data(), x, param(layout_.final_norm()), n,
                           c, config_.norm_eps);
  backend_.matmul_forward(logits_.data(), final_ln_.data(), param(layout_.lm_head()), n, c, v);
  backend_.cross_entropy_forward(losses_.data(), logits_.data(), targets_.data(), n, v);
}

template <typename T>
void Transformer<T>::head_backward(T loss_scale, const T* x, T* dx) {
  const int n = tokens_per_micro_batch(), c = config_.hidden_size, v = config_.vocab_size;
  backend_.cross_entropy_backward(dlogits_.data(), logits_.data(), targets_.data(), loss_scale, n,
                                  v);
  backend_.matmul_backward(dnorm_.data(), grad(layout_.lm_head()), dlogits_.data(),
                           final_ln_.data(), param(layout_.lm_head()), n, c, v);
  backend_.rmsnorm_backward(dx, grad(layout_.final_norm()), dnorm_.data(), x,
                            param(layout_.final_norm()), final_rstd_.data(), n, c);
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace malleus::model
