// The experiments report: one function per table, each fed one scenario at a time, and one that
// joins them into bench/results/experiments.md.
#include "sim/experiments.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "common/error.h"
#include "common/files.h"
#include "plan/cost_model.h"
#include "plan/plan.h"
#include "plan/planner.h"
#include "sim/scenario.h"

namespace malleus::sim {

namespace fs = std::filesystem;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

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
std::optional<SettledPlan> settle(const Scenario& sc, const plan::Rates& rates, bool recompute) {
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
std::optional<SettledPlan> settle(const Scenario& sc, bool recompute) {
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
  std::function<void(Scenario&)> apply;
};
std::vector<MemoryCondition> memory_conditions() {
  const auto unchanged = [](Scenario&) {};
  const auto keep_scores = [](Scenario& sc) {
    sc.cluster.flash_attention = false;
    sc.cluster.sequence_parallel = false;
  };
  const auto longer = [](Scenario& sc) {
    sc.model.max_seq_len = std::max(sc.model.max_seq_len, 8192);
    sc.batch.seq_len = 8192;
  };
  const auto whole_moments = [](Scenario& sc) { sc.distributed_optimizer = false; };
  const auto small_devices = [](Scenario& sc) { sc.cluster.memory_bytes = 40 * kGiB; };
  return {
      {"as written (80 GiB, flash attention, sequence parallelism, distributed optimizer, "
       "sequence 4096)",
       unchanged},
      {"whole moments (no distributed optimizer)", whole_moments},
      {"no flash attention, no sequence parallelism", keep_scores},
      {"sequence 8192", longer},
      {"40 GiB devices", small_devices},
      {"40 GiB devices, whole moments",
       [=](Scenario& sc) { small_devices(sc), whole_moments(sc); }},
      {"40 GiB devices, whole moments, no flash attention or sequence parallelism",
       [=](Scenario& sc) { small_devices(sc), whole_moments(sc), keep_scores(sc); }},
  };
}

// The same situations planned two ways (without and with recomputation, whole moments and the
// distributed optimizer): how many have a plan each way, how many the second way made feasible,
// faster or slower, and the summed ratios to ideal (0 where no plan fits).
struct BeforeAfterTally {
  int situations = 0, feasible_before = 0, feasible_after = 0, made_feasible = 0, made_faster = 0,
      made_slower = 0;
  double ratio_before = 0, ratio_after = 0;

  void add(const std::optional<SettledPlan>& before, const std::optional<SettledPlan>& after,
           double ideal) {
    auto ratio = [&](const std::optional<SettledPlan>& p) {
      return p && ideal > 0 ? p->samples_per_s / ideal : 0.0;
    };
    ++situations;
    feasible_before += before ? 1 : 0;
    feasible_after += after ? 1 : 0;
    if (after && !before) ++made_feasible;
    if (after && before && after->samples_per_s > before->samples_per_s * (1 + 1e-9)) {
      ++made_faster;
    }
    if (after && before && after->samples_per_s < before->samples_per_s * (1 - 1e-9)) {
      ++made_slower;
    }
    ratio_before += ratio(before);
    ratio_after += ratio(after);
  }
  double mean_before() const { return situations ? ratio_before / situations : 0; }
  double mean_after() const { return situations ? ratio_after / situations : 0; }
};

// The sentence under a before/after table, in the words of its comparison.
struct VerdictWords {
  std::string change;         // what makes the difference
  std::string faster;         // what follows the count of situations it speeds up
  std::string before, after;  // the two sides, as the mean ratios name them
};

std::string before_after_verdict(const BeforeAfterTally& n, const VerdictWords& w) {
  return "Over " + std::to_string(n.situations) + " single situations, " + w.change + " makes " +
         std::to_string(n.made_feasible) + " feasible that had no plan without it and speeds up " +
         std::to_string(n.made_faster) + w.faster + "; mean ratio to ideal " +
         num(n.mean_before(), 3) + " " + w.before + " (0 where no plan fits), " +
         num(n.mean_after(), 3) + " " + w.after + ".\n";
}

// "2 pipelines, 8 stages".
std::string plan_shape(const plan::Plan& p) {
  size_t stages = 0;
  for (const auto& pipe : p.pipelines) stages += pipe.stages.size();
  return std::to_string(p.pipelines.size()) + " pipelines, " + std::to_string(stages) + " stages";
}

// "| situation | model, devices |": how every single-situation table starts a row.
std::string situation_cells(const Scenario& sc) {
  return "| " + sc.description + " | " + sc.model.name + ", " +
         std::to_string(sc.cluster.num_devices()) + " |";
}

// "12.345 (0.91)": samples/s by the cost model and its ratio to ideal.
std::string settled_cell(const std::optional<SettledPlan>& p, double ideal) {
  return p ? num(p->samples_per_s, 3) + " (" + num(p->samples_per_s / ideal, 2) + ")"
           : std::string("no plan fits");
}

// ---- every strategy on every scenario --------------------------------------------------------

struct StrategyTable {
  std::vector<std::string> names = plan::strategy_names();
  std::string rows;
  std::vector<double> ratio_sum = std::vector<double>(names.size(), 0.0);
  std::vector<int> count = std::vector<int>(names.size(), 0);
  int situations = 0, ours_wins_or_ties = 0;
};

std::string strategy_header(const StrategyTable& t) {
  std::string table = "| situation | model, devices, base | ideal samples/s |";
  std::string rule = "|---|---|---:|";
  for (const auto& n : t.names) {
    table += " " + n + " |";
    rule += "---:|";
  }
  return table + "\n" + rule + "\n";
}

// A trace (several events) is judged end to end; a single situation by the steady-state
// throughput of the plan each strategy settles on.
double strategy_value(const Scenario& sc, const StrategyRun& run) {
  return sc.events.size() > 1 ? run.samples_per_s(sc.horizon_s) : run.steady_samples_per_s.back();
}

void add_strategy_row(StrategyTable& t, const Scenario& sc, const ScenarioResult& r, double ideal) {
  double uniform = 0, best_baseline = 0, ours = 0;
  for (const auto& run : r.runs) {
    if (run.strategy == "uniform") uniform = strategy_value(sc, run);
    if (run.strategy == "malleus") {
      ours = strategy_value(sc, run);
    } else {
      best_baseline = std::max(best_baseline, strategy_value(sc, run));
    }
  }
  const bool trace = sc.events.size() > 1;
  t.rows += "| " + sc.description + (trace ? " (end to end)" : "") + " | " + sc.model.name + ", " +
            std::to_string(sc.cluster.num_devices()) + ", " + sc.base.text() + " | " +
            num(ideal, 3) + " |";
  for (size_t i = 0; i < t.names.size(); ++i) {
    const StrategyRun* run = nullptr;
    for (const auto& x : r.runs) {
      if (x.strategy == t.names[i]) run = &x;
    }
    if (!run) {
      t.rows += " - |";
      continue;
    }
    const double v = strategy_value(sc, *run);
    std::string cell = num(v, 3) + " (" + num(ideal > 0 ? v / ideal : 0, 2) + ", " +
                       (uniform > 0 ? num(v / uniform, 2) + "×" : std::string("-")) + ")";
    if (t.names[i] == "malleus") cell = "**" + cell + "**";
    t.rows += " " + cell + " |";
    t.ratio_sum[i] += ideal > 0 ? v / ideal : 0;
    ++t.count[i];
  }
  t.rows += "\n";
  ++t.situations;
  if (ours >= best_baseline * (1 - 1e-9)) ++t.ours_wins_or_ties;
}

std::string strategy_summary(const StrategyTable& t) {
  std::string summary = "| strategy | mean ratio to ideal |\n|---|---:|\n";
  for (size_t i = 0; i < t.names.size(); ++i) {
    summary +=
        "| " + t.names[i] + " | " + num(t.count[i] ? t.ratio_sum[i] / t.count[i] : 0, 3) + " |\n";
  }
  return summary;
}

std::string strategy_verdict(const StrategyTable& t) {
  const double ours_mean = t.count[0] ? t.ratio_sum[0] / t.count[0] : 0;
  return "malleus averages " + num(ours_mean, 3) +
         " of ideal (target ≥ 0.9: " + (ours_mean >= 0.9 ? "met" : "NOT met") +
         ") and is at least as fast as " + "every baseline in " +
         std::to_string(t.ours_wins_or_ties) + " of " + std::to_string(t.situations) +
         " situations.\n";
}

// ---- stage-aware recomputation ---------------------------------------------------------------

struct RecomputeTable {
  std::string rows =
      "| situation | model, devices | ideal samples/s | without recomputation | with stage-aware "
      "recomputation | stages recomputing |\n|---|---|---:|---:|---:|---|\n";
  BeforeAfterTally tally;  // without → with
};

// The same planner on the same situation, with and without.
void add_recompute_row(RecomputeTable& t, const Scenario& sc, double ideal,
                       const std::optional<SettledPlan>& without,
                       const std::optional<SettledPlan>& with) {
  t.rows += situation_cells(sc) + " " + num(ideal, 3) + " | " + settled_cell(without, ideal) +
            " | " + settled_cell(with, ideal) + " | " +
            (with ? recomputing_stages(with->plan) : std::string("-")) + " |\n";
  t.tally.add(without, with, ideal);
}

std::string recompute_verdict(const RecomputeTable& t) {
  return before_after_verdict(t.tally, {.change = "stage-aware recomputation",
                                        .faster = " more",
                                        .before = "without",
                                        .after = "with"});
}

// ---- the distributed optimizer ---------------------------------------------------------------

struct ZeroTable {
  std::string rows =
      "| situation | model, devices | ideal samples/s | whole moments | distributed optimizer | "
      "plan, whole / distributed | fullest device GB, whole / distributed |\n"
      "|---|---|---:|---:|---:|---|---|\n";
  BeforeAfterTally tally;  // whole moments → distributed
};

// The same planner (recomputation allowed) with whole moments and with the distributed optimizer.
void add_zero_row(ZeroTable& t, const Scenario& sc, double ideal,
                  const std::optional<SettledPlan>& whole,
                  const std::optional<SettledPlan>& distributed) {
  auto gb = [](const std::optional<SettledPlan>& p) {
    return p ? num(p->max_memory_bytes / 1e9, 1) : std::string("-");
  };
  auto shape = [](const std::optional<SettledPlan>& p) {
    return p ? plan_shape(p->plan) : std::string("-");
  };
  t.rows += situation_cells(sc) + " " + num(ideal, 3) + " | " + settled_cell(whole, ideal) + " | " +
            settled_cell(distributed, ideal) + " | " + shape(whole) + " / " + shape(distributed) +
            " | " + gb(whole) + " / " + gb(distributed) + " |\n";
  t.tally.add(whole, distributed, ideal);
}

std::string zero_verdict(const ZeroTable& t) {
  return before_after_verdict(t.tally, {.change = "the distributed optimizer",
                                        .faster = "",
                                        .before = "with whole moments",
                                        .after = "with it"});
}

// ---- stage-aware recomputation where memory binds --------------------------------------------

struct ConditionsTable {
  std::vector<MemoryCondition> conditions = memory_conditions();
  std::vector<BeforeAfterTally> tallies = std::vector<BeforeAfterTally>(conditions.size());
  std::vector<RecomputingStages> stages =
      std::vector<RecomputingStages>(conditions.size(), RecomputingStages(plan::Plan{}));
  // Per condition, model and cluster: samples/s of the best healthy plan (recomputation allowed).
  std::map<std::string, double> healthy_samples_per_s;
  std::string rows;
};

std::string conditions_header(const ConditionsTable& t) {
  std::string header = "| situation | model, devices |";
  std::string rule = "|---|---|";
  for (size_t c = 1; c < t.conditions.size(); ++c) {
    header += " " + t.conditions[c].name + " |";
    rule += "---|";
  }
  return header + "\n" + rule + "\n";
}

// The ideal under a condition: as the table at the top defines it, the best healthy iteration of
// any strategy (simulated once per condition, model and cluster) × capacity / devices.
double condition_ideal(ConditionsTable& t, size_t c, const Scenario& changed,
                       const plan::Rates& rates) {
  const std::string key = std::to_string(c) + " " + changed.model.name + " " + changed.cluster.name;
  if (!t.healthy_samples_per_s.count(key)) {
    const ScenarioResult healthy = run_scenario(changed);
    const double s = healthy.healthy_iteration_s;
    t.healthy_samples_per_s[key] = std::isfinite(s) && s > 0 ? changed.batch.global_batch / s : 0.0;
  }
  return t.healthy_samples_per_s[key] * capacity(rates) / static_cast<double>(rates.size());
}

// Condition c on one situation: counted in its tally; returns the per-situation cell
// ("0.81 → 0.93, 2/8 recompute").
std::string add_condition(ConditionsTable& t, size_t c, const Scenario& sc) {
  Scenario changed = sc;
  t.conditions[c].apply(changed);
  const plan::Rates& rates = sc.events.back().rates;
  const double ideal = condition_ideal(t, c, changed, rates);
  const auto before = settle(changed, rates, false);
  const auto after = settle(changed, rates, true);
  auto ratio = [&](const std::optional<SettledPlan>& p) {
    return p && ideal > 0 ? p->samples_per_s / ideal : 0.0;
  };
  t.tallies[c].add(before, after, ideal);
  if (after) t.stages[c] += RecomputingStages(after->plan);
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
  return text;
}

// Every condition on one situation; the first (the situations as written) is the stage-aware
// table's, so it is tallied but has no column here.
void add_conditions_row(ConditionsTable& t, const Scenario& sc) {
  t.rows += situation_cells(sc);
  for (size_t c = 0; c < t.conditions.size(); ++c) {
    const std::string cell = add_condition(t, c, sc);
    if (c > 0) t.rows += " " + cell + " |";
  }
  t.rows += "\n";
}

std::string conditions_summary(const ConditionsTable& t) {
  std::string summary =
      "| condition | situations with a plan, without → with | made feasible | made faster | made "
      "slower | mean ratio to ideal, without → with | stages recomputing |\n"
      "|---|---:|---:|---:|---:|---:|---|\n";
  for (size_t c = 0; c < t.conditions.size(); ++c) {
    const BeforeAfterTally& s = t.tallies[c];
    summary += "| " + t.conditions[c].name + " | " + std::to_string(s.feasible_before) + " → " +
               std::to_string(s.feasible_after) + " of " + std::to_string(s.situations) + " | " +
               std::to_string(s.made_feasible) + " | " + std::to_string(s.made_faster) + " | " +
               std::to_string(s.made_slower) + " | " + num(s.mean_before(), 3) + " → " +
               num(s.mean_after(), 3) + " | " + t.stages[c].text() + " |\n";
  }
  return summary;
}

std::string conditions_verdict(const ConditionsTable& t) {
  int feasible = 0, faster = 0, situations = 0;
  for (size_t c = 1; c < t.conditions.size(); ++c) {
    feasible += t.tallies[c].made_feasible;
    faster += t.tallies[c].made_faster;
    situations += t.tallies[c].situations;
  }
  return "Under the " + std::to_string(t.conditions.size() - 1) + " harder conditions (" +
         std::to_string(situations) + " situations in all), stage-aware recomputation " + "makes " +
         std::to_string(feasible) + " feasible that had no plan without it " + "and speeds up " +
         std::to_string(faster) + " more.\n";
}

// ---- details ---------------------------------------------------------------------------------

// One scenario's full text table, and its chart (traces only: a single situation's is one step).
std::string scenario_detail(const std::string& file, const Scenario& sc, const ScenarioResult& r,
                            double took, const std::string& out, const std::string& svg_dir) {
  std::string svg_path;
  if (!svg_dir.empty() && sc.events.size() > 1) {
    fs::create_directories(svg_dir);
    svg_path = (fs::path(svg_dir) / (sc.name + ".svg")).string();
    write_file_atomic(svg_path, render_svg(r));
  }
  std::string detail = "### " + sc.name + "\n\n`" + file + "` — " + sc.description + " (ran in " +
                       num(took, 1) + " s)\n\n```\n" + render_table(r) + "```\n";
  if (!svg_path.empty()) {
    detail += "\n![" + sc.name + "](" +
              fs::relative(svg_path, fs::path(out).parent_path()).string() + ")\n";
  }
  return detail + "\n";
}

// ---- running the scenarios ------------------------------------------------------------------

// One scenario simulated: its file, the scenario, the result and the wall time it took.
struct Ran {
  std::string file;
  Scenario scenario;
  ScenarioResult result;
  double took_s = 0;
};

Ran run_file(const std::string& file) {
  Ran ran{file, load_scenario(file), {}, 0};
  std::fprintf(stderr, "running %s ...\n", file.c_str());
  const auto start = std::chrono::steady_clock::now();
  ran.result = run_scenario(ran.scenario);
  ran.took_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return ran;
}

// Every file's scenario, in the files' order, `jobs` at once (threads taking the next file).
std::vector<Ran> run_files(const std::vector<std::string>& files, int jobs) {
  std::vector<std::optional<Ran>> done(files.size());
  std::vector<std::exception_ptr> failed(files.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < files.size(); i = next++) {
      try {
        done[i] = run_file(files[i]);
      } catch (...) {
        failed[i] = std::current_exception();
      }
    }
  };
  std::vector<std::thread> threads;
  const size_t n = std::min(files.size(), static_cast<size_t>(std::max(1, jobs)));
  for (size_t t = 1; t < n; ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  std::vector<Ran> out;
  for (size_t i = 0; i < files.size(); ++i) {
    if (failed[i]) std::rethrow_exception(failed[i]);
    out.push_back(std::move(*done[i]));
  }
  return out;
}

// ---- at scale --------------------------------------------------------------------------------

// The scale scenarios: every strategy's throughput as in the first table, and our planner's
// planning times (the healthy plan; each event's re-plan, incremental or full).
struct ScaleTable {
  std::string machine;  // where the planning times were measured
  StrategyTable strategies;
  std::string planning_rows =
      "| situation | model, devices | healthy plan | re-plans at the events "
      "|\n|---|---|---:|---|\n";
  std::string details;
};

// "/proc/loadavg"'s first three figures, or "unknown".
std::string load_average() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  double one = 0, five = 0, fifteen = 0;
  const bool ok = f && std::fscanf(f, "%lf %lf %lf", &one, &five, &fifteen) == 3;
  if (f) std::fclose(f);
  return ok ? num(one, 2) + " " + num(five, 2) + " " + num(fifteen, 2) : std::string("unknown");
}

std::string planning_cell(const PlanningTime& p) {
  return num(p.seconds, 2) + " s " + (p.incremental ? "incremental" : "full");
}

void add_scale_scenario(ScaleTable& t, const Ran& ran, const std::string& out,
                        const std::string& svg_dir) {
  const Scenario& sc = ran.scenario;
  const ScenarioResult& r = ran.result;
  const bool trace = sc.events.size() > 1;
  add_strategy_row(t.strategies, sc, r,
                   trace ? r.ideal_samples / sc.horizon_s : r.ideal_samples_per_s.back());
  for (const auto& run : r.runs) {
    if (run.strategy != "malleus") continue;
    std::string events;
    for (size_t e = 0; e < run.event_planning.size() && e < sc.events.size(); ++e) {
      events += (e ? "; @" : "@") + num(sc.events[e].at_s, 0) + " s " +
                planning_cell(run.event_planning[e]);
    }
    t.planning_rows +=
        situation_cells(sc) + " " + planning_cell(run.start_planning) + " | " + events + " |\n";
  }
  t.details += scenario_detail(ran.file, sc, r, ran.took_s, out, svg_dir);
}

std::string compose_scale(const ScaleTable& t) {
  return "<!-- scale: begin -->\n"
         "## At scale: 4,096 to 16,384 devices\n\n"
         "llama-405b (126 layers, hidden 16384) on 512, 1,024 and 2,048 nodes of 8 H100s "
         "(configs/clusters/h100-*x8.json), 16 sequences of 4096 tokens per node and step: the "
         "straggler situations and a trace whose rates change, every strategy as in the first "
         "table. The base (the baselines' shape) is the best uniform shape of the healthy cluster, "
         "as `malleus plan --strategy uniform` finds it: dp32 tp8 pp16 and dp64 tp8 pp16 at 4,096 "
         "and 8,192 devices, dp64 tp4 pp64 at 16,384 (Llama 3's dp128 tp8 pp16 simulates 1.4 % "
         "slower there). Our planner re-plans as the controller does: incrementally from the "
         "running plan "
         "when at most 8 devices' rates moved since it last planned, the full search otherwise "
         "(docs/planner.md). In the trace, each change first costs an iteration on the old plan "
         "at the new rates (detection) or the failure timeout, which the ideal does not pay: at "
         "55 s an iteration, up to 275 s with a device at 5×, the main reason its end-to-end "
         "ratios sit below those of the windows after each change. "
         "Reproduce: `scripts/experiments.sh --scale` (adds `--scale-scenarios "
         "configs/scenarios/scale/*.json`). The planning times are wall times: " +
         t.machine + ".\n\n" + strategy_header(t.strategies) + t.strategies.rows + "\n" +
         strategy_summary(t.strategies) + "\n" + strategy_verdict(t.strategies) +
         "\nOur planner's planning times: the plan for the healthy cluster (the full search) and "
         "the re-plan at each event (incremental or full), as the scenario measured them.\n\n" +
         t.planning_rows + "\n### Details at scale\n\n" + t.details + "<!-- scale: end -->\n";
}

// ---- the document ----------------------------------------------------------------------------

struct Tables {
  StrategyTable strategies;
  RecomputeTable recompute;
  ZeroTable zero;
  ConditionsTable conditions;
  std::string details;
};

// One scenario into every table it belongs in.
void add_scenario(Tables& t, const Ran& ran, const std::string& out, const std::string& svg_dir) {
  const Scenario& sc = ran.scenario;
  const ScenarioResult& r = ran.result;
  const bool trace = sc.events.size() > 1;
  const double ideal = trace ? r.ideal_samples / sc.horizon_s : r.ideal_samples_per_s.back();
  add_strategy_row(t.strategies, sc, r, ideal);
  if (!trace) {
    const auto without = settle(sc, false), with = settle(sc, true);
    add_recompute_row(t.recompute, sc, ideal, without, with);
    Scenario whole_moments = sc;
    whole_moments.distributed_optimizer = false;
    add_zero_row(t.zero, sc, ideal, settle(whole_moments, true), with);
    add_conditions_row(t.conditions, sc);
  }
  t.details += scenario_detail(ran.file, sc, r, ran.took_s, out, svg_dir);
}

std::string compose_markdown(const Tables& t) {
  return "<!-- Generated by scripts/experiments.sh (malleus experiments); do not edit by hand. "
         "-->\n"
         "# Experiments: straggler situations at Malleus's scale\n\n"
         "Cells: throughput in samples/s (ratio to ideal, speedup over uniform). Ideal = the "
         "best healthy iteration time scaled by the remaining capacity N / Σ 1/r. Single "
         "situations compare the steady-state throughput of the plan each strategy settles on; "
         "the trace compares samples over the whole horizon, counting detection, re-planning, "
         "migration and restarts. All times are simulated (docs/planner.md has the model).\n\n"
         "Reproduce: `scripts/experiments.sh` (runs `malleus experiments --scenarios "
         "configs/scenarios/*.json --out bench/results/experiments.md --svg-dir "
         "bench/results/figures`); one "
         "scenario alone: `malleus simulate --scenario configs/scenarios/<name>.json`.\n\n" +
         strategy_header(t.strategies) + t.strategies.rows + "\n" + strategy_summary(t.strategies) +
         "\n" + strategy_verdict(t.strategies) +
         "\n## Stage-aware recomputation\n\n"
         "Our planner on each single situation's rates, its cost model allowed to give a stage "
         "that does not fit recomputation (the cheapest of selective or full on its first k layers "
         "that makes it fit; docs/planner.md) or not. Cells: samples/s by the cost model (ratio to "
         "ideal).\n\n" +
         t.recompute.rows + "\n" + recompute_verdict(t.recompute) +
         "\n## Distributed optimizer\n\n"
         "Our planner on each single situation's rates (recomputation allowed), its cost model "
         "with the distributed optimizer (ZeRO-1, the default: with P pipelines each device keeps "
         "1/P of the optimizer state — fp32 master weights and Adam moments, 12 of the 16 bytes "
         "per "
         "parameter — and a 1/P gradient shard; docs/planner.md) or with whole moments on every "
         "holder. Cells: samples/s by the cost model (ratio to ideal); the plans' shapes and their "
         "fullest device's predicted memory.\n\n" +
         t.zero.rows + "\n" + zero_verdict(t.zero) +
         "\n## Stage-aware recomputation where memory binds\n\n"
         "The comparison of the stage-aware section again, under conditions a user meets where "
         "memory binds harder than in the situations as written: whole optimizer state on every "
         "holder (the distributed optimizer off, as Megatron-LM's default), attention scores kept "
         "(no flash attention) and norms and residuals whole on every TP rank (no sequence "
         "parallelism), sequences of 8192 tokens (the same 64 sequences a step), devices of 40 GiB "
         "(A100 40GB's memory; the A800 nodes' speeds and links otherwise), and two of these "
         "together. Each condition changes that and nothing else in every single situation. The "
         "ideal "
         "is the condition's own, defined as at the top: the best healthy iteration of any "
         "strategy "
         "under it (simulated, recomputation allowed) scaled by the capacity left (N / Σ 1/r); "
         "cells are the cost model's, as in the stage-aware section, and a ratio above 1 means the "
         "plans the strategies start from on the healthy cluster are not the fastest under the "
         "condition. Without recomputation the planner may still make a plan fit by its shape "
         "(more "
         "stages, wider TP groups, more pipelines for the distributed optimizer); with it, each "
         "stage that does not fit recomputes as little as makes it fit, and the search also starts "
         "from the deeper pipelines that fit without (docs/planner.md), so allowing it never gives "
         "a slower plan (made slower: 0 is checked, not assumed).\n\n" +
         conditions_summary(t.conditions) + "\n" + conditions_verdict(t.conditions) +
         "\nPer situation: ratio to the condition's ideal without → with recomputation, and how "
         "many stages of the plan with it recompute.\n\n" +
         conditions_header(t.conditions) + t.conditions.rows + "\n## Details\n\n" + t.details;
  ;
}

std::string compose_console(const Tables& t) {
  return strategy_header(t.strategies) + t.strategies.rows + "\n" + strategy_summary(t.strategies) +
         "\n" + strategy_verdict(t.strategies) + "\n" + t.recompute.rows + "\n" +
         recompute_verdict(t.recompute) + "\n" + t.zero.rows + "\n" + zero_verdict(t.zero) + "\n" +
         conditions_summary(t.conditions) + "\n" + conditions_verdict(t.conditions) + "\n" +
         conditions_header(t.conditions) + t.conditions.rows;
}

}  // namespace

ExperimentsReport run_experiments(const ExperimentsRequest& request) {
  Tables tables;
  for (const Ran& ran : run_files(request.files, request.jobs)) {
    add_scenario(tables, ran, request.out, request.svg_dir);
  }
  ExperimentsReport report{compose_markdown(tables), compose_console(tables)};
  if (request.scale_files.empty()) return report;
  ScaleTable scale;
  const std::string before = load_average();
  for (const Ran& ran : run_files(request.scale_files, request.jobs)) {
    add_scale_scenario(scale, ran, request.out, request.svg_dir);
  }
  scale.machine = std::to_string(request.jobs) + " scenario(s) at once on " +
                  std::to_string(std::thread::hardware_concurrency()) +
                  " hardware threads, load average " + before + " before and " + load_average() +
                  " after";
  report.markdown += "\n" + compose_scale(scale);
  report.console += "\n" + strategy_header(scale.strategies) + scale.strategies.rows + "\n" +
                    strategy_summary(scale.strategies) + "\n" + strategy_verdict(scale.strategies) +
                    "\n" + scale.planning_rows;
  return report;
}

}  // namespace malleus::sim
