// Whether to switch plans: the one rule that the controller (while training) and the simulator (in
// the experiments) apply, and the migration estimate it weighs. The estimate comes from the layout
// algebra's redistribution plan, the one the engine executes, so it is what a switch then sends.
// This room sits above plan/ and layout/ and below elastic/ and sim/.
#pragma once

#include <cstdint>
#include <string>

#include "model/config.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "plan/planner.h"

namespace malleus::replan {

struct MigrationEstimate {
  int64_t total_bytes = 0;     // parameters and Adam moments received, over all ranks
  int64_t max_rank_bytes = 0;  // the busiest receiver's
  double seconds = 0;          // the busiest receiver's bytes over the inter-node bandwidth
};

// What switching `from` → `to` moves on the cost model's cluster (plans of the same world size).
MigrationEstimate estimate_migration(const plan::CostModel& cost, const plan::Plan& from,
                                     const plan::Plan& to);

// `options` with the planner's tie-break (among equally fast plans, the one moving least) using
// estimate_migration's bytes.
plan::PlannerOptions with_migration_tie_break(plan::PlannerOptions options,
                                              const plan::CostModel& cost);

// Is switching from the running plan to a proposed one worth it?
struct SwitchQuestion {
  double current_step_s = 0;   // predicted time per step of the running plan; +inf: it cannot run
  double proposed_step_s = 0;  // of the proposed plan
  double switch_s = 0;       // what switching costs: the migration, and what else the caller counts
  double horizon_steps = 0;  // the steps over which the gain is counted
  bool same_plan = false;    // the proposal is the running plan
};

struct SwitchVerdict {
  bool take = false;
  double gain_s = 0;   // (current − proposed) × horizon; +inf when the running plan cannot run
  std::string reason;  // why not, when declined

  bool operator==(const SwitchVerdict&) const = default;
};

// Switch when the time saved over the horizon exceeds what switching costs.
SwitchVerdict weigh_switch(const SwitchQuestion& question);

}  // namespace malleus::replan
