#include "model/generation.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/error.h"

namespace malleus::model {

void SamplingOptions::validate() const {
  check(std::isfinite(temperature) && temperature >= 0,
        "temperature must be a finite number >= 0, got " + std::to_string(temperature));
  check(top_k >= 0, "top-k must be >= 0 (0: no limit), got " + std::to_string(top_k));
  check(std::isfinite(top_p) && top_p > 0 && top_p <= 1,
        "top-p must be in (0, 1], got " + std::to_string(top_p));
  check(max_new_tokens >= 0, "the token limit must be >= 0, got " + std::to_string(max_new_tokens));
}

int32_t sample_token(std::span<const float> logits, const SamplingOptions& options,
                     std::mt19937_64& rng) {
  check(!logits.empty(), "sample_token: no logits");
  for (float x : logits)
    check(std::isfinite(x), "sample_token: the model produced a non-finite logit");
  if (options.temperature == 0) {
    // max_element returns the first maximum: ties go to the lowest id.
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // Candidates from most to least likely; equal logits in id order, so the choice never depends
  // on the sort's implementation.
  std::vector<int32_t> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  const auto more_likely = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  size_t keep = order.size();
  if (options.top_k > 0 && static_cast<size_t>(options.top_k) < keep) {
    keep = static_cast<size_t>(options.top_k);
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep), order.end(),
                      more_likely);
  } else {
    std::sort(order.begin(), order.end(), more_likely);
  }
  // Softmax of logits / temperature over the kept candidates, in double.
  const double top = logits[order[0]];
  std::vector<double> weight(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) {
    weight[i] = std::exp((logits[order[i]] - top) / options.temperature);
    total += weight[i];
  }
  if (options.top_p < 1) {
    double mass = 0;
    size_t nucleus = 0;
    while (nucleus < keep && mass < options.top_p * total) mass += weight[nucleus++];
    keep = std::max<size_t>(1, nucleus);
    total = mass > 0 ? mass : weight[0];
  }
  // 53 random bits, so the draw is the same with every standard library.
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
  double cumulative = 0;
  for (size_t i = 0; i < keep; ++i) {
    cumulative += weight[i];
    if (u < cumulative) return order[i];
  }
  return order[keep - 1];  // u within rounding of the total
}

Generation generate(Transformer<float>& model, const std::vector<int32_t>& prompt,
                    const SamplingOptions& options, const std::function<void(int32_t)>& on_token,
                    bool use_cache) {
  options.validate();
  check(!prompt.empty(), "generate: the prompt holds no tokens");
  const int context = model.seq_len();
  check(static_cast<int>(prompt.size()) <= context,
        "generate: the prompt has " + std::to_string(prompt.size()) +
            " tokens, more than the context of " + std::to_string(context) + " positions");
  std::mt19937_64 rng(options.seed);
  std::vector<int32_t> sequence = prompt;
  Generation result;
  model.clear_cache();
  std::vector<float> logits =
      model.forward_cached(sequence.data(), static_cast<int>(sequence.size()));
  for (int produced = 0; produced < options.max_new_tokens; ++produced) {
    const int32_t token = sample_token(logits, options, rng);
    sequence.push_back(token);
    result.tokens.push_back(token);
    if (on_token) on_token(token);
    if (std::find(options.stop_tokens.begin(), options.stop_tokens.end(), token) !=
        options.stop_tokens.end()) {
      result.stop = StopReason::kStopToken;
      return result;
    }
    if (produced + 1 == options.max_new_tokens) break;
    if (static_cast<int>(sequence.size()) >= context) {
      result.stop = StopReason::kContextFull;
      return result;
    }
    if (use_cache) {
      logits = model.forward_cached(&sequence.back(), 1);
    } else {
      model.clear_cache();
      logits = model.forward_cached(sequence.data(), static_cast<int>(sequence.size()));
    }
  }
  result.stop = StopReason::kTokenLimit;
  return result;
}

}  // namespace malleus::model
