// The controller: when the monitored rates have moved, ask the planner for a plan for the new
// rates — incrementally from the running plan when at most plan::kIncrementalDevices devices moved
// since it was planned and the links did not, the full search otherwise — and switch only if
// replan::weigh_switch says the predicted time saved over a horizon beats the predicted cost of
// moving the state (the rule the simulator applies too). The decision is made on rank 0 and its
// plan broadcast, so every rank acts on the same one.
//
// Holding still: load that moves between ranks faster than a re-plan pays back makes every switch
// a loss (the plan fits where the load was). So rank 0 keeps its own record of each switch: the
// gain it predicted, the gain it realised — the cost model's step time of the plan it left minus
// the plan it took, on every following step's own rates (unsmoothed, note_step_rates), until the
// next question — and the switch's measured cost (note_migration_seconds); and of the rates of
// the last `hold_window` steps. A switch whose realised gain did not pay for its measured cost
// puts the controller on hold. On hold it weighs one plan with the switch rule itself
// (replan::weigh_switch) over the recorded steps. Rates new to the record (a load moving between
// ranks comes back to the rates it had) or held longer than any earlier run of rates recorded
// persist once they have held `min_samples` steps: the planner's plan for them must have gained
// twice its switch cost (there and back), 2^(losses − 1) times over (losses: the losing switches,
// at most `max_backoff` counted), over the steps they held — a real straggler is planned around
// within 3 steps. New rates held fewer steps: wait and see. Otherwise the load moves: once the
// mean of the recorded rates moved by the hysteresis from the rates the running plan is for, the
// planner's plan for that mean (the plan best on average: no chase) must gain its switch cost
// once over the recorded steps at the mean rates. (Judged step by step on the recorded rates, a
// plan for a straggler that then moved loses where the load sits on one rank what it gains on
// the other: going back to the even split never pays, and the uneven one stays for good.) On
// hold every rank asks again every `hold_reask_steps` steps. Rates that stay put for half a
// window end the hold.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "metrics/metrics.h"
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
  int hold_window = 24;      // steps of rates recorded; half as many calm ones end a hold
  int hold_reask_steps = 2;  // on hold: steps between questions
  int max_backoff = 4;       // losing switches counted in the multiple of the switch cost
};

// One switch: what it predicted and what it realised (rank 0's record).
struct SwitchRecord {
  plan::Plan from, to;
  int64_t step = 0;
  double predicted_gain_per_step_s = 0;  // the cost model's, for the rates it was planned for
  double switch_s = 0;    // the predicted cost; the measured migration once known, if larger
  double realised_s = 0;  // sum over the steps since of (time of `from` − time of `to`)
  int steps = 0;

  double net_s() const { return realised_s - switch_s; }
};

// One decision: the plan to switch to, if any, and the one record of what was weighed and why
// (metrics::ReplanRecord: the metrics line, the log line and Python's Decision show it). Both are
// rank 0's and the same on every rank: the record travels with the plan.
struct Decision {
  std::optional<plan::Plan> plan;  // set: switch to it
  metrics::ReplanRecord record;
};

// How rank 0's decision reaches every rank: `broadcast` is called on every rank when the
// controller is asked, with rank 0's text on rank 0 (empty elsewhere), and returns rank 0's text
// on every rank; `root` says whether this is rank 0.
struct Transport {
  bool root = true;
  std::function<std::string(const std::string& root_text)> broadcast = {};

  static Transport alone();                          // a job of one process (tests, tools)
  static Transport over(comm::Communicator& world);  // MPI
};

// One step as the controller sees it.
struct ControllerInput {
  const plan::Plan& current;            // the running plan
  std::vector<double> rates = {};       // the monitor's (windowed) rates of every rank
  std::vector<double> step_rates = {};  // this step's alone (Monitor::step_rates); empty: `rates`
  std::vector<double> link_rates = {};  // every node's link rate; empty: not measured
  int monitored_steps = 0;              // steps observed since the last switch
  int64_t step = 0, remaining_steps = 0;
  bool always = false;  // ask the planner whether or not the rates moved (tools and tests)
};

// `rates` counted from the least slowed rank when every rank reads slowed (each divided by the
// smallest, when that is above 1); unchanged otherwise. A slowdown every rank shares (the
// machine's own swings, a cluster-wide clock or power cap) moves no work between ranks: the best
// plan depends on how the ranks compare, not on how fast all of them are.
std::vector<double> relative_to_least_slowed(std::vector<double> rates);

class Controller {
 public:
  // `cost` models this job's cluster (its devices are the ranks), model and batch.
  Controller(plan::CostModel cost, ControllerOptions options);

  // Collective over `transport` when the planner is asked (every rank calls it each step with the
  // same input): nullopt when the rates did not move enough to ask (trigger()), the decision
  // otherwise. The compute rates are taken relative to the least slowed rank
  // (relative_to_least_slowed). Rank 0 counts the step into the record of its last switch (the
  // realised gain, on `step_rates`), proposes, applies the hold, and broadcasts the plan with the
  // record.
  std::optional<Decision> decide(const ControllerInput& input, const Transport& transport);
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
  // The last migration's wall time: the switch cost is at least this (building communicators and
  // buffers costs time the bandwidth model does not see).
  // It is also the last switch's measured cost in the record of realised gains.
  void note_migration_seconds(double seconds);
  // Rank 0's record: the last switch, followed until the next question, and the losing switches.
  const std::optional<SwitchRecord>& open_record() const { return open_; }
  int losses() const { return losses_; }
  bool holding() const { return losses_ > 0; }
  // The cost model's predictions the last decide() made (a plan at given rates is predicted once
  // per step, however many times the reasoning needs it).
  int predictions() const { return predictions_; }

 private:
  std::vector<double> effective(const std::vector<double>& rates) const;
  // A plan's predicted time per step at `rates` on the cluster with `links` (effective rates),
  // predicted once per step for the same arguments.
  double step_time(const plan::Plan& plan, const std::vector<double>& rates,
                   const std::vector<double>& links);
  // Rank 0, every step: records the step's rates and adds the step to the open record.
  void account(const plan::Plan& current, const std::vector<double>& rates);
  // Rank 0, when asked: closes the open record, proposes, applies the hold.
  Decision decide_on_root(const ControllerInput& input, const std::vector<double>& link_rates);
  // What the planner and the switch rule say for the input's rates and `link_rates` (measured;
  // thresholded here): the planner and the switch rule see the links at their measured rates.
  Decision propose(const ControllerInput& input, const std::vector<double>& link_rates);
  // On hold: replaces the proposal in `d` by the plan for the persistent rates or for the mean
  // of the recorded rates, if it would have paid over them, or by none. Returns the rates the
  // plan taken is for (empty: none taken).
  std::vector<double> hold(const plan::Plan& current, Decision& d);
  // Whether every rate of `a` is within the hysteresis of `b`'s.
  bool same_rates(const std::vector<double>& a, const std::vector<double>& b) const;
  // The recorded steps cut into runs of the same rates (within the hysteresis), oldest first.
  std::vector<size_t> regimes() const;
  // On hold, the rates now: back to rates recorded before, in a run no longer than earlier ones
  // (moving); new to the record or the longest run and held min_samples steps (persistent), or
  // not yet (emerging).
  enum class Regime { moving, emerging, persistent };
  Regime regime() const;
  // On hold, the plan to weigh (none: hold still), the rates it is judged at, over how many
  // recorded steps, and how many times its switch cost it must gain.
  struct HoldCandidate {
    Regime regime = Regime::moving;
    std::optional<plan::Plan> plan;
    std::vector<double> rates;
    double steps = 0, trips = 1;
    // How `plan` was searched, and how long that took (the record of a switch to it says so).
    std::string search;
    double planning_s = 0;
  };
  HoldCandidate hold_candidate(const plan::Plan& current, const Decision& d) const;
  // The mean of the recorded rates, thresholded.
  std::vector<double> mean_rates() const;
  // All ranks, after a question: what was planned for, and whether to ask again soon.
  void asked(const std::vector<double>& rates, const std::vector<double>& links, bool held);

  plan::CostModel cost_;
  ControllerOptions options_;
  std::unique_ptr<plan::Strategy> strategy_;
  std::vector<double> planned_rates_, planned_link_rates_;
  std::vector<double> running_rates_;  // rank 0: the effective rates the running plan is for
  std::deque<std::vector<double>> link_history_;  // the last min_samples link readings
  std::vector<double> planning_link_rates_;
  double measured_migration_s_ = -1;
  std::optional<SwitchRecord> open_;
  int losses_ = 0;
  bool reask_ = false;       // on hold: ask again after hold_reask_steps (every rank knows)
  int steps_since_ask_ = 0;  // trigger() calls since the last question
  int calm_steps_ = 0;       // trigger() calls since the compute rates last moved
  std::deque<std::vector<double>> history_;  // rank 0: the last hold_window steps' rates
  // This step's predictions: (plan JSON, rates, links) -> seconds.
  std::map<std::tuple<std::string, std::vector<double>, std::vector<double>>, double> predicted_;
  int predictions_ = 0;
};

// The cluster to plan for when training on this machine: the named preset (default "cpu-local")
// with one device per rank on one node.
plan::ClusterSpec local_cluster(const std::string& preset, int world_size);
// A profile measured on a whole core, for ranks that each get only `share` of one (several
// ranks per core): the same work takes 1 / share as long.
plan::Profile shared_profile(plan::Profile profile, double share);

}  // namespace malleus::elastic
