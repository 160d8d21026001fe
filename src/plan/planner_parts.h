// The planner's internal pieces, shared by its files: planner.cpp (the interface, shared helpers),
// exact.cpp (the exact sub-solvers), baselines.cpp (the other systems' strategies) and search.cpp
// (ours). Not part of the plan library's interface.
#pragma once

#include <chrono>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "plan/planner.h"

namespace malleus::plan::detail {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
using Clock = std::chrono::steady_clock;

inline int to_int(size_t n) {
  return static_cast<int>(n);
}

// Wall time by phase of a planner's run (PlanResult::phases).
class PhaseClock {
 public:
  void lap(std::string name) {
    const auto now = Clock::now();
    phases_.push_back({std::move(name), std::chrono::duration<double>(now - last_).count()});
    last_ = now;
  }
  std::vector<PlanningPhase> phases() const { return phases_; }

 private:
  Clock::time_point last_ = Clock::now();
  std::vector<PlanningPhase> phases_;
};

// One rate per device (missing devices healthy).
Rates full_rates(const Rates& rates, int devices);
bool uses_gone(const std::vector<int>& ranks, const Rates& rates);
// TP degrees the planners consider: powers of two dividing the devices per node, at most the KV
// heads and the cost model's limit (CostModel::max_tensor_parallel).
std::vector<int> tp_degrees(const CostModel& cost);

// Layer ranges from per-stage counts.
void set_layers(std::vector<Stage>& stages, const std::vector<int>& counts);
// A TP group of `ranks` with shares balanced to their rates or even.
Stage make_group(const CostModel& cost, std::vector<int> ranks, bool balance, const Rates& rates);

// A pipeline's stages (TP groups with shares) after its layers are assigned, and its time
// coefficients: T(m) = first + (m − 1)·period.
struct PipelineEval {
  bool feasible = false;
  std::vector<Stage> stages;
  double first = kInf, period = kInf;
};

// Assigns layers to an ordered list of TP groups (exactly, for the closed form's bottleneck),
// assuming the pipeline gets at least as many micro-batches as stages (in-flight activations are
// then S − j on stage j), in a plan of `pipelines` pipelines (memory_use: the distributed
// optimizer's share).
PipelineEval evaluate_pipeline(const CostModel& cost, std::vector<Stage> stages, const Rates& rates,
                               int pipelines = 1);
// Layers per stage (empty: none fits) and the time coefficients of a pipeline.
struct PipelineTimes {
  std::vector<int> layers;
  double first = kInf, period = kInf;
};
// evaluate_pipeline, remembering its answers by the pipeline's stage costs (every number the
// evaluation reads: group costs, memory footprints, hand-off times): pipelines that cost the same
// (most healthy pipelines of a layout, which differ only in their ranks) are evaluated once.
class PipelineEvaluator {
 public:
  explicit PipelineEvaluator(const CostModel& cost) : cost_(&cost) {}
  PipelineEval operator()(std::vector<Stage> stages, const Rates& rates, int pipelines);
  size_t evaluations() const { return evaluations_; }  // layer assignments computed
  size_t reused() const { return reused_; }            // answered from memory

 private:
  const CostModel* cost_;
  std::unordered_map<std::string, PipelineTimes> times_;
  size_t evaluations_ = 0, reused_ = 0;
};
// Max of T_i(m_i) over the pipelines given micro-batches.
double allocation_time(const std::vector<double>& first, const std::vector<double>& period,
                       const std::vector<int>& m);
// A plan from evaluated pipelines and their micro-batch counts; pipelines given none are dropped
// (their ranks idle).
Plan assemble(const CostModel& cost, const std::vector<const PipelineEval*>& pipes,
              const std::vector<int>& micro_batches);
// Validates `plan` and wraps it with its prediction and the planning time since `start`.
PlanResult finish(std::string name, const CostModel& cost, Plan plan, const Rates& rates,
                  Clock::time_point start);

// ---- baselines (baselines.cpp) -----------------------------------------------------------------

struct UniformChoice {
  Plan plan;
  Shape shape;
  double time = kInf;
};

// The baselines' starting point: Megatron's layout of the base shape, with every pipeline that
// holds a gone device dropped (a data-parallel job can lose replicas, not parts of one).
struct BaseLayout {
  std::vector<std::vector<Stage>> pipelines;  // surviving pipelines, shares even, no layers yet
  bool dropped = false;
};

// The request's base shape, or the best healthy uniform shape when it gives none.
Shape resolve_base(const CostModel& cost, const Shape& base);
BaseLayout base_layout(const CostModel& cost, const Shape& shape, const Rates& rates);
// What the uneven baselines assign from the rates (the rest is split evenly).
struct UnevenAssignment {
  bool layers = false;         // layers per stage
  bool micro_batches = false;  // micro-batches per pipeline
  // A pipeline may be given no micro-batches (its ranks then idle) whenever that is fastest (a
  // hopeless replica); otherwise only when there are more pipelines than micro-batches.
  bool allow_zero_micro_batches = false;
};
// A plan from a base layout with layers and micro-batches even or assigned by rates.
Plan uneven_plan(const CostModel& cost, const BaseLayout& base, const Rates& rates,
                 UnevenAssignment uneven);
// The fastest uniform plan over the devices below `threshold` (none gone); empty when none fits.
UniformChoice drop_slow_choice(const CostModel& cost, const Rates& rates, double threshold);

std::unique_ptr<Strategy> make_uniform_strategy();
std::unique_ptr<Strategy> make_drop_slow_strategy(double threshold);
std::unique_ptr<Strategy> make_uneven_strategy(UnevenAssignment uneven);
std::unique_ptr<Strategy> make_data_parallel_strategy();
// Ours (search.cpp).
std::unique_ptr<Strategy> make_malleus_strategy(PlannerOptions options);

}  // namespace malleus::plan::detail
