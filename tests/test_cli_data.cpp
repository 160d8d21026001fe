// `malleus prepare-data` end to end on data as users hold it: a compressed JSON Lines corpus,
// prepared with a SentencePiece model, holds the ids Debian's spm_encode gives and trains with
// `malleus train`; memory stays flat as the corpus grows; bad input exits non-zero naming the file
// and line; progress lines.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <regex>
#include <sstream>

#include "common/files.h"
#include "data/shard.h"
#include "test_util.h"

using namespace malleus;
using malleus::testing::run_command;
using malleus::testing::run_malleus;
using malleus::testing::ScratchDir;

namespace {

void shell(const std::string& command) {
  const auto result = run_command(command);
  ASSERT_EQ(result.exit_code, 0) << command << "\n" << result.output;
}

// The documents as JSON Lines, written by Python's json module.
void write_json_lines(const fs::path& texts_file, const fs::path& out) {
  shell(std::string(MALLEUS_PYTHON) +
        " -c 'import sys, json\n"
        "for line in open(sys.argv[1], encoding=\"utf-8\"):\n"
        "  print(json.dumps({\"id\": 0, \"text\": line.rstrip(\"\\n\"), \"url\": \"x\"}))' " +
        texts_file.string() + " > " + out.string());
}

std::vector<uint16_t> shards_of(const fs::path& dir, const std::string& split) {
  std::vector<uint16_t> tokens;
  for (const auto& path : expand_files((dir / (split + "_*.bin")).string())) {
    data::append_shard(path, tokens);
  }
  return tokens;
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

// Runs a command line; returns its exit code and its peak resident memory in KiB.
std::pair<int, long> run_measuring_memory(const std::string& command) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", ("exec " + command + " > /dev/null").c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  struct rusage usage {};
  ::wait4(pid, &status, 0, &usage);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, usage.ru_maxrss};
}

}  // namespace

TEST(PrepareDataCli, CompressedJsonLinesMatchSpmEncodeAndTrain) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  // 630 one-line documents (spm_encode reads a line as a sentence).
  std::string texts;
  const auto lines = malleus::testing::tokenizer_corpus_lines();
  for (int round = 0; round < 3; ++round) {
    for (const auto& line : lines) texts += line + " (" + std::to_string(round) + ")\n";
  }
  write_file_atomic(dir / "texts.txt", texts);
  write_json_lines(dir / "texts.txt", dir / "corpus.jsonl");
  shell("zstd -q -c " + d + "/corpus.jsonl > " + d + "/corpus.jsonl.zst");
  shell("gzip -c " + d + "/corpus.jsonl > " + d + "/corpus.jsonl.gz");

  // The tokenizer is trained on the compressed JSON Lines too.
  auto r = run_malleus("train-tokenizer --input " + d + "/corpus.jsonl.gz --vocab-size 320 " +
                       "--output " + d + "/tok.model --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("on 630 lines of 1 files"), std::string::npos) << r.output;

  const auto spm = run_command("spm_encode --model " + d + "/tok.model --output_format=id " +
                               "--extra_options=bos:eos < " + d + "/texts.txt");
  ASSERT_EQ(spm.exit_code, 0) << "spm_encode (Debian package sentencepiece): " << spm.output;
  std::vector<std::vector<uint16_t>> expected_docs;
  std::istringstream spm_lines(spm.output);
  for (std::string line; std::getline(spm_lines, line);) {
    std::istringstream ids(line);
    expected_docs.emplace_back();
    for (int id; ids >> id;) expected_docs.back().push_back(static_cast<uint16_t>(id));
  }
  ASSERT_EQ(expected_docs.size(), 630u);
  // Document k is validation data when floor((k + 1) / 10) > floor(k / 10).
  std::vector<uint16_t> expected_train, expected_val;
  for (size_t k = 0; k < expected_docs.size(); ++k) {
    auto& split = (k + 1) % 10 == 0 ? expected_val : expected_train;
    split.insert(split.end(), expected_docs[k].begin(), expected_docs[k].end());
  }

  for (const std::string input : {"corpus.jsonl.zst", "corpus.jsonl.gz"}) {
    for (const std::string threads : {"1", "2"}) {
      r = run_malleus("prepare-data --input " + d + "/" + input + " --output " + d +
                      "/data --tokenizer " + d + "/tok.model --val-fraction 0.1 --threads " +
                      threads + " --shard-tokens 2000");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("prepared 630 documents from 1 files"), std::string::npos)
          << r.output;
      EXPECT_EQ(shards_of(dir / "data", "train"), expected_train) << input << ", " << threads;
      EXPECT_EQ(shards_of(dir / "data", "val"), expected_val) << input << ", " << threads;
    }
  }

  r = run_malleus(
      "train --model tiny --seq-len 16 --micro-batch 4 --global-batch 8 --threads 1 "
      "--warmup-steps 2 --lr 0.01 --eval-every 10 --steps 20 --train-data '" +
      d + "/data/train_*.bin' --val-data '" + d + "/data/val_*.bin' --out " + d + "/run");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("vocab_size 257 -> 320"), std::string::npos) << r.output;
  const auto curve = losses(r.output);
  ASSERT_EQ(curve.size(), 20u) << r.output;
  for (double loss : curve) EXPECT_TRUE(std::isfinite(loss));
  EXPECT_LT(curve.back(), curve.front() - 0.5) << r.output;
}

TEST(PrepareDataCli, BadInputExitsNamingFileAndLineOrIsCountedWithSkipBad) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  write_file_atomic(dir / "c.jsonl", "{\"text\": \"good\"}\n{\"text\": 7}\n{\"text\": \"fine\"}\n");
  auto r = run_malleus("prepare-data --input " + d + "/c.jsonl --output " + d + "/out");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("error: " + d + "/c.jsonl:2: \"text\" holds a number, not a string"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "train_000000.bin"));
  EXPECT_FALSE(fs::exists(dir / "out" / ".prepare-data.partial"));

  r = run_malleus("prepare-data --skip-bad --input " + d + "/c.jsonl --output " + d + "/out");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("prepared 2 documents"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("left out 1 bad document (--skip-bad): 1 not a string at the key "
                          "(first: " +
                          d + "/c.jsonl:2)"),
            std::string::npos)
      << r.output;

  r = run_malleus("prepare-data --json-key body --input " + d + "/c.jsonl --output " + d + "/out");
  EXPECT_NE(r.output.find(d + "/c.jsonl:1: no key \"body\" (--json-key)"), std::string::npos)
      << r.output;
  r = run_malleus("prepare-data --format csv --input " + d + "/c.jsonl --output " + d + "/out");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("csv"), std::string::npos) << r.output;
  r = run_malleus("prepare-data --max-document-mb 0 --input " + d + "/c.jsonl --output " + d +
                  "/out");
  EXPECT_NE(r.output.find("--max-document-mb must be in [1, 1048576], got 0"), std::string::npos)
      << r.output;

  shell("printf 'BZh91AY&SY...' > " + d + "/c.jsonl.bz2");
  r = run_malleus("prepare-data --input " + d + "/c.jsonl.bz2 --output " + d + "/out");
  EXPECT_NE(r.output.find(d + "/c.jsonl.bz2: bzip2-compressed"), std::string::npos) << r.output;
}

TEST(PrepareDataCli, PrintsProgressLines) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  std::string texts;
  for (int i = 0; i < 20000; ++i) texts += "document number " + std::to_string(i) + "\n";
  write_file_atomic(dir / "texts.txt", texts);
  write_json_lines(dir / "texts.txt", dir / "c.jsonl");
  shell("xz -c " + d + "/c.jsonl > " + d + "/c.jsonl.xz");
  const auto r = run_malleus("prepare-data --input " + d + "/c.jsonl.xz --output " + d +
                             "/out --progress-seconds 0.000001");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::regex progress(
      R"(prepare-data: [0-9.]+k? documents, [0-9.]+[kM]? tokens, [0-9.]+ MB/s, \d+ % of [0-9.]+ KiB read, ETA )");
  EXPECT_TRUE(std::regex_search(r.output, progress)) << r.output;
  EXPECT_NE(r.output.find("prepared 20000 documents"), std::string::npos) << r.output;
}

// A disk that fills midway: the run stops naming the shard and the device's error, and the output
// directory is left as it was (the earlier run's shards, whole; no partial directory).
TEST(PrepareDataCli, FullDiskStopsTheRunAndLeavesTheOutputAsItWas) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  malleus::testing::SmallFilesystem small(dir / "mnt", 256 * 1024);
  MALLEUS_REQUIRE_SMALL_FILESYSTEM(small);
  write_file_atomic(dir / "small.txt", "an earlier run\n");
  const std::string out = (small / "out").string();
  auto r = run_malleus("prepare-data --input " + d + "/small.txt --output " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string earlier = read_file(small / "out" / "train_000000.bin");
  std::string big;
  for (int i = 0; i < 4000; ++i)
    big += "a document of some length, number " + std::to_string(i) + "\n%\n";
  write_file_atomic(dir / "big.txt", big);  // about 160 KB of text: 320 KB of byte tokens
  r = run_malleus("prepare-data --input " + d + "/big.txt --output " + out +
                  " --shard-tokens 20000");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("No space left on device"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(".prepare-data.partial/train_0000"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(small / "out" / ".prepare-data.partial"));
  EXPECT_EQ(read_file(small / "out" / "train_000000.bin"), earlier);
  EXPECT_FALSE(fs::exists(small / "out" / "train_000001.bin"));
}

// Peak memory is bounded by what is in flight (prepare.h: 2 × threads + 2 batches of about 1 MiB of
// text, their tokens, and buffers), not by the corpus: 32 MB and 160 MB of text (compressed, and
// giving 64 MB and 320 MB of shards) both stay under 80 MiB, less than either corpus takes whole.
TEST(PrepareDataCli, MemoryStaysBoundedWhateverTheCorpusSizeSlow) {
  ScratchDir dir;
  const std::string d = dir.path().string();
  for (int megabytes : {32, 160}) {
    const std::string corpus = d + "/corpus" + std::to_string(megabytes) + ".txt.zst";
    // Fortune-style documents of about 1 KB, each a little different.
    shell(std::string(MALLEUS_PYTHON) +
          " -c 'import sys\n"
          "out = sys.stdout\n"
          "for i in range(" +
          std::to_string(megabytes) +
          " * 1000):\n"
          "  out.write(\"document %d \" % i + \"lorem ipsum dolor sit amet \" * 37 + \"\\n%\\n\")' "
          "| zstd -q -c > " +
          corpus);
    const auto [code, peak_kib] =
        run_measuring_memory(std::string(MALLEUS_BINARY) + " prepare-data --input " + corpus +
                             " --output " + d + "/out --threads 2 --val-fraction 0");
    ASSERT_EQ(code, 0);
    EXPECT_LT(peak_kib, 80 * 1024) << "peak KiB for " << megabytes << " MB of text";
    std::printf("peak memory for %d MB of text: %.1f MiB\n", megabytes,
                static_cast<double>(peak_kib) / 1024);
    fs::remove_all(dir / "out");
  }
}
