// A device's memory under MPI, checked on the CPU with a test double of a GPU backend
// (tests/device_double.h: the CPU backend's arithmetic on memory the host and MPI may not touch).
// The communicator stages it through host buffers (comm/staging.h), and the runtime packs,
// migrates and checkpoints it through its copies: real plans under mpirun (data parallel,
// pipelines, tensor parallel, idle ranks, the distributed optimizer) with migrations and switches
// between them train with the very losses and state of the CPU backend. A path that handed the
// double's memory to MPI or read it on the host would fault. Also the timing seam: the engine
// times its compute with the backend's timer.
//
// Run under mpirun with 1, 2 and 4 ranks; every rank runs every test (they are collective).
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/staging.h"
#include "device_double.h"
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

runtime::EngineOptions options_on(bool device) {
  runtime::EngineOptions options;
  options.seq_len = kSeq;
  if (device) options.make_backend = malleus::testing::make_device_double;
  return options;
}

// Values of `count` floats that differ by rank and position.
std::vector<float> pattern(size_t count, int rank, float scale = 1.0f) {
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) values[i] = scale * float(rank + 1) + 0.25f * float(i % 7);
  return values;
}

// A buffer of the double, filled from and read back to the host.
struct DeviceBuffer {
  explicit DeviceBuffer(backend::Backend<float>& device, const std::vector<float>& values)
      : on(device), buffer(device, values.size(), backend::MemoryKind::kWorkspace) {
    device.copy_from_host(buffer.data(), values.data(), values.size());
  }
  std::vector<float> host() {
    std::vector<float> values(buffer.size());
    on.copy_to_host(values.data(), buffer.data(), values.size());
    return values;
  }
  backend::Backend<float>& on;
  backend::Buffer<float> buffer;
};

}  // namespace

// Every communicator call takes the double's memory as it takes host memory, and gives the same
// results; the bytes went through staging buffers (MPI reading the double's pages would fault).
TEST(DeviceMpi, CollectivesAndMessagesStageDeviceBuffers) {
  Communicator world = Communicator::world();
  const int n = world.size(), me = world.rank();
  auto device = malleus::testing::make_device_double(1);
  comm::register_device_memory(device->device_memory());  // as an engine on it does
  const int64_t staged_before = comm::staged_bytes();
  const size_t count = 1000;
  double rank_sum = 0;
  for (int r = 0; r < n; ++r) rank_sum += r + 1;

  DeviceBuffer sum(*device, pattern(count, me));
  world.all_reduce_sum(sum.buffer.data(), count);
  DeviceBuffer started(*device, pattern(count, me));
  comm::Request pending = world.iall_reduce_sum(started.buffer.data(), count);
  pending.wait();
  DeviceBuffer most(*device, pattern(count, me));
  world.all_reduce_max(most.buffer.data(), count);
  const std::vector<float> summed = sum.host(), started_sum = started.host(), maxed = most.host();
  for (size_t i = 0; i < count; ++i) {
    ASSERT_FLOAT_EQ(summed[i], float(rank_sum) + float(n) * 0.25f * float(i % 7)) << i;
    ASSERT_EQ(started_sum[i], summed[i]) << i;
    ASSERT_FLOAT_EQ(maxed[i], float(n) + 0.25f * float(i % 7)) << i;
  }

  // Uneven parts: rank r's part is r + 3 elements.
  std::vector<int> counts, displacements;
  int total = 0;
  for (int r = 0; r < n; ++r) {
    displacements.push_back(total);
    counts.push_back(r + 3);
    total += r + 3;
  }
  DeviceBuffer send(*device, pattern(size_t(total), me));
  DeviceBuffer part(*device, std::vector<float>(size_t(counts[size_t(me)]), -1.0f));
  world.reduce_scatter_sum(send.buffer.data(), part.buffer.data(), counts);
  const std::vector<float> mine = part.host();
  for (int i = 0; i < counts[size_t(me)]; ++i) {
    const int at = displacements[size_t(me)] + i;
    ASSERT_FLOAT_EQ(mine[size_t(i)], float(rank_sum) + float(n) * 0.25f * float(at % 7)) << i;
  }
  std::vector<float> gathered_values(size_t(total), 0.0f);
  for (int i = 0; i < counts[size_t(me)]; ++i) {
    gathered_values[size_t(displacements[size_t(me)] + i)] = float(me * 100 + i);
  }
  DeviceBuffer gathered(*device, gathered_values);
  comm::Request gathering =
      world.iall_gather_in_place(gathered.buffer.data(), counts, displacements);
  gathering.wait();
  const std::vector<float> all = gathered.host();
  for (int r = 0; r < n; ++r) {
    for (int i = 0; i < counts[size_t(r)]; ++i) {
      ASSERT_EQ(all[size_t(displacements[size_t(r)] + i)], float(r * 100 + i)) << r << " " << i;
    }
  }

  DeviceBuffer broadcast(*device, pattern(count, me));
  world.broadcast(broadcast.buffer.data(), count * sizeof(float), n - 1);
  EXPECT_EQ(broadcast.host(), pattern(count, n - 1));

  // A ring of messages, device to device; the receive is completed by test(), not wait().
  DeviceBuffer outgoing(*device, pattern(count, me, 3.0f));
  DeviceBuffer incoming(*device, std::vector<float>(count, 0.0f));
  comm::Request receive =
      world.irecv(incoming.buffer.data(), count * sizeof(float), (me + n - 1) % n, 7);
  comm::Request sent = world.isend(outgoing.buffer.data(), count * sizeof(float), (me + 1) % n, 7);
  while (!receive.test()) {
  }
  sent.wait();
  EXPECT_EQ(incoming.host(), pattern(count, (me + n - 1) % n, 3.0f));

  EXPECT_GT(comm::staged_bytes(), staged_before);
  EXPECT_EQ(comm::device_memory_of(sum.buffer.data()),
            malleus::testing::device_double_memory().get());
  const std::vector<float> host(4);
  EXPECT_EQ(comm::device_memory_of(host.data()), nullptr);
  const std::string how = comm::transport_text(*malleus::testing::device_double_memory());
  EXPECT_NE(how.find("staged through host memory"), std::string::npos) << how;
}

namespace {

// What one run did: every step's loss and gradient norm, and the state gathered at the end.
struct Run {
  std::vector<double> losses, norms;
  runtime::FullState state;
};

// Trains `plans[0]`, then moves to each next plan (alternately migrate() and the overlapped
// switch_to()), two steps per plan, an evaluation, and a round trip of the state through the
// host: gather and scatter, and the held state a checkpoint copies and restores.
Run train_through(const std::vector<plan::Plan>& plans, runtime::EngineOptions options) {
  const auto model = malleus::testing::parallel_test_model();
  Run run;
  auto engine = std::make_unique<runtime::Engine>(model, plans[0], Communicator::world(), options);
  engine->init_parameters(21);
  auto steps = [&](int count) {
    for (int s = 0; s < count; ++s) {
      const runtime::StepResult r = engine->step(sample, 2e-3f, 1.0f);
      run.losses.push_back(r.loss);
      run.norms.push_back(r.grad_norm);
    }
  };
  steps(2);
  for (size_t p = 1; p < plans.size(); ++p) {
    engine = p % 2 == 1 ? engine->migrate(plans[p])
                        : runtime::Engine::switch_to(std::move(engine), plans[p]);
    steps(2);
  }
  run.losses.push_back(engine->evaluate(sample, 5));
  // The state out to the host and back, as a single-file checkpoint moves it...
  const runtime::FullState gathered = engine->gather();
  engine->scatter(gathered, engine->steps_done());
  // ... and as a sharded one does: each rank copies what it holds and reads it back.
  const runtime::HeldState held = engine->held_state();
  std::vector<float> params, moment;
  if (held.layout != nullptr) {
    params.assign(held.params, held.params + held.layout->total_size());
    moment.assign(held.adam_m, held.adam_m + engine->optimizer_elements());
  }
  engine->restore_held_state([&](const runtime::HeldState& target) {
    if (target.layout == nullptr) return;
    std::fill_n(target.params, params.size(), 0.0f);  // what the restore must overwrite
    std::copy(params.begin(), params.end(), target.params);
    std::copy(moment.begin(), moment.end(), target.adam_m);
  });
  steps(1);
  run.state = engine->gather();
  return run;
}

void expect_same_run(const std::vector<plan::Plan>& plans, runtime::EngineOptions options) {
  Communicator world = Communicator::world();
  std::string path;
  for (const auto& p : plans) {
    if (!path.empty()) path += " -> ";
    path += p.summary();
  }
  SCOPED_TRACE(path);
  const int64_t before = malleus::testing::device_double_bytes();
  const int64_t staged = comm::staged_bytes();
  const Run cpu = train_through(plans, options);
  options.make_backend = malleus::testing::make_device_double;
  const Run device = train_through(plans, options);
  EXPECT_EQ(device.losses, cpu.losses);
  EXPECT_EQ(device.norms, cpu.norms);
  if (world.rank() == 0) {
    EXPECT_EQ(device.state.params, cpu.state.params);
    EXPECT_EQ(device.state.adam_m, cpu.state.adam_m);
    EXPECT_EQ(device.state.adam_v, cpu.state.adam_v);
  }
  EXPECT_EQ(malleus::testing::device_double_bytes(), before) << "device memory left allocated";
  if (world.size() > 1) {
    EXPECT_GT(comm::staged_bytes(), staged) << "no device buffer went through the staging";
  }
}

}  // namespace

// Data parallel, then a 2-stage pipeline (every pipeline of two stages), then back.
TEST(DeviceMpi, DataParallelAndPipelineRunsEqualTheCpuBackend) {
  const int n = Communicator::world().size();
  const auto model = malleus::testing::parallel_test_model();
  const auto dp = plan::uniform_plan(model, n, 1, 1, 8, 1);
  std::vector<plan::Plan> plans{dp};
  if (n >= 2) {
    plans.push_back(plan::uniform_plan(model, n / 2, 1, 2, 8, 1, n));
    plans.push_back(dp);
  }
  expect_same_run(plans, options_on(false));
  runtime::EngineOptions whole = options_on(false);
  whole.distributed_optimizer = false;  // every holder keeps whole moments
  expect_same_run(plans, whole);
}

// Micro-batches of 2 sequences, dealt evenly and then unevenly over the pipelines (what the
// trainer's controller switches to around a straggler), then one tensor-parallel pipeline.
TEST(DeviceMpi, UnevenMicroBatchCountsEqualTheCpuBackend) {
  const int n = Communicator::world().size();
  if (n != 2) GTEST_SKIP() << "plans for 2 ranks";
  const auto model = malleus::testing::parallel_test_model();
  const auto even = plan::uniform_plan(model, 2, 1, 1, 16, 2);
  auto uneven = even;
  uneven.pipelines[0].micro_batches = 6;
  uneven.pipelines[1].micro_batches = 2;
  const auto tp = plan::uniform_plan(model, 1, 2, 1, 16, 2);
  expect_same_run({even, uneven, tp, even}, options_on(false));
}

// Tensor parallel groups (activations all-reduced inside layers, started non-blocking when
// sub-pipelined), a plan that leaves a rank idle (its probe), and a switch between them.
TEST(DeviceMpi, TensorParallelAndIdleRanksEqualTheCpuBackend) {
  const int n = Communicator::world().size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto model = malleus::testing::parallel_test_model();
  const auto tp = plan::uniform_plan(model, n / 2, 2, 1, 8, 1, n);
  const auto fewer = plan::uniform_plan(model, 1, 1, 1, 8, 1, n);  // ranks 1.. idle
  runtime::EngineOptions options = options_on(false);
  options.tp_subpipeline = true;
  expect_same_run({tp, fewer, tp}, options);
}

namespace {

// A region timer that says every region took the same time, and adds up the busy work asked of
// it.
class FixedTimer final : public backend::RegionTimer {
 public:
  FixedTimer(double seconds, double* busy) : seconds_(seconds), busy_(busy) {}
  void begin() override {}
  double elapsed() override { return seconds_; }
  void keep_busy(double seconds) override { *busy_ += seconds; }

 private:
  double seconds_;
  double* busy_;
};

// The host's clock, adding up the busy work asked of it instead of doing it.
class RecordingTimer final : public backend::RegionTimer {
 public:
  explicit RecordingTimer(double* busy) : busy_(busy) {}
  void begin() override { clock_.begin(); }
  double elapsed() override { return clock_.elapsed(); }
  void keep_busy(double seconds) override { *busy_ += seconds; }

 private:
  backend::SteadyClockTimer clock_;
  double* busy_;
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
  runtime::EngineOptions options = options_on(false);
  double busy = 0;
  options.make_backend = [&busy](int threads) {
    auto made = backend::make_cpu_backend<float>(threads);
    made->set_region_timer(std::make_unique<FixedTimer>(0.125, &busy));
    return made;
  };
  const auto plan = plan::uniform_plan(model, n, 1, 1, 8 * n, 1);
  runtime::Engine engine(model, plan, world, options);
  engine.init_parameters(3);
  const runtime::StepResult r = engine.step(sample, 1e-3f, 1.0f);
  EXPECT_EQ(r.compute_seconds, 2 * 8 * 0.125);
  for (int rank = 0; rank < n; ++rank) EXPECT_EQ(r.measurements[size_t(2 * rank)], 2.0);
  EXPECT_EQ(busy, 0.0);

  // An injected 3x straggler's extra work goes to the timer, on the device, where a GPU's events
  // count it: twice each region's time, in the 16 regions and the optimizer's update (less the
  // update's wait in its all-gathers on the host's clock, a small part: none on one rank).
  engine.step(sample, 1e-3f, 1.0f, 3.0);
  EXPECT_GT(busy, 2 * 0.125 * 2 * 8);
  EXPECT_LE(busy, 2 * 0.125 * (2 * 8 + 1));
  if (n == 1) {
    EXPECT_EQ(busy, 2 * 0.125 * (2 * 8 + 1));
  }

  backend::SteadyClockTimer clock;
  clock.begin();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double first = clock.elapsed();
  EXPECT_GE(first, 0.020);
  EXPECT_GE(clock.elapsed(), first);  // read again in the same region: later
  clock.keep_busy(0.030);
  EXPECT_GE(clock.elapsed(), first + 0.030);
}

// An injected straggler is slowed by its own compute only. In the distributed optimizer's update,
// its all-gather waits for peers: here rank 1 comes to it 0.4 s late (in a run, a lossy link's
// resend does the same), and that wait must not come back (slowdown - 1) times over as busy work
// (it did: a 100x straggler held a run for 25 s after one 0.25 s resend).
TEST(DeviceMpi, AStragglersWaitForALatePeerIsNotMultipliedIntoItsUpdate) {
  Communicator world = Communicator::world();
  if (world.size() < 2) GTEST_SKIP() << "needs a peer";
  const auto model = malleus::testing::parallel_test_model();
  runtime::EngineOptions options = options_on(false);
  options.distributed_optimizer = true;
  double busy = 0;
  options.make_backend = [&busy](int threads) {
    auto made = backend::make_cpu_backend<float>(threads);
    made->set_region_timer(std::make_unique<RecordingTimer>(&busy));
    return made;
  };
  const auto plan = plan::uniform_plan(model, world.size(), 1, 1, 2 * world.size(), 1);
  runtime::Engine engine(model, plan, world, options);
  engine.init_parameters(3);
  const double slowdown = world.rank() == 0 ? 20.0 : 1.0;
  engine.step(sample, 1e-3f, 1.0f, slowdown);  // connections made
  busy = 0;
  engine.step(sample, 1e-3f, 1.0f, slowdown);
  const double on_time = busy;
  busy = 0;
  engine.step(sample, 1e-3f, 1.0f, slowdown, [&world] {
    if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  });
  if (world.rank() == 0) {
    std::printf("  rank 0's busy work: %.3f s with its peers on time, %.3f s with one late\n",
                on_time, busy);
    // The late peer's 0.4 s would be 19 x 0.4 = 7.6 s more; what varies is rank 0's compute.
    EXPECT_LT(busy - on_time, 19 * 0.1);
  }
}
