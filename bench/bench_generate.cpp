// Generation speed with and without the key/value cache, side by side in one run.
//
// With the cache, each new token runs the model on one position; without it, every token runs the
// whole sequence again (the same layer code, from position 0). Prints, for each, the median over
// repeated runs (with min–max spread) of new tokens per second, and the ratio of the medians.
// The weights do not change the cost: the model is initialised from a seed unless a checkpoint is
// given. Usage: bench_generate [model preset or checkpoint dir] [new tokens] [threads] [repeats]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "common/stats.h"
#include "model/generation.h"

using namespace malleus;

namespace {}  // namespace

int main(int argc, char** argv) {
  const std::string source = argc > 1 ? argv[1] : "demo";
  const int requested = argc > 2 ? std::stoi(argv[2]) : 200;
  const int threads = argc > 3 ? std::stoi(argv[3]) : 2;
  const int repeats = argc > 4 ? std::stoi(argv[4]) : 5;
  try {
    model::ModelConfig config;
    std::vector<float> params;
    if (std::filesystem::is_directory(source)) {
      const checkpoint::Checkpoint c = checkpoint::load_checkpoint(
          checkpoint::resolve_checkpoint(source), /*with_optimizer=*/false);
      config = c.model;
      params = c.params;
    } else {
      config = model::load_model_config(source);
    }
    auto backend = backend::make_cpu_backend<float>(threads);
    model::Transformer<float> m(config, *backend, 1, config.max_seq_len);
    if (params.empty()) {
      m.init_parameters(1);
    } else {
      backend->copy_from_host(m.params(), params.data(), params.size());
    }
    const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    model::SamplingOptions options;
    options.temperature = 0;  // greedy: no stop tokens, so every run makes the same tokens
    options.max_new_tokens =
        std::min(requested, config.max_seq_len - static_cast<int>(prompt.size()));
    std::printf(
        "model %s (%d layers, hidden %d, vocab %d), %zu prompt + %d new tokens, "
        "%d threads, %d runs\n",
        config.name.c_str(), config.num_layers, config.hidden_size, config.vocab_size,
        prompt.size(), options.max_new_tokens, threads, repeats);
    std::vector<double> cached, recomputed;
    std::vector<int32_t> reference;
    for (int r = 0; r < repeats; ++r) {
      for (const bool use_cache : {true, false}) {
        const auto start = std::chrono::steady_clock::now();
        const auto out = model::generate(m, prompt, options, nullptr, use_cache);
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        (use_cache ? cached : recomputed)
            .push_back(static_cast<double>(out.tokens.size()) / seconds);
        if (reference.empty()) reference = out.tokens;
        if (out.tokens != reference) {
          std::fprintf(stderr, "error: greedy output differs between runs\n");
          return 1;
        }
      }
    }
    const Summary a = summarize(cached), b = summarize(recomputed);
    std::printf("with cache:    %9.1f tokens/s (min %.1f, max %.1f)\n", a.median, a.min, a.max);
    std::printf("without cache: %9.1f tokens/s (min %.1f, max %.1f)\n", b.median, b.min, b.max);
    std::printf("speedup:       %9.2fx (ratio of medians)\n", a.median / b.median);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
