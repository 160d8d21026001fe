// The `malleus` command end to end: help, and one test per kind of bad input — each must give a
// clear error and a non-zero exit, and leave what is already on disk untouched; the training
// config's flags and resume rules; run directories, signals and full disks on one rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/files.h"
#include "common/json.h"
#include "device/device.h"
#include "model/config.h"
#include "test_util.h"
#include "train/config.h"
#include "train_config_samples.h"

using namespace malleus;
using malleus::testing::run_malleus;
using malleus::testing::ScratchDir;

namespace {

// Flags for a two-step run of the tiny model on the synthetic corpus in `dir`.
std::string tiny_flags(const ScratchDir& dir, const std::string& model = "tiny") {
  return "--model " + model +
         " --seq-len 16 --micro-batch 2 --global-batch 2 --steps 2 --threads 1"
         " --warmup-steps 1 --train-data '" +
         (dir / "data" / "train_*.bin").string() + "' --val-data '" +
         (dir / "data" / "val_*.bin").string() + "' --out " + (dir / "run").string();
}

void expect_error(const malleus::testing::CommandResult& r,
                  std::initializer_list<std::string> parts) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("error:"), std::string::npos) << r.output;
  for (const auto& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << r.output;
}

}  // namespace

TEST(Cli, HelpListsSubcommands) {
  const auto r = run_malleus("--help");
  EXPECT_EQ(r.exit_code, 0);
  for (const char* sub : {"train", "prepare-data", "eval", "export", "models"}) {
    EXPECT_NE(r.output.find(sub), std::string::npos) << sub;
  }
  EXPECT_EQ(run_malleus("train --help").exit_code, 0);
  EXPECT_NE(run_malleus("no-such-command").exit_code, 0);
}

TEST(Cli, TrainsEvaluatesAndExports) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto r = run_malleus("train " + tiny_flags(dir));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* field :
       {"step     2/2", "loss", "lr", "grad norm", "tok/s", "ETA", "val loss"}) {
    EXPECT_NE(r.output.find(field), std::string::npos) << field << "\n" << r.output;
  }
  const auto e = run_malleus("eval --checkpoint " + (dir / "run").string() + " --data '" +
                             (dir / "data" / "val_*.bin").string() + "'");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_NE(e.output.find("mean loss"), std::string::npos) << e.output;
  const auto x = run_malleus("export --checkpoint " + (dir / "run").string() + " --output " +
                             (dir / "hf").string());
  ASSERT_EQ(x.exit_code, 0) << x.output;
  EXPECT_TRUE(fs::exists(dir / "hf" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "hf" / "config.json"));
  const auto resumed = run_malleus("train --resume " + (dir / "run").string() + " --steps 3");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resuming from"), std::string::npos);
  EXPECT_NE(resumed.output.find("step     3/3"), std::string::npos) << resumed.output;
}

TEST(Cli, UnknownTrainConfigKeyIsNamed) {
  ScratchDir dir;
  const auto config = dir / "train.json";
  write_file_atomic(config, R"({"model": "tiny", "learning_rate": 0.1})");
  expect_error(run_malleus("train --config " + config.string()), {"train.json", "learning_rate"});
}

TEST(Cli, ImpossibleModelShapeIsNamed) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto model = dir / "model.json";
  write_file_atomic(model, R"({"vocab_size": 257, "hidden_size": 30, "num_layers": 1,
                               "num_heads": 4, "ffn_hidden_size": 8, "max_seq_len": 16})");
  expect_error(run_malleus("train " + tiny_flags(dir, model.string())),
               {"model.json", "num_heads", "hidden_size"});
}

TEST(Cli, BadBatchShapeIsNamed) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  expect_error(run_malleus("train " + tiny_flags(dir) + " --global-batch 3"),
               {"global_batch_size", "micro_batch_size"});
}

TEST(Cli, MissingDataIsNamed) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  expect_error(
      run_malleus("train " + tiny_flags(dir) + " --train-data " + (dir / "nope_*.bin").string()),
      {"nope_*.bin"});
  expect_error(run_malleus("prepare-data --input " + (dir / "missing.txt").string() + " --output " +
                           (dir / "out").string()),
               {"missing.txt"});
}

TEST(Cli, MalformedDataIsNamed) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  write_file_atomic(dir / "data" / "train_000001.bin", std::string(2048, 'x'));
  expect_error(run_malleus("train " + tiny_flags(dir)), {"train_000001.bin", "magic"});
}

TEST(Cli, CorruptCheckpointIsRefusedAndLeftAlone) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  ASSERT_EQ(run_malleus("train " + tiny_flags(dir)).exit_code, 0);
  const auto ckpt = dir / "run" / "checkpoints" / "step_00000002";
  // Flip one byte of the parameters: the one rank's file starts with the parameters of its first
  // piece (the embedding's, 32 KB), which every command reads (eval and export skip the moments).
  const auto params = ckpt / "rank_00000.bin";
  std::string bytes = read_file(params);
  bytes[100] = static_cast<char>(bytes[100] ^ 0x40);
  {
    std::ofstream out(params, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  // An earlier export must survive a failed one.
  fs::create_directories(dir / "hf");
  write_file_atomic(dir / "hf" / "model.safetensors", "previous export");
  expect_error(run_malleus("train --resume " + ckpt.string() + " --steps 3"),
               {"rank_00000.bin", "corrupt"});
  expect_error(run_malleus("eval --checkpoint " + ckpt.string()), {"rank_00000.bin"});
  expect_error(
      run_malleus("export --checkpoint " + ckpt.string() + " --output " + (dir / "hf").string()),
      {"rank_00000.bin"});
  EXPECT_EQ(read_file(dir / "hf" / "model.safetensors"), "previous export");
  EXPECT_EQ(read_file(params), bytes);  // refused, not "repaired" or deleted
  // Truncation is reported as such.
  fs::resize_file(params, 100);
  expect_error(run_malleus("eval --checkpoint " + ckpt.string()), {"rank_00000.bin", "truncated"});
  expect_error(run_malleus("eval --checkpoint " + (dir / "nowhere").string()), {"nowhere"});
}

// ---- inputs that used to be accepted and ignored (issue 16) ----

TEST(Cli, MisspeltSubcommandFailsNamingIt) {
  for (const char* command : {"generat --help", "generat", "trian --steps 2"}) {
    const auto r = run_malleus(command);
    const std::string name = std::string(command).substr(0, std::string(command).find(' '));
    expect_error(r, {"unknown subcommand \"" + name + "\""});
    EXPECT_NE(r.output.find("train, prepare-data"), std::string::npos) << r.output;
  }
  EXPECT_EQ(run_malleus("train --help").exit_code, 0);
}

TEST(Cli, StragglerOnARankOutsideTheJobIsRefused) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  auto r = run_malleus("train " + tiny_flags(dir) + " --straggler 5:2:1-2");
  expect_error(r, {"straggler \"5:2:1-2\" names rank 5, but the job has 1 rank"});
  EXPECT_FALSE(fs::exists(dir / "run"));
  write_file_atomic(dir / "trace.json", R"({"events": [{"step": 1, "rates": {"3": 2}}]})");
  r = run_malleus("train " + tiny_flags(dir) + " --straggler-trace " +
                  (dir / "trace.json").string());
  expect_error(r, {"straggler trace " + (dir / "trace.json").string() + " names rank 3"});
  // 17.7: a rate that would stall the job instead of slowing it.
  for (const char* spec : {"0:inf:1-2", "0:1e308:1-2"}) {
    r = run_malleus("train " + tiny_flags(dir) + " --straggler " + spec);
    expect_error(r, {"--straggler: straggler \"" + std::string(spec) + "\"", "[1, 100]"});
  }
  EXPECT_FALSE(fs::exists(dir / "run"));
}

// `malleus profile` as planner.md shows it, without --threads: 0, the default, is every core
// (it once reached the backend as 0 threads and stopped). Too many threads are refused naming
// the value, and nothing is written then.
TEST(Cli, ProfileRunsWithTheDefaultThreadsAndRefusesTooMany) {
  ScratchDir dir;
  const std::string out = (dir / "profile.json").string();
  const auto r = run_malleus("profile --model tiny --repeats 1 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Json profile = read_json_file(out);
  EXPECT_GE(profile.at("threads").get<int>(), 1) << profile.dump();
  EXPECT_GT(profile.at("layer_forward_flops_per_s").get<double>(), 0) << profile.dump();
  const std::string other = (dir / "other.json").string();
  expect_error(run_malleus("profile --model tiny --repeats 1 --threads 100000 --out " + other),
               {"\"threads\" is 100000"});
  expect_error(run_malleus("profile --model tiny --repeats 1 --threads -3 --out " + other),
               {"--threads must not be negative (got -3)"});
  EXPECT_FALSE(fs::exists(other));
}

// `malleus clusters`: one line per preset, in columns however long a preset's name (the
// cpu-bed-2x2-turns line once overflowed its column), and the CPU presets' TFLOPS not rounded
// away to 0.0.
TEST(Cli, ClustersListsEveryPresetInColumns) {
  const auto r = run_malleus("clusters");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> lines;
  for (size_t begin = 0; begin < r.output.size();) {
    const size_t end = r.output.find('\n', begin);
    lines.push_back(r.output.substr(begin, end - begin));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  ASSERT_GE(lines.size(), 3u) << r.output;
  for (const auto& line : lines) EXPECT_EQ(line.size(), lines[0].size()) << r.output;
  bool found = false;
  for (const auto& line : lines) {
    if (line.rfind("cpu-local ", 0) == 0) {
      found = true;
      EXPECT_NE(line.find(" 0.045 "), std::string::npos) << line;
    }
  }
  EXPECT_TRUE(found) << r.output;
}

TEST(Cli, SyntaxOfFlagsIsCheckedBeforeTheData) {
  ScratchDir dir;
  // Both the data and the straggler spec are wrong: the cheap syntactic error comes first.
  const auto r =
      run_malleus("train " + tiny_flags(dir) + " --train-data /no/such/*.bin" + " --straggler 1:2");
  expect_error(r, {"straggler \"1:2\" is malformed"});
  EXPECT_EQ(r.output.find("/no/such"), std::string::npos) << r.output;
}

// --backend, --devices and --cuda-math of train, eval and generate: a bad value is named before
// any file is read, and a binary without CUDA says how to build one with it (and leaves nothing).
TEST(Cli, BackendChoicesAreCheckedBeforeTheData) {
  ScratchDir dir;
  const std::string missing = " --train-data /no/such/*.bin";
  auto r = run_malleus("train " + tiny_flags(dir) + missing + " --backend gpu");
  expect_error(r, {"--backend: \"gpu\" is not a backend (cpu or cuda)"});
  EXPECT_EQ(r.output.find("/no/such"), std::string::npos) << r.output;
  r = run_malleus("train " + tiny_flags(dir) + missing + " --devices 0,x");
  expect_error(r, {"--devices \"0,x\": \"x\" is not a device index"});
  r = run_malleus("eval --checkpoint /no/such --backend tpu");
  expect_error(r, {"--backend: \"tpu\" is not a backend"});
  r = run_malleus("generate --untrained tiny --tokenizer byte --devices 1,1");
  expect_error(r, {"--devices \"1,1\": device 1 is listed twice"});
  if (device::built_with_cuda()) return;  // the rest holds in a binary without CUDA
  malleus::testing::write_synthetic_corpus(dir / "data");
  r = run_malleus("train " + tiny_flags(dir) + " --backend cuda");
  expect_error(r, {"--backend cuda: this malleus was built without CUDA", "-DMALLEUS_BUILD_CUDA=ON",
                   "docs/cuda.md"});
  EXPECT_FALSE(fs::exists(dir / "run")) << r.output;
  r = run_malleus("generate --untrained tiny --tokenizer byte --max-tokens 2 --backend cuda");
  expect_error(r, {"this malleus was built without CUDA"});
  r = run_malleus("generate --untrained tiny --tokenizer byte --max-tokens 2 --backend cpu");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Cli, ConfigRoundTripsThroughTheCommandLineWithEveryField) {
  ScratchDir dir;
  const Json sample = malleus::testing::every_field_changed();
  const train::TrainConfig expected = train::TrainConfig::from_json(sample, "sample");
  // Every field as a flag, generated from the field table.
  std::string flags;
  for (const auto& f : train::TrainConfig::fields()) {
    flags += ' ';  // appended piece by piece: GCC 12 warns falsely on "lit" + string
    flags += malleus::testing::flags_for(f, sample[f.key]);
  }
  auto r = run_malleus("train --print-config" + flags);
  ASSERT_EQ(r.exit_code, 0) << flags << "\n" << r.output;
  EXPECT_TRUE(train::TrainConfig::from_json(parse_json(r.output, "printed"), "printed") == expected)
      << flags << "\n"
      << r.output;
  // And as a config file.
  write_file_atomic(dir / "c.json", sample.dump(2));
  r = run_malleus("train --print-config --config " + (dir / "c.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(train::TrainConfig::from_json(parse_json(r.output, "printed"), "printed") == expected)
      << r.output;
  // Flags win over the file; a switch can be turned back on.
  r = run_malleus("train --print-config --config " + (dir / "c.json").string() +
                  " --replan --steps 5");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Json printed = parse_json(r.output, "printed");
  EXPECT_EQ(printed["replan"], true);
  EXPECT_EQ(printed["steps"], 5);
}

namespace {

// A finished two-step run of the tiny model in dir/run (checkpoint at step 2).
void train_two_steps(const ScratchDir& dir) {
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto r = run_malleus("train " + tiny_flags(dir));
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace

TEST(Cli, ResumeSweepOverEveryFlag) {
  ScratchDir dir;
  train_two_steps(dir);
  const std::string resume = "train --resume " + (dir / "run").string() + " --print-config ";
  Json sample = malleus::testing::every_field_changed();
  sample["micro_batch_size"] = 1;  // the checkpoint's global batch is 2
  const Json saved = read_json_file(
      (dir / "run" / "checkpoints" / "step_00000002" / "manifest.json").string())["train_config"];
  // Every flag that defines the model or the data order is refused, naming both values.
  std::string honoured;
  for (const auto& f : train::TrainConfig::fields()) {
    if (f.on_resume != train::OnResume::kFixed) {
      honoured += ' ';
      honoured += malleus::testing::flags_for(f, sample[f.key]);
      continue;
    }
    const auto r = run_malleus(resume + malleus::testing::flags_for(f, sample[f.key]));
    expect_error(r, {f.flag + " is " + sample[f.key].dump(),
                     "the checkpoint's " + f.key + " is " + saved[f.key].dump()});
  }
  // All the others at once are honoured: each one is in the config the run would use.
  const auto r = run_malleus(resume + honoured);
  ASSERT_EQ(r.exit_code, 0) << honoured << "\n" << r.output;
  const Json resumed = parse_json(r.output, "resumed");
  const Json expected = train::TrainConfig::from_json(sample, "sample").to_json();
  for (const auto& f : train::TrainConfig::fields()) {
    const Json& wanted = f.on_resume == train::OnResume::kFixed ? saved[f.key] : expected[f.key];
    EXPECT_EQ(resumed[f.key], wanted) << f.key;
  }
}

TEST(Cli, ResumedRunTrainsWithItsOverrides) {
  ScratchDir dir;
  train_two_steps(dir);
  // The honoured overrides that show in what the run does.
  const auto r = run_malleus(
      "train --resume " + (dir / "run").string() + " --out " + (dir / "more").string() +
      " --steps 6 --lr 0.01 --min-lr-ratio 1 --warmup-steps 0 --checkpoint-every 1 "
      "--eval-every 2 --eval-samples 3 --micro-batch 1 --straggler 0:2:5-5 --no-replan");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line :
       {"step     6/6", "lr 1.00e-02", "1 pipeline: [pp1 tp1 m2]", "eval      4", "eval      6"}) {
    EXPECT_NE(r.output.find(line), std::string::npos) << line << "\n" << r.output;
  }
  EXPECT_EQ(r.output.find("re-plan"), std::string::npos) << r.output;
  for (int step : {3, 4, 5, 6}) {
    EXPECT_TRUE(fs::exists(dir / "more" / "checkpoints" / ("step_0000000" + std::to_string(step))))
        << step;
  }
  // Nothing went into the resumed run's own directory.
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints" / "step_00000003"));
  // The injected straggler shows in the metrics of step 5 only.
  std::ifstream metrics(dir / "more" / "metrics.jsonl");
  int injected_steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const Json j = parse_json(line, "metrics");
    if (j.contains("injected") && j["injected"][0].get<double>() > 1) {
      ++injected_steps;
      EXPECT_EQ(j["step"], 5);
    }
  }
  EXPECT_EQ(injected_steps, 1);
  const Json manifest =
      read_json_file((dir / "more" / "checkpoints" / "step_00000006" / "manifest.json").string());
  EXPECT_EQ(manifest["train_config"]["steps"], 6);
  EXPECT_EQ(manifest["train_config"]["micro_batch_size"], 1);
}

TEST(Cli, ModelOverrideOnResumeIsRefused) {
  ScratchDir dir;
  train_two_steps(dir);
  const auto r = run_malleus("train --resume " + (dir / "run").string() + " --model demo");
  expect_error(r, {"--model is \"demo\", but the checkpoint's model is \"tiny\""});
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints" / "step_00000003"));
}

// ---- strict numbers, limits, run directories, manifests, full disks (issue 17) ----

TEST(Cli, NumbersAreNeverConvertedSilently) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  struct Case {
    std::string file, text, flag, expected;
  };
  const std::string tiny = model::load_model_config("tiny").to_json().dump();
  for (const Case& c : {
           Case{"c.json", R"({"steps": 2.5})", "--config", "key \"steps\" must be a whole number"},
           Case{"c.json", R"({"global_batch_size": 4294967304})", "--config",
                "key \"global_batch_size\" is out of range (value 4294967304"},
           Case{"c.json", R"({"seed": -1})", "--config", "key \"seed\" is out of range (value -1"},
           Case{"c.json", R"({"lr": 0.1, "lr": 0.2})", "--config",
                "key \"lr\" appears twice in one object"},
           Case{"c.json", R"({"lr": 1e999})", "--config", "number out of range"},
           Case{"m.json", tiny.substr(0, tiny.size() - 1) + R"(, "hidden_size": 32.9})", "--model",
                "key \"hidden_size\" appears twice"},
           Case{"m.json", R"({"vocab_size": 257, "hidden_size": 32.9, "num_layers": 2,
                "num_heads": 4, "ffn_hidden_size": 64, "max_seq_len": 16})",
                "--model", "key \"hidden_size\" must be a whole number (value 32.9)"},
           Case{"p.json", R"({"world_size": 1, "micro_batch_size": 2, "pipelines": [
                {"micro_batches": 1, "stages": [{"layers": [0, 2], "ranks": [4294967296]}]}]})",
                "--plan", "key \"ranks\"[0] is out of range (value 4294967296"},
       }) {
    write_file_atomic(dir / c.file, c.text);
    const auto r =
        run_malleus("train " + tiny_flags(dir) + " " + c.flag + " " + (dir / c.file).string());
    expect_error(r, {(dir / c.file).string(), c.expected});
    EXPECT_FALSE(fs::exists(dir / "run")) << c.text;
  }
  for (const std::string flags :
       {"--steps 2.5", "--global-batch 4294967304", "--seed -1", "--lr 1e999", "--lr abc"}) {
    const auto r = run_malleus("train " + tiny_flags(dir) + " " + flags);
    expect_error(r, {flags.substr(0, flags.find(' '))});
    EXPECT_FALSE(fs::exists(dir / "run")) << flags;
  }
}

TEST(Cli, LimitsAreCheckedBeforeAnythingIsAllocated) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  // --threads 100000 used to crash (exit 139).
  auto r = run_malleus("train " + tiny_flags(dir) + " --threads 100000");
  expect_error(r, {"\"threads\" is 100000, but this machine has", "CPUs"});
  EXPECT_EQ(r.exit_code, 1);
  // A 70B model on one rank used to end in a bare std::bad_alloc.
  r = run_malleus("train " + tiny_flags(dir) + " --model llama-70b");
  expect_error(r, {"model \"llama-70b\"", "does not fit", "GiB available"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_FALSE(fs::exists(dir / "run"));
}

namespace {

// Every path under `dir`, sorted: what a refused command must leave unchanged.
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(dir)) names.push_back(e.path().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST(Cli, TwoRunsCannotShareADirectoryAndCtrlCStopsWithACheckpoint) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  malleus::testing::BackgroundCommand first(
      std::string(MALLEUS_BINARY) + " train " + tiny_flags(dir) +
          " --steps 100000 --checkpoint-every 2 --eval-every 0",
      dir / "first.out");
  ASSERT_TRUE(first.wait_for_output("saved checkpoint", 60)) << first.output();
  // A second run on the same directory, fresh or resuming it, is refused while the first runs.
  for (const std::string& second :
       {"train " + tiny_flags(dir), "train --resume " + (dir / "run").string()}) {
    expect_error(run_malleus(second), {"run directory " + (dir / "run").string() +
                                       " is in use by pid " + std::to_string(first.pid())});
  }
  // 17.1 on one rank: Ctrl-C stops it after the step it is in, with a checkpoint of that step.
  ::kill(first.pid(), SIGINT);
  EXPECT_EQ(first.wait(60), 128 + SIGINT) << first.output();
  const std::string out = first.output();
  const std::string marker = "stopped by SIGINT after step ";
  const size_t at = out.find(marker);
  ASSERT_NE(at, std::string::npos) << out;
  const int stopped = std::atoi(out.c_str() + at + marker.size());
  char name[32];
  std::snprintf(name, sizeof name, "step_%08d", stopped);
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / name / "manifest.json")) << out;
  EXPECT_EQ(read_file(dir / "run" / "checkpoints" / "latest"), std::string(name) + "\n");
  EXPECT_EQ(out.find("is in use"), std::string::npos) << "the first run was disturbed\n" << out;
  // Its metrics hold one whole record per step it made, the second runs' none.
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    if (parse_json(line, "metrics").contains("loss")) ++steps;
  }
  EXPECT_EQ(steps, stopped);
}

TEST(Cli, FreshRunRefusesAnOldRunDirectory) {
  ScratchDir dir;
  train_two_steps(dir);
  const std::string metrics_before = read_file(dir / "run" / "metrics.jsonl");
  const auto files_before = listing(dir / "run");
  // It used to overwrite the old run's checkpoints and append to its metrics.
  const auto r = run_malleus("train " + tiny_flags(dir) + " --steps 3");
  expect_error(r, {"run directory " + (dir / "run").string() + " already holds a run",
                   "--resume " + (dir / "run").string()});
  EXPECT_EQ(read_file(dir / "run" / "metrics.jsonl"), metrics_before);
  EXPECT_EQ(listing(dir / "run"), files_before);
}

TEST(Cli, ResumingACopyWritesIntoTheCopy) {
  ScratchDir dir;
  train_two_steps(dir);
  const std::string metrics_before = read_file(dir / "run" / "metrics.jsonl");
  const auto files_before = listing(dir / "run");
  // The manifest records dir/run as the output directory; the copy must not write there.
  fs::copy(dir / "run", dir / "copy", fs::copy_options::recursive);
  auto r = run_malleus("train --resume " + (dir / "copy").string() + " --steps 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(read_file(dir / "run" / "metrics.jsonl"), metrics_before);
  EXPECT_EQ(listing(dir / "run"), files_before);
  EXPECT_TRUE(fs::exists(dir / "copy" / "checkpoints" / "step_00000003")) << r.output;
  EXPECT_EQ(read_file(dir / "copy" / "checkpoints" / "latest"), "step_00000003\n");
  EXPECT_GT(read_file(dir / "copy" / "metrics.jsonl").size(), metrics_before.size());
  // Resuming into another run's directory is refused too.
  r = run_malleus("train --resume " + (dir / "copy").string() + " --steps 4 --out " +
                  (dir / "run").string());
  expect_error(r, {"already holds a run"});
  EXPECT_EQ(listing(dir / "run"), files_before);
}

TEST(Cli, ManifestAndResumeInputsAreChecked) {
  ScratchDir dir;
  train_two_steps(dir);
  const fs::path manifest = dir / "run" / "checkpoints" / "step_00000002" / "manifest.json";
  const std::string original = read_file(manifest);
  // One bit of "step": 2 -> 3.
  std::string edited = original;
  const size_t at = edited.find("\"step\": 2");
  ASSERT_NE(at, std::string::npos) << original;
  edited[at + 8] = '3';
  write_file_atomic(manifest, edited);
  auto r = run_malleus("train --resume " + (dir / "run").string() + " --steps 5");
  expect_error(r, {"manifest.json is corrupt or was edited"});
  write_file_atomic(manifest, original);
  // --steps at or below the checkpoint's step does nothing, so it is refused.
  r = run_malleus("train --resume " + (dir / "run").string() + " --steps 2");
  expect_error(r, {"--steps is 2, but the checkpoint is already at step 2"});
  // --config with --resume: its keys count as given again, by the same rules as flags.
  write_file_atomic(dir / "more.json", R"({"steps": 4, "lr": 0.005})");
  r = run_malleus("train --print-config --resume " + (dir / "run").string() + " --config " +
                  (dir / "more.json").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Json printed = parse_json(r.output, "printed");
  EXPECT_EQ(printed["steps"], 4);
  EXPECT_FLOAT_EQ(printed["lr"].get<float>(), 0.005f);
  write_file_atomic(dir / "more.json", R"({"seq_len": 32})");
  r = run_malleus("train --resume " + (dir / "run").string() + " --config " +
                  (dir / "more.json").string());
  expect_error(r, {(dir / "more.json").string() + ": key \"seq_len\" is 32",
                   "the checkpoint's seq_len is 16"});
}

TEST(Cli, FullDiskDuringARunIsReportedAndLeavesWholeFiles) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  // Room for the metrics, not for a checkpoint (the tiny model's state is about 420 KB).
  malleus::testing::SmallFilesystem small(dir / "mnt", 128 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  const auto r = run_malleus("train " + tiny_flags(dir) + " --out " + (small / "run").string());
  expect_error(r, {"No space left on device"});
  EXPECT_EQ(r.exit_code, 1);
  const std::string metrics = read_file(small / "run" / "metrics.jsonl");
  ASSERT_FALSE(metrics.empty());
  EXPECT_EQ(metrics.back(), '\n');
  std::vector<std::string> left;
  for (const auto& e : fs::recursive_directory_iterator(small / "run")) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) {
      left.push_back(e.path().string());
    }
  }
  EXPECT_TRUE(left.empty()) << left.front();
  EXPECT_FALSE(fs::exists(small / "run" / "checkpoints" / "latest"));
}

// A learning rate far too high makes the loss or the gradient norm of a step non-finite: the run
// stops there by itself, naming the step, without saving it; every checkpoint on disk is of an
// earlier step (the one still being written is committed) and holds finite weights, and eval
// refuses a checkpoint whose mean loss is not finite.
TEST(Cli, NonFiniteStepStopsTheRunAndKeepsTheLastCheckpoint) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto r = run_malleus("train " + tiny_flags(dir) +
                             " --steps 8 --lr 1e30 --warmup-steps 0 --grad-clip 0"
                             " --checkpoint-every 1 --eval-every 0");
  const std::string run = (dir / "run").string();
  expect_error(r, {"is not finite (loss ", "--resume " + run});
  const size_t at = r.output.find("error: step ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const int stopped = std::atoi(r.output.c_str() + at + std::strlen("error: step "));
  ASSERT_GE(stopped, 2) << r.output;
  ASSERT_LE(stopped, 8) << r.output;
  EXPECT_NE(r.output.find("the last checkpoint, " + run + "/checkpoints/step_0000000" +
                          std::to_string(stopped - 1) + ", is intact"),
            std::string::npos)
      << r.output;
  for (int step = 1; step < stopped; ++step) {
    const checkpoint::Checkpoint c = checkpoint::load_checkpoint(
        dir / "run" / "checkpoints" / ("step_0000000" + std::to_string(step)), false);
    EXPECT_EQ(c.step, step);
    EXPECT_TRUE(std::all_of(c.params.begin(), c.params.end(), [](float x) {
      return std::isfinite(x);
    })) << step;
  }
  for (int step = stopped; step <= 8; ++step) {
    EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints" / ("step_0000000" + std::to_string(step))))
        << step;
  }
  std::ifstream metrics(dir / "run" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    EXPECT_LT(parse_json(line, "metrics")["step"].get<int>(), stopped) << line;
  }

  // A checkpoint with NaN weights: eval exits non-zero naming the loss.
  checkpoint::Checkpoint c =
      checkpoint::load_checkpoint(dir / "run" / "checkpoints" / "step_00000001", true);
  for (size_t i = 0; i < c.params.size(); i += 97) c.params[i] = std::nanf("");
  checkpoint::save_checkpoint(dir / "nan", c);
  expect_error(run_malleus("eval --checkpoint " + (dir / "nan").string() + " --data '" +
                           (dir / "data" / "val_*.bin").string() + "'"),
               {"the mean loss is nan", (dir / "nan").string()});
}
