#include "hf/import.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <system_error>

#include "common/error.h"
#include "common/files.h"
#include "hf/safetensors.h"
#include "model/parameters.h"
#include "train/config.h"

namespace malleus::hf {

using checkpoint::Checkpoint;
using train::TrainConfig;

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Keys of a LlamaConfig (and of every Hugging Face PretrainedConfig) that do not change the
// model's math.
const std::set<std::string>& harmless_keys() {
  static const std::set<std::string> keys = {
      "_name_or_path",     "transformers_version", "torch_dtype",
      "use_cache",         "pretraining_tp",       "attention_dropout",
      "output_attentions", "output_hidden_states", "return_dict"};
  return keys;
}

[[noreturn]] void refuse(const Json& config, const std::string& source, const std::string& key,
                         const std::string& why) {
  throw Error(source + ": \"" + key + "\" is " + config.at(key).dump() + ": " + why);
}

// What malleus's model is: anything else is refused before the shape is read.
void check_supported(const Json& config, const std::string& source) {
  if (config.contains("architectures")) {
    const Json& a = config["architectures"];
    if (!(a.is_array() && a.size() == 1 && a[0] == "LlamaForCausalLM")) {
      refuse(config, source, "architectures", "only [\"LlamaForCausalLM\"] can be imported");
    }
  }
  if (config.contains("model_type") && config["model_type"] != "llama") {
    refuse(config, source, "model_type", "only \"llama\" can be imported");
  }
  auto must_be = [&](const std::string& key, const Json& allowed, const std::string& why) {
    if (config.contains(key) && config[key] != allowed) refuse(config, source, key, why);
  };
  must_be("hidden_act", "silu", "malleus's MLP is SwiGLU (silu)");
  must_be("attention_bias", false, "malleus's attention projections have no biases");
  must_be("mlp_bias", false, "malleus's MLP projections have no biases");
  must_be("tie_word_embeddings", false,
          "malleus keeps the LM head apart from the embedding (tied weights are not supported)");
  must_be("rope_scaling", nullptr, "rotary embedding scaling is not supported");
  must_be("sliding_window", nullptr, "sliding-window attention is not supported");
  must_be("partial_rotary_factor", 1.0, "malleus rotates the whole head dimension");
}

// The model's shape, norms, rotary base and special tokens.
model::ModelConfig read_model_fields(const Json& config, const std::string& source) {
  JsonReader r(config, source);  // typed reads with named errors; unknown keys are listed apart
  model::ModelConfig c;
  c.vocab_size = r.required<int>("vocab_size");
  c.hidden_size = r.required<int>("hidden_size");
  c.ffn_hidden_size = r.required<int>("intermediate_size");
  c.num_layers = r.required<int>("num_hidden_layers");
  c.num_heads = r.required<int>("num_attention_heads");
  c.num_kv_heads = r.optional<int>("num_key_value_heads", c.num_heads);
  c.max_seq_len = r.optional<int>("max_position_embeddings", 2048);
  c.norm_eps = r.optional<float>("rms_norm_eps", 1e-6f);
  c.rope_theta = r.optional<float>("rope_theta", 10000.0f);
  c.init_std = r.optional<float>("initializer_range", 0.02f);
  for (const auto& [key, field] : {std::pair{"bos_token_id", &c.bos_token_id},
                                   {"eos_token_id", &c.eos_token_id},
                                   {"pad_token_id", &c.pad_token_id}}) {
    if (!config.contains(key) || config[key].is_null()) continue;  // stays -1: none
    if (!config[key].is_number_integer())
      refuse(config, source, key, "expected one token id or null");
    *field = r.required<int>(key);
  }
  if (config.contains("head_dim") && !config["head_dim"].is_null() && c.num_heads > 0 &&
      config["head_dim"] != c.hidden_size / c.num_heads) {
    refuse(config, source, "head_dim",
           "malleus's head dimension is hidden_size / num_attention_heads (" +
               std::to_string(c.hidden_size / c.num_heads) + ")");
  }
  return c;
}

// The keys that check_supported and read_model_fields read.
const std::set<std::string>& handled_keys() {
  static const std::set<std::string> keys = {"architectures",
                                             "model_type",
                                             "hidden_act",
                                             "attention_bias",
                                             "mlp_bias",
                                             "tie_word_embeddings",
                                             "rope_scaling",
                                             "sliding_window",
                                             "partial_rotary_factor",
                                             "head_dim",
                                             "vocab_size",
                                             "hidden_size",
                                             "intermediate_size",
                                             "num_hidden_layers",
                                             "num_attention_heads",
                                             "num_key_value_heads",
                                             "max_position_embeddings",
                                             "rms_norm_eps",
                                             "rope_theta",
                                             "initializer_range",
                                             "bos_token_id",
                                             "eos_token_id",
                                             "pad_token_id"};
  return keys;
}

}  // namespace

model::ModelConfig model_config_from_hf(const Json& config, const std::string& source,
                                        std::vector<std::string>& ignored) {
  check(config.is_object(), source + ": not a JSON object");
  check_supported(config, source);
  model::ModelConfig c = read_model_fields(config, source);
  for (const auto& [key, value] : config.items()) {
    if (!handled_keys().contains(key) && !harmless_keys().contains(key)) {
      ignored.push_back(source + " key \"" + key + "\" (" + value.dump() + ")");
    }
  }
  c.validate(source);
  return c;
}

namespace {

// NaN or infinite weights would train to NaN (and evaluate to a loss of nan): refused, naming the
// first such element by its index in the tensor's shape.
void check_finite(const SafetensorsTensor& tensor, const std::string& source) {
  const auto bad = std::find_if(tensor.data.begin(), tensor.data.end(),
                                [](float x) { return !std::isfinite(x); });
  if (bad == tensor.data.end()) return;
  auto flat = static_cast<int64_t>(bad - tensor.data.begin());
  std::vector<int64_t> index(tensor.shape.size());
  for (size_t d = tensor.shape.size(); d-- > 0;) {
    index[d] = tensor.shape[d] > 0 ? flat % tensor.shape[d] : 0;
    flat = tensor.shape[d] > 0 ? flat / tensor.shape[d] : 0;
  }
  throw Error(source + " holds " +
              (std::isnan(*bad) ? "NaN"
               : *bad > 0       ? "+inf"
                                : "-inf") +
              " at index " + shape_text(index) + " (the first of " +
              std::to_string(std::count_if(tensor.data.begin(), tensor.data.end(),
                                           [](float x) { return !std::isfinite(x); })) +
              " non-finite weights): a model with such weights cannot be trained or evaluated");
}

// The weights' files: model.safetensors, or the shards that model.safetensors.index.json names.
std::vector<fs::path> weight_files(const fs::path& dir, const std::string& where) {
  std::error_code ec;
  if (fs::exists(dir / "model.safetensors", ec)) return {dir / "model.safetensors"};
  const fs::path index_path = dir / "model.safetensors.index.json";
  check(fs::exists(index_path, ec),
        where +
            ": neither model.safetensors nor model.safetensors.index.json (only "
            "safetensors weights are read)");
  const Json index = read_json_file(index_path.string());
  check(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
        index_path.string() + ": no \"weight_map\" object");
  std::set<std::string> names;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    check(file.is_string(), index_path.string() + ": weight_map[\"" + tensor + "\"] is " +
                                file.dump() + ", not a file name");
    const std::string name = file.get<std::string>();
    check(fs::path(name).filename() == name,
          index_path.string() + ": shard \"" + name + "\" is not a file in " + dir.string());
    names.insert(name);
  }
  std::vector<fs::path> files;
  for (const auto& name : names) files.push_back(dir / name);
  return files;
}

// Every tensor of the weights' files, and the file each came from.
struct Weights {
  std::map<std::string, SafetensorsTensor> tensors;
  std::map<std::string, std::string> file_of;
};

Weights read_weights(const std::vector<fs::path>& files, const std::string& where) {
  Weights w;
  for (const auto& file : files) {
    for (auto& [name, tensor] : read_safetensors(file)) {
      check(!w.tensors.contains(name), where + ": tensor \"" + name + "\" is in both " +
                                           w.file_of[name] + " and " + file.string());
      w.file_of[name] = file.string();
      w.tensors.emplace(name, std::move(tensor));
    }
  }
  return w;
}

// Copies each tensor of the layout from the weights into `params` (checked: present, of its
// shape, finite); of the tensors left over, RoPE's inverse frequencies are listed in `ignored`
// and anything else is refused. Returns the weights' dtype ("mixed" if several).
std::string place_weights(const model::ParameterLayout& layout, Weights& w,
                          std::vector<float>& params, const std::string& where,
                          std::vector<std::string>& ignored) {
  params.assign(static_cast<size_t>(layout.total_size()), 0.0f);
  std::set<std::string> dtypes;
  for (const auto& spec : layout.tensors()) {
    const auto it = w.tensors.find(spec.name);
    check(it != w.tensors.end(), where + ": tensor \"" + spec.name + "\" " +
                                     shape_text(spec.shape) + " is missing from the weights");
    const std::string& file = w.file_of[spec.name];
    check(it->second.shape == spec.shape,
          file + ": tensor \"" + spec.name + "\" has shape " + shape_text(it->second.shape) +
              ", but config.json implies " + shape_text(spec.shape));
    check_finite(it->second, file + ": tensor \"" + spec.name + "\"");
    std::copy(it->second.data.begin(), it->second.data.end(), params.begin() + spec.offset);
    dtypes.insert(it->second.dtype);
    w.tensors.erase(it);
  }
  for (const auto& [name, tensor] : w.tensors) {
    // Old LLaMA conversions saved RoPE's inverse frequencies, which malleus computes itself.
    if (name.ends_with(".rotary_emb.inv_freq")) {
      ignored.push_back(w.file_of[name] + " tensor \"" + name + "\"");
      continue;
    }
    throw Error(w.file_of[name] + ": tensor \"" + name + "\" " + shape_text(tensor.shape) +
                " has no place in malleus's LLaMA model" +
                (name.ends_with(".bias") ? " (biases are not supported)" : ""));
  }
  return dtypes.size() == 1 ? *dtypes.begin() : "mixed";
}

// A training config to continue with: the defaults, at a sequence length the model takes.
Json continuing_config(const model::ModelConfig& model) {
  TrainConfig train;
  train.model = model.name;
  train.seq_len = std::min(train.seq_len, model.max_seq_len);
  train.out_dir = "runs/" + model.name;
  return train.to_json();
}

}  // namespace

ImportResult import_hf(const fs::path& dir) {
  const std::string where = "import " + dir.string();
  std::error_code ec;
  check(fs::is_directory(dir, ec), where + ": no such directory");
  check(fs::is_regular_file(dir / "config.json", ec), where + ": no config.json");
  ImportResult result;
  const model::ModelConfig model =
      model_config_from_hf(read_json_file((dir / "config.json").string()),
                           (dir / "config.json").string(), result.ignored);
  Weights weights = read_weights(weight_files(dir, where), where);

  Checkpoint& checkpoint = result.checkpoint;
  checkpoint.model = model;
  checkpoint.model.name =
      dir.filename().empty() ? dir.parent_path().filename().string() : dir.filename().string();
  result.dtype = place_weights(model::ParameterLayout(model), weights, checkpoint.params, where,
                               result.ignored);
  checkpoint.adam_m.assign(checkpoint.params.size(), 0.0f);
  checkpoint.adam_v.assign(checkpoint.params.size(), 0.0f);

  if (fs::exists(dir / "tokenizer.model", ec)) {
    checkpoint.tokenizer = tokenizer::load_tokenizer((dir / "tokenizer.model").string());
    check(checkpoint.tokenizer->vocab_size() <= model.vocab_size,
          where + ": tokenizer.model has " + std::to_string(checkpoint.tokenizer->vocab_size()) +
              " tokens, more than the model's vocab_size " + std::to_string(model.vocab_size));
  }
  checkpoint.train_config = continuing_config(checkpoint.model);
  return result;
}

}  // namespace malleus::hf
