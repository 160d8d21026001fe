// A token corpus (one or more shards) and the sampler that turns (global sample index) into a
// training sequence. The mapping depends only on the seed, the corpus and the sequence length:
// sample i of the global batch is the same sequence whatever pipeline or micro-batch later
// processes it, which is what makes training results independent of the parallel plan.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace malleus::data {

class TokenDataset {
 public:
  // `pattern` is a shard file or a wildcard pattern ("data/train_*.bin"). Throws Error if nothing
  // matches, a shard is malformed, the corpus holds no tokens, or a token is >= vocab_size (naming
  // the file, the token and the vocab size).
  TokenDataset(const std::string& pattern, int vocab_size);

  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int num_shards() const { return num_shards_; }
  const std::vector<uint16_t>& tokens() const { return tokens_; }
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  std::vector<uint16_t> tokens_;  // all shards concatenated in file-name order
  int num_shards_ = 0;
};

// Cuts the corpus into windows of seq_len + 1 tokens (inputs and targets shifted by one). Window w
// starts at token w * seq_len, so neighbouring windows share one boundary token and the
// input/target pairs of all windows cover the corpus: windows_per_epoch() = (tokens - 1) / seq_len
// (a tail shorter than a window is not used). The windows are visited in a seeded random order,
// epoch after epoch, each epoch a fresh permutation. The permutation is computed with our own
// generator code, so it is the same on every platform and standard library.
//
// Keeps a reference to the dataset, which must outlive it. Not thread-safe (sample() caches the
// current epoch's permutation); give each thread its own Sampler.
class Sampler {
 public:
  // Throws Error if the corpus is shorter than one window (naming the corpus, its token count and
  // seq_len).
  Sampler(const TokenDataset& dataset, int seq_len, uint64_t seed);

  // Fills inputs[seq_len] and targets[seq_len] for sample `index` (counted over the whole run:
  // step × global batch + position in the batch). The result depends only on (dataset, seq_len,
  // seed, index), never on which samples were drawn before.
  void sample(int64_t index, int32_t* inputs, int32_t* targets);

  int64_t windows_per_epoch() const { return num_windows_; }
  int seq_len() const { return seq_len_; }

 private:
  const std::vector<int64_t>& permutation(int64_t epoch);

  const TokenDataset& dataset_;
  int seq_len_;
  uint64_t seed_;
  int64_t num_windows_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> order_;  // permutation of cached_epoch_: order_[pos] = window
};

}  // namespace malleus::data
