// Training-step throughput against raw sgemm on the same threads.
//
// Prints, as medians over repeated runs (with min–max spread):
//   - sgemm GFLOP/s on a large square problem (the machine's BLAS ceiling),
//   - sgemm GFLOP/s on exactly the GEMMs of one transformer block's forward and backward at the
//     model's shapes (the ceiling for this model: small hidden sizes run below the square one),
//   - the training step's achieved GFLOP/s (model FLOPs: 6 × matmul parameters × tokens plus
//     causal attention, the MFU accounting) including every kernel, the optimizer and sampling,
// and the ratio of the step to both. Usage: bench_step_throughput [model] [threads] [repeats]
//   [--micro N] [--accum N] [--backend cpu|cuda] [--math exact|tf32|bf16] [--peak-tflops X]
// (defaults: 8 sequences per micro-batch, 2 micro-batches per step, cpu).
//
// With --backend cuda (a build with -DMALLEUS_BUILD_CUDA=ON, docs/cuda.md) it prints instead the
// backend's own 8192³ matmul rate in the chosen math mode (default bf16), the step's tokens/s and
// model TFLOP/s, and the MFU: model FLOPs per second over --peak-tflops (default 989.4, the H100
// SXM's dense bf16 rate by its datasheet; the H200's is the same).
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/stats.h"
#include "model/transformer.h"
#include "plan/cost_model.h"
#include "runtime/optimizer.h"

#ifdef MALLEUS_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

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

struct Options {
  std::string model = "demo";
  int threads = 2;
  int repeats = 7;
  int micro = 8;
  int accum = 2;
  std::string backend = "cpu";
  std::string math = "bf16";
  double peak_tflops = 989.4;
};

int positive_int(const std::string& option, const std::string& value) {
  int parsed = 0;
  try {
    parsed = std::stoi(value);
  } catch (const std::exception&) {
    throw Error("bench_step_throughput: " + option + " must be a positive integer, got \"" + value +
                "\"");
  }
  check(parsed > 0,
        "bench_step_throughput: " + option + " must be a positive integer, got \"" + value + "\"");
  return parsed;
}

Options parse_options(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (!arg.starts_with("--")) {
      positional.push_back(arg);
      continue;
    }
    check(i + 1 < argc, "bench_step_throughput: " + arg + " needs a value");
    const std::string value = argv[++i];
    if (arg == "--micro") {
      o.micro = positive_int(arg, value);
    } else if (arg == "--accum") {
      o.accum = positive_int(arg, value);
    } else if (arg == "--backend") {
      o.backend = value;
    } else if (arg == "--math") {
      o.math = value;
    } else if (arg == "--peak-tflops") {
      try {
        o.peak_tflops = std::stod(value);
      } catch (const std::exception&) {
        o.peak_tflops = 0;
      }
      check(o.peak_tflops > 0,
            "bench_step_throughput: --peak-tflops must be a positive number, "
            "got \"" +
                value + "\"");
    } else {
      throw Error("bench_step_throughput: unknown option " + arg);
    }
  }
  if (positional.size() > 0) o.model = positional[0];
  if (positional.size() > 1) o.threads = positive_int("threads", positional[1]);
  if (positional.size() > 2) o.repeats = positive_int("repeats", positional[2]);
  check(o.backend == "cpu" || o.backend == "cuda",
        "bench_step_throughput: --backend must be cpu or cuda, got \"" + o.backend + "\"");
  return o;
}

// Seconds of each of `repeats` training steps, after one warm-up step: accum micro-batches of
// forward + backward, the gradient norm, AdamW. `sync` waits for the device before the clock
// stops.
std::vector<double> time_steps(backend::Backend<float>& backend, const model::ModelConfig& config,
                               const Options& o, const std::function<void()>& sync) {
  const int seq = config.max_seq_len;
  const int tokens = o.micro * seq;
  model::Transformer<float> model(config, backend, o.micro, seq);
  model.init_parameters(1);
  runtime::AdamW optimizer(backend, model.layout().total_size(), {0.9f, 0.95f, 1e-8f, 0.1f});
  std::mt19937_64 rng(5);
  std::vector<int32_t> inputs(static_cast<size_t>(tokens)), targets(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    inputs[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config.vocab_size));
    targets[i] = static_cast<int32_t>(rng() % static_cast<uint64_t>(config.vocab_size));
  }
  auto step = [&] {
    model.zero_grads();
    for (int m = 0; m < o.accum; ++m) {
      model.forward(inputs.data(), targets.data());
      model.backward(1.0f / float(tokens * o.accum));
    }
    const double norm =
        std::sqrt(backend.sum_squares(model.grads(), size_t(model.layout().total_size())));
    optimizer.step(model.layout(), model.params(), model.grads(), 1e-4f,
                   static_cast<float>(norm > 1 ? 1 / norm : 1));
    sync();
  };
  step();  // warm-up: page in activations, build caches
  std::vector<double> seconds;
  for (int r = 0; r < o.repeats; ++r) seconds.push_back(time_seconds(step));
  return seconds;
}

#ifdef MALLEUS_HAVE_CUDA
// The backend's own matmul (fp32 storage) on a large square problem of random values: the
// ceiling of the chosen math mode, in TFLOP/s per repeat.
std::vector<double> cuda_square_matmul(backend::Backend<float>& backend, int repeats) {
  const int sq = 8192;
  const size_t count = size_t(sq) * sq;
  backend::Buffer<float> a(backend, count, backend::MemoryKind::kWorkspace),
      b(backend, count, backend::MemoryKind::kWorkspace),
      c(backend, count, backend::MemoryKind::kWorkspace);
  std::vector<float> host(count);
  std::mt19937_64 rng(3);
  for (float& x : host) x = float(rng() % 2001) / 1000.0f - 1.0f;
  backend.copy_from_host(a.data(), host.data(), count);
  backend.copy_from_host(b.data(), host.data(), count);
  std::vector<double> tflops;
  for (int r = 0; r < repeats + 2; ++r) {  // two warm-ups
    const double s = time_seconds([&] {
      backend.matmul_forward(c.data(), a.data(), b.data(), sq, sq, sq);
      backend::cuda_synchronize();
    });
    if (r >= 2) tflops.push_back(2.0 * sq * sq * double(sq) / s / 1e12);
  }
  return tflops;
}

int run_cuda(const Options& o, const model::ModelConfig& config) {
  const backend::CudaMath math = backend::parse_cuda_math(o.math);
  // Its own backend, so that a profile (MALLEUS_CUDA_PROFILE=1) of the steps leaves it out.
  const Summary sqs = summarize(cuda_square_matmul(*backend::make_cuda_backend(math), o.repeats));
  auto backend = backend::make_cuda_backend(math);
  const std::vector<double> seconds =
      time_steps(*backend, config, o, [] { backend::cuda_synchronize(); });
  const double step_flops =
      plan::shard_training_flops(config, o.micro, config.max_seq_len, config.num_layers, true) *
      o.accum;
  std::vector<double> tflops;
  for (double s : seconds) tflops.push_back(step_flops / s / 1e12);
  const Summary sts = summarize(tflops), secs = summarize(seconds);
  const double tokens = double(o.micro) * config.max_seq_len * o.accum;
  std::printf(
      "model %s (%lld parameters) on %s, backend %s, step = %d × %d sequences of %d tokens, "
      "%d repeats (median [min–max])\n",
      config.name.c_str(), static_cast<long long>(config.num_parameters()),
      backend::cuda_device_name().c_str(), backend->name().c_str(), o.accum, o.micro,
      config.max_seq_len, o.repeats);
  std::printf("  matmul 8192³, fp32 storage  %7.1f TFLOP/s [%.1f–%.1f]\n", sqs.median, sqs.min,
              sqs.max);
  std::printf(
      "  training step               %7.1f TFLOP/s [%.1f–%.1f]  (%.3f s/step, %.0f tokens/s)\n",
      sts.median, sts.min, sts.max, secs.median, tokens / secs.median);
  std::printf("  MFU: model FLOPs / %.1f TFLOP/s peak  %5.1f%%\n", o.peak_tflops,
              100.0 * sts.median / o.peak_tflops);
  return 0;
}
#endif

int run_cpu(const Options& o, const model::ModelConfig& config) {
  const int repeats = o.repeats;
  const int seq = config.max_seq_len;
  const int tokens = o.micro * seq;
  auto backend = backend::make_cpu_backend<float>(o.threads);  // also sets BLAS threads

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
  const double step_flops =
      plan::shard_training_flops(config, o.micro, seq, config.num_layers, true) * o.accum;
  std::vector<double> step_gflops, step_seconds;
  for (double s : time_steps(*backend, config, o, [] {})) {
    step_seconds.push_back(s);
    step_gflops.push_back(step_flops / s / 1e9);
  }

  const Summary sqs = summarize(square), shs = summarize(shaped), sts = summarize(step_gflops),
                secs = summarize(step_seconds);
  std::printf(
      "model %s (%lld parameters), %d threads, step = %d × %d sequences of %d tokens, "
      "%d repeats (median [min–max])\n",
      config.name.c_str(), static_cast<long long>(config.num_parameters()), o.threads, o.accum,
      o.micro, seq, repeats);
  std::printf("  sgemm 1024³ square          %7.1f GFLOP/s [%.1f–%.1f]\n", sqs.median, sqs.min,
              sqs.max);
  std::printf("  sgemm at the model's shapes %7.1f GFLOP/s [%.1f–%.1f]\n", shs.median, shs.min,
              shs.max);
  std::printf(
      "  training step               %7.1f GFLOP/s [%.1f–%.1f]  (%.3f s/step, %.0f tokens/s)\n",
      sts.median, sts.min, sts.max, secs.median, tokens * o.accum / secs.median);
  std::printf("  step / sgemm at model shapes  %5.1f%%\n", 100.0 * sts.median / shs.median);
  std::printf("  step / sgemm square           %5.1f%%\n", 100.0 * sts.median / sqs.median);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_options(argc, argv);
    const auto config = model::load_model_config(o.model);
    if (o.backend == "cpu") return run_cpu(o, config);
#ifdef MALLEUS_HAVE_CUDA
    return run_cuda(o, config);
#else
    throw Error("bench_step_throughput: --backend cuda needs a build with -DMALLEUS_BUILD_CUDA=ON");
#endif
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
