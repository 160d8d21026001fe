// Generation: the key/value-cached path against an independent full recompute (the training
// forward over the whole sequence, no cache), determinism under a seed, and the sampler.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "common/error.h"
#include "model/generation.h"
#include "test_models.h"
#include "test_util.h"

using namespace malleus;
using malleus::testing::error_of;
using malleus::testing::generation_model;

namespace {

// Logits of the last position of `tokens` from the training forward of a model built for exactly
// this length: every position recomputed, no cache.
std::vector<float> recomputed_last_logits(const model::ModelConfig& config,
                                          const std::vector<float>& params,
                                          const std::vector<int32_t>& tokens) {
  auto backend = backend::make_cpu_backend<float>(1);
  const int n = static_cast<int>(tokens.size());
  model::Transformer<float> m(config, *backend, 1, n);
  backend->copy_from_host(m.params(), params.data(), params.size());
  const std::vector<int32_t> targets(tokens.size(), 0);
  m.forward(tokens.data(), targets.data());
  const std::vector<float> all = m.logits();
  return {all.end() - config.vocab_size, all.end()};
}

}  // namespace

TEST(Generation, GreedyCachedOutputEqualsFullRecomputeTokenByToken) {
  const auto config = generation_model();
  auto backend = backend::make_cpu_backend<float>(2);
  model::Transformer<float> m(config, *backend, 1, config.max_seq_len);
  m.init_parameters(5);
  std::vector<float> params(static_cast<size_t>(m.layout().total_size()));
  backend->copy_to_host(params.data(), m.params(), params.size());

  const std::vector<int32_t> prompt = {3, 14, 15, 9, 26};
  model::SamplingOptions greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = 80;  // prompt + 80 = 85 positions: past the 64-row attention block
  std::vector<std::vector<float>> cached_logits;
  const model::Generation out = model::generate(m, prompt, greedy);
  ASSERT_EQ(out.tokens.size(), 80u);
  EXPECT_EQ(out.stop, model::StopReason::kTokenLimit);

  std::vector<int32_t> sequence = prompt;
  double worst = 0;
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    const std::vector<float> logits = recomputed_last_logits(config, params, sequence);
    const int32_t expected =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    ASSERT_EQ(out.tokens[i], expected) << "token " << i;
    sequence.push_back(expected);
  }
  // The cache changes only the summation order: replaying the sequence through the cache one
  // token at a time gives the recomputed logits to float rounding (about 1e-6 in the optimised
  // build, 2e-5 unvectorised).
  m.clear_cache();
  for (size_t i = 0; i < sequence.size(); ++i) {
    const std::vector<float> cached = m.forward_cached(&sequence[i], 1);
    if (i + 1 < prompt.size() || i % 10 != 0) continue;
    const std::vector<float> recomputed = recomputed_last_logits(
        config, params, {sequence.begin(), sequence.begin() + static_cast<long>(i) + 1});
    for (size_t v = 0; v < cached.size(); ++v) {
      worst = std::max(worst, std::abs(static_cast<double>(cached[v]) - recomputed[v]) /
                                  (1.0 + std::abs(recomputed[v])));
    }
  }
  EXPECT_LT(worst, 1e-4);
}

TEST(Generation, FixedSeedIsDeterministicAndSeedsDiffer) {
  const auto config = generation_model();
  auto backend = backend::make_cpu_backend<float>(2);
  model::Transformer<float> m(config, *backend, 1, config.max_seq_len);
  m.init_parameters(6);
  model::SamplingOptions options;
  options.temperature = 1.0f;
  options.top_k = 20;
  options.top_p = 0.95f;
  options.max_new_tokens = 40;
  options.seed = 42;
  const std::vector<int32_t> prompt = {1, 2, 3};
  std::vector<int32_t> streamed;
  const auto first = model::generate(m, prompt, options, [&](int32_t t) { streamed.push_back(t); });
  const auto second = model::generate(m, prompt, options);
  EXPECT_EQ(first.tokens, second.tokens);
  EXPECT_EQ(streamed, first.tokens);  // every token reported as it was produced, in order
  // Without the cache the logits differ only by rounding: the same seed picks the same tokens.
  EXPECT_EQ(model::generate(m, prompt, options, nullptr, /*use_cache=*/false).tokens, first.tokens);
  options.seed = 43;
  EXPECT_NE(model::generate(m, prompt, options).tokens, first.tokens);
}

TEST(Generation, StopsAtStopTokenAndAtTheContext) {
  const auto config = generation_model();
  auto backend = backend::make_cpu_backend<float>(1);
  model::Transformer<float> m(config, *backend, 1, 12);
  m.init_parameters(7);
  model::SamplingOptions greedy;
  greedy.temperature = 0;
  greedy.max_new_tokens = 50;
  const std::vector<int32_t> prompt = {4, 5, 6};
  const auto full = model::generate(m, prompt, greedy);
  EXPECT_EQ(full.stop, model::StopReason::kContextFull);
  EXPECT_EQ(full.tokens.size(), 12u - prompt.size());
  greedy.stop_tokens = {full.tokens[2]};
  const auto stopped = model::generate(m, prompt, greedy);
  EXPECT_EQ(stopped.stop, model::StopReason::kStopToken);
  const auto first_stop = std::find(full.tokens.begin(), full.tokens.end(), full.tokens[2]);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(full.tokens.begin(), first_stop + 1));

  EXPECT_NE(error_of([&] {
              model::generate(m, std::vector<int32_t>(13, 1), greedy);
            }).find("more than the context of 12"),
            std::string::npos);
  EXPECT_NE(error_of([&] { model::generate(m, {}, greedy); }).find("no tokens"), std::string::npos);
  EXPECT_NE(error_of([&] { model::generate(m, {61}, greedy); }).find("outside the vocabulary"),
            std::string::npos);
  m.clear_cache();
  m.forward_cached(prompt.data(), 3);
  EXPECT_NE(error_of([&] { m.forward_cached(prompt.data(), 10); }).find("exceed"),
            std::string::npos);
}

TEST(Sampling, FollowsTemperatureTopKAndTopP) {
  // Probabilities at temperature 1: 0.1, 0.2, 0.3, 0.4 (logits are their logs).
  const std::vector<float> logits = {std::log(0.1f), std::log(0.2f), std::log(0.3f),
                                     std::log(0.4f)};
  const auto frequencies = [&](const model::SamplingOptions& options) {
    std::mt19937_64 rng(options.seed);
    std::vector<double> counts(logits.size(), 0.0);
    const int draws = 40000;
    for (int i = 0; i < draws; ++i) counts[model::sample_token(logits, options, rng)] += 1;
    for (double& c : counts) c /= draws;
    return counts;
  };
  model::SamplingOptions o;
  o.temperature = 1;
  auto f = frequencies(o);
  for (size_t i = 0; i < f.size(); ++i)
    EXPECT_NEAR(f[i], 0.1 * static_cast<double>(i + 1), 0.01) << i;
  o.top_k = 2;  // 0.3 : 0.4
  f = frequencies(o);
  EXPECT_EQ(f[0] + f[1], 0.0);
  EXPECT_NEAR(f[3], 4.0 / 7.0, 0.01);
  o.top_k = 0;
  o.top_p = 0.65f;  // 0.4 + 0.3 reach 0.65: the two most likely
  f = frequencies(o);
  EXPECT_EQ(f[0] + f[1], 0.0);
  EXPECT_NEAR(f[3], 4.0 / 7.0, 0.01);
  o.top_p = 0.3f;  // the most likely alone
  EXPECT_EQ(frequencies(o)[3], 1.0);
  o.top_p = 1;
  o.temperature = 0.5f;  // squares the ratios: 1 : 4 : 9 : 16 over 30
  f = frequencies(o);
  EXPECT_NEAR(f[3], 16.0 / 30.0, 0.01);
  o.temperature = 0;
  std::mt19937_64 rng(1);
  const std::mt19937_64 before = rng;
  EXPECT_EQ(model::sample_token(logits, o, rng), 3);
  EXPECT_EQ(rng, before);  // greedy draws nothing

  o.temperature = -1;
  EXPECT_NE(error_of([&] { o.validate(); }).find("temperature"), std::string::npos);
  o.temperature = 1;
  o.top_p = 0;
  EXPECT_NE(error_of([&] { o.validate(); }).find("top-p"), std::string::npos);
  o.top_p = 1;
  o.top_k = -3;
  EXPECT_NE(error_of([&] { o.validate(); }).find("top-k"), std::string::npos);
}
