// `malleus launch` end to end: a 4-rank job loses a rank — killed with SIGKILL, or stopped with
// SIGSTOP so that it hangs the others — and the supervisor finishes the run on the 3 ranks left,
// with the losses of a run that lost nothing; too few devices left stops it with an error and no
// restart. Every command runs under `timeout`, so a hang fails the test instead of blocking it.
#include <gtest/gtest.h>

#include <csignal>
#include <fstream>
#include <map>
#include <optional>

#include "common/files.h"
#include "common/json.h"
#include "test_util.h"
#include "metrics/metrics.h"

using namespace malleus;
using malleus::testing::BackgroundCommand;
using malleus::testing::kMpiEnvironment;
using malleus::testing::run_command;
using malleus::testing::ScratchDir;

namespace {

constexpr int kTimeoutS = 240;

// The tiny model on the synthetic corpus, a checkpoint every 2 steps and a constant learning
// rate. --no-replan: the plan must be the one the job starts with, whatever the timings. Rank 0
// computes 100 times longer than it would (an injected straggler: timing only, the numerics are
// untouched), so that a step takes a good part of a second and the test acts in mid-run.
std::string tiny_flags(const ScratchDir& dir, const std::string& run, int steps) {
  return "--model tiny --seq-len 16 --micro-batch 1 --global-batch 12 --threads 1 "
         "--warmup-steps 1 --min-lr-ratio 1 --val-data '' --checkpoint-every 2 --no-replan "
         "--straggler 0:100:1- "
         "--steps " +
         std::to_string(steps) + " --train-data '" + (dir / "data" / "train_*.bin").string() +
         "' --out " + (dir / run).string();
}

// `malleus launch` on `ranks` ranks (0: the hostfile's slots, given in `launch_flags`).
std::string launch_command(int ranks, const std::string& launch_flags, const std::string& train) {
  return kMpiEnvironment + "timeout " + std::to_string(kTimeoutS) + " " + MALLEUS_BINARY +
         " launch" + (ranks > 0 ? " --np " + std::to_string(ranks) : "") + " --mpirun " +
         MALLEUS_MPIRUN + " --mpirun-args=--oversubscribe " + launch_flags + " -- train " + train;
}

// The last loss logged for every step (a restarted job logs the steps after its checkpoint again)
// and the restart records of a run's metrics.
struct Metrics {
  std::map<int64_t, double> losses;
  std::vector<metrics::RestartRecord> restarts;
};
Metrics read_metrics(const fs::path& run) {
  Metrics m;
  std::ifstream in(run / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto record = metrics::parse_record(parse_json(line, "metrics"), "metrics");
    if (!record) continue;
    if (const auto* s = std::get_if<metrics::StepRecord>(&*record)) m.losses[s->step] = s->loss;
    if (const auto* r = std::get_if<metrics::RestartRecord>(&*record)) m.restarts.push_back(*r);
  }
  return m;
}

// The pid of `rank` from the run's ranks.json, once the job has written it.
pid_t rank_pid(const fs::path& run, int rank) {
  const Json ranks = read_json_file((run / "ranks.json").string());
  return ranks["ranks"][static_cast<size_t>(rank)]["pid"].get<pid_t>();
}

// Waits until the run's metrics reach `step`; false if the job ended or time ran out first.
bool wait_for_step(BackgroundCommand& job, int step) {
  const std::string text = "step " + std::string(step < 10 ? "    " : "   ") + std::to_string(step);
  return job.wait_for_output(text + "/", kTimeoutS);
}

// Losses of the same run never interrupted, on 4 ranks.
std::map<int64_t, double> uninterrupted(const ScratchDir& dir, int steps) {
  const auto r = run_command(kMpiEnvironment + "timeout " + std::to_string(kTimeoutS) + " " +
                             MALLEUS_MPIRUN + " --oversubscribe -np 4 " + MALLEUS_BINARY +
                             " train " + tiny_flags(dir, "straight", steps));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return read_metrics(dir / "straight").losses;
}

void expect_same_losses(const std::map<int64_t, double>& run,
                        const std::map<int64_t, double>& reference, int steps) {
  ASSERT_EQ(run.size(), static_cast<size_t>(steps));
  for (const auto& [step, loss] : reference) {
    ASSERT_TRUE(run.count(step)) << "step " << step;
    EXPECT_NEAR(run.at(step), loss, 2e-4) << "step " << step;
  }
}

// Every test: a scratch directory holding the synthetic corpus, and the tiny run in dir/run
// started under `malleus launch` in the background (launch()), its output in dir/job.out.
class RecoverySlow : public ::testing::Test {
 protected:
  static constexpr int kSteps = 40;

  RecoverySlow() { malleus::testing::write_synthetic_corpus(dir / "data"); }

  // The job: `malleus launch` on `ranks` ranks with `launch_flags` (launch_command), training the
  // tiny run for `steps` steps with `extra_train_flags`.
  BackgroundCommand& launch(int ranks, const std::string& launch_flags, int steps = kSteps,
                            const std::string& extra_train_flags = "") {
    job_.emplace(
        launch_command(ranks, launch_flags, tiny_flags(dir, "run", steps) + extra_train_flags),
        dir / "job.out");
    return *job_;
  }

  ScratchDir dir;
  const fs::path run = dir / "run";

 private:
  std::optional<BackgroundCommand> job_;  // stopped before the scratch directory goes
};

}  // namespace

TEST_F(RecoverySlow, KilledRankIsLeftOutAndTheRunFinishesOnThreeRanks) {
  BackgroundCommand& job = launch(4, "");
  ASSERT_TRUE(wait_for_step(job, 5)) << job.output();
  const pid_t victim = rank_pid(run, 3);
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  ASSERT_EQ(job.wait(kTimeoutS), 0) << job.output();
  const std::string out = job.output();

  const Metrics m = read_metrics(run);
  ASSERT_EQ(m.restarts.size(), 1u) << out;
  const metrics::RestartRecord& r = m.restarts.front();
  EXPECT_EQ(r.reason, "killed");
  EXPECT_EQ(r.lost_ranks, std::vector<int64_t>{3});
  EXPECT_EQ(r.ranks_before, 4);
  EXPECT_EQ(r.ranks_after, 3);
  EXPECT_EQ(r.step % 2, 0);  // a checkpoint's step
  EXPECT_EQ(r.steps_lost, r.failed_at_step - r.step);
  EXPECT_NE(out.find("restart 1 at step"), std::string::npos) << out;
  EXPECT_NE(out.find("plan on 3 ranks"), std::string::npos) << out;
  EXPECT_NE(out.find("| restarts 1"), std::string::npos) << out;
  EXPECT_NE(out.find("launch: the run finished after 1 restart"), std::string::npos) << out;
  expect_same_losses(m.losses, uninterrupted(dir, kSteps), kSteps);
}

TEST_F(RecoverySlow, HostfileSlotsAreLeftOutAndComeBackWhenListedAgain) {
  const fs::path hosts = dir / "hosts";
  write_file_atomic(hosts, "localhost slots=4\n");
  BackgroundCommand& job = launch(0, "--hostfile " + hosts.string());
  ASSERT_TRUE(wait_for_step(job, 5)) << job.output();
  ASSERT_EQ(::kill(rank_pid(run, 3), SIGKILL), 0);
  // The job restarted on the 3 slots left; then the operator lists the host's 4 slots again.
  ASSERT_TRUE(job.wait_for_output("plan on 3 ranks", kTimeoutS)) << job.output();
  ASSERT_TRUE(job.wait_for_output("| restarts 1", kTimeoutS)) << job.output();
  write_file_atomic(hosts, "localhost slots=4  # repaired\n");
  const auto first = read_metrics(run).restarts;
  ASSERT_EQ(first.size(), 1u);
  // Killed again once the restarted job is past the step the first one failed at, and has
  // checkpointed past the first restart's checkpoint (else the failure would count as repeating).
  ASSERT_TRUE(wait_for_step(job, static_cast<int>(first.front().failed_at_step) + 4))
      << job.output();
  ASSERT_EQ(::kill(rank_pid(run, 1), SIGKILL), 0);
  ASSERT_EQ(job.wait(kTimeoutS), 0) << job.output();
  const std::string out = job.output();
  const Metrics m = read_metrics(run);
  ASSERT_EQ(m.restarts.size(), 2u) << out;
  EXPECT_EQ(m.restarts[0].ranks_after, 3);
  // 4 slots listed, 1 just lost: 3, where keeping the first exclusion would have left 2.
  EXPECT_EQ(m.restarts[1].ranks_before, 3);
  EXPECT_EQ(m.restarts[1].ranks_after, 3) << out;
  EXPECT_NE(out.find("changed: every host it lists is used again"), std::string::npos) << out;
  EXPECT_NE(out.find("| restarts 2"), std::string::npos) << out;
  expect_same_losses(m.losses, uninterrupted(dir, kSteps), kSteps);
}

TEST_F(RecoverySlow, StoppedRankIsNamedByTheWatchdogAndLeftOut) {
  BackgroundCommand& job = launch(4, "", kSteps, " --watchdog-floor 5");
  ASSERT_TRUE(wait_for_step(job, 5)) << job.output();
  const pid_t victim = rank_pid(run, 2);
  ASSERT_EQ(::kill(victim, SIGSTOP), 0);
  const int status = job.wait(kTimeoutS);
  ::kill(victim, SIGKILL);  // if anything left it stopped
  ASSERT_EQ(status, 0) << job.output();
  const std::string out = job.output();

  const Metrics m = read_metrics(run);
  ASSERT_EQ(m.restarts.size(), 1u) << out;
  const metrics::RestartRecord& r = m.restarts.front();
  EXPECT_EQ(r.reason, "hung");
  EXPECT_EQ(r.lost_ranks, std::vector<int64_t>{2}) << r.detail;
  EXPECT_EQ(r.ranks_after, 3);
  EXPECT_NE(r.detail.find("rank 2: no heartbeat"), std::string::npos) << r.detail;
  // The watchdog's report, kept by the supervisor: rank 2 was named once the step had waited its
  // limit (5 s here: tiny steps take far less than a tenth of that), give or take a beat.
  const Json report = read_json_file((run / "hang-1.json").string());
  EXPECT_EQ(report["lost_ranks"], Json::array({2}));
  EXPECT_GE(report["waited_s"].get<double>(), report["limit_s"].get<double>());
  EXPECT_LT(report["waited_s"].get<double>(), report["limit_s"].get<double>() + 5);
  expect_same_losses(m.losses, uninterrupted(dir, kSteps), kSteps);
}

TEST_F(RecoverySlow, TooFewDevicesLeftStopsWithoutRestarting) {
  BackgroundCommand& job = launch(2, "--min-ranks 2", 100000);
  ASSERT_TRUE(wait_for_step(job, 3)) << job.output();
  ASSERT_EQ(::kill(rank_pid(run, 1), SIGKILL), 0);
  const int status = job.wait(kTimeoutS);
  const std::string out = job.output();
  EXPECT_NE(status, 0) << out;
  EXPECT_NE(status, 124) << "timed out\n" << out;
  EXPECT_NE(out.find("error: launch: rank 1 killed; 1 device left, fewer than --min-ranks 2: "
                     "not restarting"),
            std::string::npos)
      << out;
  // One job was started, none after it.
  size_t jobs = 0;
  for (size_t at = out.find("launch: "); at != std::string::npos; at = out.find("launch: ", at + 1))
    jobs += out.compare(at, 8 + std::strlen(MALLEUS_MPIRUN),
                        "launch: " + std::string(MALLEUS_MPIRUN)) == 0;
  EXPECT_EQ(jobs, 1u) << out;
  EXPECT_TRUE(read_metrics(run).restarts.empty());
}
