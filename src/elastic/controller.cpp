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
      strategy_(
          plan::make_strategy(options_.strategy, replan::with_migration_tie_break({}, cost_))),
      planned_rates_(static_cast<size_t>(cost_.cluster().num_devices()), 1.0) {}

std::vector<double> Controller::effective(const std::vector<double>& rates) const {
  std::vector<double> e(rates.size());
  for (size_t r = 0; r < rates.size(); ++r) {
    e[r] = rates[r] < options_.straggler_threshold ? 1.0 : rates[r];
  }
  return e;
}

bool Controller::trigger(const std::vector<double>& rates, int monitored_steps,
                         int64_t remaining_steps, const std::vector<double>& link_rates) {
  // Every rank sees the same rates (the monitors all-gather them), so the trigger agrees
  // everywhere and the broadcast happens only when it fires.
  // Hysteresis on the measured rates themselves, relative to the rate planned for: thresholding
  // first would turn noise around the threshold (1.19 vs 1.31) into a jump.
  auto moved_from = [&](double planned, double now) {
    const double was = std::max(1.0, planned), is = std::max(1.0, now);
    return std::abs(is - was) < options_.hysteresis * was ? 0 : is > was ? 1 : -1;
  };
  bool moved = false;
  for (size_t r = 0; r < rates.size(); ++r) {
    moved = moved || moved_from(planned_rates_[r], rates[r]) != 0;
  }
  // Links by the same rule, on every one of the last min_samples readings, in one direction.
  // (decide() records what was planned for; trigger() alone changes nothing but the history.)
  planned_link_rates_.resize(link_rates.size(), 1.0);
  link_history_.push_back(link_rates);
  while (link_history_.size() > static_cast<size_t>(std::max(1, options_.min_samples))) {
    link_history_.pop_front();
  }
  const bool full = link_history_.size() == static_cast<size_t>(std::max(1, options_.min_samples));
  planning_link_rates_ = planned_link_rates_;
  for (size_t n = 0; n < link_rates.size(); ++n) {
    const int direction = moved_from(planned_link_rates_[n], link_rates[n]);
    bool settled = full && direction != 0;
    for (const auto& reading : link_history_) {
      settled = settled && reading.size() == link_rates.size() &&
                moved_from(planned_link_rates_[n], reading[n]) == direction;
    }
    // ... and no longer climbing or falling: the last two readings agree.
    if (settled && link_history_.size() >= 2) {
      const double before = std::max(1.0, link_history_[link_history_.size() - 2][n]);
      settled = std::abs(std::max(1.0, link_rates[n]) - before) < options_.hysteresis * before;
    }
    if (settled) planning_link_rates_[n] = link_rates[n];
    moved = moved || settled;
  }
  return moved && monitored_steps >= options_.min_samples && remaining_steps > 0;
}

Decision Controller::decide(comm::Communicator& world, const plan::Plan& current,
                            const std::vector<double>& rates, int monitored_steps, int64_t step,
                            int64_t remaining_steps, const std::vector<double>& link_rates) {
  if (!trigger(rates, monitored_steps, remaining_steps, link_rates)) return {};
  const std::vector<double> links = planning_link_rates_;

  Decision decision;
  std::string plan_text;  // the plan to switch to, if any
  if (world.rank() == 0) {
    decision = propose(current, rates, step, remaining_steps, links);
    if (decision.plan) plan_text = decision.plan->to_json().dump();
  }
  int64_t length = static_cast<int64_t>(plan_text.size());
  world.broadcast(&length, sizeof length, 0);
  plan_text.resize(static_cast<size_t>(length));
  world.broadcast(plan_text.data(), plan_text.size(), 0);
  planned_rates_ = rates;
  planned_link_rates_ = links;

  decision.asked = true;
  if (world.rank() != 0 && !plan_text.empty()) {
    decision.plan = plan::Plan::from_json(Json::parse(plan_text), cost_.model(), "re-plan");
  }
  return decision;
}

Decision Controller::propose(const plan::Plan& current, const std::vector<double>& measured,
                             int64_t step, int64_t remaining_steps,
                             const std::vector<double>& link_rates) const {
  Decision d;
  d.asked = true;
  d.step = step;
  d.rates = effective(measured);
  d.link_rates = effective(link_rates);
  d.old_plan = current.summary();
  // The cluster as it is now: its links at their measured rates.
  const plan::CostModel cost = cost_.with_link_rates(d.link_rates);
  plan::PlanRequest request;
  request.rates = d.rates;
  request.current = current;
  plan::PlanResult result;
  try {
    result = strategy_->plan(cost, request);
  } catch (const Error& e) {
    d.verdict.reason = std::string("no plan: ") + e.what();
    return d;
  }
  d.new_plan = result.plan.summary();
  d.planning_s = result.planning_seconds;
  const replan::MigrationEstimate migration =
      replan::estimate_migration(cost, current, result.plan);
  d.question.current_step_s = cost.predict(current, d.rates).iteration_time;
  d.question.proposed_step_s = result.prediction.iteration_time;
  d.question.switch_s = std::max(migration.seconds, measured_migration_s_);
  d.question.horizon_steps =
      static_cast<double>(std::min<int64_t>(remaining_steps, options_.horizon_steps));
  d.question.same_plan = result.plan.to_json() == current.to_json();
  d.verdict = replan::weigh_switch(d.question);
  if (d.verdict.take) d.plan = result.plan;
  return d;
}

}  // namespace malleus::elastic
