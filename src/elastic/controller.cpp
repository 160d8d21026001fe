#include "elastic/controller.h"

#include <chrono>
#include <cmath>

#include "common/error.h"

namespace malleus::elastic {

plan::ClusterSpec local_cluster(const std::string& preset, int world_size) {
  plan::ClusterSpec cluster = plan::load_cluster(preset);
  if (cluster.num_devices() != world_size) {
    cluster.nodes = 1;
    cluster.devices_per_node = world_size;
  }
  return cluster;
}

plan::Profile shared_profile(plan::Profile p, double share) {
  check(share > 0 && share <= 1, "a rank's share of a core must be in (0, 1]");
  for (double* time :
       {&p.layer_forward_s, &p.layer_backward_s, &p.head_forward_s, &p.head_backward_s}) {
    *time /= share;
  }
  for (double* rate :
       {&p.layer_forward_flops_per_s, &p.layer_backward_flops_per_s, &p.head_flops_per_s}) {
    *rate *= share;
  }
  return p;
}

Controller::Controller(plan::CostModel cost, ControllerOptions options)
    : cost_(std::move(cost)),
      options_(std::move(options)),
      strategy_(plan::make_strategy(options_.strategy)),
      planned_rates_(static_cast<size_t>(cost_.cluster().num_devices()), 1.0) {}

std::vector<double> Controller::effective(const std::vector<double>& rates) const {
  std::vector<double> e(rates.size());
  for (size_t r = 0; r < rates.size(); ++r) {
    e[r] = rates[r] < options_.straggler_threshold ? 1.0 : rates[r];
  }
  return e;
}

Decision Controller::decide(comm::Communicator& world, const plan::Plan& current,
                            const std::vector<double>& rates, int monitored_steps, int64_t step,
                            int64_t remaining_steps) {
  // Every rank sees the same rates (the monitor all-gathers them), so the trigger agrees
  // everywhere and the broadcast happens only when it fires.
  // Hysteresis on the measured rates themselves, relative to the rate planned for: thresholding
  // first would turn noise around the threshold (1.19 vs 1.31) into a jump.
  bool moved = false;
  for (size_t r = 0; r < rates.size(); ++r) {
    const double was = std::max(1.0, planned_rates_[r]), is = std::max(1.0, rates[r]);
    moved = moved || std::abs(is - was) >= options_.hysteresis * was;
  }
  if (!moved || monitored_steps < options_.min_samples || remaining_steps <= 0) return {};

  std::string verdict;  // the record, with the new plan inside when switching
  if (world.rank() == 0) {
    Decision d = decide_on_root(current, effective(rates), step, remaining_steps);
    if (d.plan) d.record["plan_json"] = d.plan->to_json();
    verdict = d.record.dump();
  }
  int64_t length = static_cast<int64_t>(verdict.size());
  world.broadcast(&length, sizeof length, 0);
  verdict.resize(static_cast<size_t>(length));
  world.broadcast(verdict.data(), verdict.size(), 0);
  planned_rates_ = rates;

  Decision decision;
  decision.record = Json::parse(verdict);
  if (decision.record.contains("plan_json")) {
    decision.plan = plan::Plan::from_json(decision.record["plan_json"], cost_.model(), "re-plan");
    decision.record.erase("plan_json");
  }
  return decision;
}

Decision Controller::decide_on_root(const plan::Plan& current, const std::vector<double>& rates,
                                    int64_t step, int64_t remaining_steps) {
  Decision d;
  d.record = {{"step", step}, {"rates", rates}, {"old_plan", current.summary()}};
  plan::PlanRequest request;
  request.rates = rates;
  request.current = current;
  plan::PlanResult result;
  try {
    result = strategy_->plan(cost_, request);
  } catch (const Error& e) {
    d.record["event"] = "replan_declined";
    d.record["reason"] = std::string("no plan: ") + e.what();
    return d;
  }
  const double old_time = cost_.predict(current, rates).iteration_time;
  const double new_time = result.prediction.iteration_time;
  const plan::Migration migration = plan::migration_cost(current, result.plan, cost_);
  // The model's transfer estimate, or what the last migration really took if that is larger
  // (building communicators and buffers costs time the bandwidth model does not see).
  const double migration_s = std::max(migration.seconds, measured_migration_s_);
  const int64_t horizon = std::min<int64_t>(remaining_steps, options_.horizon_steps);
  const double gain = (std::isfinite(old_time) ? old_time - new_time : 1e30) * double(horizon);
  d.record["new_plan"] = result.plan.summary();
  d.record["predicted_old_s"] = std::isfinite(old_time) ? old_time : -1.0;
  d.record["predicted_new_s"] = new_time;
  d.record["predicted_gain_s"] = std::isfinite(old_time) ? old_time - new_time : -1.0;
  d.record["predicted_migration_s"] = migration_s;
  d.record["horizon_steps"] = horizon;
  d.record["planning_s"] = result.planning_seconds;
  if (result.plan.to_json() == current.to_json()) {
    d.record["event"] = "replan_declined";
    d.record["reason"] = "the current plan is still the best";
  } else if (gain <= migration_s) {
    d.record["event"] = "replan_declined";
    d.record["reason"] = "predicted gain over the horizon does not pay for the migration";
  } else {
    d.record["event"] = "replan";
    d.plan = result.plan;
  }
  return d;
}

}  // namespace malleus::elastic
