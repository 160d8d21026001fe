// Optimizer memory per rank with and without the distributed optimizer (ZeRO-1), from the
// runtime's own ledger (backend::memory_ledger, what metrics.jsonl records as peak_*_bytes):
// the data-parallel plan over all ranks of the job (mpirun -np 2, -np 4) on a 106M-parameter
// model, one training step each way, and each rank's peak by kind during that step.
//
//   mpirun -np 4 build/bench/bench_optimizer_memory
//
// Memory, not time: the figures do not depend on the machine's load.
#include <algorithm>
#include <cstdio>

#include "bench_models.h"
#include "comm/communicator.h"
#include "comm/mpi_session.h"
#include "common/json.h"
#include "model/config.h"
#include "plan/plan.h"
#include "runtime/engine.h"

using namespace malleus;

namespace {

constexpr int kSeq = 16;

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  comm::Communicator world = comm::Communicator::world();
  const model::ModelConfig model = bench::model_106m();
  const int ranks = world.size();
  const plan::Plan plan = plan::uniform_plan(model, ranks, 1, 1, ranks, 1);
  const runtime::SampleFn sample = [](int index, int32_t* inputs, int32_t* targets) {
    for (int t = 0; t < kSeq; ++t) {
      inputs[t] = (index * 31 + t * 7) % 32000;
      targets[t] = (index * 37 + t * 11 + 1) % 32000;
    }
  };
  if (world.rank() == 0) {
    std::printf(
        "| plan | distributed optimizer | optimizer MB per rank (max) | gradients MB | "
        "peak total MB |\n|---|---|---:|---:|---:|\n");
  }
  double whole = 0;
  for (const bool split : {false, true}) {
    runtime::EngineOptions options;
    options.seq_len = kSeq;
    options.distributed_optimizer = split;
    runtime::Engine engine(model, plan, world, options);
    engine.init_parameters(1);
    const runtime::StepResult r = engine.step(sample, 1e-4f, 1.0f);
    double optimizer = 0, gradients = 0, total = 0;
    for (size_t i = 0; i < r.peak_memory.size(); ++i) {
      optimizer = std::max(optimizer, double(r.peak_memory[i][backend::MemoryKind::kOptimizer]));
      gradients = std::max(gradients, double(r.peak_memory[i][backend::MemoryKind::kGradients]));
      total = std::max(total, r.peak_memory_total[i]);
    }
    if (!split) whole = optimizer;
    if (world.rank() == 0) {
      std::printf(
          "| dp%d | %s | %.1f%s | %.1f | %.1f |\n", ranks, split ? "on" : "off", optimizer / 1e6,
          split ? (" (" + std::to_string(optimizer / whole).substr(0, 5) + " of off)").c_str() : "",
          gradients / 1e6, total / 1e6);
    }
  }
  return 0;
}
