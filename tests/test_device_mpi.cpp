// What a rank computes on, under mpirun: the engine times its compute with the backend's timer
// (backend/region_timer.h), the device's clock where the backend has one.
//
// Run under mpirun with 1, 2 and 4 ranks; every rank runs every test (they are collective).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "comm/communicator.h"
#include "plan/plan.h"
#include "runtime/engine.h"
#include "test_util.h"

using namespace malleus;
using comm::Communicator;

namespace {

constexpr int kSeq = 16;

// The same sequences on every rank and in every run.
void sample(int index, int32_t* inputs, int32_t* targets) {
  for (int t = 0; t < kSeq; ++t) {
    inputs[t] = (index * 31 + t * 7) % 257;
    targets[t] = (index * 17 + t * 5 + 1) % 257;
  }
}

}  // namespace

namespace {

// A region timer that says every region took the same time.
class FixedTimer final : public backend::RegionTimer {
 public:
  explicit FixedTimer(double seconds) : seconds_(seconds) {}
  void begin() override {}
  double elapsed() override { return seconds_; }

 private:
  double seconds_;
};

}  // namespace

// The engine times its compute regions with the backend's timer (a GPU's records CUDA events):
// with a timer that says every region took 0.125 s, a rank of a one-stage pipeline with m
// micro-batches reports 2m regions (a forward and a backward each). The CPU backend's own timer
// is the host's steady clock, as the engine's timing was before.
TEST(DeviceMpi, TheEngineTimesComputeWithTheBackendsTimer) {
  Communicator world = Communicator::world();
  const int n = world.size();
  const auto model = malleus::testing::parallel_test_model();
  runtime::EngineOptions options;
  options.seq_len = kSeq;
  options.make_backend = [](int threads) {
    auto made = backend::make_cpu_backend<float>(threads);
    made->set_region_timer(std::make_unique<FixedTimer>(0.125));
    return made;
  };
  const auto plan = plan::uniform_plan(model, n, 1, 1, 8 * n, 1);
  runtime::Engine engine(model, plan, world, options);
  engine.init_parameters(3);
  const runtime::StepResult r = engine.step(sample, 1e-3f, 1.0f);
  EXPECT_EQ(r.compute_seconds, 2 * 8 * 0.125);
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(r.measurements[size_t(2 * rank)], 2.0);

  backend::SteadyClockTimer clock;
  clock.begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double first = clock.elapsed();
  EXPECT_GE(first, 0.020);
  EXPECT_GE(clock.elapsed(), first);  // read again in the same region: later
}
