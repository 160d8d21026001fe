// Model and training configs: presets, strict keys, impossible shapes.
#include <gtest/gtest.h>

#include "test_util.h"

#include "common/error.h"
#include "common/files.h"
#include "model/config.h"
#include "model/parameters.h"

using namespace malleus;
using model::ModelConfig;

namespace {

using malleus::testing::error_of;

Json tiny_json() {
  return model::load_model_config("tiny").to_json();
}

}  // namespace

TEST(ModelConfig, PresetsMatchTheirFilesAndValidate) {
  const auto names = model::model_preset_names();
  for (const char* expected :
       {"tiny", "demo", "llama-7b", "llama-32b", "llama-70b", "llama-110b"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
  for (const auto& name : names) {
    const std::string file = std::string(MALLEUS_SOURCE_DIR) + "/configs/models/" + name + ".json";
    EXPECT_EQ(model::load_model_config(name).to_json(), model::load_model_config(file).to_json());
  }
}

TEST(ModelConfig, ParameterCountsOfRealShapes) {
  // Exact parameter counts of the published LLaMA-2 checkpoints (7B: 6,738,415,616; 70B:
  // 68,976,648,192) confirm the shapes and the count.
  EXPECT_EQ(model::load_model_config("llama-7b").num_parameters(), 6738415616);
  EXPECT_EQ(model::load_model_config("llama-70b").num_parameters(), 68976648192);
  EXPECT_NEAR(static_cast<double>(model::load_model_config("llama-110b").num_parameters()), 1.1e11,
              0.02e11);
}

TEST(ModelConfig, LayoutCoversEveryParameterOnce) {
  const auto config = model::load_model_config("tiny");
  const model::ParameterLayout layout(config);
  EXPECT_EQ(layout.num_parameters(), config.num_parameters());
  int64_t end = 0;
  for (const auto& t : layout.tensors()) {
    EXPECT_GE(t.offset, end) << t.name;
    EXPECT_EQ(t.offset % model::ParameterLayout::kAlignment, 0) << t.name;
    end = t.offset + t.size;
  }
  EXPECT_LE(end, layout.total_size());
  EXPECT_EQ(layout.find("model.layers.1.self_attn.k_proj.weight").shape,
            (std::vector<int64_t>{config.kv_dim(), config.hidden_size}));
  EXPECT_THROW(layout.find("no.such.tensor"), Error);
}

TEST(ModelConfig, UnknownKeyIsRefusedByName) {
  Json j = tiny_json();
  j["hiden_size"] = 32;
  const std::string message = error_of([&] { ModelConfig::from_json(j, "my.json"); });
  EXPECT_NE(message.find("my.json"), std::string::npos) << message;
  EXPECT_NE(message.find("hiden_size"), std::string::npos) << message;
}

TEST(ModelConfig, ImpossibleShapesAreRefused) {
  struct Case {
    const char* key;
    int value;
    const char* expect;
  };
  for (const Case& c : {Case{"num_heads", 5, "must divide \"hidden_size\""},
                        Case{"num_kv_heads", 3, "must divide \"num_heads\""},
                        Case{"hidden_size", 0, "\"hidden_size\" must be positive"},
                        Case{"num_layers", -1, "\"num_layers\" must be positive"},
                        Case{"hidden_size", 12, "must be even"}}) {
    Json j = tiny_json();
    j[c.key] = c.value;
    if (std::string(c.expect) == "must be even") j["num_heads"] = 4, j["num_kv_heads"] = 4;
    const std::string message = error_of([&] { ModelConfig::from_json(j, "m.json"); });
    EXPECT_NE(message.find(c.expect), std::string::npos) << c.key << ": " << message;
  }
}

TEST(ModelConfig, WrongTypeAndMissingKeyAndUnknownPreset) {
  Json j = tiny_json();
  j["num_layers"] = "two";
  EXPECT_NE(error_of([&] { ModelConfig::from_json(j, "m.json"); }).find("wrong type"),
            std::string::npos);
  j = tiny_json();
  j.erase("vocab_size");
  EXPECT_NE(
      error_of([&] { ModelConfig::from_json(j, "m.json"); }).find("missing key \"vocab_size\""),
      std::string::npos);
  EXPECT_NE(error_of([] { model::load_model_config("no-such-model"); }).find("neither a preset"),
            std::string::npos);
  const auto bad = fs::temp_directory_path() / "malleus_bad_model.json";
  write_file_atomic(bad, "{ \"vocab_size\": 10, ");
  EXPECT_NE(error_of([&] { model::load_model_config(bad.string()); }).find("malformed JSON"),
            std::string::npos);
  fs::remove(bad);
}
