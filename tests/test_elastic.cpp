// The pieces of the straggler loop that need no MPI: injected-straggler schedules and the
// monitor's rates.
#include <gtest/gtest.h>

#include <fstream>
#include <limits>

#include "common/error.h"
#include "elastic/controller.h"
#include "elastic/monitor.h"
#include "elastic/stragglers.h"
#include "replan/replan.h"
#include "test_util.h"

using namespace malleus;

TEST(Stragglers, CommandLineWindows) {
  elastic::StragglerSchedule s;
  s.add("2:3:20-80");
  s.add("0:1.5:50-");
  EXPECT_EQ(s.rate(2, 19), 1.0);
  EXPECT_EQ(s.rate(2, 20), 3.0);
  EXPECT_EQ(s.rate(2, 80), 3.0);
  EXPECT_EQ(s.rate(2, 81), 1.0);
  EXPECT_EQ(s.rate(0, 1000000), 1.5);
  EXPECT_EQ(s.rates(3, 60), (std::vector<double>{1.5, 1.0, 3.0}));
}

TEST(Stragglers, BadSpecsAreNamed) {
  for (const char* bad : {"2:3", "x:3:1-2", "1:0.5:1-2", "1:3:5-2", "1:3:0-2", "1:fast:1-2"}) {
    elastic::StragglerSchedule s;
    try {
      s.add(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

TEST(Stragglers, TraceFileEventsHoldUntilTheNextOne) {
  malleus::testing::ScratchDir dir;
  const auto path = (dir / "trace.json").string();
  std::ofstream(path) << R"({"events": [{"step": 10, "rates": {"1": 4}},
                                       {"step": 20, "rates": {"1": 1, "3": 2}}]})";
  elastic::StragglerSchedule s;
  s.add_trace(path);
  EXPECT_EQ(s.rate(1, 9), 1.0);
  EXPECT_EQ(s.rate(1, 15), 4.0);
  EXPECT_EQ(s.rate(1, 25), 1.0);
  EXPECT_EQ(s.rate(3, 25), 2.0);
  std::ofstream(path) << R"({"events": [{"step": 10, "rates": {"1": 0.5}}]})";
  EXPECT_THROW(s.add_trace(path), Error);
}

TEST(Monitor, RatesAreTimePerFlopOverTheMedianRank) {
  // 4 ranks: rank 2 three times slower; rank 3 idle (no work), its probe twice as slow.
  const std::vector<double> m = {1.0, 1e9, 0.001, 1e6,  //
                                 2.0, 2e9, 0.001, 1e6,  //
                                 3.0, 1e9, 0.003, 1e6,  //
                                 0.0, 0.0, 0.002, 1e6};
  const auto rates = elastic::Monitor::rates_of(m);
  EXPECT_DOUBLE_EQ(rates[0], 1.0);
  EXPECT_DOUBLE_EQ(rates[1], 1.0);
  EXPECT_DOUBLE_EQ(rates[2], 3.0);
  EXPECT_DOUBLE_EQ(rates[3], 2.0 / 1.5);  // probe against the median probe of all ranks
}

TEST(Monitor, SlidingMedianIgnoresOneNoisyStep) {
  elastic::Monitor monitor(2, 3);
  auto step = [&](double slow) {
    return monitor.observe({1.0, 1e9, 0.001, 1e6, slow, 1e9, 0.001, 1e6});
  };
  step(1.0);
  step(1.0);
  EXPECT_NEAR(step(5.0)[1], 1.0, 1e-12);  // one spike among three steps: median unmoved
  EXPECT_GT(step(5.0)[1], 1.5);           // a lasting change shows
  monitor.reset();
  EXPECT_EQ(monitor.samples(), 0);
}

TEST(Controller, ProfileOfAWholeCoreIsScaledToARanksShare) {
  plan::Profile p;
  p.layer_forward_s = 0.002;
  p.layer_backward_s = 0.004;
  p.layer_forward_flops_per_s = 1e11;
  p.layer_backward_flops_per_s = 1e11;
  p.head_flops_per_s = 5e10;
  const plan::Profile half = elastic::shared_profile(p, 0.5);  // two ranks per core
  EXPECT_DOUBLE_EQ(half.layer_forward_s, 0.004);
  EXPECT_DOUBLE_EQ(half.layer_backward_flops_per_s, 5e10);
  EXPECT_DOUBLE_EQ(half.head_flops_per_s, 2.5e10);
  EXPECT_THROW(elastic::shared_profile(p, 0), Error);
}

TEST(Controller, LocalClusterHasOneDevicePerRank) {
  const auto cluster = elastic::local_cluster("cpu-local", 6);
  EXPECT_EQ(cluster.num_devices(), 6);
  EXPECT_EQ(cluster.nodes, 1);
}

TEST(Controller, DecidesWithTheSharedSwitchRule) {
  // The decision rank 0 makes is replan::weigh_switch asked with the cost model's step times, the
  // migration estimate and the horizon: the rule the simulator applies too.
  const auto model = model::load_model_config("demo");
  const plan::CostModel cost(model, elastic::local_cluster("cpu-local", 4),
                             plan::BatchConfig{16, 1, 128});
  elastic::ControllerOptions options;
  options.horizon_steps = 50;
  elastic::Controller controller(cost, options);
  const auto current = plan::uniform_plan(model, 4, 1, 1, 16, 1, 4);
  const std::vector<double> measured = {1.0, 3.0, 1.1, 1.0};
  const elastic::Decision d = controller.propose(current, measured, 20, 80);
  EXPECT_EQ(d.rates, (std::vector<double>{1.0, 3.0, 1.0, 1.0}));  // 1.1 counts as healthy
  EXPECT_EQ(replan::weigh_switch(d.question), d.verdict);
  EXPECT_DOUBLE_EQ(d.question.current_step_s, cost.predict(current, d.rates).iteration_time);
  EXPECT_DOUBLE_EQ(d.question.horizon_steps, 50);
  ASSERT_TRUE(d.plan.has_value()) << d.verdict.reason;  // a 3× straggler is worth a switch
  EXPECT_DOUBLE_EQ(d.question.switch_s, replan::estimate_migration(cost, current, *d.plan).seconds);
  EXPECT_GT(d.verdict.gain_s, d.question.switch_s);

  // Near the end of the run the same gain no longer pays for a slow migration.
  controller.note_migration_seconds(1e3);
  const elastic::Decision late = controller.propose(current, measured, 99, 1);
  EXPECT_EQ(replan::weigh_switch(late.question), late.verdict);
  EXPECT_DOUBLE_EQ(late.question.horizon_steps, 1);
  EXPECT_DOUBLE_EQ(late.question.switch_s, 1e3);
  EXPECT_FALSE(late.plan.has_value());
  EXPECT_NE(late.verdict.reason.find("does not pay"), std::string::npos);
}

TEST(SwitchRule, GainOverTheHorizonAgainstTheSwitchCost) {
  replan::SwitchQuestion q{2.0, 1.5, 10.0, 30, false};
  EXPECT_TRUE(replan::weigh_switch(q).take);  // 0.5 s × 30 steps > 10 s
  EXPECT_DOUBLE_EQ(replan::weigh_switch(q).gain_s, 15.0);
  q.horizon_steps = 20;  // exactly 10 s: not more than the cost
  EXPECT_FALSE(replan::weigh_switch(q).take);
  q.current_step_s = std::numeric_limits<double>::infinity();  // the running plan cannot run
  EXPECT_TRUE(replan::weigh_switch(q).take);
  q.same_plan = true;
  EXPECT_FALSE(replan::weigh_switch(q).take);
  EXPECT_EQ(replan::weigh_switch(q).reason, "the current plan is still the best");
}
