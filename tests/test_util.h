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
#include "model/config.h"
#include "tokenizer/byte_tokenizer.h"
#include "tokenizer/sentencepiece_tokenizer.h"

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

// Token ids as shards hold them.
inline std::vector<uint16_t> shard_tokens(const std::vector<int32_t>& ids) {
  return {ids.begin(), ids.end()};
}

// English-like text with enough regularity that a tiny model's loss falls within a few dozen
// steps; written as byte-tokenized train and val shards under `dir`, with the tokenizer's record.
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
  const tokenizer::ByteTokenizer bytes;
  fs::create_directories(dir);
  data::write_shard(dir / "train_000000.bin", shard_tokens(bytes.encode(train)));
  data::write_shard(dir / "val_000000.bin", shard_tokens(bytes.encode(val)));
  tokenizer::save_tokenizer(bytes, dir);
}

// About 9 KB of English-like lines with punctuation and numbers: enough for a few hundred
// SentencePiece pieces.
inline std::vector<std::string> tokenizer_corpus_lines() {
  const char* subjects[] = {"The old sailor", "A quiet child", "Every teacher",   "My neighbour",
                            "The clever fox", "Nobody",        "Your best friend"};
  const char* verbs[] = {"remembers",    "forgets",   "believes in",
                         "writes about", "laughs at", "dreams of"};
  const char* objects[] = {"the long winter.",
                           "a red balloon!",
                           "the 12 wise men?",
                           "three silver coins.",
                           "the sea, the sky and the wind.",
                           "what happened in 1984."};
  std::vector<std::string> lines;
  for (int i = 0; i < 210; ++i) {
    lines.push_back(std::string(subjects[i % 7]) + " " + verbs[(i / 7) % 6] + " " +
                    objects[(i / 42) % 6]);
  }
  return lines;
}

// A SentencePiece model ("bpe" or "unigram") trained on tokenizer_corpus_lines().
inline std::shared_ptr<const tokenizer::Tokenizer> small_sentencepiece(const std::string& type,
                                                                       int vocab) {
  const auto lines = tokenizer_corpus_lines();
  size_t next = 0;
  tokenizer::SentencePieceTraining options;
  options.vocab_size = vocab;
  options.model_type = type;
  const std::string model = tokenizer::train_sentencepiece(
      [&](std::string& sentence) {
        if (next == lines.size()) return false;
        sentence = lines[next++];
        return true;
      },
      options);
  return tokenizer::sentencepiece_from_bytes(model, "trained " + type + " model");
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

#ifdef MALLEUS_BINARY
// Runs `malleus <arguments>`.
inline CommandResult run_malleus(const std::string& arguments) {
  return run_command(std::string(MALLEUS_BINARY) + " " + arguments);
}
#endif

}  // namespace malleus::testing
