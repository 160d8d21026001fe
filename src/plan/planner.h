// Planners: given the cluster, every device's straggle rate, the model and the batch, choose the
// plan that trains fastest and predict its iteration time. "malleus" is ours; the baselines
// reproduce what other systems do, behind the same interface so the simulator can hold them side
// by side (docs/planner.md describes each).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/plan.h"

namespace malleus::plan {

// A uniform dp × tp × pp shape (Megatron-LM's rank order).
struct Shape {
  int dp = 0, tp = 0, pp = 0;
  bool empty() const { return dp == 0 || tp == 0 || pp == 0; }
  std::string text() const;
  static Shape parse(const std::string& text);  // "dp2,tp8,pp4" or "2x8x4" (dp×tp×pp)
};

struct PlanRequest {
  Rates rates;                  // one per device; missing devices count as 1
  Shape base;                   // the baselines' shape; empty: the best uniform shape when healthy
  std::optional<Plan> current;  // the plan running now: ties are broken toward it
  // The rates `current` was planned for. Given, and at most kIncrementalDevices devices' rates
  // differ from them, ours re-plans incrementally from `current` (PlanResult::incremental);
  // otherwise it runs the full search.
  std::optional<Rates> previous_rates{};
};
inline constexpr int kIncrementalDevices = 8;
// On clusters of at most kIncrementalCheckDevices devices (where the full search takes well under
// a second), an incremental plan predicted more than kIncrementalSlack slower than the running
// plan scaled by the capacity the change took (its time under previous_rates × capacity before /
// capacity after, remaining_capacity) is checked against the full search too, and the faster
// wins: a search from the running plan cannot reshape the cluster (fewer pipelines, another stage
// count) where the micro-batches no longer divide evenly among its pipelines.
inline constexpr int kIncrementalCheckDevices = 1024;
inline constexpr double kIncrementalSlack = 0.01;

// Where a planner's time went: a named phase and its wall time.
struct PlanningPhase {
  std::string name;
  double seconds = 0;
};

struct PlanResult {
  std::string strategy;
  Plan plan;
  Prediction prediction;              // the cost model's
  double planning_seconds = 0;        // wall time of plan()
  std::vector<PlanningPhase> phases;  // ours: planning_seconds by phase
  bool incremental = false;  // ours: re-planned from the running plan alone (previous_rates)
  bool restart = false;      // applying it means stopping and restarting the job
  std::string note;
};

// Scores a plan more precisely than the closed form (the simulator); lower is better.
using Evaluator = std::function<double(const Plan&, const Rates&)>;
// Bytes that switching from the first plan to the second moves. The planner does not know how
// state moves (that is the layout algebra's job, above it): replan::migration_tie_break supplies
// the one estimate the controller and the simulator use too.
using MigrationBytes = std::function<double(const Plan& from, const Plan& to)>;

struct PlannerOptions {
  double straggler_threshold = 1.2;  // drop-slow drops devices at or above this rate
  double tie_tolerance = 1e-6;       // relative; closer candidates count as equal
  int refine_top = 6;                // candidates re-scored by `refine`
  Evaluator refine;                  // optional
  // Among candidates within tie_tolerance of the best, the one moving the fewest bytes from the
  // request's current plan wins. Unset: the current plan wins if it is among them (it moves
  // nothing), otherwise the fastest.
  MigrationBytes migration;
  // Ours also moves whole healthy TP groups from one pipeline to another (docs/planner.md); off
  // only to measure what the move adds.
  bool move_groups = true;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // Throws Error when no valid plan exists (e.g. every device gone).
  virtual PlanResult plan(const CostModel& cost, const PlanRequest& request) const = 0;
};

std::unique_ptr<Strategy> make_strategy(const std::string& name, PlannerOptions options = {});
// "malleus", "uniform", "drop-slow", "uneven-microbatches", "uneven-layers": the strategies the
// simulator and the experiments hold side by side. make_strategy also makes "data-parallel", for
// a framework that only replicates the model (the Python package's malleus.torch): one replica
// per device, micro-batches by rates, down to none for a replica too slow to help.
std::vector<std::string> strategy_names();

// ---- exact sub-problems (exposed for tests) --------------------------------------------------

// Layers per stage for a fixed stage order: minimises the slowest stage, then the sum of stage
// times. stage_time[j](l) is stage j's time with l ≥ 1 layers, non-decreasing in l, +inf where
// it does not fit. Returns {} when no assignment is feasible.
std::vector<int> assign_layers(int layers,
                               const std::vector<std::function<double(int)>>& stage_time);

// Micro-batches per pipeline minimising max_i T_i(m_i), T_i(m) = first_i + (m − 1)·period_i for
// m ≥ 1 and T_i(0) = 0 (a pipeline given none is dropped) when allow_zero; else m_i ≥ 1.
std::vector<int> assign_micro_batches(int total, const std::vector<double>& first,
                                      const std::vector<double>& period, bool allow_zero);

// ---- shapes ------------------------------------------------------------------------------------

// The uniform shape with the lowest predicted time on a healthy cluster.
Shape best_uniform_shape(const CostModel& cost);

}  // namespace malleus::plan
