// The simulator: 1F1B's schedule against the closed form, per-device accounting, and scenarios
// (trace runs, the table, the chart, strict scenario files).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "common/error.h"
#include "plan/cost_model.h"
#include "plan/planner.h"
#include "sim/scenario.h"
#include "sim/simulator.h"
#include "test_util.h"

using namespace malleus;

TEST(Simulator, UniformPipelineMatchesTheClosedForm) {
  for (int S : {1, 2, 4, 7}) {
    for (int m : {1, 2, 4, 9, 32}) {
      const std::vector<double> f(static_cast<size_t>(S), 1.0), b(static_cast<size_t>(S), 2.0),
          d(static_cast<size_t>(S), 0.0);
      std::vector<int> peak;
      const double t = sim::simulate_pipeline(f, b, d, m, &peak);
      EXPECT_DOUBLE_EQ(t, (m + S - 1) * 3.0) << "S=" << S << " m=" << m;
      for (int s = 0; s < S; ++s) EXPECT_EQ(peak[static_cast<size_t>(s)], std::min(S - s, m));
    }
  }
}

TEST(Simulator, TransfersAndUnevenStagesStayNearTheClosedForm) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0.5, 2.0), small(0.0, 0.2);
  double worst = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int S = 1 + static_cast<int>(rng() % 6);
    const int m = S + static_cast<int>(rng() % 24);
    std::vector<plan::StagePrediction> stages(static_cast<size_t>(S));
    std::vector<double> f, b, d;
    for (auto& s : stages) {
      s.cost.forward = u(rng);
      s.cost.backward = 2 * s.cost.forward * u(rng);
      s.p2p_next = small(rng);
      f.push_back(s.cost.forward), b.push_back(s.cost.backward), d.push_back(s.p2p_next);
    }
    const double sim = sim::simulate_pipeline(f, b, d, m);
    const double closed = plan::CostModel::pipeline_time(stages, m).time;
    // Nothing can beat the slowest stage's work, nor one micro-batch's trip.
    double bound = 0;
    for (size_t s = 0; s < stages.size(); ++s) bound = std::max(bound, m * (f[s] + b[s]));
    EXPECT_GE(sim, bound - 1e-9);
    worst = std::max(worst, std::abs(sim - closed) / sim);
  }
  // The closed form is the planner's estimate: it must stay close to the real schedule.
  EXPECT_LT(worst, 0.2);
}

// The shifted schedule in the event simulation (recomputation run as soon as the stage is free,
// the rest of the backward once the gradient is there) against the closed form's account of it.
TEST(Simulator, ShiftedRecomputationStaysNearTheClosedFormAndNeverSlows) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.5, 2.0), share(0.0, 0.5), small(0.0, 0.2);
  double worst = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int S = 2 + static_cast<int>(rng() % 5);
    const int m = S + static_cast<int>(rng() % 24);
    std::vector<plan::StagePrediction> stages(static_cast<size_t>(S));
    std::vector<double> f, b, d, ahead;
    for (size_t s = 0; s < stages.size(); ++s) {
      auto& c = stages[s].cost;
      c.forward = u(rng);
      c.recompute_time = s + 1 < stages.size() ? share(rng) * 2 * c.forward : 0;
      c.backward = 2 * c.forward * u(rng) + c.recompute_time;
      c.recompute_ahead = true;
      stages[s].p2p_next = small(rng);
      f.push_back(c.forward), b.push_back(c.backward), d.push_back(stages[s].p2p_next);
      ahead.push_back(c.recompute_time);
    }
    const double shifted = sim::simulate_pipeline(f, b, d, m, nullptr, ahead);
    const double in_backward = sim::simulate_pipeline(f, b, d, m);
    EXPECT_LE(shifted, in_backward + 1e-9) << trial;
    const double closed = plan::CostModel::pipeline_time(stages, m).time;
    worst = std::max(worst, std::abs(shifted - closed) / shifted);
  }
  EXPECT_LT(worst, 0.2);
}

TEST(Simulator, PlanIterationAndDeviceAccounting) {
  const plan::CostModel cost(model::load_model_config("llama-70b"), plan::load_cluster("a800-8x8"),
                             plan::BatchConfig{64, 1, 4096});
  const auto plan = plan::uniform_plan(cost.model(), 2, 8, 4, 64, 1, 64);
  plan::Rates rates(64, 1.0);
  const auto healthy = sim::simulate(cost, plan, rates);
  const auto pred = cost.predict(plan, rates);
  EXPECT_NEAR(healthy.iteration_time, pred.iteration_time, 0.01 * pred.iteration_time);
  for (const auto& d : healthy.devices) {
    EXPECT_TRUE(d.used);
    EXPECT_NEAR(d.busy_s + d.idle_s, healthy.iteration_time, 1e-9);
    EXPECT_GT(d.busy_s / healthy.iteration_time, 0.7);
    EXPECT_GT(d.memory_bytes, 0);
  }
  EXPECT_EQ(healthy.devices[0].peak_in_flight, 4);
  EXPECT_EQ(healthy.devices[63].peak_in_flight, 1);
  // One slow device: it is busy, its TP peers and the other stages wait.
  rates[3] = 3;
  const auto slow = sim::simulate(cost, plan, rates);
  EXPECT_GT(slow.iteration_time, 2 * healthy.iteration_time);
  EXPECT_GT(slow.devices[3].busy_s, 2 * slow.devices[2].busy_s);
  EXPECT_LT(slow.mean_utilisation(), healthy.mean_utilisation());
  rates[60] = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(std::isinf(sim::simulate(cost, plan, rates).iteration_time));
}

namespace {

Json small_scenario() {
  return Json::parse(R"({
    "name": "t", "description": "test trace", "cluster": "a800-4x8", "model": "llama-7b",
    "seq_len": 2048, "global_batch": 32, "micro_batch": 1, "base": "dp4,tp2,pp4",
    "horizon_s": 600, "replan_s": 0.5,
    "events": [{"at_s": 60, "rates": {"3": 4}}, {"at_s": 300, "rates": {"9": "inf"}}]})");
}

std::string error_of(const Json& j) {
  try {
    sim::Scenario::from_json(j, "s.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Scenario, TraceRunsEveryStrategyAndOursLeads) {
  const auto sc = sim::Scenario::from_json(small_scenario(), "s.json");
  const auto r = sim::run_scenario(sc);
  ASSERT_EQ(r.runs.size(), plan::strategy_names().size());
  EXPECT_GT(r.healthy_iteration_s, 0);
  ASSERT_EQ(r.ideal_samples_per_s.size(), 2u);
  const sim::StrategyRun* ours = nullptr;
  for (const auto& run : r.runs) {
    if (run.strategy == "malleus") ours = &run;
    EXPECT_TRUE(run.error.empty()) << run.strategy << ": " << run.error;
    EXPECT_LE(run.samples, r.ideal_samples * 1.01) << run.strategy;
    double covered = 0;
    for (const auto& s : run.timeline) covered += s.end_s - s.start_s;
    EXPECT_NEAR(covered, sc.horizon_s, 1e-6) << run.strategy;
  }
  ASSERT_NE(ours, nullptr);
  EXPECT_EQ(ours->switches.size(), sc.events.size());
  for (const auto& run : r.runs) {
    if (&run != ours) {
      EXPECT_TRUE(run.switches.empty()) << run.strategy;
    }
    EXPECT_GE(ours->samples, run.samples * (1 - 1e-9)) << run.strategy;
    for (size_t e = 0; e < run.steady_samples_per_s.size(); ++e) {
      EXPECT_GE(ours->steady_samples_per_s[e], run.steady_samples_per_s[e] * (1 - 1e-9))
          << run.strategy << " event " << e;
    }
  }
  const std::string table = sim::render_table(r);
  const std::string svg = sim::render_svg(r);
  for (const auto& name : plan::strategy_names()) {
    EXPECT_NE(table.find(name), std::string::npos);
    EXPECT_NE(svg.find(name), std::string::npos);
  }
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_EQ(sim::result_to_json(r)["runs"].size(), r.runs.size());
}

TEST(Scenario, SwitchDecisionsAreTheControllersRule) {
  // On every scenario file: each switch ours weighed is decided as replan::weigh_switch — the
  // controller's rule — decides the same question, and the switches it took are its re-plans.
  // Ours alone: the baselines switch whenever their plan changes, weighing nothing.
  size_t weighed = 0, taken = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(MALLEUS_SOURCE_DIR "/configs/scenarios")) {
    if (!entry.is_regular_file()) continue;  // scale/: thousands of devices, not for a unit test
    sim::Scenario scenario = sim::load_scenario(entry.path().string());
    scenario.strategies = {"malleus"};
    const auto r = sim::run_scenario(scenario);
    ASSERT_EQ(r.runs.size(), 1u);
    const sim::StrategyRun& run = r.runs[0];
    EXPECT_EQ(run.switches.size(), r.scenario.events.size()) << entry.path();
    int took = 0;
    for (const auto& w : run.switches) {
      EXPECT_EQ(replan::weigh_switch(w.question), w.verdict)
          << entry.path() << " at " << w.at_s << " s";
      EXPECT_EQ(w.question.horizon_steps,
                r.scenario.decision_horizon_s / w.question.current_step_s);
      took += w.verdict.take ? 1 : 0;
    }
    EXPECT_EQ(took, run.replans) << entry.path();
    weighed += run.switches.size();
    taken += static_cast<size_t>(took);
  }
  EXPECT_GE(weighed, 22u);
  EXPECT_GT(taken, 0u);
  std::printf("  %zu switches weighed, %zu taken\n", weighed, taken);
}

TEST(Scenario, ChartWithMarkupInTheNameIsValidXml) {
  Json j = small_scenario();
  j["name"] = "a<&\"b>";
  const auto r = sim::run_scenario(sim::Scenario::from_json(j, "s.json"));
  malleus::testing::ScratchDir dir;
  std::ofstream(dir / "chart.svg") << sim::render_svg(r);
  const auto parsed = malleus::testing::parse_xml(dir / "chart.svg");
  ASSERT_EQ(parsed.exit_code, 0) << parsed.output;
  EXPECT_NE(parsed.output.find("a<&\"b>: throughput over time"), std::string::npos)
      << parsed.output;
}

TEST(Scenario, BadFilesNameTheKey) {
  Json j = small_scenario();
  j["horizon"] = 5;
  EXPECT_NE(error_of(j).find("horizon"), std::string::npos);
  j = small_scenario();
  j["events"][1]["at_s"] = 10;
  EXPECT_NE(error_of(j).find("event 1"), std::string::npos);
  j = small_scenario();
  j["events"][0]["rates"]["99"] = 2;
  EXPECT_NE(error_of(j).find("\"99\""), std::string::npos);
  j = small_scenario();
  j["strategies"] = {"malleus", "magic"};
  EXPECT_NE(error_of(j).find("magic"), std::string::npos);
  EXPECT_THROW(sim::load_scenario("/no/such/scenario.json"), Error);
}

// Ranks taking turns on shared cores are not scheduled by the simulator yet: where the closed
// form knows the turns (two ranks' compute on one core), the simulation is not shorter than it.
TEST(Simulator, SharedCoresTakeTheClosedFormsPipelineTime) {
  const model::ModelConfig demo = model::load_model_config("demo");
  const plan::CostModel cost(demo, plan::load_cluster("cpu-bed-2x2-turns"),
                             plan::BatchConfig{16, 2, 128});
  ASSERT_TRUE(cost.cluster().cores_shared());
  for (int dp : {4, 1}) {
    const plan::Plan p = plan::uniform_plan(demo, dp, 1, 4 / dp, 16, 2, 4);
    const plan::Rates rates(4, 1.0);
    const auto sim = sim::simulate(cost, p, rates, false);
    const auto pred = cost.predict(p, rates, false);
    EXPECT_GE(sim.iteration_time, pred.iteration_time - 1e-12) << p.summary();
    // dp4: each pipeline alone would take half the core's time; the core's sum is what counts.
    if (dp == 4) {
      EXPECT_GT(sim.iteration_time, 1.5 * sim.pipeline_times[0]);
    }
  }
}

// "distributed_optimizer" (default true) reaches the cost model the strategies plan with: with
// whole moments on every holder the healthy uniform plan (dp4) keeps 4× the optimizer state, and
// on devices this tight it predicts a slower iteration.
TEST(Scenario, DistributedOptimizerKeyAndCapacity) {
  Json j = small_scenario();
  EXPECT_TRUE(sim::Scenario::from_json(j, "s.json").distributed_optimizer);
  j["distributed_optimizer"] = "yes";
  EXPECT_NE(error_of(j).find("distributed_optimizer"), std::string::npos);
  j["distributed_optimizer"] = false;
  auto whole = sim::Scenario::from_json(j, "s.json");
  EXPECT_FALSE(whole.distributed_optimizer);
  auto zero = sim::Scenario::from_json(small_scenario(), "s.json");
  for (auto* sc : {&whole, &zero}) {
    sc->strategies = {"uniform"};
    sc->cluster.memory_bytes = 24e9;  // tight enough that the optimizer state matters
  }
  const auto with_whole = sim::run_scenario(whole), with_zero = sim::run_scenario(zero);
  EXPECT_GT(with_whole.healthy_iteration_s, with_zero.healthy_iteration_s);
  EXPECT_TRUE(std::isfinite(with_zero.healthy_iteration_s));

  plan::Rates rates(4, 1.0);
  rates[1] = 2, rates[2] = std::numeric_limits<double>::infinity();
  EXPECT_DOUBLE_EQ(sim::capacity(rates), 2.5);
}

// The simulator asks our planner as the controller does (PlanRequest::previous_rates: the rates it
// last asked about): on the 64-device trace, the events where at most plan::kIncrementalDevices
// rates moved are re-planned incrementally unless the plan falls short of the capacity left
// (plan::kIncrementalSlack), and the one where ten moved runs the full search; the healthy plan is
// the full search's.
TEST(Scenario, ReplansIncrementallyAsTheController) {
  sim::Scenario sc = sim::load_scenario(MALLEUS_SOURCE_DIR "/configs/scenarios/70b-trace.json");
  sc.strategies = {"malleus"};
  const auto r = sim::run_scenario(sc);
  ASSERT_EQ(r.runs.size(), 1u);
  const sim::StrategyRun& run = r.runs[0];
  ASSERT_TRUE(run.error.empty()) << run.error;
  EXPECT_FALSE(run.start_planning.incremental);
  EXPECT_GT(run.start_planning.seconds, 0);
  ASSERT_EQ(run.event_planning.size(), sc.events.size());
  plan::Rates before(static_cast<size_t>(sc.cluster.num_devices()), 1.0);
  int incremental = 0, full_when_many = 0;
  for (size_t e = 0; e < sc.events.size(); ++e) {
    int moved = 0;
    for (size_t d = 0; d < before.size(); ++d) moved += before[d] != sc.events[e].rates[d] ? 1 : 0;
    const bool inc = run.event_planning[e].incremental;
    if (moved > plan::kIncrementalDevices) {
      EXPECT_FALSE(inc) << "event " << e << ": " << moved << " rates moved";
      ++full_when_many;
    }
    incremental += inc ? 1 : 0;
    before = sc.events[e].rates;
  }
  EXPECT_EQ(full_when_many, 1);
  EXPECT_GE(incremental, 3) << sim::render_table(r);
  EXPECT_NE(sim::render_table(r).find("incremental"), std::string::npos);
}
