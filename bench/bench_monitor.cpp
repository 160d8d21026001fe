// What the straggler monitor costs, and what taking turns on shared cores costs.
//
// Trains the demo model data-parallel on every rank (seq 128, micro-batches of 1, global batch
// 16, one thread per rank) under several engine settings, side by side in interleaved rounds
// (A, B, C, then B, C, A, ...) so that a change in the machine's load hits every setting alike:
//   monitored     compute sections timed (steady clock, TP waits subtracted), the measurements
//                 gathered with the loss, and elastic::Monitor::observe run every step: what
//                 training does
//   unmonitored   no clock reads, no observe
//   no lease      monitored, but ranks sharing a core do not take turns (only when they share)
// A step is timed on rank 0 from a world barrier before it to one after it. Prints the median
// step time of each setting with its spread, and the ratios to the unmonitored one.
//
// Usage: mpirun -np N bench_monitor [rounds (10)] [steps per round (3)]
// e.g. 2 ranks one per core:  mpirun --bind-to core --map-by core -np 2 build/bench/bench_monitor
//      4 ranks on 2 cores:    mpirun --oversubscribe -np 4 build/bench/bench_monitor
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "bench_args.h"
#include "bench_mpi.h"
#include "comm/communicator.h"
#include "common/error.h"
#include "common/stats.h"
#include "elastic/monitor.h"
#include "model/config.h"
#include "plan/plan.h"
#include "runtime/core_lease.h"
#include "runtime/engine.h"

using namespace malleus;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSeq = 128, kGlobalBatch = 16, kWarmupSteps = 2;

struct Setting {
  std::string name;
  bool measure = true, lease = true;
  std::unique_ptr<runtime::Engine> engine;
  std::unique_ptr<elastic::Monitor> monitor;
  std::vector<double> step_s;
};

std::string load_average() {
  std::ifstream file("/proc/loadavg");
  std::string first;
  return file >> first ? first : std::string("?");
}

void run(comm::Communicator& world, int argc, char** argv) {
  const int rounds = bench::positive_arg(argc, argv, 1, 10);
  const int steps_per_round = bench::positive_arg(argc, argv, 2, 3);
  const bool root = world.rank() == 0;
  const model::ModelConfig model = model::load_model_config("demo");
  const plan::Plan plan = plan::uniform_plan(model, world.size(), 1, 1, kGlobalBatch, 1);
  const runtime::CoreSharing cores = runtime::CoreSharing::detect(world, 1);

  std::vector<Setting> settings;
  settings.push_back({"monitored", true, true, nullptr, nullptr, {}});
  settings.push_back({"unmonitored", false, true, nullptr, nullptr, {}});
  if (cores.lease) settings.push_back({"monitored, no lease", true, false, nullptr, nullptr, {}});
  for (Setting& s : settings) {
    runtime::EngineOptions options;
    options.seq_len = kSeq;
    options.threads = 1;
    options.measure = s.measure;
    if (s.lease) options.core_lease = cores.lease;
    s.engine = std::make_unique<runtime::Engine>(model, plan, world, options);
    s.engine->init_parameters(1);
    s.monitor = std::make_unique<elastic::Monitor>(world.size());
  }
  // Token ids do not change the cost of a step; any valid ones will do.
  const runtime::SampleFn sample = [](int index, int32_t* inputs, int32_t* targets) {
    for (int t = 0; t < kSeq; ++t) {
      inputs[t] = (index * 31 + t * 7) % 256;
      targets[t] = (index * 31 + t * 7 + 1) % 256;
    }
  };
  const std::vector<std::string> geometries =
      elastic::work_geometries(settings.front().engine->state().layout());
  std::vector<double> observe_s;
  auto step = [&](Setting& s) {
    world.barrier();
    const auto start = Clock::now();
    const runtime::StepResult r = s.engine->step(sample, 1e-4f, 1.0f);
    if (s.measure) {
      const auto before = Clock::now();
      s.monitor->observe(r.measurements, geometries);
      observe_s.push_back(std::chrono::duration<double>(Clock::now() - before).count());
    }
    world.barrier();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  // What one clock read costs (the engine reads the clock twice per compute section, plus twice
  // per tensor-parallel collective).
  const auto clock_start = Clock::now();
  constexpr int kReads = 1000000;
  for (int i = 0; i < kReads; ++i) Clock::now();
  const double clock_read_s =
      std::chrono::duration<double>(Clock::now() - clock_start).count() / kReads;

  const std::string load_before = load_average();
  for (Setting& s : settings) {
    for (int i = 0; i < kWarmupSteps; ++i) step(s);
  }
  // The order rotates every round, so no setting always follows the same other one.
  for (int round = 0; round < rounds; ++round) {
    for (size_t k = 0; k < settings.size(); ++k) {
      Setting& s = settings[(k + static_cast<size_t>(round)) % settings.size()];
      for (int i = 0; i < steps_per_round; ++i) s.step_s.push_back(step(s));
    }
  }
  if (!root) return;
  std::printf("demo model, dp%d, seq %d, micro-batch 1, global batch %d, 1 thread per rank\n",
              world.size(), kSeq, kGlobalBatch);
  std::printf("cores: %s\n", cores.summary.c_str());
  std::printf("%d rounds x %d steps per setting, interleaved; load average %s before, %s after\n",
              rounds, steps_per_round, load_before.c_str(), load_average().c_str());
  const double base = median(settings[1].step_s);
  for (const Setting& s : settings) {
    const auto [lo, hi] = std::minmax_element(s.step_s.begin(), s.step_s.end());
    std::printf("  %-22s %.4f s/step median [%.4f-%.4f], %+.2f%% vs unmonitored\n", s.name.c_str(),
                median(s.step_s), *lo, *hi, 100 * (median(s.step_s) / base - 1));
  }
  const int sections = 2 * kGlobalBatch / world.size();  // forward and backward per micro-batch
  std::printf(
      "  timing: %d compute sections per step, a clock read %.0f ns; Monitor::observe "
      "%.1f us per step (median)\n",
      sections, 1e9 * clock_read_s, 1e6 * median(observe_s));
  // The same comparison within each round (settings ran back to back there): robust to drift.
  std::vector<double> ratios;
  for (size_t i = 0; i < settings[0].step_s.size(); ++i) {
    ratios.push_back(settings[0].step_s[i] / settings[1].step_s[i]);
  }
  std::printf("  monitored / unmonitored, step by step: median %+.2f%%\n",
              100 * (median(ratios) - 1));
}

}  // namespace

int main(int argc, char** argv) {
  return bench::mpi_main(argc, argv, run);
}
