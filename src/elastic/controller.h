// The controller: when the monitored rates have moved, ask the planner for a plan for the new
// rates and switch only if replan::weigh_switch says the predicted time saved over a horizon beats
// the predicted cost of moving the state (the rule the simulator applies too). The decision is
// made on rank 0 and its plan broadcast, so every rank acts on the same one.
#pragma once

#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "replan/replan.h"

namespace malleus::elastic {

struct ControllerOptions {
  double straggler_threshold = 1.2;  // rates below count as healthy (1)
  double hysteresis = 0.3;           // re-plan when a rate moved by this fraction of the old one
  int horizon_steps = 50;            // gain is counted over at most this many remaining steps
  int min_samples = 3;               // monitored steps needed after a re-plan before the next
  std::string strategy = "malleus";
};

// One decision. `asked` and `plan` are the same on every rank; the rest describes rank 0's
// reasoning and is filled on rank 0 only.
struct Decision {
  bool asked = false;              // the rates moved enough to ask the planner
  std::optional<plan::Plan> plan;  // set: switch to it
  int64_t step = 0;
  std::vector<double> rates;       // the effective rates planned for
  std::vector<double> link_rates;  // the effective link rates planned for (per node)
  std::string old_plan, new_plan;  // summaries; new_plan is empty when no plan was found
  replan::SwitchQuestion question;
  replan::SwitchVerdict verdict;  // its reason also says why no plan was found
  double planning_s = std::numeric_limits<double>::quiet_NaN();
};

class Controller {
 public:
  // `cost` models this job's cluster (its devices are the ranks), model and batch.
  Controller(plan::CostModel cost, ControllerOptions options);

  // Collective: asks the planner on rank 0 when trigger() fires, and broadcasts its plan.
  Decision decide(comm::Communicator& world, const plan::Plan& current,
                  const std::vector<double>& rates, int monitored_steps, int64_t step,
                  int64_t remaining_steps, const std::vector<double>& link_rates = {});
  // Called once per step (decide() calls it): whether to ask the planner. Compute rates: when one
  // moved by the hysteresis from the rate last planned for. Link rates (per node of the cost
  // model's cluster; empty: not measured): when a node's link read moved by the hysteresis, the
  // same way, on each of the last `min_samples` steps and its last two readings agree within it
  // (settled) — a link reading jumps from 1 to 10 within the monitor's window, and a plan made
  // for the partly slowed step between (1.3) is wrong for the next step already. A link that has
  // not settled is planned at the rate last planned for.
  // After it fires, planning_link_rates() are the link rates to plan for.
  bool trigger(const std::vector<double>& rates, int monitored_steps, int64_t remaining_steps,
               const std::vector<double>& link_rates = {});
  const std::vector<double>& planning_link_rates() const { return planning_link_rates_; }
  // What rank 0 decides for `rates` and `link_rates` (measured; thresholded here), whether or
  // not they moved: the planner and the switch rule see the links at their measured rates.
  Decision propose(const plan::Plan& current, const std::vector<double>& rates, int64_t step,
                   int64_t remaining_steps, const std::vector<double>& link_rates = {}) const;
  // The last migration's wall time: the switch cost is at least this (building communicators and
  // buffers costs time the bandwidth model does not see).
  void note_migration_seconds(double seconds) { measured_migration_s_ = seconds; }

 private:
  std::vector<double> effective(const std::vector<double>& rates) const;

  plan::CostModel cost_;
  ControllerOptions options_;
  std::unique_ptr<plan::Strategy> strategy_;
  std::vector<double> planned_rates_, planned_link_rates_;
  std::deque<std::vector<double>> link_history_;  // the last min_samples link readings
  std::vector<double> planning_link_rates_;
  double measured_migration_s_ = -1;
};

// The cluster to plan for when training on this machine: the named preset (default "cpu-local")
// with one device per rank on one node.
plan::ClusterSpec local_cluster(const std::string& preset, int world_size);
// A profile measured on a whole core, for ranks that each get only `share` of one (several
// ranks per core): the same work takes 1 / share as long.
plan::Profile shared_profile(plan::Profile profile, double share);

}  // namespace malleus::elastic
