// The `malleus` command end to end: help, and one test per kind of bad input — each must give a
// clear error and a non-zero exit, and leave what is already on disk untouched.
#include <gtest/gtest.h>

#include <fstream>

#include "common/files.h"
#include "test_util.h"

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
  // Flip one byte in the middle of the parameters.
  const auto params = ckpt / "params.bin";
  std::string bytes = read_file(params);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x40);
  {
    std::ofstream out(params, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  // An earlier export must survive a failed one.
  fs::create_directories(dir / "hf");
  write_file_atomic(dir / "hf" / "model.safetensors", "previous export");
  expect_error(run_malleus("train --resume " + ckpt.string() + " --steps 3"),
               {"params.bin", "corrupt"});
  expect_error(run_malleus("eval --checkpoint " + ckpt.string()), {"params.bin"});
  expect_error(
      run_malleus("export --checkpoint " + ckpt.string() + " --output " + (dir / "hf").string()),
      {"params.bin"});
  EXPECT_EQ(read_file(dir / "hf" / "model.safetensors"), "previous export");
  EXPECT_EQ(read_file(params), bytes);  // refused, not "repaired" or deleted
  // Truncation is reported as such.
  fs::resize_file(params, 100);
  expect_error(run_malleus("eval --checkpoint " + ckpt.string()), {"params.bin", "truncated"});
  expect_error(run_malleus("eval --checkpoint " + (dir / "nowhere").string()), {"nowhere"});
}
