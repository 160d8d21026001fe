#include "sim/scenario.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "common/error.h"
#include "sim/simulator.h"
#include "svg/svg.h"

namespace malleus::sim {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

}  // namespace

double capacity(const plan::Rates& rates) {
  return plan::remaining_capacity(rates);
}

Scenario Scenario::from_json(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  Scenario s;
  s.source = source;
  s.name = r.required<std::string>("name");
  s.description = r.optional<std::string>("description", "");
  const Json cluster = r.required<Json>("cluster");
  s.cluster = cluster.is_string() ? plan::load_cluster(cluster.get<std::string>())
                                  : plan::ClusterSpec::from_json(cluster, source + ": cluster");
  const Json model = r.required<Json>("model");
  s.model = model.is_string() ? model::load_model_config(model.get<std::string>())
                              : model::ModelConfig::from_json(model, source + ": model");
  s.batch.seq_len = r.optional<int>("seq_len", s.model.max_seq_len);
  s.batch.global_batch = r.required<int>("global_batch");
  s.batch.micro_batch = r.optional<int>("micro_batch", 1);
  s.batch.validate(source);
  const std::string base = r.optional<std::string>("base", "");
  if (!base.empty()) s.base = plan::Shape::parse(base);
  s.horizon_s = r.required<double>("horizon_s");
  check(s.horizon_s > 0, source + ": \"horizon_s\" must be positive");
  s.strategies = r.optional<std::vector<std::string>>("strategies", plan::strategy_names());
  for (const auto& name : s.strategies) plan::make_strategy(name);  // rejects unknown names
  if (r.has("replan_s")) s.replan_s = r.required<double>("replan_s");
  s.detect_iterations = r.optional<double>("detect_iterations", s.detect_iterations);
  s.rebuild_s = r.optional<double>("rebuild_s", s.rebuild_s);
  s.failure_timeout_s = r.optional<double>("failure_timeout_s", s.failure_timeout_s);
  s.decision_horizon_s = r.optional<double>("decision_horizon_s", s.decision_horizon_s);
  const std::string profile = r.optional<std::string>("profile", "");
  if (!profile.empty()) s.profile = plan::Profile::from_json(read_json_file(profile), profile);
  s.distributed_optimizer = r.optional<bool>("distributed_optimizer", s.distributed_optimizer);
  const Json events = r.required<Json>("events");
  r.finish();
  check(events.is_array() && !events.empty(), source + ": \"events\" must be a non-empty list");
  double last = -1;
  for (size_t i = 0; i < events.size(); ++i) {
    const std::string at = source + ": event " + std::to_string(i);
    JsonReader er(events[i], at);
    RateEvent e;
    e.at_s = er.required<double>("at_s");
    const Json rates = er.required<Json>("rates");
    er.finish();
    check(e.at_s >= 0 && e.at_s < s.horizon_s && e.at_s > last,
          at + ": \"at_s\" " + std::to_string(e.at_s) +
              " must be after the previous event and before the horizon");
    last = e.at_s;
    e.rates = plan::rates_from_json(rates, s.cluster.num_devices(), at + ": rates");
    s.events.push_back(std::move(e));
  }
  return s;
}

Scenario load_scenario(const std::string& path) {
  return Scenario::from_json(read_json_file(path), path);
}

plan::Evaluator simulator_evaluator(const plan::CostModel& cost) {
  return [&cost](const plan::Plan& p, const plan::Rates& rates) {
    const SimResult r = simulate(cost, p, rates);
    return r.fits ? r.iteration_time : kInf;
  };
}

namespace {

// One strategy's run through a scenario's events: its plan, the clock, the samples trained and
// the timeline.
class Replay {
 public:
  Replay(const Scenario& sc, const plan::CostModel& cost, const plan::PlannerOptions& options,
         const std::string& name)
      : sc_(sc),
        cost_(cost),
        name_(name),
        strategy_(plan::make_strategy(name, options)),
        rates_(static_cast<size_t>(sc.cluster.num_devices()), 1.0),
        planned_rates_(rates_) {
    run_.strategy = name;
  }

  // Plans for the healthy cluster; returns the plan's iteration time (infinite when none).
  double start() {
    try {
      plan::PlanResult first = strategy_->plan(cost_, {rates_, sc_.base, std::nullopt});
      run_.start_planning = {first.planning_seconds, first.incremental};
      current_ = first.plan;
      iter_ = sim_time(*current_, rates_);
    } catch (const Error& e) {
      run_.error = e.what();
    }
    return iter_;
  }

  // Runs up to the event, notices it, and lets the strategy re-plan.
  void on_event(const RateEvent& event) {
    if (!current_) return;
    advance(event.at_s, iter_, current_->summary());
    rates_ = event.rates;
    const double old_iter = sim_time(*current_, rates_);
    // Noticing the change: a few iterations on the old plan, or a timeout if it hangs.
    if (std::isfinite(old_iter)) {
      advance(t_ + sc_.detect_iterations * old_iter, old_iter, "detecting");
    } else {
      const double stall = std::min(sc_.failure_timeout_s, sc_.horizon_s - t_);
      run_.overhead_s += stall;
      advance(t_ + stall, kInf, "device lost");
    }
    iter_ = old_iter;
    try {
      reconsider(event, old_iter);
      planned_rates_ = rates_;  // asked about these, as the controller's record (taken or not)
    } catch (const Error& e) {
      run_.error = e.what();
      current_.reset();
      iter_ = kInf;
    }
    run_.steady_samples_per_s.push_back(std::isfinite(iter_) ? sc_.batch.global_batch / iter_
                                                             : 0.0);
  }

  // Runs to the horizon.
  StrategyRun finish() {
    if (current_) advance(sc_.horizon_s, iter_, current_->summary());
    while (run_.steady_samples_per_s.size() < sc_.events.size()) {
      run_.steady_samples_per_s.push_back(0);
    }
    run_.event_planning.resize(sc_.events.size());
    return std::move(run_);
  }

 private:
  double sim_time(const plan::Plan& p, const plan::Rates& rates) const {
    const SimResult r = simulate(cost_, p, rates);
    return r.fits ? r.iteration_time : kInf;
  }

  // Trains at one iteration per `iteration` seconds until `until` (within the horizon).
  void advance(double until, double iteration, const std::string& what) {
    until = std::min(until, sc_.horizon_s);
    if (until <= t_) return;
    const double rate = std::isfinite(iteration) ? sc_.batch.global_batch / iteration : 0.0;
    run_.samples += rate * (until - t_);
    run_.timeline.push_back({t_, until, rate, what});
    t_ = until;
  }

  // The strategy's plan for the new rates, and whether to switch to it (and at what cost).
  void reconsider(const RateEvent& event, double old_iter) {
    // From the running plan and the rates last asked about, as the controller asks: the planner
    // decides between its incremental re-plan and the full search.
    plan::PlanResult next = strategy_->plan(cost_, {rates_, sc_.base, *current_, planned_rates_});
    run_.event_planning.resize(run_.steady_samples_per_s.size());
    run_.event_planning.push_back({next.planning_seconds, next.incremental});
    const bool same = next.plan.to_json() == current_->to_json();
    const double new_iter = same ? old_iter : sim_time(next.plan, rates_);
    const double planning = sc_.replan_s ? *sc_.replan_s : next.planning_seconds;
    double switch_s = 0;  // keeping the plan costs nothing
    std::string what;
    if (!same && (next.restart || name_ == "drop-slow")) {
      switch_s = sc_.cluster.restart_seconds;
      what = "restart";
    } else if (!same) {
      switch_s = planning + replan::estimate_migration(cost_, *current_, next.plan).seconds +
                 sc_.rebuild_s;
      what = "re-plan + migration";
    }
    bool take = !same;
    // Ours weighs the switch with the controller's rule; the horizon is the steps the old plan
    // would run within decision_horizon_s.
    if (name_ == "malleus") {
      WeighedSwitch weighed;
      weighed.at_s = event.at_s;
      weighed.question = {old_iter, new_iter, switch_s, sc_.decision_horizon_s / old_iter, same};
      weighed.verdict = replan::weigh_switch(weighed.question);
      take = weighed.verdict.take;
      run_.switches.push_back(std::move(weighed));
    }
    if (take) {
      run_.overhead_s += std::min(switch_s, std::max(0.0, sc_.horizon_s - t_));
      advance(t_ + switch_s, kInf, what);
      current_ = next.plan;
      iter_ = new_iter;
      ++run_.replans;
    }
  }

  const Scenario& sc_;
  const plan::CostModel& cost_;
  const std::string name_;
  std::unique_ptr<plan::Strategy> strategy_;
  StrategyRun run_;
  double t_ = 0;
  plan::Rates rates_;
  plan::Rates planned_rates_;  // the rates last asked about (PlanRequest::previous_rates)
  std::optional<plan::Plan> current_;
  double iter_ = kInf;
};

}  // namespace

ScenarioResult run_scenario(const Scenario& sc) {
  ScenarioResult out;
  out.scenario = sc;
  plan::CostModel cost(sc.model, sc.cluster, sc.batch, sc.profile);
  cost.use_distributed_optimizer(sc.distributed_optimizer);
  const int N = sc.cluster.num_devices();
  const double GB = sc.batch.global_batch;
  plan::PlannerOptions options = replan::with_migration_tie_break({}, cost);
  options.refine = simulator_evaluator(cost);
  out.healthy_iteration_s = kInf;
  for (const auto& name : sc.strategies) {
    Replay replay(sc, cost, options, name);
    out.healthy_iteration_s = std::min(out.healthy_iteration_s, replay.start());
    for (const RateEvent& event : sc.events) replay.on_event(event);
    out.runs.push_back(replay.finish());
  }
  // Ideal: the healthy iteration scaled by the cluster's remaining capacity.
  const double healthy_rate = std::isfinite(out.healthy_iteration_s) && out.healthy_iteration_s > 0
                                  ? GB / out.healthy_iteration_s
                                  : 0.0;
  double t = 0, rate = healthy_rate;
  for (const RateEvent& e : sc.events) {
    out.ideal_samples += rate * (e.at_s - t);
    t = e.at_s;
    rate = healthy_rate * capacity(e.rates) / N;
    out.ideal_samples_per_s.push_back(rate);
  }
  out.ideal_samples += rate * (sc.horizon_s - t);
  return out;
}

namespace {

// "  planning (malleus): start 6.512 s full | @300 s 0.071 s incremental | ..."
std::string planning_line(const Scenario& sc, const StrategyRun& run) {
  auto text = [](const PlanningTime& p) {
    return fixed(p.seconds, 3) + " s " + (p.incremental ? "incremental" : "full");
  };
  std::string line = "  planning (" + run.strategy + "): start " + text(run.start_planning);
  for (size_t e = 0; e < run.event_planning.size() && e < sc.events.size(); ++e) {
    line += " | @" + fixed(sc.events[e].at_s, 0) + " s " + text(run.event_planning[e]);
  }
  return line + "\n";
}

Json planning_json(const PlanningTime& p) {
  return {{"seconds", p.seconds}, {"incremental", p.incremental}};
}

}  // namespace

std::string render_table(const ScenarioResult& r) {
  const Scenario& sc = r.scenario;
  std::string text = "scenario " + sc.name;
  if (!sc.description.empty()) text += ": " + sc.description;
  text += "\n  " + sc.model.name + " on " + sc.cluster.name + " (" +
          std::to_string(sc.cluster.num_devices()) + " devices), global batch " +
          std::to_string(sc.batch.global_batch) + ", micro-batch " +
          std::to_string(sc.batch.micro_batch) + ", seq " + std::to_string(sc.batch.seq_len);
  if (!sc.base.empty()) text += ", base " + sc.base.text();
  text += "\n  healthy iteration " + fixed(r.healthy_iteration_s, 3) + " s; ideal end-to-end " +
          fixed(r.ideal_samples / sc.horizon_s, 3) + " samples/s over " + fixed(sc.horizon_s, 0) +
          " s\n";
  const StrategyRun* uniform = nullptr;
  for (const auto& run : r.runs) {
    if (run.strategy == "uniform") uniform = &run;
  }
  char line[512];
  std::snprintf(line, sizeof line, "  %-20s %10s %7s %8s %8s %9s", "strategy", "samples/s",
                "/ideal", "×uniform", "replans", "overhead");
  text += line;
  for (size_t e = 0; e < sc.events.size(); ++e) {
    std::snprintf(line, sizeof line, " | @%-6.0fs %7s %8s", sc.events[e].at_s, "/ideal",
                  "×uniform");
    text += line;
  }
  text += "\n";
  const double ideal = r.ideal_samples / sc.horizon_s;
  for (const auto& run : r.runs) {
    const double thr = run.samples_per_s(sc.horizon_s);
    const double base = uniform ? uniform->samples_per_s(sc.horizon_s) : 0;
    std::snprintf(line, sizeof line, "  %-20s %10.3f %7.3f %8s %8d %8.1fs", run.strategy.c_str(),
                  thr, ideal > 0 ? thr / ideal : 0,
                  base > 0 ? (fixed(thr / base, 2) + "×").c_str() : "-", run.replans,
                  run.overhead_s);
    text += line;
    for (size_t e = 0; e < run.steady_samples_per_s.size(); ++e) {
      const double s = run.steady_samples_per_s[e];
      const double u = uniform ? uniform->steady_samples_per_s[e] : 0;
      const double id = r.ideal_samples_per_s[e];
      std::snprintf(line, sizeof line, " | %8.3f %7.3f %8s", s, id > 0 ? s / id : 0,
                    u > 0 ? (fixed(s / u, 2) + "×").c_str() : "-");
      text += line;
    }
    if (!run.error.empty()) text += "  (" + run.error + ")";
    text += "\n";
  }
  for (const auto& run : r.runs) {
    if (run.strategy == "malleus") text += planning_line(sc, run);
  }
  return text;
}

Json result_to_json(const ScenarioResult& r) {
  Json runs = Json::array();
  for (const auto& run : r.runs) {
    Json timeline = Json::array();
    for (const auto& s : run.timeline) {
      timeline.push_back({{"start_s", s.start_s},
                          {"end_s", s.end_s},
                          {"samples_per_s", s.samples_per_s},
                          {"what", s.what}});
    }
    Json event_planning = Json::array();
    for (const auto& p : run.event_planning) event_planning.push_back(planning_json(p));
    runs.push_back({{"strategy", run.strategy},
                    {"samples", run.samples},
                    {"samples_per_s", run.samples_per_s(r.scenario.horizon_s)},
                    {"overhead_s", run.overhead_s},
                    {"replans", run.replans},
                    {"steady_samples_per_s", run.steady_samples_per_s},
                    {"error", run.error},
                    {"start_planning", planning_json(run.start_planning)},
                    {"event_planning", event_planning},
                    {"timeline", timeline}});
  }
  return {{"scenario", r.scenario.name},
          {"description", r.scenario.description},
          {"cluster", r.scenario.cluster.name},
          {"model", r.scenario.model.name},
          {"horizon_s", r.scenario.horizon_s},
          {"healthy_iteration_s", r.healthy_iteration_s},
          {"ideal_samples_per_s", r.ideal_samples / r.scenario.horizon_s},
          {"ideal_steady_samples_per_s", r.ideal_samples_per_s},
          {"runs", runs}};
}

std::string render_svg(const ScenarioResult& r) {
  const double W = 820, H = 420, left = 70, right = 190, top = 40, bottom = 50;
  const double pw = W - left - right, ph = H - top - bottom;
  const double horizon = r.scenario.horizon_s;
  const double healthy = r.healthy_iteration_s > 0 && std::isfinite(r.healthy_iteration_s)
                             ? r.scenario.batch.global_batch / r.healthy_iteration_s
                             : 0;
  double ymax = healthy;
  for (double v : r.ideal_samples_per_s) ymax = std::max(ymax, v);
  for (const auto& run : r.runs) {
    for (const auto& s : run.timeline) ymax = std::max(ymax, s.samples_per_s);
  }
  const svg::Axis axis = svg::nice_axis(0, ymax > 0 ? ymax * 1.05 : 1, 5);
  const svg::Scale x{0, horizon, left, left + pw}, y{axis.lo, axis.hi, top + ph, top};
  static const char* colors[] = {"#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  svg::Document doc(W, H);
  doc.style("text{font-family:sans-serif;font-size:12px}\n.title{font-size:14px}\n");
  doc.rect(0, 0, W, H, {{"fill", "white"}});
  doc.text(left, 22,
           r.scenario.name + ": throughput over time (" + r.scenario.model.name + ", " +
               r.scenario.cluster.name + ")",
           {{"class", "title"}});
  // Axes and grid.
  for (double v : axis.ticks) {
    doc.line(left, y(v), left + pw, y(v), {{"stroke", "#ddd"}});
    doc.text(left - 6, y(v) + 4, fixed(v, axis.step < 1 ? 2 : 0), {{"text-anchor", "end"}});
  }
  for (int i = 0; i <= 6; ++i) {
    const double t = horizon * i / 6;
    doc.text(x(t), top + ph + 18, fixed(t, 0), {{"text-anchor", "middle"}});
  }
  doc.rect(left, top, pw, ph, {{"fill", "none"}, {"stroke", "#444"}});
  doc.text(left + pw / 2, H - 10, "time (s)", {{"text-anchor", "middle"}});
  doc.text(-(top + ph / 2), 16, "samples/s",
           {{"transform", "rotate(-90)"}, {"text-anchor", "middle"}});
  auto series = [&](const svg::Points& steps, const std::string& color, bool dashed) {
    svg::Points points;
    for (const auto& [t, v] : steps) points.emplace_back(x(t), y(v));
    svg::Attributes style{{"fill", "none"}, {"stroke", color}, {"stroke-width", "2"}};
    style.emplace_back(dashed ? "stroke-dasharray" : "stroke-opacity", dashed ? "6,4" : "0.85");
    doc.path(svg::path_data(points), style);
  };
  // Ideal, as a dashed step function.
  {
    svg::Points steps;
    double t = 0, v = healthy;
    for (size_t e = 0; e < r.scenario.events.size(); ++e) {
      steps.emplace_back(t, v);
      steps.emplace_back(r.scenario.events[e].at_s, v);
      t = r.scenario.events[e].at_s;
      v = r.ideal_samples_per_s[e];
    }
    steps.emplace_back(t, v);
    steps.emplace_back(horizon, v);
    series(steps, "#000", true);
  }
  for (size_t i = 0; i < r.runs.size(); ++i) {
    svg::Points steps;
    for (const auto& s : r.runs[i].timeline) {
      steps.emplace_back(s.start_s, s.samples_per_s);
      steps.emplace_back(s.end_s, s.samples_per_s);
    }
    series(steps, colors[i % 6], false);
  }
  // Legend.
  for (size_t i = 0; i <= r.runs.size(); ++i) {
    const double yy = top + 10 + 20.0 * static_cast<double>(i);
    const bool ideal = i == r.runs.size();
    svg::Attributes style{{"stroke", ideal ? "#000" : colors[i % 6]}, {"stroke-width", "2"}};
    if (ideal) style.emplace_back("stroke-dasharray", "6,4");
    doc.line(left + pw + 12, yy, left + pw + 36, yy, style);
    doc.text(left + pw + 42, yy + 4, ideal ? std::string("ideal") : r.runs[i].strategy);
  }
  return doc.finish();
}

}  // namespace malleus::sim
