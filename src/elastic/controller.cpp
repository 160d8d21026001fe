#include "elastic/controller.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <variant>

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
      planned_rates_(static_cast<size_t>(cost_.cluster().num_devices()), 1.0),
      running_rates_(planned_rates_) {}

std::vector<double> Controller::effective(const std::vector<double>& rates) const {
  std::vector<double> e(rates.size());
  for (size_t r = 0; r < rates.size(); ++r) {
    e[r] = rates[r] < options_.straggler_threshold ? 1.0 : rates[r];
  }
  return e;
}

std::vector<double> relative_to_least_slowed(std::vector<double> rates) {
  if (rates.empty()) return rates;
  const double least = *std::min_element(rates.begin(), rates.end());
  if (least > 1.0) {
    for (double& r : rates) r /= least;
  }
  return rates;
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
  // A rank planned for as a straggler that now reads clearly healthy (below halfway to the
  // threshold) has moved, however close the two rates: a plan for 1.28 is not kept at 1.0.
  const double clearly_healthy = 1.0 + (options_.straggler_threshold - 1.0) / 2;
  auto recovered = [&](double planned, double now) {
    return planned >= options_.straggler_threshold && now <= clearly_healthy;
  };
  ++steps_since_ask_;
  bool moved = false;
  for (size_t r = 0; r < rates.size(); ++r) {
    moved = moved || moved_from(planned_rates_[r], rates[r]) != 0 ||
            recovered(planned_rates_[r], rates[r]);
  }
  calm_steps_ = moved ? 0 : calm_steps_ + 1;
  // On hold, every rank asks again after hold_reask_steps: the record of rates has grown.
  moved = moved || (reask_ && steps_since_ask_ >= std::max(1, options_.hold_reask_steps));
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

Transport Transport::alone() {
  return Transport{.root = true, .broadcast = [](const std::string& text) { return text; }};
}

Transport Transport::over(comm::Communicator& world) {
  return Transport{.root = world.rank() == 0, .broadcast = [&world](const std::string& root_text) {
                     std::string text = root_text;
                     int64_t length = static_cast<int64_t>(text.size());
                     world.broadcast(&length, sizeof length, 0);
                     text.resize(static_cast<size_t>(length));
                     world.broadcast(text.data(), text.size(), 0);
                     return text;
                   }};
}

std::optional<Decision> Controller::decide(const ControllerInput& input,
                                           const Transport& transport) {
  check(transport.broadcast != nullptr, "controller: no transport for rank 0's decision");
  ControllerInput in = input;
  in.rates = relative_to_least_slowed(input.rates);
  in.step_rates = relative_to_least_slowed(input.step_rates);
  predicted_.clear();
  predictions_ = 0;
  if (transport.root) {
    account(in.current, in.step_rates.size() == in.rates.size() ? in.step_rates : in.rates);
  }
  const bool moved = trigger(in.rates, in.monitored_steps, in.remaining_steps, in.link_rates);
  if (!moved && !in.always) return std::nullopt;
  // Asked without a move: the links at their measured rates.
  const std::vector<double> links = moved ? planning_link_rates_ : in.link_rates;

  Decision decision;
  // Whether rank 0 is on hold (every rank then asks again soon): '1' or '0', then the record and
  // the plan.
  std::string text;
  if (transport.root) {
    decision = decide_on_root(in, links);
    const Json message = {{"record", metrics::to_json(decision.record)},
                          {"plan", decision.plan ? decision.plan->to_json() : Json()}};
    text = (holding() ? "1" : "0") + message.dump();
  }
  text = transport.broadcast(text);
  check(!text.empty(), "controller: the broadcast of rank 0's decision brought nothing");
  asked(in.rates, links, text[0] == '1');
  if (!transport.root) {
    const Json message = Json::parse(text.substr(1));
    const std::string where = "controller: rank 0's decision";
    check(message.is_object() && message.contains("record") && message.contains("plan"),
          where + " lacks its record or its plan: " + text.substr(0, 100));
    const auto record = metrics::parse_record(message.at("record"), where);
    check(record && std::holds_alternative<metrics::ReplanRecord>(*record),
          where + " is not a decision record");
    decision.record = std::get<metrics::ReplanRecord>(*record);
    if (!message.at("plan").is_null()) {
      decision.plan = plan::Plan::from_json(message.at("plan"), cost_.model(), "re-plan");
    }
  }
  return decision;
}

void Controller::asked(const std::vector<double>& rates, const std::vector<double>& links,
                       bool held) {
  planned_rates_ = rates;
  planned_link_rates_ = links;
  reask_ = held;
  steps_since_ask_ = 0;
}

void Controller::note_migration_seconds(double seconds) {
  measured_migration_s_ = seconds;
  if (open_) open_->switch_s = std::max(open_->switch_s, seconds);
}

double Controller::step_time(const plan::Plan& plan, const std::vector<double>& rates,
                             const std::vector<double>& links) {
  auto key = std::make_tuple(plan.to_json().dump(), rates, links);
  const auto it = predicted_.find(key);
  if (it != predicted_.end()) return it->second;
  ++predictions_;
  const double seconds = cost_.with_link_rates(links).predict(plan, rates).iteration_time;
  predicted_.emplace(std::move(key), seconds);
  return seconds;
}

void Controller::account(const plan::Plan& current, const std::vector<double>& rates) {
  const std::vector<double> measured = effective(rates);
  history_.push_back(measured);
  while (history_.size() > static_cast<size_t>(std::max(1, options_.hold_window))) {
    history_.pop_front();
  }
  // Rates that held still for half a window: the load that defeated re-planning has gone.
  if (holding() && 2 * calm_steps_ >= options_.hold_window) losses_ = 0;
  if (!open_) return;
  const std::vector<double> links = effective(planned_link_rates_);
  const double gain = step_time(open_->from, measured, links) - step_time(current, measured, links);
  if (!std::isfinite(gain)) return;
  open_->realised_s += gain;
  ++open_->steps;
}

bool Controller::same_rates(const std::vector<double>& a, const std::vector<double>& b) const {
  // Every rate within the hysteresis of `b`'s (rates below 1 count as 1).
  if (a.size() != b.size()) return false;
  for (size_t r = 0; r < a.size(); ++r) {
    const double was = std::max(1.0, b[r]), is = std::max(1.0, a[r]);
    if (std::abs(is - was) >= options_.hysteresis * was) return false;
  }
  return true;
}

std::vector<size_t> Controller::regimes() const {
  // Runs of recorded steps whose every rate is within the hysteresis of the run's first step's.
  std::vector<size_t> lengths;
  const std::vector<double>* first = nullptr;
  for (const auto& rates : history_) {
    if (first != nullptr && same_rates(rates, *first)) {
      ++lengths.back();
    } else {
      lengths.push_back(1);
      first = &rates;
    }
  }
  return lengths;
}

Controller::Regime Controller::regime() const {
  // New rates (no earlier recorded step had them: a load that moves between ranks comes back to
  // the rates it had) or rates that held longer than any earlier run recorded (a load that moves
  // every few steps never does) persist once they have held for min_samples steps. So does
  // health: every rank healthy again is where a straggler's end leads, not a load that moved.
  const std::vector<size_t> runs = regimes();
  if (runs.empty()) return Regime::moving;
  const size_t begins = history_.size() - runs.back();
  bool seen = false;
  for (size_t i = 0; i < begins && !seen; ++i) seen = same_rates(history_[i], history_[begins]);
  const bool outlasted = std::all_of(runs.begin(), runs.end() - 1,
                                     [&](size_t length) { return length < runs.back(); });
  const bool healthy = std::all_of(history_[begins].begin(), history_[begins].end(),
                                   [](double rate) { return rate <= 1.0; });
  if (seen && !outlasted && !healthy) return Regime::moving;
  return runs.back() >= static_cast<size_t>(std::max(1, options_.min_samples)) ? Regime::persistent
                                                                               : Regime::emerging;
}

std::vector<double> Controller::mean_rates() const {
  std::vector<double> mean(history_.empty() ? 0 : history_.back().size(), 0.0);
  for (const auto& rates : history_) {
    for (size_t r = 0; r < mean.size() && r < rates.size(); ++r) {
      mean[r] += rates[r] / static_cast<double>(history_.size());
    }
  }
  return effective(mean);
}

Decision Controller::decide_on_root(const ControllerInput& in,
                                    const std::vector<double>& link_rates) {
  if (open_) {
    // A switch that did not pay for its measured cost: the load moved on before it paid back.
    // On hold, one that paid does not end the hold (a calm window does).
    if (open_->net_s() < 0) {
      ++losses_;
    } else if (!holding()) {
      losses_ = 0;
    }
    open_.reset();
  }
  Decision d = propose(in, link_rates);
  std::vector<double> planned_for = d.record.rates;
  if (holding()) planned_for = hold(in.current, d);
  d.record.switched = d.plan.has_value();
  if (d.plan) {
    running_rates_ = planned_for;
    open_ = SwitchRecord{.from = in.current,
                         .to = *d.plan,
                         .step = in.step,
                         .predicted_gain_per_step_s = d.record.predicted_gain_s,
                         .switch_s = d.record.predicted_migration_s};
  }
  return d;
}

namespace {

// The switch rule's question and answer into the decision's record.
void put(metrics::ReplanRecord& r, const replan::SwitchQuestion& q,
         const replan::SwitchVerdict& v) {
  r.predicted_old_s = q.current_step_s;
  r.predicted_new_s = q.proposed_step_s;
  r.predicted_gain_s = q.current_step_s - q.proposed_step_s;
  r.predicted_migration_s = q.switch_s;
  r.horizon_steps = static_cast<int64_t>(q.horizon_steps);
  r.switched = v.take;
  r.reason = v.reason;
}

}  // namespace

Controller::HoldCandidate Controller::hold_candidate(const plan::Plan& current,
                                                     const Decision& d) const {
  // (The rule is the header's.) Persistent rates: the planner's plan for them, at them, over
  // the steps they held, twice its switch cost times 2^(losses − 1). A moving load: the plan for
  // the mean of the recorded rates, at them, over the recorded steps, once — if that mean moved
  // from the rates the running plan is for. Emerging rates: none.
  HoldCandidate c;
  c.regime = regime();
  const double multiple = std::ldexp(1.0, std::min(losses_, options_.max_backoff) - 1);
  if (c.regime == Regime::persistent) {
    c.plan = d.plan;
    c.search = d.record.search;
    c.planning_s = d.record.planning_s;
    c.rates = d.record.rates;
    c.steps = static_cast<double>(regimes().back());
    c.trips = 2.0 * multiple;
  } else if (c.regime == Regime::moving) {
    c.rates = mean_rates();
    c.steps = static_cast<double>(history_.size());
    c.trips = 1.0;
    if (same_rates(c.rates, running_rates_)) return c;  // the running plan is for these rates
    try {
      plan::PlanRequest request;
      request.rates = c.rates;
      request.current = current;
      plan::PlanResult result =
          strategy_->plan(cost_.with_link_rates(d.record.link_rates), request);
      c.plan = std::move(result.plan);
      c.search = result.incremental ? "incremental" : "full";
      c.planning_s = result.planning_seconds;
    } catch (const Error&) {
      // No plan for the mean rates: hold still.
    }
  }
  if (c.plan && c.plan->to_json() == current.to_json()) c.plan.reset();
  return c;
}

std::vector<double> Controller::hold(const plan::Plan& current, Decision& d) {
  const HoldCandidate c = hold_candidate(current, d);
  metrics::ReplanRecord& r = d.record;
  const bool rule_took = d.plan.has_value();
  d.plan.reset();
  if (c.plan) {
    const double switch_s = std::max(
        replan::estimate_migration(cost_.with_link_rates(r.link_rates), current, *c.plan).seconds,
        measured_migration_s_);
    // The switch rule itself, over the recorded steps at the rates the candidate is judged at.
    const replan::SwitchQuestion q{.current_step_s = step_time(current, c.rates, r.link_rates),
                                   .proposed_step_s = step_time(*c.plan, c.rates, r.link_rates),
                                   .switch_s = c.trips * switch_s,
                                   .horizon_steps = c.steps,
                                   .same_plan = false};
    const replan::SwitchVerdict verdict = replan::weigh_switch(q);
    if (verdict.take) {
      // The record says what the plan taken is predicted to gain at the rates planned for, and
      // what it costs, over the recorded steps it was judged over.
      d.plan = c.plan;
      r.new_plan = c.plan->summary();
      // Its own search: the proposal's (for the rates now) may have been another, or failed.
      r.search = c.search;
      r.planning_s = c.planning_s;
      put(r,
          {.current_step_s = step_time(current, r.rates, r.link_rates),
           .proposed_step_s = step_time(*c.plan, r.rates, r.link_rates),
           .switch_s = switch_s,
           .horizon_steps = c.steps},
          verdict);
      return c.rates;
    }
  }
  if (!rule_took && !c.plan) return {};  // nothing but the running plan: the rule's reason stands
  char detail[160];
  if (c.regime == Regime::emerging) {
    std::snprintf(detail, sizeof detail, "the rates now are new, held %zu step(s) so far",
                  regimes().back());
  } else {
    std::snprintf(
        detail, sizeof detail,
        "the plan for the %s rates would not have paid %g x its switch cost over %g steps",
        c.regime == Regime::persistent ? "persistent" : "mean recorded", c.trips, c.steps);
  }
  char why[320];
  std::snprintf(why, sizeof why,
                "holding still: %d re-plan(s) did not pay for their measured cost, and %s", losses_,
                detail);
  r.held = true;
  r.switched = false;
  r.reason = why;
  return {};
}

Decision Controller::propose(const ControllerInput& in, const std::vector<double>& link_rates) {
  Decision d;
  metrics::ReplanRecord& r = d.record;
  r.step = in.step;
  r.rates = effective(in.rates);
  r.link_rates = effective(link_rates);
  r.old_plan = in.current.summary();
  // The cluster as it is now: its links at their measured rates.
  const plan::CostModel cost = cost_.with_link_rates(r.link_rates);
  plan::PlanRequest request;
  request.rates = r.rates;
  request.current = in.current;
  // From the running plan when only a few devices moved since it was planned and the links did
  // not (the planner falls back to its full search when more than plan::kIncrementalDevices did).
  if (effective(planned_link_rates_) == r.link_rates ||
      (planned_link_rates_.empty() && r.link_rates.empty())) {
    request.previous_rates = effective(planned_rates_);
  }
  plan::PlanResult result;
  try {
    result = strategy_->plan(cost, request);
  } catch (const Error& e) {
    r.reason = std::string("no plan: ") + e.what();
    return d;
  }
  r.new_plan = result.plan.summary();
  r.planning_s = result.planning_seconds;
  r.search = result.incremental ? "incremental" : "full";
  // The planner predicted its plan at these rates already.
  predicted_.emplace(std::make_tuple(result.plan.to_json().dump(), r.rates, r.link_rates),
                     result.prediction.iteration_time);
  const replan::SwitchQuestion q{
      .current_step_s = step_time(in.current, r.rates, r.link_rates),
      .proposed_step_s = result.prediction.iteration_time,
      .switch_s = std::max(replan::estimate_migration(cost, in.current, result.plan).seconds,
                           measured_migration_s_),
      .horizon_steps =
          static_cast<double>(std::min<int64_t>(in.remaining_steps, options_.horizon_steps)),
      .same_plan = result.plan.to_json() == in.current.to_json()};
  const replan::SwitchVerdict verdict = replan::weigh_switch(q);
  put(r, q, verdict);
  if (verdict.take) d.plan = result.plan;
  return d;
}

}  // namespace malleus::elastic
