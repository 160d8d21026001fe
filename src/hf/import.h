// Import from the Hugging Face format: a LlamaForCausalLM directory (config.json, and
// model.safetensors or a sharded model.safetensors.index.json, in F32, BF16 or F16; tokenizer.model
// when present) becomes a malleus checkpoint. Export's inverse: export → import → export gives the
// same bytes.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/json.h"
#include "model/config.h"

namespace malleus::hf {

struct ImportResult {
  // Step 0 with zeroed Adam moments (the state of a fresh optimizer), so `train --resume` on it
  // continues from the imported weights with a new optimizer and LR schedule.
  checkpoint::Checkpoint checkpoint;
  std::vector<std::string> ignored;  // config.json keys and tensors read but not needed
  std::string dtype;                 // of the weights as stored ("F32", "BF16", "F16", or mixed)
};

// The model config of a LlamaConfig. Throws Error naming `source`, the key and its value for what
// malleus's model cannot represent: other architectures, biases, tied embeddings, rope scaling,
// a head_dim other than hidden_size / num_attention_heads, another activation, sliding windows.
// Keys it does not know are listed in `ignored`.
model::ModelConfig model_config_from_hf(const Json& config, const std::string& source,
                                        std::vector<std::string>& ignored);

// Throws Error naming the file and tensor for missing or misshapen tensors and unknown extra ones.
ImportResult import_hf(const std::filesystem::path& dir);

}  // namespace malleus::hf
