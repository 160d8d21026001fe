// Export to the Hugging Face format: model.safetensors with LlamaForCausalLM tensor names (the
// names our ParameterLayout already uses) and a config.json for LlamaConfig, so
// `LlamaForCausalLM.from_pretrained(dir)` loads the model.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/json.h"
#include "model/config.h"

namespace malleus::train {

struct Checkpoint;

// Writes <out_dir>/model.safetensors and <out_dir>/config.json (each atomically).
void export_hf(const Checkpoint& checkpoint, const std::filesystem::path& out_dir);

// LlamaConfig fields for `config`.
Json hf_config_json(const model::ModelConfig& config);

struct SafetensorsTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};
// Reads an F32 safetensors file; throws Error naming the file for malformed input.
std::map<std::string, SafetensorsTensor> read_safetensors(const std::filesystem::path& path);

}  // namespace malleus::train
