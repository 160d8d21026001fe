// Where every parameter lives in the flat parameter buffer. Gradients and the two AdamW moments
// use the same layout in buffers of their own, so "tensor X" is one (offset, size) everywhere:
// the explicit, addressable storage that checkpoints, exports and (later) gradient sync and
// migration slice into.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace malleus::model {

// How a tensor is split under tensor parallelism: along which axis, in which unit. Recorded now
// so that layouts for sharded plans can be derived from this one.
enum class ShardAxis { kReplicated, kRows, kColumns };
enum class ShardUnit { kNone, kHead, kKvHead, kFfnColumn, kVocabRow };

// Which part of the model one rank holds: a range of layers (with the embedding on the first stage
// and the final norm and LM head on the last) and, under tensor parallelism, a contiguous share of
// the query heads (whole KV groups), the FFN columns and the vocabulary rows.
struct ShardSpec {
  int layer_begin = 0, layer_end = 0;  // [begin, end)
  bool has_embedding = true;
  bool has_head = true;  // final norm + LM head + loss
  int head_begin = 0, heads = 0;
  int ffn_begin = 0, ffn = 0;
  int vocab_begin = 0, vocab = 0;

  // The whole model on one rank.
  static ShardSpec full(const ModelConfig& config);
  int kv_head_begin(const ModelConfig& c) const {
    return head_begin / (c.num_heads / c.num_kv_heads);
  }
  int kv_heads(const ModelConfig& c) const { return heads / (c.num_heads / c.num_kv_heads); }
  // Throws Error if the shard does not fit the model (ranges out of bounds, partial KV groups).
  void validate(const ModelConfig& config) const;
};

struct TensorSpec {
  std::string name;  // Hugging Face LlamaForCausalLM name, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;       // of the part held here
  std::vector<int64_t> full_shape;  // of the whole tensor
  int64_t shard_begin = 0;  // first row (kRows) or column (kColumns) of the whole tensor held here
  int64_t offset = 0;       // in elements, into the flat buffers
  int64_t size = 0;
  int layer = -1;            // block index, or -1 for embedding / final norm / head
  bool weight_decay = true;  // AdamW decays matrices, not norm gains
  ShardAxis shard_axis = ShardAxis::kReplicated;
  ShardUnit shard_unit = ShardUnit::kNone;
};

// Indices into ParameterLayout::tensors() of one block's tensors.
struct BlockTensors {
  int attn_norm, q_proj, k_proj, v_proj, o_proj, mlp_norm, gate_proj, up_proj, down_proj;
};

class ParameterLayout {
 public:
  // The whole model.
  explicit ParameterLayout(const ModelConfig& config);
  // The part of the model held under `shard`; tensors keep their full-model names and layer
  // indices.
  ParameterLayout(const ModelConfig& config, const ShardSpec& shard);

  const ShardSpec& shard() const { return shard_; }

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const TensorSpec& tensor(int index) const { return tensors_.at(index); }
  // Throws Error if no tensor has this name.
  const TensorSpec& find(const std::string& name) const;
  // Elements in each flat buffer (tensors are aligned to kAlignment elements; the gaps stay zero).
  int64_t total_size() const { return total_size_; }
  int64_t num_parameters() const;

  // Tensor indices; -1 where the shard does not hold the tensor.
  int embedding() const { return embedding_; }
  int final_norm() const { return final_norm_; }
  int lm_head() const { return lm_head_; }
  // `layer` is a model layer index within [shard().layer_begin, shard().layer_end).
  const BlockTensors& block(int layer) const { return blocks_.at(layer - shard_.layer_begin); }

  static constexpr int64_t kAlignment = 16;  // 64 bytes of float

 private:
  int add(std::string name, std::vector<int64_t> full_shape, int layer, bool decay, ShardAxis axis,
          ShardUnit unit, int64_t begin, int64_t count);

  ShardSpec shard_;
  std::vector<TensorSpec> tensors_;
  std::vector<BlockTensors> blocks_;
  int embedding_ = -1, final_norm_ = -1, lm_head_ = -1;
  int64_t total_size_ = 0;
};

}  // namespace malleus::model
