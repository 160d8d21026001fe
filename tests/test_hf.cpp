// The Hugging Face export read back by our safetensors reader and by the independent NumPy
// reference (tests/hf_llama_reference.py), and the reader's refusal of damaged files.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint_samples.h"
#include "common/error.h"
#include "common/files.h"
#include "common/json.h"
#include "hf/export.h"
#include "hf/safetensors.h"
#include "model/config.h"
#include "model/parameters.h"
#include "test_util.h"

namespace malleus::hf {
namespace {

namespace fs = std::filesystem;
using namespace malleus::testing::checkpoints;

// ---------------------------------------------------------------------------------------------
// Hugging Face export

uint64_t header_length(const std::string& bytes) {
  uint64_t n = 0;
  for (size_t i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  return n;
}

// A safetensors file from a header text and data bytes, header padded like ours.
std::string safetensors_bytes(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (size_t i = 0; i < 8; ++i) {
    bytes[i] = static_cast<char>((uint64_t{header.size()} >> (8 * i)) & 0xff);
  }
  return bytes + header + data;
}

TEST(Export, SafetensorsRoundTripIsBitIdentical) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(30);
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const auto tensors = read_safetensors(out / "model.safetensors");
  const model::ParameterLayout layout(c.model);
  ASSERT_EQ(tensors.size(), layout.tensors().size());
  for (const auto& spec : layout.tensors()) {
    const auto it = tensors.find(spec.name);
    ASSERT_NE(it, tensors.end()) << spec.name;
    EXPECT_EQ(it->second.shape, spec.shape) << spec.name;
    ASSERT_EQ(it->second.data.size(), static_cast<size_t>(spec.size)) << spec.name;
    EXPECT_EQ(std::memcmp(it->second.data.data(), c.params.data() + spec.offset,
                          it->second.data.size() * sizeof(float)),
              0)
        << spec.name;
  }
  EXPECT_TRUE(tensors.count("lm_head.weight") && tensors.count("model.embed_tokens.weight") &&
              tensors.count("model.layers.1.mlp.down_proj.weight") &&
              tensors.count("model.norm.weight"));
}

TEST(Export, SafetensorsFileLayout) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(31);
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const std::string bytes = read_file(out / "model.safetensors");
  ASSERT_GE(bytes.size(), 8u);
  const uint64_t n = header_length(bytes);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, bytes.size());
  const std::string text = bytes.substr(8, n);
  EXPECT_EQ(text.front(), '{');
  EXPECT_EQ(text.find_last_not_of(' '), text.rfind('}'));
  const auto header = nlohmann::ordered_json::parse(text);

  const model::ParameterLayout layout(c.model);
  auto it = header.begin();
  ASSERT_EQ(it.key(), "__metadata__");
  EXPECT_EQ(it.value(), (nlohmann::ordered_json{{"format", "pt"}}));
  int64_t offset = 0;
  for (const auto& spec : layout.tensors()) {
    ++it;
    ASSERT_NE(it, header.end());
    EXPECT_EQ(it.key(), spec.name);  // layout order
    EXPECT_EQ(it.value()["dtype"], "F32");
    EXPECT_EQ(it.value()["shape"].get<std::vector<int64_t>>(), spec.shape);
    EXPECT_EQ(it.value()["data_offsets"].get<std::vector<int64_t>>(),
              (std::vector<int64_t>{offset, offset + spec.size * 4}));
    offset += spec.size * 4;
  }
  EXPECT_EQ(bytes.size(), 8 + n + static_cast<uint64_t>(offset));
  EXPECT_TRUE(leftovers(out, {"model.safetensors", "config.json"}).empty());
}

TEST(Export, ConfigJsonHasLlamaConfigFields) {
  TempDir tmp;
  const Checkpoint c = make_checkpoint(32, /*with_optimizer=*/false);
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const Json config = read_json_file((out / "config.json").string());
  EXPECT_EQ(config, hf_config_json(c.model));
  EXPECT_EQ(config["architectures"], Json::array({"LlamaForCausalLM"}));
  EXPECT_EQ(config["model_type"], "llama");
  EXPECT_EQ(config["vocab_size"], 257);
  EXPECT_EQ(config["hidden_size"], 32);
  EXPECT_EQ(config["intermediate_size"], 64);
  EXPECT_EQ(config["num_hidden_layers"], 2);
  EXPECT_EQ(config["num_attention_heads"], 4);
  EXPECT_EQ(config["num_key_value_heads"], 2);
  EXPECT_EQ(config["head_dim"], 8);
  EXPECT_EQ(config["max_position_embeddings"], 64);
  // The decimal a Python config would hold, not float 1e-5 widened to double.
  EXPECT_EQ(config["rms_norm_eps"].get<double>(), 1e-5);
  EXPECT_EQ(config["rope_theta"].get<double>(), 10000.0);
  EXPECT_EQ(config["initializer_range"].get<double>(), 0.02);
  EXPECT_EQ(config["hidden_act"], "silu");
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_EQ(config["attention_bias"], false);
  EXPECT_EQ(config["mlp_bias"], false);
  EXPECT_EQ(config["torch_dtype"], "float32");
  // Special ids come from the model config: none known here.
  EXPECT_TRUE(config["bos_token_id"].is_null());
  EXPECT_TRUE(config["eos_token_id"].is_null());
  EXPECT_TRUE(config["pad_token_id"].is_null());
  EXPECT_FALSE(fs::exists(out / "tokenizer.model"));  // no tokenizer recorded, none written

  model::ModelConfig byte_model = c.model;
  byte_model.eos_token_id = 256;  // what a run on byte-tokenized data records
  EXPECT_EQ(hf_config_json(byte_model)["eos_token_id"], 256);
  EXPECT_TRUE(hf_config_json(byte_model)["bos_token_id"].is_null());
}

TEST(Export, OverwritesAnEarlierExport) {
  TempDir tmp;
  const fs::path out = tmp.path() / "hf";
  export_hf(make_checkpoint(33), out);
  const Checkpoint second = make_checkpoint(34);
  export_hf(second, out);
  const auto tensors = read_safetensors(out / "model.safetensors");
  const auto& embed = tensors.at("model.embed_tokens.weight");
  EXPECT_EQ(std::memcmp(embed.data.data(), second.params.data(), embed.data.size() * sizeof(float)),
            0);
  EXPECT_TRUE(leftovers(out, {"model.safetensors", "config.json"}).empty());

  Checkpoint bad = second;
  bad.params.pop_back();
  EXPECT_CONTAINS(error_of([&] { export_hf(bad, out); }), "params has");
}

TEST(Safetensors, RefusesTruncatedFiles) {
  TempDir tmp;
  const fs::path out = tmp.path() / "hf";
  export_hf(make_checkpoint(35), out);
  const std::string bytes = read_file(out / "model.safetensors");
  const uint64_t n = header_length(bytes);
  const fs::path cut = tmp.path() / "cut.safetensors";
  const std::vector<std::pair<size_t, std::string>> cases = {
      {0, "too short"},
      {5, "too short"},
      {8 + n / 2, "beyond the end of the file"},
      {8 + n, "out of range"},
      {8 + n + 100, "out of range"},
      {bytes.size() - 1, "out of range"},
  };
  for (const auto& [size, expected] : cases) {
    write_file_atomic(cut, bytes.substr(0, size));
    const std::string message = error_of([&] { read_safetensors(cut); });
    EXPECT_CONTAINS(message, cut.string());
    EXPECT_CONTAINS(message, expected);
  }
  EXPECT_CONTAINS(error_of([&] { read_safetensors(tmp.path() / "missing.safetensors"); }),
                  "missing.safetensors");
}

TEST(Safetensors, RefusesMalformedHeaders) {
  TempDir tmp;
  const fs::path path = tmp.path() / "bad.safetensors";
  const std::string data(24, '\0');  // six floats
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"a": {"dtype": "F32", "shape": [2, 3], )", "malformed JSON"},
      {R"([1, 2])", "not a JSON object"},
      {R"({"a": {"dtype": "F64", "shape": [3], "data_offsets": [0, 24]}})",
       "unsupported dtype \"F64\""},
      {R"({"a": {"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 24]}})",
       "shape has 6 elements of F16"},
      {R"({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 24]}})",
       "shape has 4 elements"},
      {R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}})", "out of range"},
      {R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 0]}})", "out of range"},
      {R"({"a": {"dtype": "F32", "shape": [2, 3]}})", "missing key \"data_offsets\""},
      {R"({"a": {"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]}})",
       "negative dimension"},
      {R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4], "data_offsets": [0, 24]}})",
       "shape does not match"},
  };
  for (const auto& [header, expected] : cases) {
    write_file_atomic(path, safetensors_bytes(header, data));
    const std::string message = error_of([&] { read_safetensors(path); });
    EXPECT_CONTAINS(message, path.string());
    EXPECT_CONTAINS(message, expected);
  }

  // A well-formed hand-written file, with keys in any order and an empty tensor.
  const float values[6] = {1.0f, -2.0f, 3.5f, 0.0f, 1e-30f, 6.0f};
  write_file_atomic(
      path, safetensors_bytes(R"({"z": {"dtype": "F32", "shape": [0], "data_offsets": [24, 24]},
        "a": {"data_offsets": [0, 24], "shape": [3, 2], "dtype": "F32"}})",
                              std::string(reinterpret_cast<const char*>(values), 24)));
  const auto tensors = read_safetensors(path);
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors.at("a").shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(std::memcmp(tensors.at("a").data.data(), values, sizeof values), 0);
  EXPECT_TRUE(tensors.at("z").data.empty());
}

// The format's own rules, which its reader enforces: the tensors' data tile the data exactly (no
// overlap, no gap, no trailing bytes), a header of at most 100 MB that begins with '{', and
// metadata of strings. Each refusal names the file and, where one is to blame, the tensor.
TEST(Safetensors, FollowsTheFormatStrictly) {
  TempDir tmp;
  const fs::path path = tmp.path() / "strict.safetensors";
  const std::string data(24, '\0');  // six floats
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
       {"tensor \"b\"", "[8, 24] overlap tensor \"a\"'s [0, 16]"}},
      {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
           "b": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}})",
       {"overlap"}},
      {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}})",
       {"tensor \"b\"", "leave bytes [8, 16) before it to no tensor"}},
      {R"({"b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
       {"tensor \"b\"", "bytes [0, 8)"}},
      {R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
       {"8 bytes after the last tensor's data (tensor \"a\" ends at 16)"}},
      {R"({"__metadata__": {"format": "pt"}})",
       {"24 bytes after the header, which names no tensor"}},
      {R"({"__metadata__": {"format": 1}, "a": {"dtype": "F32", "shape": [6],
           "data_offsets": [0, 24]}})",
       {"__metadata__ \"format\" is 1, not a string"}},
      {R"( {"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}})", {"begin with '{'"}},
  };
  for (const auto& [header, expected] : cases) {
    write_file_atomic(path, safetensors_bytes(header, data));
    const std::string message = error_of([&] { read_safetensors(path); });
    EXPECT_CONTAINS(message, path.string());
    for (const auto& part : expected) EXPECT_CONTAINS(message, part);
  }
  // A header length over the format's 100 MB limit is refused before anything is read.
  std::string big(8, '\0');
  const uint64_t length = 100'000'001;
  for (size_t i = 0; i < 8; ++i) big[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  write_file_atomic(path, big + std::string(64, ' '));
  EXPECT_CONTAINS(error_of([&] { read_safetensors(path); }), "exceeds the format's limit");
}

// Half-precision weights (as most Hugging Face models are stored) are read exactly into float.
TEST(Safetensors, ReadsBf16AndF16Exactly) {
  TempDir tmp;
  const fs::path path = tmp.path() / "half.safetensors";
  // F16: 1, -2, the smallest subnormal 2^-24, the largest finite 65504, +inf, a subnormal 3·2^-24.
  // BF16 (float's upper 16 bits): 1, -3.140625, 2^-133 (a float subnormal), -0.
  const uint16_t f16[6] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x7C00, 0x0003};
  const uint16_t bf16[4] = {0x3F80, 0xC049, 0x0001, 0x8000};
  std::string data(reinterpret_cast<const char*>(f16), sizeof f16);
  data.append(reinterpret_cast<const char*>(bf16), sizeof bf16);
  write_file_atomic(path, safetensors_bytes(R"({"h": {"dtype": "F16", "shape": [6],
        "data_offsets": [0, 12]}, "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [12, 20]}})",
                                            data));
  const auto tensors = read_safetensors(path);
  const std::vector<float> h = tensors.at("h").data;
  EXPECT_EQ(tensors.at("h").dtype, "F16");
  EXPECT_EQ(h[0], 1.0f);
  EXPECT_EQ(h[1], -2.0f);
  EXPECT_EQ(h[2], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[3], 65504.0f);
  EXPECT_TRUE(std::isinf(h[4]) && h[4] > 0);
  EXPECT_EQ(h[5], 3 * std::ldexp(1.0f, -24));
  const std::vector<float> b = tensors.at("b").data;
  EXPECT_EQ(b[0], 1.0f);
  EXPECT_EQ(b[1], -3.140625f);
  EXPECT_EQ(b[2], std::ldexp(1.0f, -133));
  EXPECT_TRUE(b[3] == 0.0f && std::signbit(b[3]));
}

// ---------------------------------------------------------------------------------------------
// The independent NumPy reference of Hugging Face's LlamaForCausalLM (tests/hf_llama_reference.py)

struct CommandResult {
  int status = -1;
  std::string output;
};

CommandResult run_command(const std::string& command) {
  CommandResult result;
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0) result.output.append(buffer, n);
  result.status = ::pclose(pipe);
  return result;
}

const std::string kReference = std::string(MALLEUS_SOURCE_DIR) + "/tests/hf_llama_reference.py";

TEST(HfReference, SelfTestPasses) {
  const CommandResult result =
      run_command(std::string(MALLEUS_PYTHON) + " '" + kReference + "' --selftest");
  EXPECT_EQ(result.status, 0) << result.output;
  EXPECT_CONTAINS(result.output, "selftest passed");
}

// With o_proj and down_proj zero every block is the identity, so the loss is a function of the
// embedding, final norm and lm_head alone, computed here in a few lines. Agreement checks that the
// reference reads our safetensors and config.json with the tensors in the orientation HF expects.
TEST(HfReference, ReadsOurExport) {
  TempDir tmp;
  Checkpoint c = make_checkpoint(36, /*with_optimizer=*/false);
  const model::ParameterLayout layout(c.model);
  for (int l = 0; l < c.model.num_layers; ++l) {
    for (int index : {layout.block(l).o_proj, layout.block(l).down_proj}) {
      const auto& spec = layout.tensor(index);
      std::fill_n(c.params.begin() + spec.offset, spec.size, 0.0f);
    }
  }
  const fs::path out = tmp.path() / "hf";
  export_hf(c, out);
  const std::vector<std::vector<int>> sequences = {{5, 17, 200, 256, 3, 99, 0}, {256, 1, 2}};
  std::string text;
  for (const auto& sequence : sequences) {
    for (int token : sequence) text += std::to_string(token) + " ";
    text += "\n";
  }
  write_file_atomic(out / "tokens.txt", text);

  const auto& embed = layout.tensor(layout.embedding());
  const auto& norm = layout.tensor(layout.final_norm());
  const auto& head = layout.tensor(layout.lm_head());
  const int64_t hidden = c.model.hidden_size, vocab = c.model.vocab_size;
  auto at = [&](const model::TensorSpec& spec, int64_t i) {
    return double{c.params[static_cast<size_t>(spec.offset + i)]};
  };
  double total = 0.0;
  int count = 0;
  for (const auto& sequence : sequences) {
    for (size_t t = 0; t + 1 < sequence.size(); ++t) {
      std::vector<double> x(static_cast<size_t>(hidden));
      double mean_square = 0.0;
      for (int64_t i = 0; i < hidden; ++i) {
        x[static_cast<size_t>(i)] = at(embed, sequence[t] * hidden + i);
        mean_square += x[static_cast<size_t>(i)] * x[static_cast<size_t>(i)];
      }
      const double scale = 1.0 / std::sqrt(mean_square / static_cast<double>(hidden) + 1e-5);
      for (int64_t i = 0; i < hidden; ++i) x[static_cast<size_t>(i)] *= scale * at(norm, i);
      std::vector<double> logits(static_cast<size_t>(vocab));
      double max_logit = -1e300;
      for (int64_t v = 0; v < vocab; ++v) {
        double dot = 0.0;
        for (int64_t i = 0; i < hidden; ++i)
          dot += at(head, v * hidden + i) * x[static_cast<size_t>(i)];
        logits[static_cast<size_t>(v)] = dot;
        max_logit = std::max(max_logit, dot);
      }
      double z = 0.0;
      for (double logit : logits) z += std::exp(logit - max_logit);
      total += max_logit + std::log(z) - logits[static_cast<size_t>(sequence[t + 1])];
      ++count;
    }
  }
  const double expected = total / count;

  const CommandResult result =
      run_command(std::string(MALLEUS_PYTHON) + " '" + kReference + "' '" + out.string() + "' '" +
                  (out / "tokens.txt").string() + "'");
  ASSERT_EQ(result.status, 0) << result.output;
  const double reference = std::stod(result.output);
  EXPECT_NEAR(reference, expected, 1e-9 * expected) << result.output;
}

}  // namespace
}  // namespace malleus::hf
