// The shape of a LLaMA-style decoder (what Hugging Face calls LlamaConfig), read from a JSON file
// or a built-in preset (the files in configs/models, compiled in).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json.h"

namespace malleus::model {

struct ModelConfig {
  std::string name = "custom";
  int vocab_size = 0;
  int hidden_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;  // grouped-query attention when smaller than num_heads
  int ffn_hidden_size = 0;
  int max_seq_len = 0;
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;  // normal(0, init_std) for weights; residual outputs scaled by 1/sqrt(2L)
  // Special token ids of the tokenizer the model is trained with (LlamaConfig's fields); -1: none
  // or unknown. Set from the training data's tokenizer (train/), or from an imported config.json.
  int bos_token_id = -1;
  int eos_token_id = -1;
  int pad_token_id = -1;

  int head_dim() const { return hidden_size / num_heads; }
  int kv_dim() const { return num_kv_heads * head_dim(); }
  int64_t num_parameters() const;

  // Throws Error naming `source` and the offending key if the shape is impossible.
  void validate(const std::string& source) const;
  static ModelConfig from_json(const Json& json, const std::string& source);
  Json to_json() const;
};

// `name_or_path` is a preset name (see model_preset_names) or a path to a JSON file.
ModelConfig load_model_config(const std::string& name_or_path);
std::vector<std::string> model_preset_names();

}  // namespace malleus::model
