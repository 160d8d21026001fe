#include "model/parameters.h"

#include "common/error.h"

namespace malleus::model {

ParameterLayout::ParameterLayout(const ModelConfig& config) {
  const int64_t c = config.hidden_size, f = config.ffn_hidden_size, v = config.vocab_size;
  const int64_t q = int64_t{config.num_heads} * config.head_dim(), kv = config.kv_dim();
  using A = ShardAxis;
  using U = ShardUnit;
  embedding_ = add("model.embed_tokens.weight", {v, c}, -1, true, A::kRows, U::kVocabRow);
  for (int l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    BlockTensors b{};
    b.attn_norm = add(p + "input_layernorm.weight", {c}, l, false, A::kReplicated, U::kNone);
    b.q_proj = add(p + "self_attn.q_proj.weight", {q, c}, l, true, A::kRows, U::kHead);
    b.k_proj = add(p + "self_attn.k_proj.weight", {kv, c}, l, true, A::kRows, U::kKvHead);
    b.v_proj = add(p + "self_attn.v_proj.weight", {kv, c}, l, true, A::kRows, U::kKvHead);
    b.o_proj = add(p + "self_attn.o_proj.weight", {c, q}, l, true, A::kColumns, U::kHead);
    b.mlp_norm =
        add(p + "post_attention_layernorm.weight", {c}, l, false, A::kReplicated, U::kNone);
    b.gate_proj = add(p + "mlp.gate_proj.weight", {f, c}, l, true, A::kRows, U::kFfnColumn);
    b.up_proj = add(p + "mlp.up_proj.weight", {f, c}, l, true, A::kRows, U::kFfnColumn);
    b.down_proj = add(p + "mlp.down_proj.weight", {c, f}, l, true, A::kColumns, U::kFfnColumn);
    blocks_.push_back(b);
  }
  final_norm_ = add("model.norm.weight", {c}, -1, false, A::kReplicated, U::kNone);
  lm_head_ = add("lm_head.weight", {v, c}, -1, true, A::kRows, U::kVocabRow);
}

int ParameterLayout::add(std::string name, std::vector<int64_t> shape, int layer, bool decay,
                         ShardAxis axis, ShardUnit unit) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.size = 1;
  for (int64_t d : shape) spec.size *= d;
  spec.shape = std::move(shape);
  spec.offset = total_size_;
  spec.layer = layer;
  spec.weight_decay = decay;
  spec.shard_axis = axis;
  spec.shard_unit = unit;
  total_size_ += (spec.size + kAlignment - 1) / kAlignment * kAlignment;
  tensors_.push_back(std::move(spec));
  return static_cast<int>(tensors_.size()) - 1;
}

const TensorSpec& ParameterLayout::find(const std::string& name) const {
  for (const auto& t : tensors_) {
    if (t.name == name) return t;
  }
  throw Error("no parameter tensor named \"" + name + "\"");
}

int64_t ParameterLayout::num_parameters() const {
  int64_t n = 0;
  for (const auto& t : tensors_) n += t.size;
  return n;
}

}  // namespace malleus::model
