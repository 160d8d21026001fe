// Training throughput of several parallel plans on the same 4 ranks, side by side.
//
// Every plan trains the same model from the same seed on the same data. All trainers are built
// first, then timed in interleaved rounds (plan A, B, C, ..., A, B, C, ...), so that drift in the
// machine's load (oversubscribed ranks, other processes) spreads over all plans instead of
// favouring whichever ran first. A step is timed on rank 0 from a world barrier before it to one
// after it, so it covers the slowest rank. Because every plan computes the same math (plan
// invariance), the last column — each plan's loss after the same number of steps — must agree
// across rows up to fp32 summation order; a row that differs is a bug, not a fast plan.
// Tokens/s is given at the median step and at the fastest one: on a shared machine other jobs
// come and go, and the fastest step is the best estimate of the plan's cost on its own.
//
// Usage: mpirun -np 4 bench_plans [rounds] [steps_per_round] [model] [threads_per_rank]
//                                  [--json FILE]
// (bench/bench_plans.sh sets up mpirun). Prints markdown tables on rank 0; with --json, also
// writes the same figures, unrounded, to FILE for programs to read (bench/bench_bed.sh).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "bench_args.h"
#include "bench_mpi.h"
#include "comm/communicator.h"
#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/json.h"
#include "common/stats.h"
#include "data/shard.h"
#include "metrics/metrics.h"
#include "model/config.h"
#include "tokenizer/byte_tokenizer.h"
#include "train/trainer.h"

using namespace malleus;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kWorld = 4;
constexpr int kWarmupSteps = 2;

struct BenchPlan {
  std::string name;
  int dp = 0, tp = 1, pp = 1;
  Json plan_json;  // when set, used instead of dp/tp/pp
};

// One pipeline pp2 on ranks 0-2 whose first stage is tp2, and one single-rank pipeline on rank 3.
// Pipeline 0's slowest stage holds half the layers, pipeline 1 all of them, so 5 : 3 micro-batches
// roughly balance them ((5 + 1) × ½ ≈ 3 × 1 with 1F1B's bubble).
Json heterogeneous_plan(const model::ModelConfig& model, int micro_batch, int global_batch) {
  const int half = model.num_layers / 2;
  const int micro_batches = global_batch / micro_batch;
  const int first = (micro_batches * 5 + 4) / 8;
  auto stage = [](int begin, int end, std::vector<int> ranks) {
    return Json{{"layers", std::vector<int>{begin, end}}, {"ranks", std::move(ranks)}};
  };
  Json pipelines = Json::array();
  pipelines.push_back(
      {{"micro_batches", first},
       {"stages", Json::array({stage(0, half, {0, 1}), stage(half, model.num_layers, {2})})}});
  pipelines.push_back({{"micro_batches", micro_batches - first},
                       {"stages", Json::array({stage(0, model.num_layers, {3})})}});
  return {{"world_size", kWorld}, {"micro_batch_size", micro_batch}, {"pipelines", pipelines}};
}

// Deterministic English-like text for when no prepared corpus is around; its content does not
// matter for throughput, only that there is enough of it.
std::vector<uint16_t> synthetic_tokens() {
  const char* words[] = {"the",   "cat",  "sees", "a",     "dog",   "that", "likes",
                         "old",   "book", "on",   "green", "tree",  "and",  "reads",
                         "paint", "sky",  "blue", "under", "every", "quiet"};
  std::string text;
  uint32_t state = 12345;
  while (text.size() < 400000) {
    state = state * 1664525u + 1013904223u;
    text += words[(state >> 16) % 20];
    text += ((state >> 8) % 11 == 0) ? ".\n" : " ";
  }
  const std::vector<int32_t> ids = tokenizer::ByteTokenizer().encode(text);
  return {ids.begin(), ids.end()};
}

// The 1-minute load average: on a shared machine, other processes' load is part of the result.
std::string load_average() {
  std::ifstream file("/proc/loadavg");
  std::string first;
  return file >> first ? first : std::string("?");
}

void broadcast_string(comm::Communicator& world, std::string& text) {
  int64_t length = static_cast<int64_t>(text.size());
  world.broadcast(&length, sizeof length, 0);
  text.resize(static_cast<size_t>(length));
  world.broadcast(text.data(), text.size(), 0);
}

void run(comm::Communicator& world, int argc, char** argv) {
  const std::string json_path = bench::take_option(argc, argv, "--json");
  check(world.size() == kWorld,
        "bench_plans runs on exactly 4 ranks (mpirun -np 4), not " + std::to_string(world.size()));
  const int rounds = bench::positive_arg(argc, argv, 1, 5);
  const int steps_per_round = bench::positive_arg(argc, argv, 2, 4);
  const std::string model_name = argc > 3 ? argv[3] : "demo";
  const int threads = bench::positive_arg(argc, argv, 4, 1);
  const bool root = world.rank() == 0;

  train::TrainConfig base;
  base.model = model_name;
  base.val_data = "";
  const model::ModelConfig model = model::load_model_config(model_name);
  base.seq_len = std::min(128, model.max_seq_len);
  base.micro_batch_size = 2;
  base.global_batch_size = 16;
  base.threads = threads;
  base.steps = kWarmupSteps + rounds * steps_per_round;
  base.warmup_steps = 2;
  // Each row measures the plan it names: the straggler controller must not switch plans midway
  // (on an oversubscribed machine the monitored rates are noisy).
  base.replan = false;

  // Rank 0 sets up the scratch directory (plan files, synthetic shards); all ranks of this
  // single-machine benchmark see the same file system.
  std::string scratch, train_data;
  if (root) {
    scratch = (fs::temp_directory_path() / ("malleus_bench_plans_" + std::to_string(::getpid())))
                  .string();
    fs::create_directories(scratch);
    try {
      expand_files("data/fortunes/train_*.bin");
      train_data = "data/fortunes/train_*.bin";
    } catch (const Error&) {
      train_data = (fs::path(scratch) / "train_000000.bin").string();
      data::write_shard(train_data, synthetic_tokens());
    }
  }
  broadcast_string(world, scratch);
  broadcast_string(world, train_data);
  base.train_data = train_data;
  base.out_dir = (fs::path(scratch) / "run").string();

  // Plans the model's shape allows: TP degrees in whole KV groups, no more stages than layers.
  const bool tp2 = model.num_kv_heads % 2 == 0, tp4 = model.num_kv_heads % 4 == 0;
  const bool pp2 = model.num_layers >= 2, pp4 = model.num_layers >= 4;
  std::vector<BenchPlan> plans = {{"dp1 (3 ranks idle)", 1, 1, 1, {}}, {"dp4", 4, 1, 1, {}}};
  if (tp2) plans.push_back({"tp2 × dp2", 2, 2, 1, {}});
  if (pp2) plans.push_back({"pp2 × dp2", 2, 1, 2, {}});
  if (tp2 && pp2) plans.push_back({"tp2 × pp2", 1, 2, 2, {}});
  if (pp4) plans.push_back({"pp4", 1, 1, 4, {}});
  if (tp4) plans.push_back({"tp4", 1, 4, 1, {}});
  if (tp2 && pp2) {
    plans.push_back({"heterogeneous: pp2 (tp2, tp1) + pp1", 0, 1, 1,
                     heterogeneous_plan(model, base.micro_batch_size, base.global_batch_size)});
  }

  const std::string load_before = load_average();
  std::vector<std::unique_ptr<train::Trainer>> trainers;
  for (size_t i = 0; i < plans.size(); ++i) {
    train::TrainConfig config = base;
    config.dp = plans[i].dp;
    config.tp = plans[i].tp;
    config.pp = plans[i].pp;
    if (!plans[i].plan_json.is_null()) {
      config.plan = (fs::path(scratch) / ("plan_" + std::to_string(i) + ".json")).string();
      if (root) write_file_atomic(config.plan, plans[i].plan_json.dump(2));
      world.barrier();  // the file is complete before any rank reads it
    }
    trainers.push_back(std::make_unique<train::Trainer>(config, model, world));
  }

  // Per step, besides its wall time, every rank's phases as the runtime measures them: its
  // compute (the monitor's elapsed time of its compute sections, StepRecord::compute_s) and its
  // time inside tensor-parallel collectives (waiting for the partner included), to hold against
  // the cost model's terms (bench/bench_bed.sh).
  struct Sample {
    double wall_s, loss;
    std::vector<double> compute_s, tp_wait_s;
  };
  const size_t ranks = static_cast<size_t>(kWorld), me = static_cast<size_t>(world.rank());
  auto timed_step = [&](train::Trainer& trainer) {
    auto* tp = trainer.engine().state().tensor_parallel();
    const double tp_before = tp ? tp->wait_seconds() : 0;
    world.barrier();
    const auto start = Clock::now();
    const train::StepStats stats = trainer.train_step();
    world.barrier();
    Sample sample{std::chrono::duration<double>(Clock::now() - start).count(), stats.loss,
                  stats.compute_s, std::vector<double>(ranks, 0.0)};
    sample.tp_wait_s[me] = (tp ? tp->wait_seconds() : 0) - tp_before;
    world.all_reduce_sum(sample.tp_wait_s.data(), ranks);
    return sample;
  };

  std::vector<std::vector<double>> times(plans.size());
  // [plan][rank]: per-step compute and TP-collective seconds of each rank.
  std::vector<std::vector<std::vector<double>>> compute(plans.size(),
                                                        std::vector<std::vector<double>>(ranks)),
      tp_wait = compute;
  std::vector<double> last_loss(plans.size());
  for (size_t i = 0; i < plans.size(); ++i) {
    for (int s = 0; s < kWarmupSteps; ++s) timed_step(*trainers[i]);
  }
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < plans.size(); ++i) {
      for (int s = 0; s < steps_per_round; ++s) {
        const Sample sample = timed_step(*trainers[i]);
        times[i].push_back(sample.wall_s);
        last_loss[i] = sample.loss;
        for (size_t k = 0; k < ranks && k < sample.compute_s.size(); ++k) {
          compute[i][k].push_back(sample.compute_s[k]);
          tp_wait[i][k].push_back(sample.tp_wait_s[k]);
        }
      }
    }
  }
  // Every rank's training FLOPs per step under each plan (0: idle).
  std::vector<std::vector<double>> flops(plans.size(), std::vector<double>(ranks, 0.0));
  for (size_t i = 0; i < plans.size(); ++i) {
    flops[i][me] = trainers[i]->engine().work_flops();
    world.all_reduce_sum(flops[i].data(), ranks);
  }

  if (root) {
    const unsigned cores = std::thread::hardware_concurrency();
    const std::string load_after = load_average();
    std::printf(
        "model %s: %s parameters (%d layers, hidden %d, %d heads / %d kv, ffn %d, vocab %d)\n"
        "seq %d, micro-batch %d, global batch %d (%lld tokens/step), %d thread(s) per rank, "
        "%d ranks on %u cores\n"
        "data %s; per plan %d warm-up steps, then %d rounds × %d timed steps, plans "
        "interleaved\n"
        "load average (1 min) before / after: %s / %s\n\n",
        model.name.c_str(), format_count(static_cast<double>(model.num_parameters())).c_str(),
        model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads,
        model.ffn_hidden_size, model.vocab_size, base.seq_len, base.micro_batch_size,
        base.global_batch_size, static_cast<long long>(base.tokens_per_step()), threads, kWorld,
        cores, train_data.c_str(), kWarmupSteps, rounds, steps_per_round, load_before.c_str(),
        load_after.c_str());
    std::printf(
        "| plan | summary | step time, median [min–max] | tokens/s (median) | tokens/s (best "
        "step) | loss after %lld steps |\n",
        static_cast<long long>(base.steps));
    std::printf("|---|---|---|---:|---:|---:|\n");
    for (size_t i = 0; i < plans.size(); ++i) {
      const Summary t = summarize(times[i]);
      std::printf("| %s | %s | %.3f s [%.3f–%.3f] | %.0f | %.0f | %.4f |\n", plans[i].name.c_str(),
                  trainers[i]->engine().plan().summary().c_str(), t.median, t.min, t.max,
                  static_cast<double>(base.tokens_per_step()) / t.median,
                  static_cast<double>(base.tokens_per_step()) / t.min, last_loss[i]);
    }
    std::printf(
        "\nPhases per rank (median over the timed steps; ranks 0..%d): compute is the elapsed time "
        "of the rank's compute sections (without tensor-parallel collectives), TP the time inside "
        "them, GFLOP/s the rank's training FLOPs over its compute time\n\n",
        kWorld - 1);
    std::printf("| plan | compute s | TP collectives s | GFLOP/s while computing |\n");
    std::printf("|---|---|---|---|\n");
    for (size_t i = 0; i < plans.size(); ++i) {
      std::string compute_text, tp_text, rate_text;
      for (size_t k = 0; k < ranks; ++k) {
        const double c = compute[i][k].empty() ? 0 : median(compute[i][k]);
        const double w = tp_wait[i][k].empty() ? 0 : median(tp_wait[i][k]);
        char text[64];
        const char* gap = k == 0 ? "" : " ";
        std::snprintf(text, sizeof text, "%s%.3f", gap, c);
        compute_text += text;
        std::snprintf(text, sizeof text, "%s%.3f", gap, w);
        tp_text += text;
        if (flops[i][k] > 0 && c > 0) {
          std::snprintf(text, sizeof text, "%s%.1f", gap, flops[i][k] / c / 1e9);
        } else {
          std::snprintf(text, sizeof text, "%sidle", gap);
        }
        rate_text += text;
      }
      std::printf("| %s | %s | %s | %s |\n", plans[i].name.c_str(), compute_text.c_str(),
                  tp_text.c_str(), rate_text.c_str());
    }
    std::fflush(stdout);
    if (!json_path.empty()) {
      Json out = {{"model", model.name},
                  {"tokens_per_step", base.tokens_per_step()},
                  {"steps", base.steps},
                  {"load_average_before", load_before},
                  {"load_average_after", load_after},
                  {"plans", Json::array()}};
      for (size_t i = 0; i < plans.size(); ++i) {
        const Summary t = summarize(times[i]);
        Json plan = {{"name", plans[i].name},
                     {"summary", trainers[i]->engine().plan().summary()},
                     {"step_s", {{"median", t.median}, {"min", t.min}, {"max", t.max}}},
                     {"loss", last_loss[i]},
                     {"ranks", Json::array()}};
        for (size_t k = 0; k < ranks; ++k) {
          const double c = compute[i][k].empty() ? 0 : median(compute[i][k]);
          const double w = tp_wait[i][k].empty() ? 0 : median(tp_wait[i][k]);
          plan["ranks"].push_back(
              {{"compute_s", c},
               {"tp_s", w},
               {"gflops", flops[i][k] > 0 && c > 0 ? Json(flops[i][k] / c / 1e9) : Json()}});
        }
        out["plans"].push_back(std::move(plan));
      }
      write_file_atomic(json_path, out.dump(2) + "\n");
    }
  }
  trainers.clear();
  world.barrier();
  if (root) fs::remove_all(scratch);
}

}  // namespace

int main(int argc, char** argv) {
  return bench::mpi_main(argc, argv, run);
}
