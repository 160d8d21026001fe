// `malleus launch` end to end: a 4-rank job loses a rank — killed with SIGKILL, or stopped with
// SIGSTOP so that it hangs the others — and the supervisor finishes the run on the 3 ranks left,
// with the losses of a run that lost nothing; too few devices left stops it with an error and no
// restart. With memory checkpoints (checkpoint/memory_checkpoint.h) the restart reads the copies
// the ranks keep in each other's memory, and the disk where a copy is gone, stale or damaged.
// Every command runs under `timeout`, so a hang fails the test instead of blocking it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "checkpoint/memory_checkpoint.h"
#include "checkpoint/memory_folder.h"
#include "checkpoint/memory_gather.h"
#include "common/files.h"
#include "common/format.h"
#include "common/json.h"
#include "metrics/metrics.h"
#include "test_util.h"
#include "train/resume.h"
#include "train/stop_signal.h"
#include "watchdog/watchdog.h"

using namespace malleus;
using malleus::testing::BackgroundCommand;
using malleus::testing::kMpiEnvironment;
using malleus::testing::run_command;
using malleus::testing::ScratchDir;

namespace {

constexpr int kTimeoutS = 240;
// Steps of the tiny run the kill and stop tests train: they act at step 5 or so (twice, by step
// 10 or so, in the hostfile test), and what follows the restart only has to reach the end.
constexpr int kSteps = 20;

// How fast the tiny run steps: slowed, so that a test can act in mid-run, or at full speed.
enum class Pace { kSlowed, kFull };

// The tiny model on the synthetic corpus, a checkpoint every 2 steps and a constant learning
// rate. --no-replan: the plan must be the one the job starts with, whatever the timings. Slowed,
// rank 0 computes 100 times longer than it would (an injected straggler: timing only, the numerics
// are untouched), so that a step takes a good part of a second and the test acts in mid-run.
std::string tiny_flags(const ScratchDir& dir, const std::string& run, int steps,
                       Pace pace = Pace::kSlowed) {
  return "--model tiny --seq-len 16 --micro-batch 1 --global-batch 12 --threads 1 "
         "--warmup-steps 1 --min-lr-ratio 1 --val-data '' --checkpoint-every 2 --no-replan " +
         std::string(pace == Pace::kSlowed ? "--straggler 0:100:1- " : "") + "--steps " +
         std::to_string(steps) + " --train-data '" + (dir / "data" / "train_*.bin").string() +
         "' --out " + (dir / run).string();
}

// `malleus launch` on `ranks` ranks (0: the hostfile's slots, given in `launch_flags`), in a
// session of its own (tests/own_session.sh): the watchdog judges elapsed time, and other sessions'
// load must not make a step outlast its limit. The command keeps its pid.
std::string launch_command(int ranks, const std::string& launch_flags, const std::string& train) {
  return MALLEUS_SOURCE_DIR "/tests/own_session.sh " + kMpiEnvironment + "timeout " +
         std::to_string(kTimeoutS) + " " + MALLEUS_BINARY + " launch" +
         (ranks > 0 ? " --np " + std::to_string(ranks) : "") + " --mpirun " + MALLEUS_MPIRUN +
         " --mpirun-args=--oversubscribe " + launch_flags + " -- train " + train;
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

std::map<int64_t, double> uninterrupted_with(const ScratchDir& dir, const std::string& train);

// Losses of the same run never interrupted, on 4 ranks (at full speed: the injected straggler
// changes timings only), in a session of its own like the job (tests/own_session.sh).
std::map<int64_t, double> uninterrupted(const ScratchDir& dir, int steps) {
  return uninterrupted_with(dir, tiny_flags(dir, "run", steps, Pace::kFull));
}

// ... of the run `train` gives (its --out replaced).
std::map<int64_t, double> uninterrupted_with(const ScratchDir& dir, const std::string& train) {
  const std::string run = "--out " + (dir / "run").string();
  std::string flags = train;
  const size_t at = flags.find(run);
  EXPECT_NE(at, std::string::npos) << flags;
  if (at != std::string::npos)
    flags.replace(at, run.size(), "--out " + (dir / "straight").string());
  const auto r = run_command(MALLEUS_SOURCE_DIR "/tests/own_session.sh " + kMpiEnvironment +
                             "timeout " + std::to_string(kTimeoutS) + " " + MALLEUS_MPIRUN +
                             " --oversubscribe -np 4 " + MALLEUS_BINARY + " train " + flags);
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
  RecoverySlow() { malleus::testing::write_synthetic_corpus(dir / "data"); }
  // The job stopped first, then whatever memory copies it left (a run that lost a rank and was
  // not restarted leaves them) removed.
  ~RecoverySlow() override {
    job_.reset();
    checkpoint::remove_memory_checkpoints(run);
  }

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
  // From the disk checkpoint (memory checkpoints: KilledRankIsRestoredFromItsPeersMemoryCopy).
  BackgroundCommand& job = launch(4, "", kSteps, " --no-memory-checkpoints");
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
  // The memory copies the job left (every step for its first three saves) stay: the supervisor
  // says where, how much memory they hold, and the command that removes them.
  const auto held = checkpoint::memory_copies_held(run);
  ASSERT_TRUE(held.has_value()) << out;
  EXPECT_NE(
      out.find("launch: the run's memory copies stay in " + held->root.string() + " on " +
               checkpoint::host_name() + " (" + format_bytes(static_cast<double>(held->bytes)) +
               " of memory); malleus "
               "clean-memory " +
               run.string() + " removes them"),
      std::string::npos)
      << out;
  const auto cleaned = run_command(std::string(MALLEUS_BINARY) + " clean-memory " + run.string());
  EXPECT_EQ(cleaned.exit_code, 0) << cleaned.output;
  EXPECT_NE(cleaned.output.find("removed " + held->root.string()), std::string::npos)
      << cleaned.output;
  EXPECT_FALSE(fs::exists(held->root));
}

// ---- A job mpirun cannot end (launch/job_end.h) ----
//
// A stand-in for mpirun that behaves as mpirun does when a link went down: the job failed (its
// watchdog wrote hang.json naming rank 1 cut off) and mpirun never returns, waiting for the
// daemon of a host it cannot reach; that host's rank still beats (a process outside the stand-in's
// tree, as a rank on another machine is). A second job (-np 1) finishes at once.

namespace {

void write_stand_in(const fs::path& path, const fs::path& run, const std::string& second_job) {
  const std::string heartbeat = (run / "heartbeats" / "rank_00001.json").string();
  write_file_atomic(path,
                    "#!/bin/bash\n"
                    "for a in \"$@\"; do [[ $a == 1 && $np == 1 ]] && { " +
                        second_job +
                        "; }; "
                        "[[ $a == -np ]] && np=1 || np=; done\n"
                        "mkdir -p " +
                        (run / "heartbeats").string() +
                        "\n"
                        "(setsid bash -c 'while :; do echo "
                        "\"{\\\"rank\\\":1,\\\"pid\\\":$$,\\\"host\\\":\\\"far\\\","
                        "\\\"step\\\":3,\\\"phase\\\":\\\"step\\\",\\\"phase_since\\\":0,"
                        "\\\"beat\\\":$EPOCHREALTIME}\" "
                        "> " +
                        heartbeat + ".tmp && mv " + heartbeat + ".tmp " + heartbeat +
                        "; sleep 0.2; done' "
                        "< /dev/null > /dev/null 2>&1 &)\n"
                        "echo \"step     3/20 | loss 5.0\"\n"
                        "sleep 0.5\n"
                        "echo '{\"lost_ranks\": [1], \"cut_off_hosts\": [\"far\"], \"message\": "
                        "\"watchdog: host far "
                        "is cut off\"}' > " +
                        (run / "hang.json").string() +
                        "\n"
                        "exec sleep 600\n");
  fs::permissions(path, fs::perms::owner_all);
}

}  // namespace

TEST_F(RecoverySlow, AJobMpirunCannotEndIsEndedAfterTheGraceAndWhatBeatsOnIsNamed) {
  // The run needs a checkpoint to restart from: two steps of the real job first.
  ASSERT_EQ(run_command(kMpiEnvironment + "timeout 120 " MALLEUS_MPIRUN " --oversubscribe -np 2 " +
                        MALLEUS_BINARY + " train " + tiny_flags(dir, "run", 2, Pace::kFull))
                .exit_code,
            0);
  const fs::path stand_in = dir / "mpirun";
  write_stand_in(stand_in, run, "echo 'step     4/20'; exit 0");
  const auto r = run_command("timeout 120 " MALLEUS_BINARY
                             " launch --np 2 --exit-grace 2 "
                             "--mpirun " +
                             stand_in.string() + " -- train " +
                             tiny_flags(dir, "run", 20, Pace::kFull) + " --resume " + run.string());
  // From the job's failure (the report's time of writing; kept as hang-1.json) to the end of the
  // supervisor, the restart's stand-in job included (under load, the start may take longer).
  struct stat report {};
  ASSERT_EQ(::stat((run / "hang-1.json").c_str(), &report), 0) << r.output;
  const double took =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count() -
      (static_cast<double>(report.st_mtim.tv_sec) +
       1e-9 * static_cast<double>(report.st_mtim.tv_nsec));
  // The rank that beat on, named by the pid in its heartbeat: ended here, after the test.
  const Json last = read_json_file((run / "heartbeats" / "rank_00001.json").string());
  ::kill(static_cast<pid_t>(last["pid"].get<int64_t>()), SIGKILL);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_LT(took, 15) << r.output;  // 2 s of grace, 1.5 s to see who beats on, the restart
  EXPECT_NE(r.output.find("launch: the job failed (the watchdog's " + (run / "hang.json").string() +
                          ") and mpirun had not ended it 2."),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("could not end rank 1 (pid " +
                          std::to_string(last["pid"].get<int64_t>()) + " on far): still running"),
            std::string::npos)
      << r.output;
  const Metrics m = read_metrics(run);
  ASSERT_EQ(m.restarts.size(), 1u) << r.output;
  EXPECT_EQ(m.restarts[0].reason, "cut off");
  EXPECT_EQ(m.restarts[0].cut_off_hosts, std::vector<std::string>{"far"});
  EXPECT_EQ(m.restarts[0].ended_by, "launch");
  EXPECT_EQ(m.restarts[0].unended_ranks, std::vector<int64_t>{1});
  EXPECT_EQ(m.restarts[0].ranks_after, 1);
}

TEST_F(RecoverySlow, AJobThatPrintsNothingIsEndedAfterTheStartTimeout) {
  const fs::path stand_in = dir / "mpirun";
  write_file_atomic(stand_in, "#!/bin/bash\nexec sleep 600\n");
  fs::permissions(stand_in, fs::perms::owner_all);
  const auto r =
      run_command("timeout 120 " MALLEUS_BINARY
                  " launch --np 2 --start-timeout 2 "
                  "--mpirun " +
                  stand_in.string() + " -- train " + tiny_flags(dir, "run", 20, Pace::kFull));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("error: launch: the job printed nothing within 2.0 s of its start "
                          "(--start-timeout): mpirun may be waiting for a host it cannot reach; "
                          "ended it, not restarting"),
            std::string::npos)
      << r.output;
}

TEST_F(RecoverySlow, ASavedStopEndsWithItsSignalsStatusThoughSrunEndedTheLastRank) {
  // Slurm's SIGUSR1 ahead of a time limit: every rank saves and exits 138, and the batch script
  // requeues on 138. srun ends the ranks still exiting once the first has (seen in the Slurm
  // test: one rank's 138, then "srun: ... Terminating StepId", then 143 for the job). The stand-in
  // launcher is that job: the stop recorded (train::write_stop_record), status 143.
  for (const bool saved : {true, false}) {
    fs::create_directories(run);
    train::write_stop_record(run, {.signal = "SIGUSR1",
                                   .step = 3,
                                   .checkpoint = (run / "checkpoints" / "step_00000003").string(),
                                   .saved = saved,
                                   .previous = ""});
    const fs::path stand_in = dir / "srun";
    write_file_atomic(stand_in, "#!/bin/bash\necho 'step     3/20 | loss 5.0'\nexit 143\n");
    fs::permissions(stand_in, fs::perms::owner_all);
    const auto r =
        run_command("timeout 120 " MALLEUS_BINARY " launch --np 2 --mpirun " + stand_in.string() +
                    " -- train " + tiny_flags(dir, "run", 20, Pace::kFull));
    EXPECT_EQ(r.exit_code, saved ? 128 + SIGUSR1 : 143) << r.output;
    EXPECT_NE(r.output.find(saved ? "launch: the job was stopped (exit status 138; its launcher "
                                    "reported 143, ending ranks that were exiting)"
                                  : "launch: the job was stopped (exit status 143)"),
              std::string::npos)
        << r.output;
  }
}

TEST_F(RecoverySlow, AJobThatFailsAfterTheRunsLastStepWasSavedEndsAsFinished) {
  // A rank that crashes in MPI_Finalize once the run's last checkpoint is on disk (Open MPI 4's
  // TCP transport, now and then; a SEGV, which the sanitizer turns into exit status 1): the
  // stand-in launcher runs the job under mpirun, then fails so. The run is complete, and launch
  // ends as for a finished run, saying what it saw. A job that fails before the run is complete
  // is a failure; so is one that fails beside a run finished before this supervision began.
  const auto stand_in = [&](const std::string& name, const std::string& body) {
    const fs::path path = dir / name / "mpirun";
    fs::create_directories(path.parent_path());
    write_file_atomic(path, "#!/bin/bash\n" + body + "echo 'error: stand-in crash' >&2\nexit 1\n");
    fs::permissions(path, fs::perms::owner_all);
    return kMpiEnvironment + "timeout 120 " MALLEUS_BINARY " launch --np 2 --mpirun " +
           path.string() + " --mpirun-args=--oversubscribe -- train " +
           tiny_flags(dir, "run", 4, Pace::kFull);
  };
  const std::string after_the_run = stand_in("after", MALLEUS_MPIRUN " \"$@\" || exit\n");
  auto r = run_command(after_the_run);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("launch: warning: the job failed (exit status 1) after the run's last "
                          "step (4) was saved"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("launch: the run finished\n"), std::string::npos) << r.output;
  // The same run directory, its last step saved before this supervision: the job's failure (the
  // train command's own, or the stand-in's) is the job's.
  r = run_command(after_the_run);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("without losing a rank: not restarting it"), std::string::npos)
      << r.output;
  fs::remove_all(run);
  r = run_command(stand_in("before", ""));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("launch: the job failed (exit status 1) without losing a rank: not "
                          "restarting it"),
            std::string::npos)
      << r.output;
}

namespace {

// A 4-rank job under plain mpirun (no supervisor), memory checkpoints every step and disk ones
// every 2, that loses rank 3 to SIGKILL after step 5: mpirun ends it, leaving the memory copies.
// Returns the newest complete memory checkpoint it left.
fs::path killed_with_memory_copies(const ScratchDir& dir, const fs::path& run) {
  BackgroundCommand job(kMpiEnvironment + "timeout " + std::to_string(kTimeoutS) + " " +
                            MALLEUS_MPIRUN + " --oversubscribe -np 4 " + MALLEUS_BINARY +
                            " train " + tiny_flags(dir, "run", kSteps) +
                            " --memory-checkpoint-every 1",
                        dir / "killed.out");
  EXPECT_TRUE(wait_for_step(job, 5)) << job.output();
  // Killed once the memory checkpoint of step 5 is complete: newer than the disk's of step 4.
  for (int i = 0; i < 20 * kTimeoutS; ++i) {
    const auto memory = checkpoint::latest_memory_checkpoint(run);
    if (memory && checkpoint::checkpoint_dir_step(*memory).value_or(0) >= 5) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(::kill(rank_pid(run, 3), SIGKILL), 0);
  EXPECT_NE(job.wait(kTimeoutS), 0) << job.output();
  const auto memory = checkpoint::latest_memory_checkpoint(run);
  EXPECT_TRUE(memory.has_value()) << job.output();
  return memory.value_or(fs::path());
}

// A restart's output says why it did not take the memory copy `copy` (`why`, e.g.
// "rank_00003.bin is missing") and that it resumed from the disk checkpoint `disk` instead.
void expect_resumed_from_disk(const std::string& output, const fs::path& copy,
                              const std::string& why, const fs::path& disk) {
  EXPECT_NE(output.find("not resuming from memory: checkpoint " + copy.string() + ": " + why),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("resuming from " + disk.string() + " at step " +
                        std::to_string(checkpoint::checkpoint_dir_step(disk).value_or(0))),
            std::string::npos)
      << output;
}

// `malleus train --resume run` on 3 ranks, to the end of the run.
malleus::testing::CommandResult resume_on_three(const fs::path& run) {
  return run_command(kMpiEnvironment + "timeout " + std::to_string(kTimeoutS) + " " +
                     MALLEUS_MPIRUN + " --oversubscribe -np 3 " + MALLEUS_BINARY +
                     " train --resume " + run.string() + " --plan auto");
}

}  // namespace

TEST_F(RecoverySlow, KilledRankIsRestoredFromItsPeersMemoryCopy) {
  // Disk checkpoints only every 100 steps: the restart can only come from memory.
  BackgroundCommand& job =
      launch(4, "", kSteps, " --checkpoint-every 100 --memory-checkpoint-every 1");
  ASSERT_TRUE(wait_for_step(job, 5)) << job.output();
  ASSERT_EQ(::kill(rank_pid(run, 3), SIGKILL), 0);
  ASSERT_EQ(job.wait(kTimeoutS), 0) << job.output();
  const std::string out = job.output();
  const Metrics m = read_metrics(run);
  ASSERT_EQ(m.restarts.size(), 1u) << out;
  const metrics::RestartRecord& r = m.restarts.front();
  EXPECT_EQ(r.lost_ranks, std::vector<int64_t>{3});
  EXPECT_GE(r.step, 4) << out;
  EXPECT_LE(r.steps_lost, 1) << out;  // a memory checkpoint every step
  EXPECT_NE(out.find("(a memory checkpoint) at step " + std::to_string(r.step)), std::string::npos)
      << out;
  EXPECT_NE(out.find("launch: the run finished after 1 restart"), std::string::npos) << out;
  // The finished run removed its copies.
  EXPECT_FALSE(fs::exists(checkpoint::memory_checkpoint_root(run)));
  expect_same_losses(m.losses, uninterrupted(dir, kSteps), kSteps);
}

TEST_F(RecoverySlow, MemoryCopyWhoseHolderIsGoneFallsBackToDisk) {
  const fs::path memory = killed_with_memory_copies(dir, run);
  ASSERT_FALSE(memory.empty());
  // Rank 3's shard was held by its peer, rank 0 (one host: the next rank). That host's memory
  // gone: the copy is incomplete.
  EXPECT_EQ(checkpoint::memory_holders({0, 0, 0, 0}, 3).peer, 0);
  fs::remove(memory / "rank_00003.bin");
  // The disk checkpoint: of step 4, or of step 2 if step 4's was not committed yet at the kill.
  const fs::path disk = *checkpoint::latest_checkpoint(run / "checkpoints");
  const auto r = resume_on_three(run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_resumed_from_disk(r.output, memory, "rank_00003.bin is missing", disk);
  expect_same_losses(read_metrics(run).losses, uninterrupted(dir, kSteps), kSteps);
}

TEST_F(RecoverySlow, DamagedMemoryCopyIsRefusedAndTheDiskRead) {
  const fs::path memory = killed_with_memory_copies(dir, run);
  ASSERT_FALSE(memory.empty());
  // One byte flipped in the middle of a shard: its size is right, its checksum is not.
  const fs::path victim = memory / "rank_00001.bin";
  std::string bytes = read_file(victim);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x40);
  {
    std::ofstream out(victim, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  const fs::path disk = *checkpoint::latest_checkpoint(run / "checkpoints");
  const auto r = resume_on_three(run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("(a memory checkpoint)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("memory checkpoint refused: checkpoint " + memory.string() +
                          ": rank_00001.bin is corrupt"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("resuming from " + disk.string() + " instead"), std::string::npos)
      << r.output;
  expect_same_losses(read_metrics(run).losses, uninterrupted(dir, kSteps), kSteps);
}

TEST_F(RecoverySlow, StaleOrUnfinishedMemoryCopiesAreNotTaken) {
  const fs::path memory = killed_with_memory_copies(dir, run);
  ASSERT_FALSE(memory.empty());
  const int64_t step = checkpoint::checkpoint_dir_step(memory).value_or(0);
  const int64_t disk =
      checkpoint::checkpoint_dir_step(*checkpoint::latest_checkpoint(run / "checkpoints"))
          .value_or(0);
  ASSERT_GT(step, disk);
  std::string refused;
  EXPECT_EQ(train::usable_memory_checkpoint(run, disk, &refused), memory) << refused;
  // Stale: not later than the disk checkpoint.
  EXPECT_FALSE(train::usable_memory_checkpoint(run, step, &refused));
  EXPECT_NE(refused.find("is of step " + std::to_string(step) + ", not later than the disk's"),
            std::string::npos)
      << refused;
  // Truncated: a file shorter than its manifest says.
  const fs::path shard = memory / "rank_00002.bin";
  const auto size = fs::file_size(shard);
  fs::resize_file(shard, size - 4);
  EXPECT_FALSE(train::usable_memory_checkpoint(run, disk, &refused));
  EXPECT_NE(refused.find("rank_00002.bin has " + std::to_string(size - 4) +
                         " bytes, manifest says " + std::to_string(size)),
            std::string::npos)
      << refused;
  // What malleus launch restarts from: on one host the unusable copy does not count; on several,
  // a copy with its manifest does though files are short or missing here (the others hold them,
  // and the restart gathers them).
  EXPECT_EQ(train::restart_step(run), disk);
  EXPECT_EQ(train::restart_step(run, train::MemoryHosts::kSeveral), step);
  fs::remove(shard);
  EXPECT_EQ(train::restart_step(run, train::MemoryHosts::kSeveral), step);
  // Unfinished: a step directory without its manifest (a save a rank died in) is not a
  // checkpoint at all; the restart step is then the disk's.
  fs::remove(memory / "manifest.json");
  EXPECT_FALSE(checkpoint::latest_memory_checkpoint(run).has_value());
  EXPECT_EQ(train::restart_step(run), disk);
  EXPECT_EQ(train::restart_step(run, train::MemoryHosts::kSeveral), disk);
  checkpoint::remove_memory_checkpoints(run);
}

// ---- Two hosts (scripts/hosts.sh): a host whose memory is lost ----
//
// A 2-host job of 2 ranks each on the emulated test bed, where each host keeps its memory
// checkpoints in a folder of its own (<base>/mr-hI: hosts.sh gives each host's ranks its own
// MALLEUS_MEMORY_CHECKPOINT_DIR, as each machine has its own /dev/shm). Every shard is on both
// hosts (its rank's and its peer's); host 0's memory is lost, so the restart — rank 0's host empty
// — completes host 0's copy from host 1's over MPI before it reads it.

namespace {

// The bed's namespaces and addresses, apart from the other tests' (tests/CMakeLists.txt).
const std::string kBedEnvironment =
    kMpiEnvironment +
    "MALLEUS_HOSTS_PREFIX=mr MALLEUS_HOSTS_SUBNET=198.18.15 MALLEUS_HOSTS_SLOTS=2 ";
const std::string kBed = kBedEnvironment + MALLEUS_SOURCE_DIR "/scripts/hosts.sh ";

// Brings the bed of 2 hosts up (skipped() where namespaces cannot be made) and always down again.
class TwoHosts {
 public:
  TwoHosts() {
    const auto r = run_command("timeout 60 " + kBed + "up 2");
    skipped_ = r.exit_code == 77;
    EXPECT_TRUE(skipped_ || r.exit_code == 0) << r.output;
  }
  ~TwoHosts() { run_command("timeout 60 " + kBed + "down"); }
  TwoHosts(const TwoHosts&) = delete;
  TwoHosts& operator=(const TwoHosts&) = delete;
  bool skipped() const { return skipped_; }

  // Host `h`'s memory copies of `run` (checkpoint::memory_checkpoint_root on that host).
  static fs::path memory_root(int h, const fs::path& run) {
    return checkpoint::memory_checkpoint_base() / ("mr-h" + std::to_string(h)) /
           checkpoint::memory_checkpoint_root(run).filename();
  }
  // The newest step host `h` holds complete (with a manifest), or -1.
  static int64_t newest_step(int h, const fs::path& run) {
    int64_t newest = -1;
    for (const auto& s : checkpoint::host_memory_copies(memory_root(h, run)).steps) {
      if (!s.listed.empty()) newest = std::max(newest, s.step);
    }
    return newest;
  }

 private:
  bool skipped_ = false;
};

constexpr int kHostSteps = 16;

// `malleus train` across the bed's 4 ranks, `train` its arguments.
std::string on_bed(const std::string& train) {
  return "timeout " + std::to_string(kTimeoutS) + " " + kBed + "mpirun -np 4 " + MALLEUS_BINARY +
         " train " + train;
}

// The tiny run across both hosts with a memory checkpoint every step and a disk one every
// `disk_every`, killed (rank 1, on host 0) once both hosts hold a memory checkpoint of step 5 or
// later; then host 0's memory is lost. Returns the step host 1 holds.
int64_t lose_host_zero(const ScratchDir& dir, const fs::path& run, int disk_every) {
  BackgroundCommand job(on_bed(tiny_flags(dir, "run", kHostSteps) + " --memory-checkpoint-every 1" +
                               " --checkpoint-every " + std::to_string(disk_every)),
                        dir / "killed.out");
  EXPECT_TRUE(wait_for_step(job, 5)) << job.output();
  for (int i = 0; i < 20 * kTimeoutS; ++i) {
    if (std::min(TwoHosts::newest_step(0, run), TwoHosts::newest_step(1, run)) >= 5) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(::kill(rank_pid(run, 1), SIGKILL), 0);
  EXPECT_NE(job.wait(kTimeoutS), 0) << job.output();
  const int64_t step = TwoHosts::newest_step(1, run);
  // Each host held every shard of it: its ranks' own and their peers' (on the other host).
  const fs::path held = checkpoint::checkpoint_dir(TwoHosts::memory_root(1, run), step);
  for (int r = 0; r < 4; ++r) {
    EXPECT_TRUE(fs::exists(held / ("rank_0000" + std::to_string(r) + ".bin"))) << r;
  }
  fs::remove_all(checkpoint::memory_checkpoint_base() / "mr-h0");
  return step;
}

}  // namespace

TEST_F(RecoverySlow, LostHostIsSentTheOtherHostsMemoryCopyAndTheRunResumesFromIt) {
  TwoHosts bed;
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  // No disk checkpoint before the loss: the restart can only come from memory.
  const int64_t step = lose_host_zero(dir, run, 100);
  ASSERT_GE(step, 5);
  const auto r = run_command(on_bed("--resume " + run.string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Host 0 (rank 0's) was sent all six files: 4 shards, the tokenizer, the manifest.
  EXPECT_NE(r.output.find("memory checkpoint of step " + std::to_string(step) +
                          " completed on every host: 6 files"),
            std::string::npos)
      << r.output;
  const fs::path copy = checkpoint::checkpoint_dir(TwoHosts::memory_root(0, run), step);
  EXPECT_NE(r.output.find("resuming from " + copy.string() + " (a memory checkpoint) at step " +
                          std::to_string(step)),
            std::string::npos)
      << r.output;
  // The finished run removed its copies on both hosts.
  EXPECT_FALSE(fs::exists(TwoHosts::memory_root(0, run)));
  EXPECT_FALSE(fs::exists(TwoHosts::memory_root(1, run)));
  expect_same_losses(read_metrics(run).losses, uninterrupted(dir, kHostSteps), kHostSteps);
}

TEST_F(RecoverySlow, ShardWhoseHoldersAreBothGoneFallsBackToDiskNamingIt) {
  TwoHosts bed;
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  const int64_t step = lose_host_zero(dir, run, 4);
  ASSERT_GE(step, 5);
  // Rank 1's shard was on host 0 (its own copy) and host 1 (its peer's, rank 3): both gone.
  EXPECT_EQ(checkpoint::memory_holders({0, 0, 1, 1}, 1).peer, 3);
  for (const auto& s : fs::directory_iterator(TwoHosts::memory_root(1, run))) {
    if (checkpoint::checkpoint_dir_step(s.path())) fs::remove(s.path() / "rank_00001.bin");
  }
  const fs::path disk = *checkpoint::latest_checkpoint(run / "checkpoints");
  ASSERT_LT(checkpoint::checkpoint_dir_step(disk).value_or(0), step);
  const auto r = run_command(on_bed("--resume " + run.string()));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const fs::path copy = checkpoint::checkpoint_dir(TwoHosts::memory_root(0, run), step);
  expect_resumed_from_disk(r.output, copy, "rank_00001.bin is missing on every host", disk);
  expect_same_losses(read_metrics(run).losses, uninterrupted(dir, kHostSteps), kHostSteps);
}

// ---- A host cut off on the bed (watchdog/partition.h, launch/job_end.h) ----
//
// `malleus launch` across the bed's 2 hosts × 2 ranks (the supervisor on host 0: it sees host 0's
// memory), the tiny run with a memory checkpoint every step and the watchdog's floor at 5 s. Host
// 1's link goes down at a chosen point of a step: the watchdog's probes find host 1 cut off,
// mpirun (which cannot reach host 1's daemon) is ended by the supervisor after its grace, and the
// job restarts on host 0 from host 0's memory (its ranks' own shards and their peers' copies of
// host 1's), with the losses of a run never cut. The time from the cut to the first step of the
// restarted job is printed.

namespace {

constexpr int kCutSteps = 24;
// The demo model's runs across a shaped link are cut by step 3 or so; the rest, on host 0 alone,
// only has to reach the end.
constexpr int kSlowLinkSteps = 12;
// The watchdog's floor: the tiny run's steps and saves take a fraction of a second, so 5 s; the
// demo model's across a shaped link take seconds (3.5 s a step, saves included, at 200 Mbit/s),
// so 10 s.
constexpr double kFloorS = 5;
constexpr double kSlowLinkFloorS = 10;

// `malleus launch` on the bed (the hostfile of its 2 hosts in `hosts`), training `train`. A job
// that prints nothing for 60 s (a restart across a link that still drops most packets) is ended
// with the supervisor's message, well before the test's own limit.
std::string launch_on_bed(const fs::path& hosts, const std::string& train) {
  const std::string base = checkpoint::memory_checkpoint_base().string();
  return MALLEUS_SOURCE_DIR "/tests/own_session.sh " + kBedEnvironment +
         "MALLEUS_HOSTS_SHM=" + base + " MALLEUS_MEMORY_CHECKPOINT_DIR=" + base +
         "/mr-h0 timeout " + std::to_string(kTimeoutS) + " " + MALLEUS_BINARY +
         " launch --hostfile " + hosts.string() +
         " --mpirun " MALLEUS_SOURCE_DIR
         "/scripts/bed_mpirun.sh --exit-grace 2 --start-timeout 60 -- train " +
         train;
}

// The tiny run for the bed: memory checkpoints every step, the watchdog's floor at kFloorS.
std::string bed_flags(const ScratchDir& dir, const std::string& extra = "") {
  return tiny_flags(dir, "run", kCutSteps) + " --memory-checkpoint-every 1 --watchdog-floor " +
         std::to_string(static_cast<int>(kFloorS)) + extra;
}

// Rank `rank`'s heartbeat's phase, or "" while it has none.
std::string phase_of(const fs::path& run, int rank) {
  try {
    return read_json_file(
               (watchdog::heartbeat_dir(run) / ("rank_0000" + std::to_string(rank) + ".json"))
                   .string())["phase"]
        .get<std::string>();
  } catch (const std::exception&) {
    return "";
  }
}

// Polls `ready` every 10 ms for up to the test's time limit.
template <typename Ready>
bool poll_until(Ready&& ready) {
  for (int i = 0; i < 100 * kTimeoutS; ++i) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// The bed up, its hostfile written, a job launched on it; host 1's link cut when asked.
class CutBed {
 public:
  CutBed(const ScratchDir& dir, const fs::path& run) : dir_(dir), run_(run) {}
  bool skipped() const { return bed_.skipped(); }

  BackgroundCommand& launch(const std::string& train) {
    const auto r = run_command("timeout 60 " + kBed + "hostfile");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    write_file_atomic(dir_.path() / "hosts", r.output);
    job_.emplace(launch_on_bed(dir_.path() / "hosts", train), dir_.path() / "job.out");
    return *job_;
  }
  // `hosts.sh COMMAND` (cut 1, heal 1, loss 1 10, shape 1 2mbit...).
  void bed(const std::string& command) {
    const auto r = run_command("timeout 60 " + kBed + command);
    EXPECT_EQ(r.exit_code, 0) << command << ": " << r.output;
  }
  void cut() {
    bed("cut 1");
    cut_at_ = std::chrono::steady_clock::now();
  }
  // The job's output and the watchdog's reports in the run (hang.json, hang-N.json: the partition
  // its probes found), for a failure's message: what tells a link judged wrongly from a hang.
  std::string story() const {
    std::string s = job_ ? job_->output() : "";
    std::error_code ec;
    for (const auto& f : fs::directory_iterator(run_, ec)) {
      const std::string name = f.path().filename().string();
      if (name.rfind("hang", 0) == 0 && f.path().extension() == ".json") {
        s += "\n" + name + ": " + read_file(f.path());
      }
    }
    return s;
  }
  // Seconds from the cut to the first step of the restarted job (which says "| restarts 1"), for
  // a run whose watchdog floor is `floor_s`.
  double cut_to_first_step(double floor_s) {
    EXPECT_TRUE(job_->wait_for_output("| restarts 1", kTimeoutS)) << job_->output();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - cut_at_).count();
    std::printf("cut to the first step of the restarted job: %.1f s (watchdog floor %.0f s)\n", s,
                floor_s);
    return s;
  }

 private:
  const ScratchDir& dir_;
  const fs::path run_;
  TwoHosts bed_;  // before job_: the job goes first
  std::optional<BackgroundCommand> job_;
  std::chrono::steady_clock::time_point cut_at_;
};

// What every cut run must show: the watchdog named host 1 cut off while rank 0, the rank the test
// watched before cutting, was in `phases` (one, or several as "step|checkpoint"; by its last
// heartbeat in the hang record), the supervisor ended the job itself and restarted it on host
// 0's two ranks from host 0's memory, and the run finished with the losses of one never cut (the
// tiny run's, or that of `reference_flags` for `steps` steps). The rank that judged may be
// another, still in the step that rank 0 finished before the cut (the step's last messages to
// it never arrived; its limit, the floor, is the same as that of rank 0's phase): so the
// judge's own phase is that step or one of `phases`.
void expect_left_out_and_finished(const ScratchDir& dir, const fs::path& run,
                                  const std::string& out, const std::string& phases,
                                  const std::string& reference_flags = "", int steps = kCutSteps) {
  const Metrics m = read_metrics(run);
  ASSERT_EQ(m.restarts.size(), 1u) << out;
  const metrics::RestartRecord& r = m.restarts.front();
  EXPECT_EQ(r.reason, "cut off") << out;
  EXPECT_EQ(r.cut_off_hosts, std::vector<std::string>{"mr-h1"});
  EXPECT_EQ(r.lost_ranks, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(r.ranks_after, 2);
  EXPECT_EQ(r.ended_by, "launch") << out;             // mpirun could not reach host 1 to end it
  EXPECT_TRUE(r.unended_ranks.empty()) << r.unended;  // host 1's watchdogs ended its ranks
  EXPECT_LE(r.steps_lost, 1) << out;
  const Json hang = read_json_file((run / "hang-1.json").string());
  const auto in_phases = [&](const std::string& phase) {
    return ("|" + phases + "|").find("|" + phase + "|") != std::string::npos;
  };
  const auto rank0 = std::find_if(hang["ranks"].begin(), hang["ranks"].end(),
                                  [](const Json& rank) { return rank["rank"] == 0; });
  ASSERT_NE(rank0, hang["ranks"].end()) << hang.dump(2);
  EXPECT_TRUE(in_phases((*rank0)["heartbeat"].value("phase", ""))) << hang.dump(2);
  const std::string phase = hang["phase"].get<std::string>();
  EXPECT_TRUE(in_phases(phase) ||
              (phase == "step" && hang["step"] == (*rank0)["heartbeat"]["step"]))
      << hang.dump(2);
  EXPECT_EQ(hang["cut_off_hosts"], Json::array({"mr-h1"}));
  EXPECT_NE(out.find("(a memory checkpoint) at step " + std::to_string(r.step)), std::string::npos)
      << out;
  EXPECT_NE(out.find("launch: the run finished after 1 restart"), std::string::npos) << out;
  expect_same_losses(m.losses,
                     reference_flags.empty() ? uninterrupted(dir, kCutSteps)
                                             : uninterrupted_with(dir, reference_flags),
                     steps);
}

}  // namespace

TEST_F(RecoverySlow, LinkDownMidStepLeavesTheHostOutAndTheRunFinishesFromMemory) {
  CutBed bed(dir, run);
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  BackgroundCommand& job = bed.launch(bed_flags(dir));
  ASSERT_TRUE(wait_for_step(job, 6)) << job.output();
  ASSERT_TRUE(poll_until([&] { return phase_of(run, 0) == "step"; }));
  bed.cut();
  EXPECT_LT(bed.cut_to_first_step(kFloorS), kFloorS + 20);
  ASSERT_EQ(job.wait(kTimeoutS), 0) << bed.story();
  // A rank's sends end once in its socket buffers, and what it receives may have arrived before
  // the cut: rank 0 can finish the step and wait in the memory save that follows it.
  expect_left_out_and_finished(dir, run, job.output(), "step|checkpoint");
}

namespace {

// The demo model (3.5M parameters) at 16 tokens a sample, across the bed with host 1's link
// shaped: a memory save sends each rank's 10 MiB shard to the other host and a migration moves
// optimizer shards between the hosts, so each lasts a second or so and can be cut in the middle.
std::string slow_link_flags(const ScratchDir& dir, const std::string& extra) {
  return "--model demo --seq-len 16 --micro-batch 1 --global-batch 12 --threads 1 "
         "--warmup-steps 1 --min-lr-ratio 1 --val-data '' --checkpoint-every 100 --steps " +
         std::to_string(kSlowLinkSteps) + " --train-data '" +
         (dir / "data" / "train_*.bin").string() + "' --out " + (dir / "run").string() +
         " --memory-checkpoint-every 1 --watchdog-floor " +
         std::to_string(static_cast<int>(kSlowLinkFloorS)) + extra;
}

}  // namespace

TEST_F(RecoverySlow, LinkDownMidCheckpointLeavesTheHostOutAndTheRunFinishesFromMemory) {
  CutBed bed(dir, run);
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  // At 200 Mbit/s a save lasts about a second: time to see it under way and cut it; its limit is
  // the watchdog's floor (10 x the median save, made before the shaping, is less). The link is
  // shaped once step 2 is logged (its first steps across the shaped link took 3.5 s each, saves
  // included), so the save of step 4 is the first that is surely slow.
  BackgroundCommand& job = bed.launch(slow_link_flags(dir, " --no-replan"));
  ASSERT_TRUE(wait_for_step(job, 2)) << job.output();
  bed.bed("shape 1 200mbit");
  // A memory save under way after the shaping: a step directory on host 0 without its manifest
  // yet.
  const fs::path copies = TwoHosts::memory_root(0, run);
  ASSERT_TRUE(poll_until([&] {
    std::error_code ec;
    for (const auto& s : fs::directory_iterator(copies, ec)) {
      if (checkpoint::checkpoint_dir_step(s.path()).value_or(0) > 3 &&
          !fs::exists(s.path() / "manifest.json")) {
        return true;
      }
    }
    return false;
  }));
  bed.cut();
  bed.cut_to_first_step(kSlowLinkFloorS);
  ASSERT_EQ(job.wait(kTimeoutS), 0) << bed.story();
  expect_left_out_and_finished(dir, run, job.output(), "checkpoint",
                               slow_link_flags(dir, " --no-replan"), kSlowLinkSteps);
}

TEST_F(RecoverySlow, LinkDownMidMigrationLeavesTheHostOutAndTheRunFinishesFromMemory) {
  CutBed bed(dir, run);
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  // Rank 1 8 times slower from step 3 (not more: a step must stay within its own watchdog limit,
  // 10 x its median, on a slow machine; and for steps, as the monitor's window takes one slow
  // step for noise): the controller leaves it out, and the optimizer's shards
  // (ZeRO-1) move to the ranks left, two of them on the other host, before the next step (no
  // overlap). Rank 1 is on host 0, which the restarted job keeps. The link is shaped once step 2
  // is logged, before the migration (after step 4 at the earliest); shaped from the start, the
  // first two steps took 7 s each, saves included.
  BackgroundCommand& job =
      bed.launch(slow_link_flags(dir, " --straggler 1:8:3-8 --no-overlap-switch"));
  ASSERT_TRUE(wait_for_step(job, 2)) << job.output();
  bed.bed("shape 1 100mbit");
  ASSERT_TRUE(poll_until([&] { return phase_of(run, 0) == "migration" || job.wait(0) != -1; }))
      << job.output();
  // The migration (0.4 s in one CI run) can fall between two looks at rank 0's phase, and the
  // run then ends uncut: the case was not reached, which is not a failure of the recovery.
  if (job.wait(0) != -1) {
    GTEST_SKIP() << "no migration was seen in progress before the run ended: nothing was cut";
  }
  bed.cut();
  bed.cut_to_first_step(kSlowLinkFloorS);
  ASSERT_EQ(job.wait(kTimeoutS), 0) << bed.story();
  // As in the mid-step case: the migration's last messages may be in the socket buffers before
  // the cut, and the ranks then wait in the memory save that follows it (seen once in CI: phase
  // "checkpoint" at the migration's step, everything else as here).
  expect_left_out_and_finished(dir, run, job.output(), "migration|checkpoint",
                               slow_link_flags(dir, ""), kSlowLinkSteps);
}

// ---- A link that comes back, and links that drop packets (watchdog/partition.h's rule) ----

TEST_F(RecoverySlow, ALinkThatComesBackWithinTheLimitCostsNoRestart) {
  CutBed bed(dir, run);
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  BackgroundCommand& job = bed.launch(bed_flags(dir));
  ASSERT_TRUE(wait_for_step(job, 6)) << job.output();
  ASSERT_TRUE(poll_until([&] { return phase_of(run, 0) == "step"; }));
  // Down for 0.7 of a step's limit (the floor): past half the limit, when the probes start, so
  // they see it fail, for about 1 s, short of the 3 s without a probe that makes a link cut;
  // TCP's resends (their timeout doubling) may resume the collective only after the limit, when
  // the probes connect again: healed, and the phase gets more time.
  bed.cut();
  std::this_thread::sleep_for(std::chrono::duration<double>(0.7 * kFloorS));
  bed.bed("heal 1");
  ASSERT_EQ(job.wait(kTimeoutS), 0) << bed.story();
  const Metrics m = read_metrics(run);
  EXPECT_TRUE(m.restarts.empty()) << job.output();
  EXPECT_FALSE(fs::exists(run / "hang.json")) << job.output();
  const bool extended = job.output().find("went down and came back") != std::string::npos;
  std::printf("the step outlasted its limit and was given more time: %s\n",
              extended ? "yes" : "no (it ended within the limit)");
  expect_same_losses(m.losses, uninterrupted(dir, kCutSteps), kCutSteps);
}

TEST_F(RecoverySlow, ALinkThatDropsSomePacketsIsTrainedThroughOrCutNeverBlamedOnNobody) {
  CutBed bed(dir, run);
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  // The floor at 30 s. On this loaded machine, resends at 5 % loss have held a phase past even
  // that (62 s once): then the rule cuts the link all the same (watchdog/partition.h), and the run
  // finishes on host 0. What must not happen is a restart on both hosts that names nobody. 11
  // lossy steps (about 0.9 s each), not the cut tests' 21.
  constexpr int kLossySteps = 14;
  BackgroundCommand& job = bed.launch(tiny_flags(dir, "run", kLossySteps) +
                                      " --memory-checkpoint-every 1 --watchdog-floor 30");
  ASSERT_TRUE(wait_for_step(job, 3)) << job.output();
  // 5 % of host 1's packets lost in each direction: TCP resends them, steps take longer; as a
  // rule none outlasts its limit, no phase is judged, and the run finishes on both hosts.
  bed.bed("loss 1 5");
  ASSERT_EQ(job.wait(kTimeoutS), 0) << bed.story();
  const Metrics m = read_metrics(run);
  if (!m.restarts.empty()) {
    ASSERT_EQ(m.restarts.size(), 1u) << job.output();
    EXPECT_EQ(m.restarts[0].reason, "cut off") << job.output();
    EXPECT_EQ(m.restarts[0].cut_off_hosts, std::vector<std::string>{"mr-h1"});
  }
  std::printf("trained through: %s\n",
              m.restarts.empty() ? "yes" : "no, a phase was held: cut off");
  expect_same_losses(m.losses, uninterrupted(dir, kLossySteps), kLossySteps);
}

TEST_F(RecoverySlow, ALinkThatDropsMostPacketsIsTreatedAsCut) {
  CutBed bed(dir, run);
  if (bed.skipped()) GTEST_SKIP() << "network namespaces cannot be made here";
  BackgroundCommand& job = bed.launch(bed_flags(dir));
  ASSERT_TRUE(wait_for_step(job, 6)) << job.output();
  // 70 % lost each way: a collective stalls past its limit, and the probes that connect now and
  // then make the link lossy (or cut): host 1 is left out as if its link were down.
  bed.bed("loss 1 70");
  ASSERT_EQ(job.wait(kTimeoutS), 0) << bed.story();
  const Metrics m = read_metrics(run);
  ASSERT_EQ(m.restarts.size(), 1u) << job.output();
  EXPECT_EQ(m.restarts[0].reason, "cut off") << job.output();
  EXPECT_EQ(m.restarts[0].cut_off_hosts, std::vector<std::string>{"mr-h1"});
  EXPECT_EQ(m.restarts[0].ranks_after, 2);
  const Json hang = read_json_file((run / "hang-1.json").string());
  std::printf("judged: %s\n", hang["message"].get<std::string>().c_str());
  expect_same_losses(m.losses, uninterrupted(dir, kCutSteps), kCutSteps);
}

// A supervisor killed before its end (SIGKILL, a closed terminal's SIGHUP) leaves its hostfile
// folder in the temporary directory; the next supervisor on the host removes it, and only such
// folders: one whose supervisor still runs, another user's, and other names stay.
TEST(Launch, AFolderAKilledSupervisorLeftIsRemovedByTheNext) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const checkpoint::HostProcess me = checkpoint::this_process();
  const std::string prefix = "malleus-launch-" + std::to_string(me.pid) + "-";
  struct Folders {  // removed at the end, whatever the test found
    std::vector<fs::path> made;
    ~Folders() {
      std::error_code ignored;
      for (const fs::path& p : made) fs::remove_all(p, ignored);
    }
    fs::path make(const std::string& name) {
      made.push_back(fs::temp_directory_path() / name);
      fs::create_directories(made.back());
      write_file_atomic(made.back() / "hosts.0", "localhost slots=1\n");
      return made.back();
    }
  } folders;
  // The start time tells this process from a gone one that had the same pid.
  const fs::path gone = folders.make(prefix + std::to_string(me.start + 1) + "-gone00");
  const fs::path running = folders.make(prefix + std::to_string(me.start) + "-live00");
  const fs::path other_name = folders.make("malleus-launch-test" + std::to_string(me.pid));
  std::optional<fs::path> foreign;
  if (::geteuid() == 0) {  // root can give a folder to another user (65534: nobody)
    foreign = folders.make(prefix + std::to_string(me.start + 1) + "-foreign");
    ASSERT_EQ(::lchown(foreign->c_str(), 65534, 65534), 0);
  }
  const auto r = run_command(launch_command(1, "", tiny_flags(dir, "run", 1, Pace::kFull)));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(gone)) << r.output;
  EXPECT_TRUE(fs::exists(running / "hosts.0")) << r.output;
  EXPECT_TRUE(fs::exists(other_name / "hosts.0")) << r.output;
  if (foreign) {
    EXPECT_TRUE(fs::exists(*foreign / "hosts.0")) << r.output;
  }
}
