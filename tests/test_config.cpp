// Model and training configs: presets, strict keys, impossible shapes; strict JSON numbers in
// every reader; the training-config field table (round trip, resume policy of every field).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "test_util.h"
#include "train_config_samples.h"

#include "common/error.h"
#include "common/files.h"
#include "common/stats.h"
#include "elastic/stragglers.h"
#include "model/config.h"
#include "model/parameters.h"
#include "plan/plan.h"
#include "train/config.h"

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
       {"tiny", "demo", "llama-7b", "llama-32b", "llama-70b", "llama-110b", "llama-405b"}) {
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
  // Llama 3.1 405B's shape (126 layers, hidden 16384, 128 heads, 8 KV heads, FFN 53248,
  // vocabulary 128256, untied embeddings): its published count.
  EXPECT_EQ(model::load_model_config("llama-405b").num_parameters(), 405853388800);
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

// A device or a directory named as a file is refused by name before it is read: /dev/zero would
// otherwise be read until the memory is full.
TEST(ModelConfig, ADeviceOrADirectoryIsNoFile) {
  for (const char* path : {"/dev/zero", "/dev/null"}) {
    EXPECT_EQ(error_of([&] { model::load_model_config(path); }),
              std::string("cannot read ") + path + ": it is a device, not a file");
  }
  const std::string dir = fs::temp_directory_path().string();
  EXPECT_EQ(error_of([&] { model::load_model_config(dir); }),
            "cannot read " + dir + ": it is a directory");
}

// ---- strict JSON (common/json.h): what every reader gets ----

namespace {

template <typename T>
std::string conversion_error(const Json& value) {
  return error_of([&] { json_to<T>(value, "f.json: key \"k\""); });
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST(StrictJson, IntegersAreWholeNumbersInRange) {
  EXPECT_EQ(json_to<int>(Json(2.0), "x"), 2);  // whole, though written as a float
  EXPECT_EQ(json_to<int64_t>(Json(1e3), "x"), 1000);
  EXPECT_EQ(json_to<int64_t>(Json(std::numeric_limits<int64_t>::min()), "x"),
            std::numeric_limits<int64_t>::min());
  EXPECT_EQ(json_to<uint64_t>(Json(std::numeric_limits<uint64_t>::max()), "x"),
            std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(json_to<int>(Json(-2147483648LL), "x"), std::numeric_limits<int>::min());

  std::string m = conversion_error<int>(Json(2.5));
  EXPECT_TRUE(contains(m, "f.json: key \"k\" must be a whole number (value 2.5)")) << m;
  m = conversion_error<int>(Json(4294967304LL));  // would wrap to 8
  EXPECT_TRUE(contains(m, "f.json: key \"k\" is out of range (value 4294967304")) << m;
  m = conversion_error<int>(Json(-2147483649LL));
  EXPECT_TRUE(contains(m, "out of range")) << m;
  m = conversion_error<uint64_t>(Json(-1));  // would become 2^64 - 1
  EXPECT_TRUE(contains(m, "f.json: key \"k\" is out of range (value -1")) << m;
  m = conversion_error<int64_t>(Json(9223372036854775808ULL));
  EXPECT_TRUE(contains(m, "out of range")) << m;
  m = conversion_error<int64_t>(Json(1e30));
  EXPECT_TRUE(contains(m, "out of range")) << m;
  m = conversion_error<int>(Json("5"));
  EXPECT_TRUE(contains(m, "has the wrong type (value \"5\"")) << m;
  m = conversion_error<int>(Json(true));
  EXPECT_TRUE(contains(m, "wrong type")) << m;
  m = conversion_error<std::vector<int>>(Json{1, 4294967296LL});
  EXPECT_TRUE(contains(m, "f.json: key \"k\"[1] is out of range")) << m;
}

TEST(StrictJson, FloatsAreFiniteAndFitTheirType) {
  EXPECT_FLOAT_EQ(json_to<float>(Json(3), "x"), 3.0f);
  EXPECT_DOUBLE_EQ(json_to<double>(Json(1e308), "x"), 1e308);
  EXPECT_TRUE(contains(conversion_error<float>(Json(1e39)), "out of range")) << "1e39";
  EXPECT_TRUE(contains(conversion_error<float>(Json(1e-50)), "out of range")) << "1e-50 -> 0";
  EXPECT_TRUE(contains(conversion_error<float>(Json(std::numeric_limits<double>::infinity())),
                       "out of range"));
  EXPECT_TRUE(contains(conversion_error<float>(Json("0.1")), "wrong type"));
}

TEST(StrictJson, DuplicateKeysAndHugeNumbersNameTheFile) {
  std::string m = error_of([] { parse_json(R"({"lr": 0.1, "lr": 0.2})", "t.json"); });
  EXPECT_TRUE(contains(m, "t.json: key \"lr\" appears twice")) << m;
  m = error_of([] { parse_json(R"({"a": {"b": 1, "b": 2}})", "t.json"); });
  EXPECT_TRUE(contains(m, "key \"b\" appears twice")) << m;
  // The same key in different objects, or in sibling objects of a list, is fine.
  EXPECT_EQ(
      parse_json(R"({"b": 0, "a": {"b": 1}, "l": [{"b": 2}, {"b": 3}]})", "t.json")["l"][1]["b"],
      3);
  m = error_of([] { parse_json(R"({"lr": 1e999})", "t.json"); });
  EXPECT_TRUE(contains(m, "t.json: number out of range")) << m;
  EXPECT_TRUE(contains(m, "1e999")) << m;
}

TEST(StrictJson, EveryReaderGetsIt) {
  // Model config: hidden_size 32.9 used to become 32.
  Json model = tiny_json();
  model["hidden_size"] = 32.9;
  std::string m = error_of([&] { ModelConfig::from_json(model, "m.json"); });
  EXPECT_TRUE(contains(m, "m.json: key \"hidden_size\" must be a whole number (value 32.9)")) << m;
  model = tiny_json();
  model["rope_theta"] = 1e39;
  m = error_of([&] { ModelConfig::from_json(model, "m.json"); });
  EXPECT_TRUE(contains(m, "m.json: key \"rope_theta\" is out of range")) << m;

  // Plan: rank 4294967296 used to become rank 0.
  const Json plan = parse_json(R"({"world_size": 1, "micro_batch_size": 1, "pipelines": [
      {"micro_batches": 1, "stages": [{"layers": [0, 2], "ranks": [4294967296]}]}]})",
                               "p.json");
  m = error_of([&] { plan::Plan::from_json(plan, model::load_model_config("tiny"), "p.json"); });
  EXPECT_TRUE(contains(m, "p.json: pipeline 0 stage 0: key \"ranks\"[0] is out of range")) << m;

  // Straggler traces and specs: a rank beyond int, a rate that stalls the job.
  malleus::testing::ScratchDir dir;
  const auto trace = dir / "trace.json";
  write_file_atomic(trace, R"({"events": [{"step": 1, "rates": {"4294967301": 2}}]})");
  m = error_of([&] { elastic::StragglerSchedule().add_trace(trace.string()); });
  EXPECT_TRUE(contains(m, "\"4294967301\" is not a rank")) << m;
  write_file_atomic(trace, R"({"events": [{"step": 1, "rates": {"1": 1e308}}]})");
  m = error_of([&] { elastic::StragglerSchedule().add_trace(trace.string()); });
  EXPECT_TRUE(contains(m, "trace.json: event 0: rank 1 has rate 1e+308")) << m;
  for (const char* spec : {"1:inf:1-2", "1:1e308:1-2", "1:nan:1-2", "4294967301:2:1-2"}) {
    m = error_of([&] { elastic::StragglerSchedule().add(spec); });
    EXPECT_TRUE(contains(m, std::string("straggler \"") + spec + "\"")) << m;
  }
}

// ---- the training config's field table ----

using malleus::testing::every_field_changed;
using train::OnResume;
using train::TrainConfig;

TEST(TrainConfig, TheSampleChangesEveryFieldOfTheTable) {
  const Json sample = every_field_changed();
  const Json defaults = TrainConfig{}.to_json();
  size_t fields = 0;
  for (const auto& f : TrainConfig::fields()) {
    ++fields;
    ASSERT_TRUE(sample.contains(f.key)) << "no sample value for field " << f.key;
    EXPECT_NE(TrainConfig::from_json(sample, "sample").to_json()[f.key], defaults[f.key]) << f.key;
    EXPECT_EQ(f.flag.rfind("--", 0), 0u) << f.key;
  }
  EXPECT_EQ(sample.size(), fields) << "the sample has keys the table does not";
  EXPECT_EQ(defaults.size(), fields);
}

TEST(TrainConfig, RoundTripsThroughJsonWithEveryField) {
  const TrainConfig c = TrainConfig::from_json(every_field_changed(), "sample");
  const TrainConfig back = TrainConfig::from_json(parse_json(c.to_json().dump(), "dump"), "dump");
  EXPECT_TRUE(back == c) << back.to_json().dump() << "\n" << c.to_json().dump();
  EXPECT_EQ(back.stragglers, (std::vector<std::string>{"1:2:3-4", "2:3:5-"}));
  EXPECT_FALSE(back.replan);
  EXPECT_FLOAT_EQ(back.lr, 0.0005f);
}

TEST(TrainConfig, FloatsAreWrittenAsTheirShortestDecimal) {
  // A float field is shown as the decimal it was given, not the double nearest the float
  // (9.99999993922529e-09 for 1e-8), and reads back as the same float.
  const TrainConfig defaults;
  const Json json = defaults.to_json();
  EXPECT_EQ(json.at("adam_eps").dump(), "1e-08");
  EXPECT_EQ(json.at("lr").dump(), "0.002");
  EXPECT_EQ(json.at("beta2").dump(), "0.95");
  TrainConfig odd;
  odd.lr = std::nextafter(3e-4f, 1.0f);  // needs 9 digits
  const TrainConfig back = TrainConfig::from_json(odd.to_json(), "odd");
  EXPECT_EQ(back.lr, odd.lr);
}

TEST(TrainConfig, StrictFieldsNameFileKeyAndValue) {
  struct Case {
    Json json;
    std::string expected;
  };
  for (const Case& c : {
           Case{{{"steps", 2.5}}, "c.json: key \"steps\" must be a whole number (value 2.5)"},
           Case{{{"global_batch_size", 4294967304LL}},
                "c.json: key \"global_batch_size\" is out of range (value 4294967304"},
           Case{{{"seed", -1}}, "c.json: key \"seed\" is out of range (value -1"},
           Case{{{"lr", 1e39}}, "c.json: key \"lr\" is out of range"},
           Case{{{"seq_len", 0}}, "c.json: key \"seq_len\" must be positive (got 0)"},
           Case{{{"beta2", 1.0}}, "c.json: key \"beta2\" must be in [0, 1) (got 1)"},
           Case{{{"replan", 1}}, "c.json: key \"replan\" has the wrong type (value 1"},
           Case{{{"stragglers", {"1:2"}}}, "c.json: key \"stragglers\": straggler \"1:2\""},
           Case{{{"learning_rate", 0.1}}, "c.json: unknown key(s) \"learning_rate\""},
       }) {
    const std::string m = error_of([&] { TrainConfig::from_json(c.json, "c.json"); });
    EXPECT_TRUE(contains(m, c.expected)) << c.json.dump() << ": " << m;
  }
}

TEST(TrainConfig, ResumeSweepOverEveryField) {
  // A checkpoint's config; every field given again, one at a time, with another value.
  TrainConfig saved;
  saved.model = "tiny";
  const int64_t checkpoint_step = 10;
  const Json sample = every_field_changed();
  int honoured = 0, refused = 0;
  for (const auto& f : TrainConfig::fields()) {
    const Json value = sample[f.key];
    const train::ConfigValues given{{&f, value, f.flag}};
    ASSERT_NE(f.write(saved), value) << f.key;
    if (f.on_resume == OnResume::kFixed) {
      ++refused;
      const std::string m = error_of([&] { saved.resumed(given, checkpoint_step); });
      EXPECT_TRUE(contains(m, f.flag + " is " + value.dump())) << f.key << ": " << m;
      EXPECT_TRUE(contains(m, "the checkpoint's " + f.key + " is " + f.write(saved).dump()))
          << f.key << ": " << m;
    } else {
      ++honoured;
      const TrainConfig resumed = saved.resumed(given, checkpoint_step);
      TrainConfig expected = saved;
      f.read(expected, value, f.flag);
      EXPECT_TRUE(resumed == expected) << f.key;
      EXPECT_NE(f.write(resumed), f.write(saved)) << f.key << " did not take effect";
    }
  }
  // The fields that define the model and the data order are exactly these.
  EXPECT_EQ(refused, 4);
  EXPECT_GT(honoured, 20);
  for (const char* key : {"model", "seq_len", "global_batch_size", "seed"}) {
    bool found = false;
    for (const auto& f : TrainConfig::fields()) {
      if (f.key == key) found = f.on_resume == OnResume::kFixed;
    }
    EXPECT_TRUE(found) << key;
  }
  // The same value as the checkpoint's is no change, so it is accepted.
  const auto& model_field = TrainConfig::fields().front();
  ASSERT_EQ(model_field.key, "model");
  EXPECT_EQ(saved.resumed({{&model_field, Json("tiny"), "--model"}}, checkpoint_step).model,
            "tiny");
}

// A checkpoint at step 0 (an import) has made no progress: the data order, sequence length and
// batch are the new run's choice; its model still is not.
TEST(TrainConfig, AStepZeroCheckpointFixesOnlyItsModel) {
  TrainConfig saved;
  saved.model = "tiny";
  const Json sample = every_field_changed();
  for (const auto& f : TrainConfig::fields()) {
    if (f.on_resume != OnResume::kFixed) continue;
    const train::ConfigValues given{{&f, sample[f.key], f.flag}};
    if (f.key == "model") {
      EXPECT_TRUE(contains(error_of([&] { saved.resumed(given, 0); }), "--model is"));
    } else {
      EXPECT_EQ(f.write(saved.resumed(given, 0)), sample[f.key]) << f.key;
    }
  }
}

TEST(TrainConfig, ResumeNeedsStepsLeft) {
  TrainConfig saved;
  saved.steps = 10;
  std::string m = error_of([&] { saved.resumed({}, 10); });
  EXPECT_TRUE(contains(m, "the checkpoint is at step 10, the run's last")) << m;
  const train::ConfigField* steps = nullptr;
  for (const auto& f : TrainConfig::fields()) {
    if (f.key == "steps") steps = &f;
  }
  ASSERT_NE(steps, nullptr);
  m = error_of([&] { saved.resumed({{steps, Json(8), "--steps"}}, 10); });
  EXPECT_TRUE(contains(m, "--steps is 8, but the checkpoint is already at step 10")) << m;
  EXPECT_EQ(saved.resumed({{steps, Json(12), "--steps"}}, 10).steps, 12);
}

TEST(Stats, MedianAndSummaryOfMeasurements) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(median({3, 1, 2}), 2);
  EXPECT_EQ(median({4, 1, 3, 2}), 2.5);  // the mean of the two middle values
  EXPECT_EQ(median({nan, 5, 1}), 3);     // missing numbers are ignored
  EXPECT_TRUE(std::isnan(median({})));
  const Summary s = summarize({nan, 0.5, 2, -1, 7});
  EXPECT_EQ(s.median, 1.25);
  EXPECT_EQ(s.min, -1);
  EXPECT_EQ(s.max, 7);
  EXPECT_TRUE(std::isnan(summarize({nan}).min));
}
