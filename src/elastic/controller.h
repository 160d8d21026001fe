// The controller: when the monitored rates have moved, ask the planner for a plan for the new
// rates and switch only if the predicted time saved over a horizon beats the predicted cost of
// moving the state. The decision is made on rank 0 and broadcast, so every rank acts on the same
// one.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/json.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace malleus::elastic {

struct ControllerOptions {
  double straggler_threshold = 1.2;  // rates below count as healthy (1)
  double hysteresis = 0.3;           // re-plan when a rate moved by this fraction of the old one
  int horizon_steps = 50;            // gain is counted over at most this many remaining steps
  int min_samples = 3;               // monitored steps needed after a re-plan before the next
  std::string strategy = "malleus";
};

struct Decision {
  std::optional<plan::Plan> plan;  // set: switch to it
  Json record;  // for the metrics log ("replan" or "replan_declined"); null when nothing was asked
};

class Controller {
 public:
  // `cost` models this job's cluster (its devices are the ranks), model and batch.
  Controller(plan::CostModel cost, ControllerOptions options);

  // Collective. `measured_migration_s`: the last migration's wall time, if any, to correct the
  // cost model's estimate.
  Decision decide(comm::Communicator& world, const plan::Plan& current,
                  const std::vector<double>& rates, int monitored_steps, int64_t step,
                  int64_t remaining_steps);
  // The measured rates the current plan was chosen for.
  const std::vector<double>& planned_rates() const { return planned_rates_; }
  void note_migration_seconds(double seconds) { measured_migration_s_ = seconds; }

 private:
  std::vector<double> effective(const std::vector<double>& rates) const;
  Decision decide_on_root(const plan::Plan& current, const std::vector<double>& rates, int64_t step,
                          int64_t remaining_steps);

  plan::CostModel cost_;
  ControllerOptions options_;
  std::unique_ptr<plan::Strategy> strategy_;
  std::vector<double> planned_rates_;
  double measured_migration_s_ = -1;
};

// The cluster to plan for when training on this machine: the named preset (default "cpu-local")
// with one device per rank on one node.
plan::ClusterSpec local_cluster(const std::string& preset, int world_size);
// A profile measured on a whole core, for ranks that each get only `share` of one (several
// ranks per core): the same work takes 1 / share as long.
plan::Profile shared_profile(plan::Profile profile, double share);

}  // namespace malleus::elastic
