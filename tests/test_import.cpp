// Hugging Face import: export → import → export is byte-identical (weights, config.json and the
// SentencePiece tokenizer files); sharded BF16 weights are read exactly; configs and weights the
// model cannot represent give errors naming the key (or tensor) and its value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "checkpoint/checkpoint.h"
#include "common/files.h"
#include "hf/export.h"
#include "hf/import.h"
#include "hf/safetensors.h"
#include "model/parameters.h"
#include "model/transformer.h"
#include "test_util.h"

using namespace malleus;
using malleus::testing::error_of;
using malleus::testing::ScratchDir;

namespace {

// A small model with a SentencePiece tokenizer of the same vocabulary, randomly initialised.
checkpoint::Checkpoint sentencepiece_checkpoint() {
  checkpoint::Checkpoint c;
  c.tokenizer = malleus::testing::small_sentencepiece("bpe", 320);
  c.model = model::load_model_config("tiny");
  c.model.vocab_size = 320;
  c.model.bos_token_id = 1;
  c.model.eos_token_id = 2;
  c.model.rope_theta = 500000.0f;
  c.model.norm_eps = 1e-6f;
  auto backend = backend::make_cpu_backend<float>(1);
  model::Transformer<float> m(c.model, *backend, 1, 8);
  m.init_parameters(3);
  c.params.resize(static_cast<size_t>(m.layout().total_size()));
  backend->copy_to_host(c.params.data(), m.params(), c.params.size());
  c.train_config = Json::object();
  return c;
}

void expect_same_files(const fs::path& a, const fs::path& b) {
  size_t count = 0;
  for (const auto& entry : fs::directory_iterator(a)) {
    const auto name = entry.path().filename();
    ASSERT_TRUE(fs::exists(b / name)) << name;
    EXPECT_TRUE(read_file(entry.path()) == read_file(b / name)) << name << " differs";
    ++count;
  }
  EXPECT_EQ(count, static_cast<size_t>(
                       std::distance(fs::directory_iterator(b), fs::directory_iterator())));
}

// An HF directory written by hand: config.json plus the model's tensors.
void write_hf(const fs::path& dir, const Json& config, const std::vector<hf::TensorRef>& t) {
  fs::create_directories(dir);
  write_file_atomic(dir / "config.json", config.dump(2));
  hf::write_safetensors(dir / "model.safetensors", t);
}

std::vector<hf::TensorRef> tensor_refs(const checkpoint::Checkpoint& c) {
  std::vector<hf::TensorRef> refs;
  const model::ParameterLayout layout(c.model);
  for (const auto& spec : layout.tensors()) {
    refs.push_back({spec.name, spec.shape, c.params.data() + spec.offset});
  }
  return refs;
}

void expect_error(const std::function<void()>& f, std::initializer_list<std::string> parts) {
  const std::string message = error_of(f);
  EXPECT_FALSE(message.empty()) << "no error";
  for (const auto& part : parts) EXPECT_NE(message.find(part), std::string::npos) << message;
}

}  // namespace

TEST(Import, ExportImportExportIsByteIdentical) {
  ScratchDir dir;
  const checkpoint::Checkpoint original = sentencepiece_checkpoint();
  hf::export_hf(original, dir / "first");
  for (const char* file :
       {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"}) {
    EXPECT_TRUE(fs::exists(dir / "first" / file)) << file;
  }
  const Json tokenizer_config = read_json_file((dir / "first" / "tokenizer_config.json").string());
  EXPECT_EQ(tokenizer_config["tokenizer_class"], "LlamaTokenizer");
  EXPECT_EQ(tokenizer_config["bos_token"], "<s>");
  EXPECT_EQ(tokenizer_config["eos_token"], "</s>");
  EXPECT_EQ(tokenizer_config["unk_token"], "<unk>");
  EXPECT_TRUE(tokenizer_config["pad_token"].is_null());

  const hf::ImportResult imported = hf::import_hf(dir / "first");
  EXPECT_TRUE(imported.ignored.empty());
  EXPECT_EQ(imported.dtype, "F32");
  const checkpoint::Checkpoint& c = imported.checkpoint;
  EXPECT_EQ(c.params, original.params);
  EXPECT_EQ(c.step, 0);
  EXPECT_EQ(c.adam_m, std::vector<float>(c.params.size(), 0.0f));  // a fresh optimizer
  ASSERT_NE(c.tokenizer, nullptr);
  EXPECT_TRUE(tokenizer::same_tokenizer(*c.tokenizer, *original.tokenizer));
  EXPECT_EQ(c.model.bos_token_id, 1);
  EXPECT_EQ(c.model.rope_theta, 500000.0f);

  // Through a saved checkpoint too, as `malleus import` then `malleus export` do.
  checkpoint::save_checkpoint(dir / "ckpt", c);
  hf::export_hf(checkpoint::load_checkpoint(dir / "ckpt", false), dir / "second");
  expect_same_files(dir / "first", dir / "second");
}

TEST(Import, ShardedBf16WeightsAreReadExactly) {
  ScratchDir dir;
  checkpoint::Checkpoint c = sentencepiece_checkpoint();
  c.tokenizer = nullptr;
  // Weights representable in bf16, so reading them must give them back exactly.
  for (float& x : c.params) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits &= 0xffff0000u;
    std::memcpy(&x, &bits, 4);
  }
  const auto layout = model::ParameterLayout(c.model);
  fs::create_directories(dir / "hf");
  Json config = hf::hf_config_json(c.model);
  config["torch_dtype"] = "bfloat16";
  config["transformers_version"] = "4.40.0";
  config["some_future_flag"] = true;
  write_file_atomic(dir / "hf" / "config.json", config.dump(2));
  // Two shards, tensors split between them, each stored as BF16 by hand.
  Json weight_map = Json::object();
  const auto& specs = layout.tensors();
  for (int shard = 0; shard < 2; ++shard) {
    const std::string name = "model-0000" + std::to_string(shard + 1) + "-of-00002.safetensors";
    nlohmann::ordered_json header;
    std::string data;
    for (size_t i = shard == 0 ? 0 : specs.size() / 2;
         i < (shard == 0 ? specs.size() / 2 : specs.size()); ++i) {
      const auto& spec = specs[i];
      const size_t begin = data.size();
      for (int64_t e = 0; e < spec.size; ++e) {
        uint32_t bits;
        std::memcpy(&bits, &c.params[static_cast<size_t>(spec.offset + e)], 4);
        const auto upper = static_cast<uint16_t>(bits >> 16);
        data.append(reinterpret_cast<const char*>(&upper), 2);
      }
      header[spec.name] = {
          {"dtype", "BF16"}, {"shape", spec.shape}, {"data_offsets", {begin, data.size()}}};
      weight_map[spec.name] = name;
    }
    const std::string text = header.dump();
    std::string bytes(8, '\0');
    for (size_t i = 0; i < 8; ++i) bytes[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
    write_file_atomic(dir / "hf" / name, bytes + text + data);
  }
  write_file_atomic(dir / "hf" / "model.safetensors.index.json",
                    Json{{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}.dump());
  const hf::ImportResult imported = hf::import_hf(dir / "hf");
  EXPECT_EQ(imported.dtype, "BF16");
  EXPECT_EQ(imported.checkpoint.params, c.params);
  EXPECT_EQ(imported.checkpoint.tokenizer, nullptr);  // no tokenizer.model in the directory
  ASSERT_EQ(imported.ignored.size(), 1u);             // keys it does not know are reported
  EXPECT_NE(imported.ignored[0].find("some_future_flag"), std::string::npos);

  // A shard the index names but the directory lacks.
  fs::remove(dir / "hf" / "model-00002-of-00002.safetensors");
  expect_error([&] { hf::import_hf(dir / "hf"); }, {"model-00002-of-00002.safetensors"});
}

TEST(Import, UnsupportedConfigsNameTheKeyAndValue) {
  ScratchDir dir;
  const checkpoint::Checkpoint c = sentencepiece_checkpoint();
  const Json base = hf::hf_config_json(c.model);
  const std::vector<std::tuple<std::string, Json, std::string>> cases = {
      {"architectures", Json::array({"MistralForCausalLM"}), "MistralForCausalLM"},
      {"model_type", "gpt2", "gpt2"},
      {"attention_bias", true, "biases"},
      {"mlp_bias", true, "biases"},
      {"tie_word_embeddings", true, "tied"},
      {"rope_scaling", Json{{"type", "linear"}, {"factor", 2.0}}, "linear"},
      {"hidden_act", "gelu", "gelu"},
      {"head_dim", 16, "16"},
      {"sliding_window", 4096, "4096"},
      {"eos_token_id", Json::array({2, 3}), "[2,3]"},
      {"num_attention_heads", 5, "(5)"},  // malleus's validation: heads must divide hidden_size
  };
  for (const auto& [key, value, shown] : cases) {
    Json config = base;
    config[key] = value;
    if (key == "num_attention_heads") config.erase("head_dim");
    write_hf(dir / "hf", config, tensor_refs(c));
    expect_error([&] { hf::import_hf(dir / "hf"); },
                 {"config.json", key == "num_attention_heads" ? "num_heads" : key, shown});
  }
}

TEST(Import, UnsupportedOrMissingWeightsAreNamed) {
  ScratchDir dir;
  const checkpoint::Checkpoint c = sentencepiece_checkpoint();
  const Json config = hf::hf_config_json(c.model);
  auto refs = tensor_refs(c);
  // An attention bias the model has no place for.
  const std::vector<float> bias(32, 0.5f);
  auto with_bias = refs;
  with_bias.push_back({"model.layers.0.self_attn.q_proj.bias", {32}, bias.data()});
  write_hf(dir / "hf", config, with_bias);
  expect_error([&] { hf::import_hf(dir / "hf"); },
               {"model.layers.0.self_attn.q_proj.bias", "biases are not supported"});
  // A missing LM head (as a tied-embedding model would store it).
  auto without_head = refs;
  without_head.pop_back();
  write_hf(dir / "hf", config, without_head);
  expect_error([&] { hf::import_hf(dir / "hf"); }, {"lm_head.weight", "missing"});
  // A shape that disagrees with config.json.
  auto wrong = refs;
  wrong[0].shape = {32, 320};
  write_hf(dir / "hf", config, wrong);
  expect_error([&] { hf::import_hf(dir / "hf"); },
               {"model.embed_tokens.weight", "[32, 320]", "[320, 32]"});
  // Old conversions' rotary buffers are ignored, not refused.
  auto with_inv_freq = refs;
  const std::vector<float> inv_freq(4, 1.0f);
  with_inv_freq.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {4}, inv_freq.data()});
  write_hf(dir / "hf", config, with_inv_freq);
  EXPECT_EQ(hf::import_hf(dir / "hf").ignored.size(), 1u);
  // Not a model directory at all; a bad tokenizer.model.
  expect_error([&] { hf::import_hf(dir / "nowhere"); }, {"nowhere", "no such directory"});
  write_file_atomic(dir / "hf" / "tokenizer.model", "not a model");
  expect_error([&] { hf::import_hf(dir / "hf"); }, {"tokenizer.model"});
  fs::remove(dir / "hf" / "model.safetensors");
  expect_error([&] { hf::import_hf(dir / "hf"); }, {"model.safetensors"});
}

// NaN or infinite weights are refused, naming the file, the tensor and the first bad element by its
// index in the tensor's shape (they imported without a word before: issue 27).
TEST(Import, NonFiniteWeightsAreRefusedNamingTheTensorAndIndex) {
  ScratchDir dir;
  checkpoint::Checkpoint c = sentencepiece_checkpoint();
  const Json config = hf::hf_config_json(c.model);
  const model::ParameterLayout layout(c.model);
  const auto& spec = layout.tensors()[2];  // a [rows, columns] weight of layer 0
  ASSERT_EQ(spec.shape.size(), 2u);
  const int64_t columns = spec.shape[1];
  c.params[static_cast<size_t>(spec.offset + 2 * columns + 5)] = std::nanf("");
  c.params[static_cast<size_t>(spec.offset + 3 * columns)] = INFINITY;
  write_hf(dir / "hf", config, tensor_refs(c));
  expect_error([&] { hf::import_hf(dir / "hf"); },
               {(dir / "hf" / "model.safetensors").string(), "tensor \"" + spec.name + "\"",
                "holds NaN at index [2, 5]", "the first of 2 non-finite"});
  c.params[static_cast<size_t>(spec.offset + 2 * columns + 5)] = 0.5f;
  write_hf(dir / "hf", config, tensor_refs(c));
  expect_error([&] { hf::import_hf(dir / "hf"); }, {"holds +inf at index [3, 0]"});
}
