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

struct TensorSpec {
  std::string name;  // Hugging Face LlamaForCausalLM name, e.g. "model.layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in elements, into the flat buffers
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
  explicit ParameterLayout(const ModelConfig& config);

  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const TensorSpec& tensor(int index) const { return tensors_.at(index); }
  // Throws Error if no tensor has this name.
  const TensorSpec& find(const std::string& name) const;
  // Elements in each flat buffer (tensors are aligned to kAlignment elements; the gaps stay zero).
  int64_t total_size() const { return total_size_; }
  int64_t num_parameters() const;

  int embedding() const { return embedding_; }
  int final_norm() const { return final_norm_; }
  int lm_head() const { return lm_head_; }
  const BlockTensors& block(int layer) const { return blocks_.at(layer); }

  static constexpr int64_t kAlignment = 16;  // 64 bytes of float

 private:
  int add(std::string name, std::vector<int64_t> shape, int layer, bool decay, ShardAxis axis,
          ShardUnit unit);

  std::vector<TensorSpec> tensors_;
  std::vector<BlockTensors> blocks_;
  int embedding_ = -1, final_norm_ = -1, lm_head_ = -1;
  int64_t total_size_ = 0;
};

}  // namespace malleus::model
