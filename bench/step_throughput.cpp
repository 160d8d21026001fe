// Training-step throughput against raw sgemm on the same threads.
//
// Prints, as medians over repeated runs (with min–max spread):
//   - sgemm GFLOP/s on a large square problem (the machine's BLAS ceiling),
//   - sgemm GFLOP/s on exactly the GEMMs of one transformer block's forward and backward at the
//     model's shapes (the ceiling for this model: small hidden sizes run below the square one),
//   - the training step's achieved GFLOP/s (model FLOPs: 6 × matmul parameters × tokens plus
//     causal attention, the MFU accounting) including every kernel, the optimizer and sampling,
// and the ratio of the step to both. Usage: bench_step_throughput [model] [threads] [repeats]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/stats.h"
#include "model/transformer.h"
#include "plan/cost_model.h"
#include "runtime/optimizer.h"

using namespace malleus;
using Clock = std::chrono::steady_clock;

namespace {

template <typename F>
double time_seconds(F&& f) {
  const auto start = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Gemm {
  int m, n, k;  // C[m,n] = A[m,k] · B[k,n]
  bool trans_a, trans_b;
};

// The GEMMs of one block's forward and backward, in the shapes Transformer issues them.
std::vector<Gemm> block_gemms(const model::ModelConfig& c, int tokens) {
  const int h = c.hidden_size, f = c.ffn_hidden_size, q = c.num_heads * c.head_dim(),
            kv = c.kv_dim();
  std::vector<Gemm> gemms;
  auto linear = [&](int in, int out) {
    gemms.push_back({tokens, out, in, false, true});   // forward: out = in · Wᵀ
    gemms.push_back({tokens, in, out, false, false});  // din = dout · W
    gemms.push_back({out, in, tokens, true, false});   // dW += doutᵀ · in
  };
  linear(h, q);
  linear(h, kv);
  linear(h, kv);
  linear(q, h);
  linear(h, f);
  linear(h, f);
  linear(f, h);
  return gemms;
}

double run_gemms(const std::vector<Gemm>& gemms, std::vector<float>& a, std::vector<float>& b,
                 std::vector<float>& c) {
  double flops = 0;
  for (const Gemm& g : gemms) {
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans,
                g.trans_b ? CblasTrans : CblasNoTrans, g.m, g.n, g.k, 1.0f, a.data(),
                g.trans_a ? g.m : g.k, b.data(), g.trans_b ? g.k : g.n, 0.0f, c.data(), g.n);
    flops += 2.0 * g.m * g.n * g.k;
  }
  return flops;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string model_name = argc > 1 ? argv[1] : "demo";
  const int threads = argc > 2 ? std::stoi(argv[2]) : 2;
  const int repeats = argc > 3 ? std::stoi(argv[3]) : 7;
  const int micro = 8, accum = 2;

  const auto config = model::load_model_config(model_name);
  const int seq = config.max_seq_len;
  const int tokens = micro * seq;
  auto backend = backend::make_cpu_backend<float>(threads);  // also sets BLAS threads

  // Square sgemm: the BLAS ceiling of this machine.
  const int sq = 1024;
  std::vector<float> a(size_t(sq) * sq, 0.5f), b(a.size(), 0.25f), c(a.size());
  std::vector<double> square;
  run_gemms({{sq, sq, sq, false, false}}, a, b, c);
  for (int r = 0; r < repeats; ++r) {
    double flops = 0;
    const double s = time_seconds([&] {
      flops = run_gemms({{sq, sq, sq, false, false}}, a, b, c);
    });
    square.push_back(flops / s / 1e9);
  }

  // The model's own GEMM shapes.
  const auto gemms = block_gemms(config, tokens);
  size_t largest = 0;
  for (const Gemm& g : gemms) {
    largest = std::max({largest, size_t(g.m) * g.k, size_t(g.k) * g.n, size_t(g.m) * g.n});
  }
  std::vector<float> ga(largest, 0.5f), gb(largest, 0.25f), gc(largest);
  run_gemms(gemms, ga, gb, gc);
  std::vector<double> shaped;
  for (int r = 0; r < repeats; ++r) {
    double flops = 0;
    const double s = time_seconds([&] { flops = run_gemms(gemms, ga, gb, gc); });
    shaped.push_back(flops / s / 1e9);
  }

  // A full training step: accum micro-batches of forward + backward, grad norm, AdamW.
  model::Transformer<float> model(config, *backend, micro, seq);
  model.init_parameters(1);
  runtime::AdamW optimizer(*backend, model.layout().total_size(), {0.9f, 0.95f, 1e-8f, 0.1f});
  std::mt19937_64 rng(5);
  std::vector<int32_t> inputs(static_cast<size_t>(tokens)), targets(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config.vocab_size));
    targets[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config.vocab_size));
  }
  auto step = [&] {
    model.zero_grads();
    for (int m = 0; m < accum; ++m) {
      model.forward(inputs.data(), targets.data());
      model.backward(1.0f / float(tokens * accum));
    }
    const double norm =
        std::sqrt(backend->sum_squares(model.grads(), size_t(model.layout().total_size())));
    optimizer.step(model.layout(), model.params(), model.grads(), 1e-4f,
                   static_cast<float>(norm > 1 ? 1 / norm : 1));
  };
  step();  // warm-up: page in activations, build caches
  const double step_flops =
      plan::shard_training_flops(config, micro, seq, config.num_layers, true) * accum;
  std::vector<double> step_gflops, step_seconds;
  for (int r = 0; r < repeats; ++r) {
    const double s = time_seconds(step);
    step_seconds.push_back(s);
    step_gflops.push_back(step_flops / s / 1e9);
  }

  const Summary sqs = summarize(square), shs = summarize(shaped), sts = summarize(step_gflops),
                secs = summarize(step_seconds);
  std::printf(
      "model %s (%lld parameters), %d threads, step = %d × %d sequences of %d tokens, "
      "%d repeats (median [min–max])\n",
      config.name.c_str(), static_cast<long long>(config.num_parameters()), threads, accum, micro,
      seq, repeats);
  std::printf("  sgemm 1024³ square          %7.1f GFLOP/s [%.1f–%.1f]\n", sqs.median, sqs.min,
              sqs.max);
  std::printf("  sgemm at the model's shapes %7.1f GFLOP/s [%.1f–%.1f]\n", shs.median, shs.min,
              shs.max);
  std::printf(
      "  training step               %7.1f GFLOP/s [%.1f–%.1f]  (%.3f s/step, %.0f tokens/s)\n",
      sts.median, sts.min, sts.max, secs.median, tokens * accum / secs.median);
  std::printf("  step / sgemm at model shapes  %5.1f%%\n", 100.0 * sts.median / shs.median);
  std::printf("  step / sgemm square           %5.1f%%\n", 100.0 * sts.median / sqs.median);
  return 0;
}
