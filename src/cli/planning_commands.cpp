// plan, simulate, profile, experiments, clusters: the planner, the cost model and the simulator
// on the command line, with machine-readable output (--json) for scripts.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>

#include "backend/backend.h"
#include "cli/commands.h"
#include "common/error.h"
#include "common/files.h"
#include "common/format.h"
#include "common/json.h"
#include "common/stats.h"
#include "model/config.h"
#include "model/transformer.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "replan/replan.h"
#include "sim/scenario.h"
#include "sim/simulator.h"

namespace malleus::cli {

namespace fs = std::filesystem;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// What plan and simulate share: the cluster, model, rates, batch and optional profile.
struct SetupArgs {
  std::string cluster, model, rates, link_rates, profile, base;
  int nodes = 0, global_batch = 64, micro_batch = 1, seq_len = 0;
  bool json = false, shifted_recompute = false, tp_subpipeline = false;

  void add_to(CLI::App& app, bool need_cluster) {
    auto* c = app.add_option("--cluster", cluster,
                             "Cluster preset (see `malleus clusters`) or JSON file");
    auto* m = app.add_option("--model", model, "Model preset or JSON file");
    if (need_cluster) c->required(), m->required();
    app.add_option("--nodes", nodes, "Override the cluster's node count")
        ->check(CLI::PositiveNumber);
    app.add_option("--rates", rates,
                   "Straggle rates: inline JSON '{\"3\": 2, \"17\": \"inf\"}' or a JSON file "
                   "(device → rate; missing = 1)");
    app.add_option("--link-rates", link_rates,
                   "How many times slower each node's inter-node link is: inline JSON '{\"1\": "
                   "10}' or a JSON file (node → rate ≥ 1; missing = 1)");
    app.add_option("--global-batch", global_batch, "Sequences per optimizer step")
        ->capture_default_str();
    app.add_option("--micro-batch", micro_batch, "Sequences per micro-batch")
        ->capture_default_str();
    app.add_option("--seq-len", seq_len, "Tokens per sequence (default: the model's maximum)");
    app.add_option("--profile", profile, "Measured per-layer times (from `malleus profile`)");
    app.add_option("--base", base,
                   "The baselines' uniform shape, e.g. dp2,tp8,pp4 (default: the best uniform "
                   "shape of a healthy cluster)");
    app.add_flag("--json", json, "Print one JSON object instead of text");
    app.add_flag("--shifted-recompute,!--no-shifted-recompute", shifted_recompute,
                 "The runtime recomputes ahead of the gradient (the training option of that "
                 "name): memory and time with it");
    app.add_flag("--tp-subpipeline,!--no-tp-subpipeline", tp_subpipeline,
                 "Predict sub-pipelined tensor parallelism (the training option of that name)");
  }

  plan::CostModel cost_model() const {
    plan::ClusterSpec c = plan::load_cluster(cluster);
    if (nodes > 0) c.nodes = nodes;
    if (!link_rates.empty()) {
      c.link_rates = plan::parse_rates(link_rates, c.nodes);
      c.validate("--link-rates");
    }
    const model::ModelConfig m = model::load_model_config(model);
    plan::BatchConfig batch{global_batch, micro_batch, seq_len > 0 ? seq_len : m.max_seq_len};
    batch.validate("command line");
    std::optional<plan::Profile> p;
    if (!profile.empty()) p = plan::Profile::from_json(read_json_file(profile), profile);
    plan::CostModel cost(m, c, batch, p);
    cost.set_shifted_recompute(shifted_recompute);
    cost.set_tp_subpipeline(tp_subpipeline);
    return cost;
  }
  plan::Shape shape() const { return base.empty() ? plan::Shape{} : plan::Shape::parse(base); }
};

double max_memory(const plan::Prediction& p) {
  double m = 0;
  for (double b : p.memory_bytes) m = std::max(m, b);
  return m;
}

void run_plan(const SetupArgs& args, const std::string& strategy_name, const std::string& current,
              const std::string& out) {
  const plan::CostModel cost = args.cost_model();
  const int N = cost.cluster().num_devices();
  plan::PlanRequest req;
  req.rates = plan::parse_rates(args.rates, N);
  req.base = args.shape();
  if (!current.empty()) {
    req.current = plan::Plan::from_json(read_json_file(current), cost.model(), current);
    plan::validate(*req.current, cost.model(), current);
  }
  plan::PlannerOptions options = replan::with_migration_tie_break({}, cost);
  options.refine = sim::simulator_evaluator(cost);
  const auto strategy = plan::make_strategy(strategy_name, options);
  const plan::PlanResult r = strategy->plan(cost, req);
  const sim::SimResult simulated = sim::simulate(cost, r.plan, req.rates);
  write_file_atomic(out, r.plan.to_json().dump(2) + "\n");
  const double gb = cost.batch().global_batch;
  if (args.json) {
    const Json j = {{"strategy", r.strategy},
                    {"plan_file", out},
                    {"summary", r.plan.summary()},
                    {"predicted_iteration_s", r.prediction.iteration_time},
                    {"simulated_iteration_s", simulated.iteration_time},
                    {"samples_per_s", gb / simulated.iteration_time},
                    {"grad_sync_s", r.prediction.grad_sync_time},
                    {"optimizer_s", r.prediction.optimizer_time},
                    {"planning_s", r.planning_seconds},
                    {"max_memory_gib", max_memory(r.prediction) / kGiB},
                    {"fits", r.prediction.fits},
                    {"restart", r.restart},
                    {"note", r.note},
                    {"plan", r.plan.to_json()}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("strategy %s: %s\n", r.strategy.c_str(), r.plan.summary().c_str());
  std::printf("predicted iteration %.4f s (cost model), %.4f s (simulated): %.3f samples/s\n",
              r.prediction.iteration_time, simulated.iteration_time, gb / simulated.iteration_time);
  std::printf("  pipelines %.4f s, gradient sync %.4f s, optimizer %.4f s; peak memory %s%s\n",
              r.prediction.pipeline_time, r.prediction.grad_sync_time, r.prediction.optimizer_time,
              format_bytes(max_memory(r.prediction)).c_str(),
              r.prediction.fits ? "" : " (does NOT fit)");
  std::printf("  planned in %.3f s%s%s\n", r.planning_seconds, r.note.empty() ? "" : "; ",
              r.note.c_str());
  std::printf("wrote %s\n", out.c_str());
}

void run_simulate_plan(const SetupArgs& args, const std::string& plan_file) {
  const plan::CostModel cost = args.cost_model();
  const int N = cost.cluster().num_devices();
  const plan::Rates rates = plan::parse_rates(args.rates, N);
  const plan::Plan p = plan::Plan::from_json(read_json_file(plan_file), cost.model(), plan_file);
  plan::validate(p, cost.model(), plan_file);
  check(p.world_size <= N, plan_file + ": the plan is for " + std::to_string(p.world_size) +
                               " devices, the cluster has " + std::to_string(N));
  check(p.global_batch() == cost.batch().global_batch,
        plan_file + ": the plan's global batch is " + std::to_string(p.global_batch()) +
            ", --global-batch is " + std::to_string(cost.batch().global_batch));
  // The plan as written, recomputation included: what `malleus train --plan` would run.
  const sim::SimResult r = sim::simulate(cost, p, rates, /*choose_recompute=*/false);
  const plan::Prediction pred = cost.predict(p, rates, /*choose_recompute=*/false);
  const double gb = cost.batch().global_batch;
  if (args.json) {
    Json devices = Json::array();
    for (size_t d = 0; d < r.devices.size(); ++d) {
      const auto& dev = r.devices[d];
      devices.push_back(
          {{"device", d},
           {"used", dev.used},
           {"busy_s", dev.busy_s},
           {"idle_s", dev.idle_s},
           {"utilisation", dev.used && r.iteration_time > 0 && std::isfinite(r.iteration_time)
                               ? dev.busy_s / r.iteration_time
                               : 0.0},
           {"memory_gib", dev.memory_bytes / kGiB},
           {"peak_in_flight", dev.peak_in_flight}});
    }
    const Json j = {{"simulated_iteration_s", r.iteration_time},
                    {"predicted_iteration_s", pred.iteration_time},
                    {"samples_per_s", std::isfinite(r.iteration_time) ? gb / r.iteration_time : 0},
                    {"pipeline_s", r.pipeline_times},
                    {"grad_sync_s", r.grad_sync_time},
                    {"optimizer_s", r.optimizer_time},
                    {"mean_utilisation", r.mean_utilisation()},
                    {"fits", r.fits},
                    {"problem", r.problem},
                    {"devices", devices}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("plan %s: %s\n", plan_file.c_str(), p.summary().c_str());
  std::printf(
      "simulated iteration %.4f s (cost model %.4f s): %.3f samples/s, mean utilisation "
      "%.1f%%\n",
      r.iteration_time, pred.iteration_time,
      std::isfinite(r.iteration_time) ? gb / r.iteration_time : 0.0, 100 * r.mean_utilisation());
  if (!r.problem.empty()) std::printf("  problem: %s\n", r.problem.c_str());
  std::printf("%7s %5s %6s %10s %10s %7s %10s\n", "device", "node", "rate", "busy s", "idle s",
              "util", "memory");
  for (size_t d = 0; d < r.devices.size(); ++d) {
    const auto& dev = r.devices[d];
    const double rate = d < rates.size() ? rates[d] : 1.0;
    if (!dev.used) {
      std::printf("%7zu %5d %6.2f %10s %10s %7s %10s\n", d, cost.cluster().node_of(int(d)), rate,
                  "idle", "-", "-", "-");
      continue;
    }
    std::printf("%7zu %5d %6.2f %10.4f %10.4f %6.1f%% %10s\n", d, cost.cluster().node_of(int(d)),
                rate, dev.busy_s, dev.idle_s, 100 * dev.busy_s / r.iteration_time,
                format_bytes(dev.memory_bytes).c_str());
  }
}

void run_scenario_command(const std::string& file, const std::string& svg, bool json) {
  const sim::Scenario sc = sim::load_scenario(file);
  const sim::ScenarioResult r = sim::run_scenario(sc);
  const std::string svg_path = svg.empty() ? sc.name + ".svg" : svg;
  write_file_atomic(svg_path, sim::render_svg(r));
  if (json) {
    Json j = sim::result_to_json(r);
    j["svg"] = svg_path;
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%s", sim::render_table(r).c_str());
    std::printf("wrote %s\n", svg_path.c_str());
  }
}

// ---- experiments ---------------------------------------------------------------------------

std::string num(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// The plan our planner settles on for a situation's final rates, with the cost model allowed to
// recompute (stage-aware) or not, and with the distributed optimizer or not: samples/s by the
// cost model, the plan and its fullest device's memory; nullopt when no plan fits.
struct SettledPlan {
  double samples_per_s = 0;
  plan::Plan plan;
  double max_memory_bytes = 0;
};
std::optional<SettledPlan> settle(const sim::Scenario& sc, const plan::Rates& rates,
                                  bool recompute) {
  plan::CostModel cost(sc.model, sc.cluster, sc.batch, sc.profile);
  cost.allow_recompute(recompute);
  cost.use_distributed_optimizer(sc.distributed_optimizer);
  plan::PlanRequest request;
  request.rates = rates;
  request.base = sc.base;
  try {
    const plan::PlanResult r = plan::make_strategy("malleus")->plan(cost, request);
    if (!r.prediction.fits || !std::isfinite(r.prediction.iteration_time)) return std::nullopt;
    const auto& memory = r.prediction.memory_bytes;
    return SettledPlan{sc.batch.global_batch / r.prediction.iteration_time, r.plan,
                       memory.empty() ? 0.0 : *std::max_element(memory.begin(), memory.end())};
  } catch (const Error&) {
    return std::nullopt;
  }
}
std::optional<SettledPlan> settle(const sim::Scenario& sc, bool recompute) {
  return settle(sc, sc.events.back().rates, recompute);
}

// Stages of a plan, and how many of them recompute selectively and fully.
struct RecomputingStages {
  int stages = 0, selective = 0, full = 0;
  explicit RecomputingStages(const plan::Plan& p) {
    for (const auto& pipe : p.pipelines) {
      for (const auto& s : pipe.stages) {
        ++stages;
        if (s.recompute.layers == 0) continue;
        ++(s.recompute.mode == model::RecomputeMode::kFull ? full : selective);
      }
    }
  }
  RecomputingStages& operator+=(const RecomputingStages& o) {
    stages += o.stages, selective += o.selective, full += o.full;
    return *this;
  }
  // "3 of 8 stages (2 selective, 1 full)", "none of 8".
  std::string text() const {
    if (selective + full == 0) return "none of " + std::to_string(stages);
    return std::to_string(selective + full) + " of " + std::to_string(stages) + " stages (" +
           std::to_string(selective) + " selective, " + std::to_string(full) + " full)";
  }
};
std::string recomputing_stages(const plan::Plan& p) {
  return RecomputingStages(p).text();
}

// Conditions a user meets where memory binds harder than in the situations as written (80 GB
// devices, flash attention, sequence parallelism, the distributed optimizer, sequence 4096): each
// changes the cluster, the model's sequence or the optimizer of every situation, nothing else.
struct MemoryCondition {
  std::string name;
  std::function<void(sim::Scenario&)> apply;
};
std::vector<MemoryCondition> memory_conditions() {
  const auto unchanged = [](sim::Scenario&) {};
  const auto keep_scores = [](sim::Scenario& sc) {
    sc.cluster.flash_attention = false;
    sc.cluster.sequence_parallel = false;
  };
  const auto longer = [](sim::Scenario& sc) {
    sc.model.max_seq_len = std::max(sc.model.max_seq_len, 8192);
    sc.batch.seq_len = 8192;
  };
  const auto whole_moments = [](sim::Scenario& sc) { sc.distributed_optimizer = false; };
  const auto small_devices = [](sim::Scenario& sc) { sc.cluster.memory_bytes = 40 * kGiB; };
  return {
      {"as written (80 GiB, flash attention, sequence parallelism, distributed optimizer, "
       "sequence 4096)",
       unchanged},
      {"whole moments (no distributed optimizer)", whole_moments},
      {"no flash attention, no sequence parallelism", keep_scores},
      {"sequence 8192", longer},
      {"40 GiB devices", small_devices},
      {"40 GiB devices, whole moments",
       [=](sim::Scenario& sc) { small_devices(sc), whole_moments(sc); }},
      {"40 GiB devices, whole moments, no flash attention or sequence parallelism",
       [=](sim::Scenario& sc) { small_devices(sc), whole_moments(sc), keep_scores(sc); }},
  };
}

// One condition over every single situation: without and with stage-aware recomputation.
struct ConditionTally {
  int situations = 0, feasible_without = 0, feasible_with = 0, made_feasible = 0, made_faster = 0,
      made_slower = 0;
  double ratio_without = 0, ratio_with = 0;  // sums; 0 where no plan fits
  RecomputingStages stages{plan::Plan{}};
};

// "2 pipelines, 8 stages".
std::string plan_shape(const plan::Plan& p) {
  size_t stages = 0;
  for (const auto& pipe : p.pipelines) stages += pipe.stages.size();
  return std::to_string(p.pipelines.size()) + " pipelines, " + std::to_string(stages) + " stages";
}

void run_experiments(const std::vector<std::string>& files, const std::string& out,
                     const std::string& svg_dir) {
  std::string zero_table =
      "| situation | model, devices | ideal samples/s | whole moments | distributed optimizer | "
      "plan, whole / distributed | fullest device GB, whole / distributed |\n"
      "|---|---|---:|---:|---:|---|---|\n";
  int zero_situations = 0, zero_feasible = 0, zero_faster = 0;
  double zero_ratio_without = 0, zero_ratio_with = 0;
  std::string recompute_table =
      "| situation | model, devices | ideal samples/s | without recomputation | with stage-aware "
      "recomputation | stages recomputing |\n|---|---|---:|---:|---:|---|\n";
  int situations = 0, made_feasible = 0, made_faster = 0;
  double ratio_without = 0, ratio_with = 0;
  const std::vector<MemoryCondition> conditions = memory_conditions();
  std::vector<ConditionTally> tallies(conditions.size());
  std::string conditions_table = "| situation | model, devices |";
  std::string conditions_rule = "|---|---|";
  for (size_t c = 1; c < conditions.size(); ++c) {
    conditions_table += " " + conditions[c].name + " |";
    conditions_rule += "---|";
  }
  conditions_table += "\n" + conditions_rule + "\n";
  // Per condition, model and cluster: samples/s of the best healthy plan (recomputation allowed).
  std::map<std::string, double> healthy_samples_per_s;
  const std::vector<std::string> names = plan::strategy_names();
  std::string table = "| situation | model, devices, base | ideal samples/s |";
  std::string rule = "|---|---|---:|";
  for (const auto& n : names) {
    table += " " + n + " |";
    rule += "---:|";
  }
  table += "\n" + rule + "\n";
  std::vector<double> ratio_sum(names.size(), 0.0);
  std::vector<int> count(names.size(), 0);
  std::vector<int> wins_or_ties(names.size(), 0);
  std::string details;
  int rows = 0;
  for (const auto& file : files) {
    const sim::Scenario sc = sim::load_scenario(file);
    std::fprintf(stderr, "running %s ...\n", file.c_str());
    const auto start = std::chrono::steady_clock::now();
    const sim::ScenarioResult r = sim::run_scenario(sc);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // A trace (several events) is judged end to end; a single situation by the steady-state
    // throughput of the plan each strategy settles on.
    const bool trace = sc.events.size() > 1;
    const double ideal = trace ? r.ideal_samples / sc.horizon_s : r.ideal_samples_per_s.back();
    auto value = [&](const sim::StrategyRun& run) {
      return trace ? run.samples_per_s(sc.horizon_s) : run.steady_samples_per_s.back();
    };
    double uniform = 0, best_baseline = 0, ours = 0;
    for (const auto& run : r.runs) {
      if (run.strategy == "uniform") uniform = value(run);
      if (run.strategy == "malleus") {
        ours = value(run);
      } else {
        best_baseline = std::max(best_baseline, value(run));
      }
    }
    table += "| " + sc.description + (trace ? " (end to end)" : "") + " | " + sc.model.name + ", " +
             std::to_string(sc.cluster.num_devices()) + ", " + sc.base.text() + " | " +
             num(ideal, 3) + " |";
    for (size_t i = 0; i < names.size(); ++i) {
      const sim::StrategyRun* run = nullptr;
      for (const auto& x : r.runs) {
        if (x.strategy == names[i]) run = &x;
      }
      if (!run) {
        table += " - |";
        continue;
      }
      const double v = value(*run);
      std::string cell = num(v, 3) + " (" + num(ideal > 0 ? v / ideal : 0, 2) + ", " +
                         (uniform > 0 ? num(v / uniform, 2) + "×" : std::string("-")) + ")";
      if (names[i] == "malleus") cell = "**" + cell + "**";
      table += " " + cell + " |";
      ratio_sum[i] += ideal > 0 ? v / ideal : 0;
      ++count[i];
    }
    table += "\n";
    ++rows;
    if (ours >= best_baseline * (1 - 1e-9)) ++wins_or_ties[0];
    if (!trace) {
      // Stage-aware recomputation: the same planner on the same situation, with and without.
      const auto without = settle(sc, false), with = settle(sc, true);
      auto cell = [&](const std::optional<SettledPlan>& p) {
        return p ? num(p->samples_per_s, 3) + " (" + num(p->samples_per_s / ideal, 2) + ")"
                 : std::string("no plan fits");
      };
      recompute_table += "| " + sc.description + " | " + sc.model.name + ", " +
                         std::to_string(sc.cluster.num_devices()) + " | " + num(ideal, 3) + " | " +
                         cell(without) + " | " + cell(with) + " | " +
                         (with ? recomputing_stages(with->plan) : std::string("-")) + " |\n";
      ++situations;
      if (with && !without) ++made_feasible;
      if (with && without && with->samples_per_s > without->samples_per_s * (1 + 1e-9)) {
        ++made_faster;
      }
      ratio_without += without ? without->samples_per_s / ideal : 0;
      ratio_with += with ? with->samples_per_s / ideal : 0;
      // The distributed optimizer: the same planner (recomputation allowed) with whole moments.
      sim::Scenario whole_moments = sc;
      whole_moments.distributed_optimizer = false;
      const auto whole = settle(whole_moments, true);
      auto gb = [](const std::optional<SettledPlan>& p) {
        return p ? num(p->max_memory_bytes / 1e9, 1) : std::string("-");
      };
      zero_table += "| " + sc.description + " | " + sc.model.name + ", " +
                    std::to_string(sc.cluster.num_devices()) + " | " + num(ideal, 3) + " | " +
                    cell(whole) + " | " + cell(with) + " | " +
                    (whole ? plan_shape(whole->plan) : std::string("-")) + " / " +
                    (with ? plan_shape(with->plan) : std::string("-")) + " | " + gb(whole) + " / " +
                    gb(with) + " |\n";
      ++zero_situations;
      if (with && !whole) ++zero_feasible;
      if (with && whole && with->samples_per_s > whole->samples_per_s * (1 + 1e-9)) ++zero_faster;
      zero_ratio_without += whole ? whole->samples_per_s / ideal : 0;
      zero_ratio_with += with ? with->samples_per_s / ideal : 0;
      // The same comparison under each condition where memory binds harder; the ideal is that
      // condition's own (its healthy plan, recomputation allowed, × capacity / devices).
      conditions_table += "| " + sc.description + " | " + sc.model.name + ", " +
                          std::to_string(sc.cluster.num_devices()) + " |";
      const plan::Rates& rates = sc.events.back().rates;
      for (size_t c = 0; c < conditions.size(); ++c) {
        const MemoryCondition& condition = conditions[c];
        sim::Scenario changed = sc;
        condition.apply(changed);
        const std::string key = std::to_string(c) + " " + sc.model.name + " " + sc.cluster.name;
        if (!healthy_samples_per_s.count(key)) {
          // As the table at the top defines it: the best healthy iteration of any strategy.
          const sim::ScenarioResult healthy = sim::run_scenario(changed);
          const double t = healthy.healthy_iteration_s;
          healthy_samples_per_s[key] =
              std::isfinite(t) && t > 0 ? changed.batch.global_batch / t : 0.0;
        }
        const double condition_ideal =
            healthy_samples_per_s[key] * sim::capacity(rates) / static_cast<double>(rates.size());
        const auto before = settle(changed, rates, false);
        const auto after = settle(changed, rates, true);
        auto ratio = [&](const std::optional<SettledPlan>& p) {
          return p && condition_ideal > 0 ? p->samples_per_s / condition_ideal : 0.0;
        };
        ConditionTally& t = tallies[c];
        ++t.situations;
        t.feasible_without += before ? 1 : 0;
        t.feasible_with += after ? 1 : 0;
        if (after && !before) ++t.made_feasible;
        if (after && before && after->samples_per_s > before->samples_per_s * (1 + 1e-9)) {
          ++t.made_faster;
        }
        if (after && before && after->samples_per_s < before->samples_per_s * (1 - 1e-9)) {
          ++t.made_slower;
        }
        t.ratio_without += ratio(before);
        t.ratio_with += ratio(after);
        if (after) t.stages += RecomputingStages(after->plan);
        if (c == 0) continue;  // the situations as written: the table above
        auto ratio_cell = [&](const std::optional<SettledPlan>& p) {
          return p ? num(ratio(p), 2) : std::string("none fits");
        };
        std::string text = ratio_cell(before) + " → " + ratio_cell(after);
        if (after) {
          const RecomputingStages recomputing(after->plan);
          if (recomputing.selective + recomputing.full > 0) {
            text += ", " + std::to_string(recomputing.selective + recomputing.full) + "/" +
                    std::to_string(recomputing.stages) + " recompute";
          }
        }
        conditions_table += " " + text + " |";
      }
      conditions_table += "\n";
    }
    // Per-scenario detail: the full text table and the chart.
    std::string svg_path;
    if (!svg_dir.empty() && trace) {  // a single situation's chart is one step; traces only
      fs::create_directories(svg_dir);
      svg_path = (fs::path(svg_dir) / (sc.name + ".svg")).string();
      write_file_atomic(svg_path, sim::render_svg(r));
    }
    details += "### " + sc.name + "\n\n`" + file + "` — " + sc.description + " (ran in " +
               num(took, 1) + " s)\n\n```\n" + sim::render_table(r) + "```\n";
    if (!svg_path.empty()) {
      details += "\n![" + sc.name + "](" +
                 fs::relative(svg_path, fs::path(out).parent_path()).string() + ")\n";
    }
    details += "\n";
  }
  std::string summary = "| strategy | mean ratio to ideal |\n|---|---:|\n";
  for (size_t i = 0; i < names.size(); ++i) {
    summary += "| " + names[i] + " | " + num(count[i] ? ratio_sum[i] / count[i] : 0, 3) + " |\n";
  }
  const double ours_mean = count[0] ? ratio_sum[0] / count[0] : 0;
  std::string verdict = "malleus averages " + num(ours_mean, 3) +
                        " of ideal (target ≥ 0.9: " + (ours_mean >= 0.9 ? "met" : "NOT met") +
                        ") and is at least as fast as " + "every baseline in " +
                        std::to_string(wins_or_ties[0]) + " of " + std::to_string(rows) +
                        " situations.\n";
  const std::string recompute_verdict =
      "Over " + std::to_string(situations) + " single situations, stage-aware recomputation " +
      "makes " + std::to_string(made_feasible) + " feasible that had no plan without it and " +
      "speeds up " + std::to_string(made_faster) + " more; mean ratio to ideal " +
      num(situations ? ratio_without / situations : 0, 3) + " without (0 where no plan fits), " +
      num(situations ? ratio_with / situations : 0, 3) + " with.\n";
  std::string conditions_summary =
      "| condition | situations with a plan, without → with | made feasible | made faster | made "
      "slower | mean ratio to ideal, without → with | stages recomputing |\n"
      "|---|---:|---:|---:|---:|---:|---|\n";
  int conditions_feasible = 0, conditions_faster = 0, conditions_situations = 0;
  for (size_t c = 0; c < conditions.size(); ++c) {
    const ConditionTally& t = tallies[c];
    const double n = std::max(t.situations, 1);
    conditions_summary += "| " + conditions[c].name + " | " + std::to_string(t.feasible_without) +
                          " → " + std::to_string(t.feasible_with) + " of " +
                          std::to_string(t.situations) + " | " + std::to_string(t.made_feasible) +
                          " | " + std::to_string(t.made_faster) + " | " +
                          std::to_string(t.made_slower) + " | " + num(t.ratio_without / n, 3) +
                          " → " + num(t.ratio_with / n, 3) + " | " + t.stages.text() + " |\n";
    if (c == 0) continue;
    conditions_feasible += t.made_feasible;
    conditions_faster += t.made_faster;
    conditions_situations += t.situations;
  }
  const std::string conditions_verdict =
      "Under the " + std::to_string(conditions.size() - 1) + " harder conditions (" +
      std::to_string(conditions_situations) + " situations in all), stage-aware recomputation " +
      "makes " + std::to_string(conditions_feasible) + " feasible that had no plan without it " +
      "and speeds up " + std::to_string(conditions_faster) + " more.\n";
  const std::string zero_verdict =
      "Over " + std::to_string(zero_situations) + " single situations, the distributed " +
      "optimizer makes " + std::to_string(zero_feasible) + " feasible that had no plan " +
      "without it and speeds up " + std::to_string(zero_faster) + "; mean ratio to ideal " +
      num(zero_situations ? zero_ratio_without / zero_situations : 0, 3) +
      " with whole moments (0 where no plan fits), " +
      num(zero_situations ? zero_ratio_with / zero_situations : 0, 3) + " with it.\n";
  const std::string doc =
      "<!-- Generated by scripts/experiments.sh (malleus experiments); do not edit by hand. -->\n"
      "# Experiments: straggler situations at Malleus's scale\n\n"
      "Cells: throughput in samples/s (ratio to ideal, speedup over uniform). Ideal = the "
      "best healthy iteration time scaled by the remaining capacity N / Σ 1/r. Single "
      "situations compare the steady-state throughput of the plan each strategy settles on; "
      "the trace compares samples over the whole horizon, counting detection, re-planning, "
      "migration and restarts. All times are simulated (docs/planner.md has the model).\n\n"
      "Reproduce: `scripts/experiments.sh` (runs `malleus experiments --scenarios "
      "configs/scenarios/*.json --out docs/experiments.md --svg-dir docs/figures`); one "
      "scenario alone: `malleus simulate --scenario configs/scenarios/<name>.json`.\n\n" +
      table + "\n" + summary + "\n" + verdict +
      "\n## Stage-aware recomputation\n\n"
      "Our planner on each single situation's rates, its cost model allowed to give a stage "
      "that does not fit recomputation (the cheapest of selective or full on its first k layers "
      "that makes it fit; docs/planner.md) or not. Cells: samples/s by the cost model (ratio to "
      "ideal).\n\n" +
      recompute_table + "\n" + recompute_verdict +
      "\n## Distributed optimizer\n\n"
      "Our planner on each single situation's rates (recomputation allowed), its cost model "
      "with the distributed optimizer (ZeRO-1, the default: with P pipelines each device keeps "
      "1/P of the optimizer state — fp32 master weights and Adam moments, 12 of the 16 bytes per "
      "parameter — and a 1/P gradient shard; docs/planner.md) or with whole moments on every "
      "holder. Cells: samples/s by the cost model (ratio to ideal); the plans' shapes and their "
      "fullest device's predicted memory.\n\n" +
      zero_table + "\n" + zero_verdict +
      "\n## Stage-aware recomputation where memory binds\n\n"
      "The comparison of the stage-aware section again, under conditions a user meets where "
      "memory binds harder than in the situations as written: whole optimizer state on every "
      "holder (the distributed optimizer off, as Megatron-LM's default), attention scores kept "
      "(no flash attention) and norms and residuals whole on every TP rank (no sequence "
      "parallelism), sequences of 8192 tokens (the same 64 sequences a step), devices of 40 GiB "
      "(A100 40GB's memory; the A800 nodes' speeds and links otherwise), and two of these "
      "together. Each condition changes that and nothing else in every single situation. The ideal "
      "is the condition's own, defined as at the top: the best healthy iteration of any strategy "
      "under it (simulated, recomputation allowed) scaled by the capacity left (N / Σ 1/r); "
      "cells are the cost model's, as in the stage-aware section, and a ratio above 1 means the "
      "plans the strategies start from on the healthy cluster are not the fastest under the "
      "condition. Without recomputation the planner may still make a plan fit by its shape (more "
      "stages, wider TP groups, more pipelines for the distributed optimizer); with it, each "
      "stage that does not fit recomputes as little as makes it fit, and the search also starts "
      "from the deeper pipelines that fit without (docs/planner.md), so allowing it never gives "
      "a slower plan (made slower: 0 is checked, not assumed).\n\n" +
      conditions_summary + "\n" + conditions_verdict +
      "\nPer situation: ratio to the condition's ideal without → with recomputation, and how "
      "many stages of the plan with it recompute.\n\n" +
      conditions_table + "\n## Details\n\n" + details;
  write_file_atomic(out, doc);
  std::printf("%s\n%s\n%s\n%s\n%s\n%s\n%s\n%s\n%s\n%s", table.c_str(), summary.c_str(),
              verdict.c_str(), recompute_table.c_str(), recompute_verdict.c_str(),
              zero_table.c_str(), zero_verdict.c_str(), conditions_summary.c_str(),
              conditions_verdict.c_str(), conditions_table.c_str());
  std::printf("wrote %s\n", out.c_str());
}

// ---- profile -------------------------------------------------------------------------------

// Times forward and backward of the model with one and with two layers; the difference is one
// layer, the rest is embedding + head + loss.
void run_profile(const std::string& model_name, int micro_batch, int seq_len, int threads,
                 int repeats, const std::string& out) {
  using Clock = std::chrono::steady_clock;
  model::ModelConfig base = model::load_model_config(model_name);
  if (seq_len <= 0) seq_len = base.max_seq_len;
  check(seq_len <= base.max_seq_len, "--seq-len " + std::to_string(seq_len) +
                                         " exceeds the model's " +
                                         std::to_string(base.max_seq_len));
  auto backend = backend::make_cpu_backend<float>(threads);
  const size_t tokens = static_cast<size_t>(micro_batch) * static_cast<size_t>(seq_len);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> token(0, base.vocab_size - 1);
  std::vector<int32_t> inputs(tokens), targets(tokens);
  for (auto& t : inputs) t = token(rng);
  for (auto& t : targets) t = token(rng);
  double fwd[2], bwd[2];
  for (int layers = 1; layers <= 2; ++layers) {
    model::ModelConfig c = base;
    c.num_layers = layers;
    model::Transformer<float> m(c, *backend, micro_batch, seq_len);
    m.init_parameters(1);
    m.zero_grads();
    m.forward(inputs.data(), targets.data());  // warm-up
    m.backward(1.0f / static_cast<float>(tokens));
    std::vector<double> f, b;
    for (int i = 0; i < repeats; ++i) {
      const auto t0 = Clock::now();
      m.forward(inputs.data(), targets.data());
      const auto t1 = Clock::now();
      m.backward(1.0f / static_cast<float>(tokens));
      const auto t2 = Clock::now();
      f.push_back(std::chrono::duration<double>(t1 - t0).count());
      b.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
    fwd[layers - 1] = median(f);
    bwd[layers - 1] = median(b);
  }
  plan::Profile p;
  p.device = "cpu (" + std::to_string(backend->num_threads()) + " threads)";
  p.model = base.name;
  p.threads = backend->num_threads();
  p.micro_batch = micro_batch;
  p.seq_len = seq_len;
  // Noise can make the 2-layer run look barely slower; keep every time positive.
  p.layer_forward_s = std::max(fwd[1] - fwd[0], 1e-3 * fwd[1]);
  p.layer_backward_s = std::max(bwd[1] - bwd[0], 1e-3 * bwd[1]);
  p.head_forward_s = std::max(fwd[0] - p.layer_forward_s, 1e-3 * fwd[0]);
  p.head_backward_s = std::max(bwd[0] - p.layer_backward_s, 1e-3 * bwd[0]);
  plan::ClusterSpec any;  // FLOP counts do not depend on the cluster
  any.peak_flops = 1;
  const plan::CostModel cost(base, any, plan::BatchConfig{micro_batch, micro_batch, seq_len});
  p.layer_forward_flops_per_s = cost.layer_forward_flops() / p.layer_forward_s;
  p.layer_backward_flops_per_s = 2 * cost.layer_forward_flops() / p.layer_backward_s;
  p.head_flops_per_s = 3 * cost.head_forward_flops() / (p.head_forward_s + p.head_backward_s);
  write_file_atomic(out, p.to_json().dump(2) + "\n");
  std::printf("profile of %s (micro-batch %d, seq %d, %d threads), median of %d:\n",
              base.name.c_str(), micro_batch, seq_len, p.threads, repeats);
  std::printf("  layer forward %.3f ms (%.2f GFLOP/s), backward %.3f ms (%.2f GFLOP/s)\n",
              1e3 * p.layer_forward_s, p.layer_forward_flops_per_s / 1e9, 1e3 * p.layer_backward_s,
              p.layer_backward_flops_per_s / 1e9);
  std::printf("  embedding + head + loss forward %.3f ms, backward %.3f ms (%.2f GFLOP/s)\n",
              1e3 * p.head_forward_s, 1e3 * p.head_backward_s, p.head_flops_per_s / 1e9);
  std::printf("wrote %s\n", out.c_str());
}

}  // namespace

void add_planning_commands(CLI::App& app) {
  // plan
  struct PlanArgs {
    SetupArgs setup;
    std::string strategy = "malleus", current, out = "plan.json";
  };
  auto plan_args = std::make_shared<PlanArgs>();
  auto* plan_cmd = app.add_subcommand(
      "plan", "Choose the fastest plan for a cluster whose devices straggle; write it as JSON");
  plan_args->setup.add_to(*plan_cmd, true);
  plan_cmd
      ->add_option("--strategy", plan_args->strategy,
                   "malleus | uniform | drop-slow | uneven-microbatches | uneven-layers")
      ->capture_default_str();
  plan_cmd->add_option("--current", plan_args->current,
                       "The running plan; ties are broken toward it (less migration)");
  plan_cmd->add_option("--out", plan_args->out, "Plan file to write")->capture_default_str();
  plan_cmd->callback([plan_args] {
    run_plan(plan_args->setup, plan_args->strategy, plan_args->current, plan_args->out);
  });

  // simulate
  struct SimArgs {
    SetupArgs setup;
    std::string plan, scenario, svg;
  };
  auto sim_args = std::make_shared<SimArgs>();
  auto* sim_cmd = app.add_subcommand(
      "simulate",
      "Simulate one iteration of a plan (--plan), or a straggler trace against every strategy "
      "(--scenario)");
  sim_args->setup.add_to(*sim_cmd, false);
  sim_cmd->add_option("--plan", sim_args->plan, "Plan file (with --cluster, --model)");
  sim_cmd->add_option("--scenario", sim_args->scenario, "Scenario file (configs/scenarios)");
  sim_cmd->add_option("--svg", sim_args->svg, "Chart of a scenario (default: <name>.svg)");
  sim_cmd->callback([sim_args] {
    const auto& a = *sim_args;
    check(a.plan.empty() != a.scenario.empty(), "simulate: give --plan or --scenario (one)");
    if (!a.scenario.empty()) {
      run_scenario_command(a.scenario, a.svg, a.setup.json);
      return;
    }
    check(!a.setup.cluster.empty() && !a.setup.model.empty(),
          "simulate --plan needs --cluster and --model");
    run_simulate_plan(a.setup, a.plan);
  });

  // experiments
  struct ExpArgs {
    std::vector<std::string> scenarios;
    std::string out = "docs/experiments.md", svg_dir = "docs/figures";
  };
  auto exp_args = std::make_shared<ExpArgs>();
  auto* exp_cmd = app.add_subcommand(
      "experiments", "Run scenarios against every strategy and write the markdown table");
  exp_cmd->add_option("--scenarios", exp_args->scenarios, "Scenario files")->required();
  exp_cmd->add_option("--out", exp_args->out, "Markdown file")->capture_default_str();
  exp_cmd->add_option("--svg-dir", exp_args->svg_dir, "Charts (\"\": none)")->capture_default_str();
  exp_cmd->callback(
      [exp_args] { run_experiments(exp_args->scenarios, exp_args->out, exp_args->svg_dir); });

  // profile
  struct ProfileArgs {
    std::string model = "demo", out = "profile.json";
    int micro_batch = 1, seq_len = 0, threads = 0, repeats = 5;
  };
  auto prof = std::make_shared<ProfileArgs>();
  auto* prof_cmd = app.add_subcommand(
      "profile", "Measure this machine's per-layer forward/backward times for the cost model");
  prof_cmd->add_option("--model", prof->model, "Model preset or JSON file")->capture_default_str();
  prof_cmd->add_option("--micro-batch", prof->micro_batch, "Sequences per micro-batch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  prof_cmd->add_option("--seq-len", prof->seq_len, "Tokens per sequence (default: the model's)");
  prof_cmd->add_option("--threads", prof->threads, "Compute threads (0: all cores)");
  prof_cmd->add_option("--repeats", prof->repeats, "Timed runs (median)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  prof_cmd->add_option("--out", prof->out, "Profile file to write")->capture_default_str();
  prof_cmd->callback([prof] {
    run_profile(prof->model, prof->micro_batch, prof->seq_len, prof->threads, prof->repeats,
                prof->out);
  });

  // clusters
  app.add_subcommand("clusters", "List the built-in cluster presets")->callback([] {
    std::printf("%-14s %6s %8s %9s %8s %11s %11s\n", "preset", "nodes", "per node", "memory",
                "TFLOPS", "intra GB/s", "inter GB/s");
    for (const auto& name : plan::cluster_preset_names()) {
      const plan::ClusterSpec c = plan::load_cluster(name);
      std::printf("%-14s %6d %8d %9s %8.1f %11.1f %11.1f\n", name.c_str(), c.nodes,
                  c.devices_per_node, format_bytes(c.memory_bytes).c_str(), c.flops() / 1e12,
                  c.intra_node_bandwidth / 1e9, c.inter_node_bandwidth / 1e9);
    }
  });
}

}  // namespace malleus::cli
