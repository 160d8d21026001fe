#include "hf/export.h"

#include <charconv>
#include <system_error>

#include "checkpoint/checkpoint.h"
#include "common/error.h"
#include "common/files.h"
#include "hf/safetensors.h"
#include "model/parameters.h"

namespace malleus::hf {

using checkpoint::Checkpoint;

namespace {

// The shortest decimal that reads back as `value`: 1e-5f as float is 9.99999974737875e-06 as
// double, and config.json should say 1e-05 like a Python-written one does.
double shortest_decimal(float value) {
  char text[64];
  const auto written = std::to_chars(text, text + sizeof text, value);
  double result = value;
  std::from_chars(text, written.ptr, result);
  return result;
}

}  // namespace

Json hf_config_json(const model::ModelConfig& config) {
  auto id = [](int token) { return token >= 0 ? Json(token) : Json(nullptr); };
  return Json{
      {"architectures", Json::array({"LlamaForCausalLM"})},
      {"model_type", "llama"},
      {"vocab_size", config.vocab_size},
      {"hidden_size", config.hidden_size},
      {"intermediate_size", config.ffn_hidden_size},
      {"num_hidden_layers", config.num_layers},
      {"num_attention_heads", config.num_heads},
      {"num_key_value_heads", config.num_kv_heads},
      {"head_dim", config.head_dim()},
      {"max_position_embeddings", config.max_seq_len},
      {"rms_norm_eps", shortest_decimal(config.norm_eps)},
      {"rope_theta", shortest_decimal(config.rope_theta)},
      {"rope_scaling", nullptr},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", false},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"torch_dtype", "float32"},
      {"initializer_range", shortest_decimal(config.init_std)},
      // null, not absent, where there is none: LlamaConfig would default bos to 1 and eos to 2.
      {"bos_token_id", id(config.bos_token_id)},
      {"eos_token_id", id(config.eos_token_id)},
      {"pad_token_id", id(config.pad_token_id)},
  };
}

Json hf_tokenizer_config_json(const tokenizer::Tokenizer& tokenizer,
                              const model::ModelConfig& config) {
  const tokenizer::SpecialTokens s = tokenizer.special_tokens();
  auto piece = [&](int32_t id) { return id >= 0 ? Json(tokenizer.piece(id)) : Json(nullptr); };
  return Json{
      {"tokenizer_class", "LlamaTokenizer"},
      // Documents in training start with bos and end with eos (tokenizer::encode_document);
      // LlamaTokenizer adds bos, and generation stops at eos.
      {"add_bos_token", s.bos >= 0},
      {"add_eos_token", false},
      {"bos_token", piece(s.bos)},
      {"eos_token", piece(s.eos)},
      {"unk_token", piece(s.unk)},
      {"pad_token", piece(s.pad)},
      // SentencePiece's own behaviour, which is what malleus encodes with.
      {"legacy", true},
      {"clean_up_tokenization_spaces", false},
      {"model_max_length", config.max_seq_len},
      {"sp_model_kwargs", Json::object()},
  };
}

void export_hf(const Checkpoint& checkpoint, const fs::path& out_dir) {
  const std::string where = "export to " + out_dir.string();
  checkpoint.model.validate(where + ": model config");
  const model::ParameterLayout layout(checkpoint.model);
  check(checkpoint.params.size() == static_cast<size_t>(layout.total_size()),
        where + ": params has " + std::to_string(checkpoint.params.size()) +
            " elements, but the parameter layout has " + std::to_string(layout.total_size()));
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  check(!ec, where + ": cannot create " + out_dir.string() + ": " + ec.message());

  std::vector<TensorRef> tensors;
  for (const auto& tensor : layout.tensors()) {
    tensors.push_back({tensor.name, tensor.shape, checkpoint.params.data() + tensor.offset});
  }
  write_safetensors(out_dir / "model.safetensors", tensors);
  write_file_atomic(out_dir / "config.json", hf_config_json(checkpoint.model).dump(2) + "\n");
  const tokenizer::Tokenizer* tok = checkpoint.tokenizer.get();
  if (tok != nullptr && !tok->model_file().empty()) {
    write_file_atomic(out_dir / "tokenizer.model", tok->model_file());
    write_file_atomic(out_dir / "tokenizer_config.json",
                      hf_tokenizer_config_json(*tok, checkpoint.model).dump(2) + "\n");
  } else {
    // An earlier export's tokenizer would be taken for this model's.
    for (const char* stale : {"tokenizer.model", "tokenizer_config.json"}) {
      fs::remove(out_dir / stale, ec);
      check(!ec,
            where + ": cannot remove stale " + (out_dir / stale).string() + ": " + ec.message());
    }
  }
}

}  // namespace malleus::hf
