// The commands around models end to end: train-tokenizer → prepare-data --tokenizer → train (the
// SentencePiece shards train: loss finite and falling) → generate (deterministic under a seed,
// the same with and without the cache) → export → import → export (byte-identical) → train
// --resume from the import; and their errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <regex>

#include "common/files.h"
#include "test_util.h"

using namespace malleus;
using malleus::testing::run_malleus;
using malleus::testing::ScratchDir;

namespace {

void expect_error(const malleus::testing::CommandResult& r,
                  std::initializer_list<std::string> parts) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("error:"), std::string::npos) << r.output;
  for (const auto& part : parts) EXPECT_NE(r.output.find(part), std::string::npos) << r.output;
}

std::vector<double> losses(const std::string& output) {
  std::vector<double> values;
  const std::regex line(R"(step +\d+/\d+ \| loss ([0-9.]+))");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line);
       it != std::sregex_iterator(); ++it) {
    values.push_back(std::stod((*it)[1]));
  }
  return values;
}

// Generated text: stdout without the statistics line (which goes to stderr, merged here).
std::string text_of(const std::string& output) {
  return output.substr(0, output.rfind("\n["));
}

}  // namespace

TEST(CliModels, SentencePieceTrainGenerateExportImportResume) {
  ScratchDir dir;
  std::string corpus;
  for (const auto& line : malleus::testing::tokenizer_corpus_lines()) corpus += line + "\n%\n";
  write_file_atomic(dir / "corpus.txt", corpus);
  const std::string d = dir.path().string();

  auto r = run_malleus("train-tokenizer --input " + d + "/corpus.txt --vocab-size 320 --output " +
                       d + "/tok.model --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("320 tokens (bos 1, eos 2, pad none, unk 0)"), std::string::npos)
      << r.output;
  r = run_malleus("prepare-data --input " + d + "/corpus.txt --output " + d + "/data --tokenizer " +
                  d + "/tok.model");
  ASSERT_EQ(r.exit_code, 0) << r.output;

  const std::string train =
      "train --model tiny --seq-len 16 --micro-batch 4 --global-batch 8 "
      "--threads 1 --warmup-steps 2 --lr 0.01 --eval-every 0 "
      "--train-data '" +
      d + "/data/train_*.bin' --val-data '" + d + "/data/val_*.bin'";
  r = run_malleus(train + " --steps 25 --out " + d + "/run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("vocab_size 257 -> 320"), std::string::npos) << r.output;
  const auto curve = losses(r.output);
  ASSERT_EQ(curve.size(), 25u) << r.output;
  for (double loss : curve) EXPECT_TRUE(std::isfinite(loss));
  EXPECT_NEAR(curve.front(), std::log(320.0), 0.3);  // starts near uniform over the vocabulary
  EXPECT_LT(curve.back(), curve.front() - 1.0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / "step_00000025" / "tokenizer.model"));

  const std::string generate = "generate --checkpoint " + d + "/run --prompt 'The old' " +
                               "--max-tokens 40 --temperature 0.9 --top-k 50 --top-p 0.95";
  const auto first = run_malleus(generate + " --seed 7");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_EQ(first.output.rfind("The old", 0), 0u) << first.output;  // the prompt comes first
  EXPECT_NE(first.output.find("tokens/s"), std::string::npos) << first.output;
  const auto again = run_malleus(generate + " --seed 7");
  EXPECT_EQ(text_of(again.output), text_of(first.output));
  EXPECT_EQ(text_of(run_malleus(generate + " --seed 7 --no-cache").output), text_of(first.output));

  r = run_malleus("export --checkpoint " + d + "/run --output " + d + "/hf");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = run_malleus("import --input " + d + "/hf --output " + d + "/imported");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // An existing checkpoint is replaced only with --force; another directory never.
  const std::string manifest = read_file(dir / "imported" / "manifest.json");
  expect_error(run_malleus("import --input " + d + "/hf --output " + d + "/imported"),
               {d + "/imported is a checkpoint already", "--force"});
  expect_error(run_malleus("import --input " + d + "/hf --output " + d + "/run --force"),
               {d + "/run exists and is not a checkpoint"});
  EXPECT_TRUE(fs::exists(dir / "run" / "metrics.jsonl"));
  EXPECT_EQ(read_file(dir / "imported" / "manifest.json"), manifest);
  r = run_malleus("import --input " + d + "/hf --output " + d + "/imported --force");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const auto& entry : fs::directory_iterator(dir.path())) {  // no temporary left beside it
    EXPECT_NE(entry.path().filename().string().rfind("imported.", 0), 0u) << entry.path();
  }
  // A NaN weight (the first element of the first tensor's data): refused naming the tensor,
  // and nothing is written, not even with --force onto the good checkpoint.
  fs::create_directories(dir / "hfnan");
  for (const auto& entry : fs::directory_iterator(dir / "hf")) {
    fs::copy_file(entry.path(), dir / "hfnan" / entry.path().filename());
  }
  std::string weights = read_file(dir / "hf" / "model.safetensors");
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = header << 8 | static_cast<unsigned char>(weights[i]);
  const float nan = std::nanf("");
  std::memcpy(weights.data() + 8 + header, &nan, sizeof nan);
  write_file_atomic(dir / "hfnan" / "model.safetensors", weights);
  expect_error(run_malleus("import --input " + d + "/hfnan --output " + d + "/nan"),
               {"model.safetensors: tensor \"", "holds NaN at index [0, 0]"});
  EXPECT_FALSE(fs::exists(dir / "nan"));
  const std::string before = read_file(dir / "imported" / "manifest.json");
  expect_error(run_malleus("import --input " + d + "/hfnan --output " + d + "/imported --force"),
               {"holds NaN"});
  EXPECT_EQ(read_file(dir / "imported" / "manifest.json"), before);
  r = run_malleus("export --checkpoint " + d + "/imported --output " + d + "/hf2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* file :
       {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"}) {
    EXPECT_TRUE(read_file(dir / "hf" / file) == read_file(dir / "hf2" / file)) << file;
  }
  // The imported model generates what the trained one does.
  EXPECT_EQ(
      text_of(run_malleus("generate --checkpoint " + d + "/imported --prompt 'The old' " +
                          "--max-tokens 40 --temperature 0.9 --top-k 50 --top-p 0.95 " + "--seed 7")
                  .output),
      text_of(first.output));
  // Training continues from the imported weights with a fresh optimizer.
  // The model is the checkpoint's; at step 0 the batch and sequence length are the run's choice.
  std::string resume = train;
  resume.replace(resume.find("--model tiny "), std::string("--model tiny ").size(), "");
  r = run_malleus(resume + " --steps 5 --resume " + d + "/imported --out " + d + "/tuned");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto tuned = losses(r.output);
  ASSERT_EQ(tuned.size(), 5u) << r.output;
  EXPECT_LT(tuned.front(), curve.front() - 1.0);  // it starts where the trained model was
}

TEST(CliModels, ErrorsAreNamed) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  write_file_atomic(dir / "bad.model", "not a sentencepiece model");
  malleus::testing::write_synthetic_corpus(dir / "data");
  expect_error(run_malleus("prepare-data --input " + d + "/data --output " + d +
                           "/out --tokenizer " + d + "/bad.model"),
               {"bad.model", "SentencePiece"});
  expect_error(run_malleus("prepare-data --input " + d + "/data --output " + d +
                           "/out --tokenizer " + d + "/none.model"),
               {"none.model", "no such file"});
  expect_error(run_malleus("generate --checkpoint " + d + "/nowhere"), {"nowhere"});
  expect_error(run_malleus("import --input " + d + " --output " + d + "/x"), {"config.json"});
  expect_error(run_malleus("train-tokenizer --input " + d + "/data/train_000000.bin --output " + d +
                           "/t.model"),
               {"no text"});
  // The inputs are train-tokenizer's as much as prepare-data's: the message names the flag, not
  // the other command.
  const auto missing =
      run_malleus("train-tokenizer --input " + d + "/missing.txt --output " + d + "/t.model");
  expect_error(missing, {"--input " + d + "/missing.txt: no such file or directory"});
  EXPECT_EQ(missing.output.find("prepare-data"), std::string::npos) << missing.output;

  // A checkpoint trained on byte-tokenized data generates bytes; sampling options are checked.
  const std::string run =
      "train --model tiny --seq-len 16 --micro-batch 2 --global-batch 2 "
      "--steps 1 --threads 1 --eval-every 0 --train-data '" +
      d + "/data/train_*.bin' --val-data '' --out " + d + "/run";
  ASSERT_EQ(run_malleus(run).exit_code, 0);
  const auto ok = run_malleus("generate --checkpoint " + d + "/run --max-tokens 5 --seed 1");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("byte"), std::string::npos) << ok.output;
  expect_error(run_malleus("generate --checkpoint " + d + "/run --temperature -1"),
               {"temperature"});
  expect_error(run_malleus("generate --checkpoint " + d + "/run --top-p 0"), {"top-p"});
  expect_error(run_malleus("generate --checkpoint " + d + "/run --context 100"),
               {"--context 100", "max_seq_len"});
  expect_error(run_malleus("generate --checkpoint " + d + "/run --tokenizer " + d + "/bad.model"),
               {"bad.model"});
  // The model as training initialises it, for a "before training" sample.
  const auto untrained = run_malleus("generate --untrained tiny --tokenizer byte --max-tokens 5");
  EXPECT_EQ(untrained.exit_code, 0) << untrained.output;
  // A prompt ending in U+FFFD is held back as an incomplete character until the end of
  // generation, then shown: with no new token, the prompt itself.
  const auto replacement = run_malleus(
      "generate --untrained tiny --tokenizer byte --max-tokens 0 --prompt 'price: 5 \xEF\xBF\xBD'");
  EXPECT_EQ(replacement.exit_code, 0) << replacement.output;
  EXPECT_EQ(text_of(replacement.output), "price: 5 \xEF\xBF\xBD") << replacement.output;
  expect_error(run_malleus("generate --untrained tiny"), {"--tokenizer"});
  expect_error(run_malleus("generate --untrained tiny --checkpoint " + d + "/run"),
               {"either --checkpoint or --untrained"});
}

// Shards without a tokenizer record (llm.c's, or prepared before records existed) train as before;
// once the data has its record, resuming such a checkpoint goes on and records the tokenizer.
TEST(CliModels, CheckpointWithoutTokenizerResumesOnRecordedData) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  malleus::testing::write_synthetic_corpus(dir / "data");
  fs::remove(dir / "data" / "tokenizer_meta.json");
  const std::string run =
      "train --model tiny --seq-len 16 --micro-batch 2 --global-batch 2 "
      "--threads 1 --eval-every 0 --train-data '" +
      d + "/data/train_*.bin' --val-data '' --out " + d + "/run";
  ASSERT_EQ(run_malleus(run + " --steps 2").exit_code, 0);
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints" / "step_00000002" / "tokenizer_meta.json"));
  expect_error(run_malleus("generate --checkpoint " + d + "/run"), {"records no tokenizer"});
  tokenizer::save_tokenizer(tokenizer::ByteTokenizer(), dir / "data");
  const auto resumed = run_malleus("train --resume " + d + "/run --steps 3");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / "step_00000003" / "tokenizer_meta.json"));
  EXPECT_EQ(run_malleus("generate --checkpoint " + d + "/run --max-tokens 3").exit_code, 0);
}
