// Discrete-event simulation of one training iteration of a plan: every pipeline runs 1F1B with
// its real dependencies (a forward waits for the previous stage's forward and the activation's
// transfer, a backward for the next stage's backward and the gradient's transfer, and each stage
// runs its operations in 1F1B order), then gradients are synced across pipelines and the
// optimizer steps. Operation durations come from the cost model, so the simulator and the
// closed form differ only where 1F1B's schedule does (uneven stages, transfer latencies).
// Ranks that take turns on shared cores (ClusterSpec::cores_per_node) are not scheduled as such
// yet: there the closed form's pipeline time, which knows the turns, bounds the result.
#pragma once

#include <vector>

#include "plan/cost_model.h"
#include "plan/plan.h"

namespace malleus::sim {

struct DeviceStats {
  bool used = false;
  double busy_s = 0;  // computing or communicating
  double idle_s = 0;  // iteration time − busy
  double memory_bytes = 0;
  int peak_in_flight = 0;  // micro-batches whose activations it held at once
};

struct SimResult {
  double iteration_time = 0;  // +inf when a used device is gone
  double pipeline_time = 0, grad_sync_time = 0, optimizer_time = 0;
  std::vector<double> pipeline_times;
  std::vector<DeviceStats> devices;
  bool fits = true;
  std::string problem;
  double mean_utilisation() const;  // busy / iteration over used devices
};

// `choose_recompute` as CostModel::predict: false runs the plan's recomputation exactly as written
// (what `malleus simulate --plan` and the runtime do).
SimResult simulate(const plan::CostModel& cost, const plan::Plan& plan, const plan::Rates& rates,
                   bool choose_recompute = true);

// Finish time of one pipeline under 1F1B from per-stage forward, backward and transfer times
// (transfer[s]: between stage s and s + 1, each way). Also fills each stage's busy time and the
// most micro-batches it held at once when the pointers are given. `ahead[s]` (empty: none): the
// part of stage s's backward that it runs before the gradient arrives (the shifted schedule's
// recomputation), as soon as the stage is free.
double simulate_pipeline(const std::vector<double>& forward, const std::vector<double>& backward,
                         const std::vector<double>& transfer, int micro_batches,
                         std::vector<int>* peak_in_flight = nullptr,
                         const std::vector<double>& ahead = {});

}  // namespace malleus::sim
