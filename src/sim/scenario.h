// Straggler scenarios: a cluster, a model, a batch and a trace of rate changes over time. Every
// strategy is run through the trace end to end: it starts on its plan for a healthy cluster,
// notices each change after a few iterations, re-plans, and pays for it (planning time, moving
// parameters and optimizer state, rebuilding communicators; a full restart for the strategies
// that restart). Iteration times come from the simulator.
//
// JSON (docs/planner.md):
//   {"name": "70b-one-5x", "description": "one device at 5×",
//    "cluster": "a800-8x8", "model": "llama-70b",
//    "seq_len": 4096, "global_batch": 64, "micro_batch": 1, "base": "dp2,tp8,pp4",
//    "horizon_s": 3600,
//    "events": [{"at_s": 0, "rates": {"3": 5}}, {"at_s": 1800, "rates": {}}]}
// Optional: "strategies" (default all), "replan_s" (default: measured planning time),
// "detect_iterations" (1), "rebuild_s" (5), "failure_timeout_s" (60), "decision_horizon_s"
// (600), "profile" (a profile file), "distributed_optimizer" (true: the runtime's default; false:
// whole optimizer state on every holder). An event's rates replace all earlier ones.
//
// Ours switches only when replan::weigh_switch (the controller's rule) says so, asked with the
// simulated step times, the migration estimate plus planning and rebuild time as the switch cost,
// and the steps of the old plan that fit in decision_horizon_s as the horizon. Every strategy is
// asked as the controller asks ours: with the running plan and the rates it last planned for
// (plan::PlanRequest::previous_rates), so ours re-plans incrementally when at most
// plan::kIncrementalDevices rates moved since and runs the full search otherwise.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/planner.h"
#include "replan/replan.h"

namespace malleus::sim {

struct RateEvent {
  double at_s = 0;
  plan::Rates rates;
};

struct Scenario {
  std::string name, description, source;
  plan::ClusterSpec cluster;
  model::ModelConfig model;
  plan::BatchConfig batch;
  plan::Shape base;
  std::vector<RateEvent> events;
  double horizon_s = 3600;
  std::vector<std::string> strategies;
  std::optional<double> replan_s;   // fixed planning time instead of the measured one
  double detect_iterations = 1;     // iterations on the old plan before a change is acted on
  double rebuild_s = 5;             // new communicators after a live re-plan
  double failure_timeout_s = 60;    // noticing a device that is gone
  double decision_horizon_s = 600;  // a live re-plan must repay its cost within this
  std::optional<plan::Profile> profile;
  bool distributed_optimizer = true;  // plan::CostModel::use_distributed_optimizer

  static Scenario from_json(const Json& json, const std::string& source);
};

Scenario load_scenario(const std::string& path);

// A switch our strategy weighed (replan::weigh_switch) at an event: the question, as the
// simulator put it, and the verdict.
struct WeighedSwitch {
  double at_s = 0;
  replan::SwitchQuestion question;
  replan::SwitchVerdict verdict;
};

// One call of a strategy's planner: its wall time, and whether ours re-planned incrementally from
// the running plan (plan::PlanResult::incremental) or ran the full search.
struct PlanningTime {
  double seconds = 0;
  bool incremental = false;
};

// One strategy's plan over one stretch of the trace.
struct Segment {
  double start_s = 0, end_s = 0;
  double samples_per_s = 0;  // 0 while re-planning / migrating / restarting
  std::string what;          // plan summary, or the overhead
};

struct StrategyRun {
  std::string strategy;
  double samples = 0;
  double overhead_s = 0;  // planning + migration + rebuild + restart + detection stalls
  int replans = 0;
  std::vector<double> steady_samples_per_s;  // per event: throughput of the plan it settled on
  std::vector<Segment> timeline;
  std::vector<WeighedSwitch> switches;  // ours only: the baselines switch whenever the plan changes
  PlanningTime start_planning;          // the plan for the healthy cluster
  std::vector<PlanningTime> event_planning;  // per event: the re-plan, taken or not
  std::string error;  // the strategy could not run (e.g. every pipeline lost a device)
  double samples_per_s(double horizon) const { return horizon > 0 ? samples / horizon : 0; }
};

struct ScenarioResult {
  Scenario scenario;
  double healthy_iteration_s = 0;           // best simulated iteration time of a healthy cluster
  std::vector<double> ideal_samples_per_s;  // per event: healthy × Σ(1/r) / N
  double ideal_samples = 0;                 // over the horizon
  std::vector<StrategyRun> runs;
};

ScenarioResult run_scenario(const Scenario& scenario);

// What the devices left can do, in healthy devices: Σ 1/r over the devices not gone. The ideal
// throughput under `rates` is the healthy one × capacity / devices.
double capacity(const plan::Rates& rates);

// Plain-text table: per strategy, end-to-end and per-event steady-state throughput, the ratio to
// ideal and the speedup over "uniform".
std::string render_table(const ScenarioResult& result);
Json result_to_json(const ScenarioResult& result);
// Throughput over time, one line per strategy, with the ideal dashed.
std::string render_svg(const ScenarioResult& result);

// The evaluator the planner uses to pick among its best candidates: simulated iteration time.
plan::Evaluator simulator_evaluator(const plan::CostModel& cost);

}  // namespace malleus::sim
