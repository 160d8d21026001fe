// The pieces of the straggler loop that need no MPI: injected-straggler schedules and the
// monitor's rates.
#include <gtest/gtest.h>

#include <fstream>

#include "common/error.h"
#include "elastic/controller.h"
#include "elastic/monitor.h"
#include "elastic/stragglers.h"
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
