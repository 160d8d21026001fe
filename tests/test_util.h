// Shared test helpers: scratch directories, a small synthetic corpus, running the CLI.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>

#include "common/error.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "model/config.h"

namespace malleus::testing {

namespace fs = std::filesystem;

// A fresh directory, removed afterwards; named after the running test, so tests can run in
// parallel (ctest -j) and leave nothing behind.
class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("malleus_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
             std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// The message of the malleus::Error that `f` throws, or "" if it throws none.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Small, but with room for uneven parallel shares: 8 heads in 4 KV groups, 4 layers.
inline model::ModelConfig parallel_test_model() {
  model::ModelConfig c;
  c.name = "parallel-test";
  c.vocab_size = 257;
  c.hidden_size = 32;
  c.num_layers = 4;
  c.num_heads = 8;
  c.num_kv_heads = 4;
  c.ffn_hidden_size = 48;
  c.max_seq_len = 16;
  c.init_std = 0.1f;
  return c;
}

// English-like text with enough regularity that a tiny model's loss falls within a few dozen
// steps; written as train and val shards under `dir`.
inline void write_synthetic_corpus(const fs::path& dir) {
  const char* subjects[] = {"the cat", "a dog", "my friend", "the old man", "our teacher"};
  const char* verbs[] = {"sees", "likes", "finds", "reads", "paints"};
  const char* objects[] = {"a red ball.", "the blue sky.", "an old book.", "the green tree."};
  std::string train, val;
  for (int i = 0; i < 400; ++i) {
    std::string sentence = std::string(subjects[i % 5]) + " " + verbs[(i / 5) % 5] + " " +
                           objects[(i / 25) % 4] + "\n";
    (i % 10 == 9 ? val : train) += sentence;
  }
  data::ByteTokenizer tokenizer;
  fs::create_directories(dir);
  data::write_shard(dir / "train_000000.bin", tokenizer.encode(train));
  data::write_shard(dir / "val_000000.bin", tokenizer.encode(val));
}

struct CommandResult {
  int exit_code;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line.
inline CommandResult run_command(const std::string& command) {
  CommandResult result{-1, ""};
  std::FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  std::array<char, 4096> chunk;
  size_t n;
  while ((n = std::fread(chunk.data(), 1, chunk.size(), pipe)) > 0)
    result.output.append(chunk.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

#ifdef MALLEUS_PYTHON
// Parses `path` with Python's xml.etree (an XML parser independent of ours) and prints every
// element's text and attribute values, one per line; the exit code is non-zero unless the file is
// well-formed XML.
inline CommandResult parse_xml(const fs::path& path) {
  return run_command(std::string(MALLEUS_PYTHON) +
                     " -c 'import sys, xml.etree.ElementTree as E\n"
                     "for e in E.parse(sys.argv[1]).iter():\n"
                     "  print(e.text or \"\")\n"
                     "  for v in e.attrib.values(): print(v)' " +
                     path.string());
}
#endif

#ifdef MALLEUS_BINARY
// Runs `malleus <arguments>`.
inline CommandResult run_malleus(const std::string& arguments) {
  return run_command(std::string(MALLEUS_BINARY) + " " + arguments);
}
#endif

}  // namespace malleus::testing
