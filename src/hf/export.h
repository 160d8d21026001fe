// Export to the Hugging Face format: model.safetensors with LlamaForCausalLM tensor names (the
// names our ParameterLayout already uses) and a config.json for LlamaConfig, so
// `LlamaForCausalLM.from_pretrained(dir)` loads the model; with a SentencePiece tokenizer also
// tokenizer.model and tokenizer_config.json (LlamaTokenizer), so the directory is a complete
// model. The byte tokenizer has no Hugging Face counterpart: its models get config.json and
// weights only (docs/tokenizers-and-generation.md).
#pragma once

#include <filesystem>

#include "common/json.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace malleus::checkpoint {
struct Checkpoint;
}

namespace malleus::hf {

// Writes <out_dir>/model.safetensors, config.json and the tokenizer files (each atomically). The
// output is a function of the checkpoint's model config, parameters and tokenizer alone, so
// export → import → export gives the same bytes.
void export_hf(const checkpoint::Checkpoint& checkpoint, const std::filesystem::path& out_dir);

// LlamaConfig fields for `config`.
Json hf_config_json(const model::ModelConfig& config);

// LlamaTokenizer settings for a SentencePiece tokenizer used by a model of `config`.
Json hf_tokenizer_config_json(const tokenizer::Tokenizer& tokenizer,
                              const model::ModelConfig& config);

}  // namespace malleus::hf
