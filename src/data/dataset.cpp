#include "data/dataset.h"

#include <filesystem>
#include <numeric>
#include <random>
#include <system_error>

#include "common/error.h"
#include "common/files.h"
#include "common/hash.h"
#include "data/shard.h"

namespace malleus::data {

namespace {

// Uniform in [0, bound) by rejection. std::uniform_int_distribution is not used because its
// algorithm is implementation-defined, and the permutation must be the same with every standard
// library, or a run could not be resumed or compared across machines.
uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound: the biased low values
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

TokenDataset::TokenDataset(const std::string& pattern, int vocab_size) : pattern_(pattern) {
  check(vocab_size > 0, "vocab_size must be positive, got " + std::to_string(vocab_size));
  const std::vector<fs::path> files = expand_files(pattern);

  // Reserve from the file sizes first, so the corpus never needs twice its size in memory while
  // the vector grows. A malformed size is caught by append_shard; this is only a hint.
  uintmax_t hint = 0;
  for (const auto& file : files) {
    std::error_code ec;
    const uintmax_t bytes = fs::file_size(file, ec);
    if (!ec && bytes > kShardHeaderInts * sizeof(int32_t)) {
      hint += (bytes - kShardHeaderInts * sizeof(int32_t)) / sizeof(uint16_t);
    }
  }
  tokens_.reserve(static_cast<size_t>(hint));

  for (const auto& file : files) {
    const size_t begin = tokens_.size();
    append_shard(file, tokens_);
    // Checked here, once, rather than in the embedding lookup: a GPT-2 shard fed to a byte-level
    // model would otherwise index past the embedding table.
    for (size_t i = begin; i < tokens_.size(); ++i) {
      check(tokens_[i] < vocab_size, file.string() + " holds token " + std::to_string(tokens_[i]) +
                                         " (at position " + std::to_string(i - begin) +
                                         "), but the model's vocab_size is " +
                                         std::to_string(vocab_size));
    }
    ++num_shards_;
  }
  check(!tokens_.empty(), pattern + ": the token corpus is empty (" + std::to_string(num_shards_) +
                              " shard(s), 0 tokens)");
}

Sampler::Sampler(const TokenDataset& dataset, int seq_len, uint64_t seed)
    : dataset_(dataset), seq_len_(seq_len), seed_(seed), num_windows_(0) {
  check(seq_len > 0, "seq_len must be positive, got " + std::to_string(seq_len));
  const int64_t n = dataset.num_tokens();
  check(n >= static_cast<int64_t>(seq_len) + 1,
        dataset.pattern() + " holds " + std::to_string(n) +
            " tokens, too few for one training sequence of seq_len " + std::to_string(seq_len) +
            " (needs seq_len + 1 = " + std::to_string(static_cast<int64_t>(seq_len) + 1) + ")");
  // Windows overlap by one token (a window's last target is the next window's first input), so
  // every token but the very first is a target exactly once per epoch.
  num_windows_ = (n - 1) / seq_len;
}

const std::vector<int64_t>& Sampler::permutation(int64_t epoch) {
  if (epoch == cached_epoch_) return order_;
  order_.resize(static_cast<size_t>(num_windows_));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  std::mt19937_64 rng(mix64(seed_ ^ mix64(static_cast<uint64_t>(epoch))));
  // Fisher–Yates written out: std::shuffle's algorithm differs between standard libraries.
  for (size_t i = order_.size(); i > 1; --i) {
    const auto j = static_cast<size_t>(uniform_below(rng, i));
    std::swap(order_[i - 1], order_[j]);
  }
  cached_epoch_ = epoch;
  return order_;
}

void Sampler::sample(int64_t index, int32_t* inputs, int32_t* targets) {
  check(index >= 0, "sample index must be non-negative, got " + std::to_string(index));
  const int64_t epoch = index / num_windows_;
  const int64_t pos = index % num_windows_;
  const int64_t window = permutation(epoch)[static_cast<size_t>(pos)];
  const uint16_t* start = dataset_.tokens().data() + window * seq_len_;
  for (int t = 0; t < seq_len_; ++t) {
    inputs[t] = start[t];
    targets[t] = start[t + 1];
  }
}

}  // namespace malleus::data
