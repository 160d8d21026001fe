// Text generation from a model, token by token: the next-token distribution of the model's last
// position, shaped by temperature, top-k and top-p (nucleus sampling, Holtzman et al., ICLR 2020),
// sampled with a seeded generator so a seed gives the same text on every platform.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include "model/transformer.h"

namespace malleus::model {

struct SamplingOptions {
  float temperature = 0.8f;  // 0: greedy (the most likely token, lowest id on ties)
  int top_k = 0;             // keep the k most likely tokens; 0: all
  float top_p = 1.0f;        // keep the smallest set of most likely tokens with mass >= top_p
  uint64_t seed = 0;
  int max_new_tokens = 100;
  std::vector<int32_t> stop_tokens;  // generation ends after producing one of these

  // Throws Error naming the option that is out of range.
  void validate() const;
};

// Draws one token id from `logits` (the whole vocabulary). `rng` advances only when sampling
// (temperature > 0), by one draw.
int32_t sample_token(std::span<const float> logits, const SamplingOptions& options,
                     std::mt19937_64& rng);

enum class StopReason { kTokenLimit, kStopToken, kContextFull };

struct Generation {
  std::vector<int32_t> tokens;  // the new tokens, without the prompt
  StopReason stop = StopReason::kTokenLimit;
};

// Continues `prompt` (at least one token) with model(whole model, one rank; its seq_len() is the
// context). With use_cache, the prompt is run once and each new token costs one position; without
// it, every token recomputes the whole sequence (the same layer code, for comparison). on_token,
// when given, is called with each new token as soon as it is chosen.
Generation generate(Transformer<float>& model, const std::vector<int32_t>& prompt,
                    const SamplingOptions& options,
                    const std::function<void(int32_t)>& on_token = nullptr, bool use_cache = true);

}  // namespace malleus::model
