#include "model/config.h"

#include <filesystem>
#include <map>

#include "common/error.h"

namespace malleus::model {

// Generated at configure time from configs/models/*.json (see src/model/CMakeLists.txt).
const std::map<std::string, std::string>& embedded_model_presets();

int64_t ModelConfig::num_parameters() const {
  const int64_t c = hidden_size, f = ffn_hidden_size, kv = kv_dim();
  const int64_t per_layer = 2 * c + c * c /*q*/ + 2 * c * kv /*k,v*/ + c * c /*o*/ + 3 * c * f;
  return num_layers * per_layer + c /*final norm*/ + 2 * int64_t{vocab_size} * c /*embed, head*/;
}

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](const char* key, double value) {
    check(value > 0,
          source + ": \"" + key + "\" must be positive (got " + std::to_string(value) + ")");
  };
  positive("vocab_size", vocab_size);
  positive("hidden_size", hidden_size);
  positive("num_layers", num_layers);
  positive("num_heads", num_heads);
  positive("num_kv_heads", num_kv_heads);
  positive("ffn_hidden_size", ffn_hidden_size);
  positive("max_seq_len", max_seq_len);
  positive("rope_theta", rope_theta);
  positive("norm_eps", norm_eps);
  positive("init_std", init_std);
  check(hidden_size % num_heads == 0, source + ": \"num_heads\" (" + std::to_string(num_heads) +
                                          ") must divide \"hidden_size\" (" +
                                          std::to_string(hidden_size) + ")");
  check(num_heads % num_kv_heads == 0,
        source + ": \"num_kv_heads\" (" + std::to_string(num_kv_heads) +
            ") must divide \"num_heads\" (" + std::to_string(num_heads) + ")");
  check(head_dim() % 2 == 0, source + ": head dimension hidden_size/num_heads (" +
                                 std::to_string(head_dim()) +
                                 ") must be even for rotary embedding");
  for (const auto& [key, id] : {std::pair{"bos_token_id", bos_token_id},
                                {"eos_token_id", eos_token_id},
                                {"pad_token_id", pad_token_id}}) {
    check(id >= -1 && id < vocab_size, source + ": \"" + key + "\" (" + std::to_string(id) +
                                           ") must be -1 (none) or a token id below vocab_size (" +
                                           std::to_string(vocab_size) + ")");
  }
}

ModelConfig ModelConfig::from_json(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  ModelConfig c;
  c.name = r.optional<std::string>("name", c.name);
  c.vocab_size = r.required<int>("vocab_size");
  c.hidden_size = r.required<int>("hidden_size");
  c.num_layers = r.required<int>("num_layers");
  c.num_heads = r.required<int>("num_heads");
  c.num_kv_heads = r.optional<int>("num_kv_heads", c.num_heads);
  c.ffn_hidden_size = r.required<int>("ffn_hidden_size");
  c.max_seq_len = r.required<int>("max_seq_len");
  c.rope_theta = r.optional<float>("rope_theta", c.rope_theta);
  c.norm_eps = r.optional<float>("norm_eps", c.norm_eps);
  c.init_std = r.optional<float>("init_std", c.init_std);
  c.bos_token_id = r.optional<int>("bos_token_id", c.bos_token_id);
  c.eos_token_id = r.optional<int>("eos_token_id", c.eos_token_id);
  c.pad_token_id = r.optional<int>("pad_token_id", c.pad_token_id);
  r.finish();
  c.validate(source);
  return c;
}

Json ModelConfig::to_json() const {
  Json json{{"name", name},
            {"vocab_size", vocab_size},
            {"hidden_size", hidden_size},
            {"num_layers", num_layers},
            {"num_heads", num_heads},
            {"num_kv_heads", num_kv_heads},
            {"ffn_hidden_size", ffn_hidden_size},
            {"max_seq_len", max_seq_len},
            {"rope_theta", rope_theta},
            {"norm_eps", norm_eps},
            {"init_std", init_std}};
  // Only when known, so configs of models without a tokenizer read as they always did.
  if (bos_token_id >= 0) json["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) json["eos_token_id"] = eos_token_id;
  if (pad_token_id >= 0) json["pad_token_id"] = pad_token_id;
  return json;
}

ModelConfig load_model_config(const std::string& name_or_path) {
  const auto& presets = embedded_model_presets();
  if (auto it = presets.find(name_or_path); it != presets.end()) {
    std::string source = "model preset \"" + name_or_path + "\"";
    return ModelConfig::from_json(parse_json(it->second, source), source);
  }
  if (!std::filesystem::exists(name_or_path)) {
    std::string names;
    for (const auto& [name, text] : presets) names += " " + name;
    throw Error("model \"" + name_or_path + "\" is neither a preset (" + names.substr(1) +
                ") nor an existing file");
  }
  return ModelConfig::from_json(read_json_file(name_or_path), name_or_path);
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, text] : embedded_model_presets()) names.push_back(name);
  return names;
}

}  // namespace malleus::model
