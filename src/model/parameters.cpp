#include "model/parameters.h"

#include "common/error.h"

namespace malleus::model {

ShardSpec ShardSpec::full(const ModelConfig& c) {
  ShardSpec s;
  s.layer_begin = 0;
  s.layer_end = c.num_layers;
  s.heads = c.num_heads;
  s.ffn = c.ffn_hidden_size;
  s.vocab = c.vocab_size;
  return s;
}

void ShardSpec::validate(const ModelConfig& c) const {
  auto within = [](int begin, int count, int total) {
    return begin >= 0 && count >= 0 && begin + count <= total;
  };
  const int group = c.num_heads / c.num_kv_heads;
  check(layer_begin >= 0 && layer_begin < layer_end && layer_end <= c.num_layers,
        "shard layers [" + std::to_string(layer_begin) + ", " + std::to_string(layer_end) +
            ") are not a non-empty range of the model's " + std::to_string(c.num_layers));
  check(within(head_begin, heads, c.num_heads) && head_begin % group == 0 && heads % group == 0,
        "shard heads [" + std::to_string(head_begin) + ", +" + std::to_string(heads) +
            ") are not whole KV groups of " + std::to_string(group) + " within " +
            std::to_string(c.num_heads) + " heads");
  check(within(ffn_begin, ffn, c.ffn_hidden_size), "shard FFN columns out of range");
  check(within(vocab_begin, vocab, c.vocab_size), "shard vocabulary rows out of range");
}

ParameterLayout::ParameterLayout(const ModelConfig& config)
    : ParameterLayout(config, ShardSpec::full(config)) {}

ParameterLayout::ParameterLayout(const ModelConfig& config, const ShardSpec& shard)
    : shard_(shard) {
  shard.validate(config);
  const int64_t c = config.hidden_size, f = config.ffn_hidden_size, v = config.vocab_size;
  const int64_t hd = config.head_dim(), q = int64_t{config.num_heads} * hd, kv = config.kv_dim();
  const int64_t q_begin = shard.head_begin * hd, q_count = shard.heads * hd;
  const int64_t kv_begin = shard.kv_head_begin(config) * hd, kv_count = shard.kv_heads(config) * hd;
  using A = ShardAxis;
  using U = ShardUnit;
  if (shard.has_embedding) {
    embedding_ = add("model.embed_tokens.weight", {v, c}, -1, true, A::kRows, U::kVocabRow,
                     shard.vocab_begin, shard.vocab);
  }
  for (int l = shard.layer_begin; l < shard.layer_end; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    BlockTensors b{};
    b.attn_norm = add(p + "input_layernorm.weight", {c}, l, false, A::kReplicated, U::kNone, 0, c);
    b.q_proj =
        add(p + "self_attn.q_proj.weight", {q, c}, l, true, A::kRows, U::kHead, q_begin, q_count);
    b.k_proj = add(p + "self_attn.k_proj.weight", {kv, c}, l, true, A::kRows, U::kKvHead, kv_begin,
                   kv_count);
    b.v_proj = add(p + "self_attn.v_proj.weight", {kv, c}, l, true, A::kRows, U::kKvHead, kv_begin,
                   kv_count);
    b.o_proj = add(p + "self_attn.o_proj.weight", {c, q}, l, true, A::kColumns, U::kHead, q_begin,
                   q_count);
    b.mlp_norm =
        add(p + "post_attention_layernorm.weight", {c}, l, false, A::kReplicated, U::kNone, 0, c);
    b.gate_proj = add(p + "mlp.gate_proj.weight", {f, c}, l, true, A::kRows, U::kFfnColumn,
                      shard.ffn_begin, shard.ffn);
    b.up_proj = add(p + "mlp.up_proj.weight", {f, c}, l, true, A::kRows, U::kFfnColumn,
                    shard.ffn_begin, shard.ffn);
    b.down_proj = add(p + "mlp.down_proj.weight", {c, f}, l, true, A::kColumns, U::kFfnColumn,
                      shard.ffn_begin, shard.ffn);
    blocks_.push_back(b);
  }
  if (shard.has_head) {
    final_norm_ = add("model.norm.weight", {c}, -1, false, A::kReplicated, U::kNone, 0, c);
    lm_head_ = add("lm_head.weight", {v, c}, -1, true, A::kRows, U::kVocabRow, shard.vocab_begin,
                   shard.vocab);
  }
}

int ParameterLayout::add(std::string name, std::vector<int64_t> full_shape, int layer, bool decay,
                         ShardAxis axis, ShardUnit unit, int64_t begin, int64_t count) {
  TensorSpec spec;
  spec.name = std::move(name);
  spec.full_shape = full_shape;
  spec.shape = std::move(full_shape);
  if (axis == ShardAxis::kRows) spec.shape[0] = count;
  if (axis == ShardAxis::kColumns) spec.shape[1] = count;
  spec.shard_begin = axis == ShardAxis::kReplicated ? 0 : begin;
  spec.size = 1;
  for (int64_t d : spec.shape) spec.size *= d;
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
