// `malleus train` under mpirun, end to end: plan files with uneven tensor-parallel shares,
// resuming under another plan, bad plans, stopping on a signal, and memory copies on a host shared
// with other users (private; another user's refused). A bad plan must stop the whole
// job with a named error; the real risk is a hang (one rank throwing while the others wait in a
// collective), so every command runs under `timeout` and a timeout (exit 124) fails the test.
//
// These tests launch mpirun themselves, so they are plain (single-process) gtest executables.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "checkpoint/memory_checkpoint.h"
#include "common/files.h"
#include "common/json.h"
#include "common/proc_stat.h"
#include "test_util.h"
#include "train/stop_signal.h"

using namespace malleus;
using malleus::testing::CommandResult;
using malleus::testing::run_command;
using malleus::testing::ScratchDir;

namespace {

constexpr int kTimeoutS = 60;

// `malleus <arguments>` on `ranks` MPI ranks. The environment is set on the command line so the
// test works as root (containers) and with more ranks than cores; yield_when_idle keeps waiting
// ranks from starving the computing ones on an oversubscribed machine.
// `environment`: more VAR=value settings for the ranks.
CommandResult run_mpi(int ranks, const std::string& arguments,
                      const std::string& environment = "") {
  std::string command = malleus::testing::kMpiEnvironment + environment + " timeout ";
  command += std::to_string(kTimeoutS);
  command += " ";
  command += MALLEUS_MPIRUN;
  command += " --oversubscribe -np ";
  command += std::to_string(ranks);
  command += " ";
  command += MALLEUS_BINARY;
  command += " ";
  command += arguments;
  return run_command(command);
}

// The tiny model (2 layers, 4 heads in 2 KV groups, FFN 64, vocabulary 257) on the synthetic
// corpus: global batch 8 in micro-batches of 2, so 4 micro-batches per step.
std::string tiny_flags(const ScratchDir& dir, const std::string& run, int steps) {
  std::string flags = "--model tiny --seq-len 16 --micro-batch 2 --global-batch 8 --threads 1";
  // --no-replan: these tests check that the job runs the plan it was given, so the straggler
  // controller must not switch plans on noisy timings of an oversubscribed machine.
  flags += " --warmup-steps 1 --val-data '' --checkpoint-every 0 --no-replan --steps ";
  flags += std::to_string(steps);
  flags += " --train-data '";
  flags += (dir / "data" / "train_*.bin").string();
  flags += "' --out ";
  flags += (dir / run).string();
  return flags;
}

std::string write_plan(const ScratchDir& dir, const std::string& name, const std::string& json) {
  const fs::path path = dir / name;
  write_file_atomic(path, json);
  return path.string();
}

// Two ranks training the tiny model for `steps` on the synthetic corpus (written first) under the
// plan `json`, written as `file`.
CommandResult train_under_plan(const ScratchDir& dir, int steps, const std::string& file,
                               const std::string& json) {
  malleus::testing::write_synthetic_corpus(dir / "data");
  const std::string plan = write_plan(dir, file, json);
  return run_mpi(2, "train " + tiny_flags(dir, "run", steps) + " --plan " + plan);
}

// Loss of every step line ("step     3/4 | loss 5.1234 | ...") by step number.
std::map<int, double> step_losses(const std::string& output) {
  std::map<int, double> losses;
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    int step = 0, total = 0;
    double loss = 0;
    if (std::sscanf(line.c_str(), "step %d/%d | loss %lf", &step, &total, &loss) == 3) {
      losses[step] = loss;
    }
  }
  return losses;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Whether there are step lines and every one of them names the plan (as " | <summary>").
bool step_lines_show(const std::string& output, const std::string& summary) {
  std::istringstream lines(output);
  std::string line;
  int steps = 0;
  while (std::getline(lines, line)) {
    if (line.rfind("step ", 0) != 0) continue;
    ++steps;
    if (!contains(line, " | " + summary)) return false;
  }
  return steps > 0;
}

// Fails unless the job stopped by itself (not by `timeout`) with a non-zero exit and every part
// of the expected error message.
void expect_clean_failure(const CommandResult& r, std::initializer_list<std::string> parts) {
  EXPECT_NE(r.exit_code, 124) << "the job hung and was killed by timeout\n" << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "error:")) << r.output;
  for (const auto& part : parts) EXPECT_TRUE(contains(r.output, part)) << part << "\n" << r.output;
}

}  // namespace

TEST(CliMpi, TrainsWithUnevenTensorParallelShares) {
  ScratchDir dir;
  // With 2 KV groups of 2 heads, tp2's head shares can only be [2, 2]; the FFN columns and the
  // vocabulary rows carry the uneven split.
  const auto r = train_under_plan(dir, 3, "uneven.json", R"({
    "world_size": 2, "micro_batch_size": 2,
    "pipelines": [{"micro_batches": 4, "stages": [
      {"layers": [0, 2], "ranks": [0, 1], "heads": [2, 2], "ffn": [48, 16], "vocab": [200, 57]}]}]
  })");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto losses = step_losses(r.output);
  EXPECT_EQ(losses.size(), 3u) << r.output;
  for (const auto& [step, loss] : losses) EXPECT_TRUE(std::isfinite(loss)) << step;
  EXPECT_TRUE(contains(r.output, "step     3/3")) << r.output;
  EXPECT_TRUE(step_lines_show(r.output, "1 pipeline: [pp1 tp2 m4]")) << r.output;
  EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / "latest"));
}

TEST(CliMpi, ResumesUnderAnotherPlan) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto first = run_mpi(2, "train " + tiny_flags(dir, "run", 2) + " --dp 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_TRUE(step_lines_show(first.output, "2 pipelines: [pp1 tp1 m2] [pp1 tp1 m2]"))
      << first.output;

  const std::string pp2 = write_plan(dir, "pp2.json", R"({
    "world_size": 2, "micro_batch_size": 2,
    "pipelines": [{"micro_batches": 4, "stages": [
      {"layers": [0, 1], "ranks": [0]}, {"layers": [1, 2], "ranks": [1]}]}]
  })");
  const auto resumed =
      run_mpi(2, "train --resume " + (dir / "run").string() + " --plan " + pp2 + " --steps 4");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "resuming from")) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "at step 2")) << resumed.output;
  EXPECT_TRUE(step_lines_show(resumed.output, "1 pipeline: [pp2 tp1,1 m4]")) << resumed.output;
  const auto resumed_losses = step_losses(resumed.output);
  ASSERT_EQ(resumed_losses.size(), 2u) << resumed.output;

  // The plan changes only how the work is split: the resumed steps must match an uninterrupted
  // run under the first plan, up to fp32 summation order.
  const auto straight = run_mpi(2, "train " + tiny_flags(dir, "straight", 4) + " --dp 2");
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto straight_losses = step_losses(straight.output);
  for (int step : {3, 4}) {
    ASSERT_TRUE(resumed_losses.count(step) && straight_losses.count(step)) << step;
    EXPECT_NEAR(resumed_losses.at(step), straight_losses.at(step), 2e-4) << "step " << step;
  }
}

TEST(CliMpi, OverlappingRanksStopTheJob) {
  ScratchDir dir;
  const auto r = train_under_plan(dir, 2, "overlap.json", R"({
    "world_size": 2, "micro_batch_size": 2,
    "pipelines": [{"micro_batches": 2, "stages": [{"layers": [0, 2], "ranks": [0]}]},
                  {"micro_batches": 2, "stages": [{"layers": [0, 2], "ranks": [0]}]}]
  })");
  expect_clean_failure(r, {"overlap.json: pipeline 1 stage 0: rank 0 is already used by "
                           "pipeline 0 stage 0"});
  EXPECT_FALSE(contains(r.output, "step ")) << r.output;
}

TEST(CliMpi, WorldSizeMismatchNamesBothNumbers) {
  ScratchDir dir;
  const auto r = train_under_plan(dir, 2, "three.json", R"({
    "world_size": 3, "micro_batch_size": 2,
    "pipelines": [{"micro_batches": 4, "stages": [
      {"layers": [0, 1], "ranks": [0, 1]}, {"layers": [1, 2], "ranks": [2]}]}]
  })");
  expect_clean_failure(r, {"three.json: the plan is for 3 ranks but the job has 2"});
}

// ---- stopping on a signal (issue 17.1) ----
// "Slow": several multi-rank jobs each, and mpirun's kill timeout waited out; the sanitizer build
// leaves them out (it runs the one-rank Ctrl-C test of test_cli.cpp).

namespace {

// The pid of world rank `rank` among mpirun's children (read from their environment), or -1.
pid_t rank_pid(pid_t mpirun, int rank) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::vector<std::string> fields =
        malleus::proc_stat_fields((entry.path() / "stat").string());
    if (fields.size() < 2 || fields[1] != std::to_string(mpirun)) continue;
    std::ifstream environ(entry.path() / "environ");
    const std::string wanted = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
    for (std::string var; std::getline(environ, var, '\0');) {
      if (var == wanted) return static_cast<pid_t>(std::stoi(name));
    }
  }
  return -1;
}

// The step a stopped run names in "stopped by SIG... after step N", or -1.
int stopped_step(const std::string& output, const std::string& signal) {
  const std::string marker = "stopped by " + signal + " after step ";
  const size_t at = output.find(marker);
  return at == std::string::npos ? -1 : std::atoi(output.c_str() + at + marker.size());
}

std::string checkpoint_name(int step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08d", step);
  return name;
}

// `mpirun -np <ranks> malleus <arguments>` in the background, as run_mpi runs it.
std::string mpi_command(int ranks, const std::string& arguments, const std::string& mpirun_flags) {
  return malleus::testing::kMpiEnvironment + MALLEUS_MPIRUN + " " + mpirun_flags +
         " --oversubscribe -np " + std::to_string(ranks) + " " + MALLEUS_BINARY + " " + arguments;
}

// A constant learning rate after one warmup step, so the losses of steps 1..N do not depend on
// the run's total length: the stopped run (100000 steps) and the uninterrupted one are comparable.
const char* kConstantLr = " --min-lr-ratio 1";

}  // namespace

TEST(CliMpi, SigtermToOneRankStopsEveryRankWithACheckpointSlow) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  int stopped = -1;
  {
    malleus::testing::BackgroundCommand job(
        mpi_command(4, "train " + tiny_flags(dir, "run", 100000) + kConstantLr, ""),
        dir / "job.out");
    ASSERT_TRUE(job.wait_for_output("step     3/", kTimeoutS)) << job.output();
    const pid_t rank2 = rank_pid(job.pid(), 2);
    ASSERT_GT(rank2, 0) << "no rank 2 among mpirun's children";
    ::kill(rank2, SIGTERM);
    const int status = job.wait(kTimeoutS);
    const std::string out = job.output();
    // Every rank stops after the same step with 128 + SIGTERM, so mpirun reports that.
    EXPECT_EQ(status, 128 + SIGTERM) << out;
    stopped = stopped_step(out, "SIGTERM");
    ASSERT_GE(stopped, 3) << out;
    EXPECT_TRUE(contains(out, "saved checkpoint " + (dir / "run" / "checkpoints").string() + "/" +
                                  checkpoint_name(stopped)))
        << out;
    // No step after the one it stopped at.
    EXPECT_EQ(step_losses(out).rbegin()->first, stopped) << out;
  }
  EXPECT_EQ(read_file(dir / "run" / "checkpoints" / "latest"), checkpoint_name(stopped) + "\n");

  // Resumed, it goes on exactly as a run that was never stopped.
  const int end = stopped + 2;
  const auto resumed =
      run_mpi(4, "train --resume " + (dir / "run").string() + " --steps " + std::to_string(end));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto straight = run_mpi(4, "train " + tiny_flags(dir, "straight", end) + kConstantLr);
  ASSERT_EQ(straight.exit_code, 0) << straight.output;
  const auto resumed_losses = step_losses(resumed.output);
  const auto straight_losses = step_losses(straight.output);
  ASSERT_EQ(resumed_losses.size(), 2u) << resumed.output;
  for (const auto& [step, loss] : resumed_losses) {
    ASSERT_TRUE(straight_losses.count(step)) << step;
    EXPECT_NEAR(loss, straight_losses.at(step), 2e-4) << "step " << step;
  }
}

// The last step recorded in a run's metrics (written by rank 0 itself, not through mpirun).
int last_metrics_step(const fs::path& run) {
  std::ifstream metrics(run / "metrics.jsonl");
  int last = -1;
  for (std::string line; std::getline(metrics, line);) {
    const Json j = parse_json(line, "metrics");
    if (j.contains("loss")) last = j["step"].get<int>();
  }
  return last;
}

TEST(CliMpi, SignalsToMpirunStopTheJobWithACheckpointSlow) {
  // mpirun sends SIGCONT to every rank, SIGTERM after odls_base_sigkill_timeout seconds and
  // SIGKILL after as many again, and stops forwarding the ranks' output (docs/running.md);
  // SIGUSR1 it forwards at once and keeps forwarding output.
  for (const int signal : {SIGTERM, SIGUSR1}) {
    ScratchDir dir;
    malleus::testing::write_synthetic_corpus(dir / "data");
    malleus::testing::BackgroundCommand job(
        mpi_command(2, "train " + tiny_flags(dir, "run", 100000),
                    "--mca odls_base_sigkill_timeout 3"),
        dir / "job.out");
    ASSERT_TRUE(job.wait_for_output("step     2/", kTimeoutS)) << job.output();
    const auto killed = std::chrono::steady_clock::now();
    ::kill(job.pid(), signal);
    const int status = job.wait(kTimeoutS);
    const std::string out = job.output();
    std::printf("%s: the job ended %.2f s after the signal\n", strsignal(signal),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count());
    EXPECT_NE(status, 0) << out;
    EXPECT_NE(status, -1) << "still running\n" << out;
    // The checkpoint (the only one: --checkpoint-every 0) is of the last step the run made.
    const int last = last_metrics_step(dir / "run");
    ASSERT_GE(last, 2) << out;
    ASSERT_TRUE(fs::exists(dir / "run" / "checkpoints" / "latest"))
        << strsignal(signal) << ": no checkpoint; stop.json: "
        << (fs::exists(dir / "run" / "stop.json") ? read_file(dir / "run" / "stop.json") : "none")
        << "\n"
        << out;
    EXPECT_EQ(read_file(dir / "run" / "checkpoints" / "latest"), checkpoint_name(last) + "\n")
        << strsignal(signal) << "\n"
        << out;
    const Json manifest = read_json_file(
        (dir / "run" / "checkpoints" / checkpoint_name(last) / "manifest.json").string());
    EXPECT_EQ(manifest["step"], last);
    if (signal == SIGUSR1) {
      EXPECT_EQ(status, 128 + SIGUSR1) << out;
      EXPECT_EQ(stopped_step(out, "SIGUSR1"), last) << out;
    }
  }
}

// ---- Sharded checkpoints: each rank writes its own pieces; any plan and world size reads them
// ----

namespace {

// Four ranks: one pipeline of one tensor-parallel stage with uneven FFN and vocabulary shares,
// and one of two pipeline stages.
const char* kFourRankPlan = R"({
  "world_size": 4, "micro_batch_size": 2,
  "pipelines": [
    {"micro_batches": 2, "stages": [
      {"layers": [0, 2], "ranks": [0, 1], "heads": [2, 2], "ffn": [48, 16], "vocab": [200, 57]}]},
    {"micro_batches": 2, "stages": [{"layers": [0, 1], "ranks": [2]}, {"layers": [1, 2], "ranks": [3]}]}]
})";
// Three ranks and other cuts: one rank holding the whole model, and a pipeline of two stages;
// no tensor parallelism, so every rank reads whole tensors that four ranks wrote in parts.
const char* kThreeRankPlan = R"({
  "world_size": 3, "micro_batch_size": 2,
  "pipelines": [
    {"micro_batches": 2, "stages": [{"layers": [0, 2], "ranks": [0]}]},
    {"micro_batches": 2, "stages": [{"layers": [0, 1], "ranks": [1]}, {"layers": [1, 2], "ranks": [2]}]}]
})";

int64_t file_size_or_zero(const fs::path& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(size);
}

}  // namespace

TEST(CliMpi, ShardedCheckpointFromFourRanksResumesOnThreeSlow) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const std::string four = write_plan(dir, "four.json", kFourRankPlan);
  const std::string three = write_plan(dir, "three.json", kThreeRankPlan);
  // Straight through 4 steps on 4 ranks, with a checkpoint at step 2.
  const auto first = run_mpi(
      4, "train " + tiny_flags(dir, "run", 4) + " --plan " + four + " --checkpoint-every 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto straight = step_losses(first.output);
  ASSERT_EQ(straight.size(), 4u) << first.output;

  // Every rank wrote its own file, and together they store each element once: parameters and
  // both Adam moments of the tiny model, 4 bytes each. The moments came straight from each
  // rank's optimizer shard (both plans have two pipelines: the distributed optimizer splits them),
  // pieces of their own written by every rank.
  const fs::path checkpoint = dir / "run" / "checkpoints" / checkpoint_name(2);
  const Json manifest = read_json_file((checkpoint / "manifest.json").string());
  EXPECT_EQ(manifest["version"], 4);
  for (const auto& [file, entry] : manifest["files"].items()) {
    int moment_pieces = 0;
    for (const Json& piece : entry["pieces"]) moment_pieces += piece["state"] == "moments";
    EXPECT_GT(moment_pieces, 0) << file;
  }
  int64_t elements = 0;
  for (const Json& t : manifest["tensors"]) {
    int64_t n = 1;
    for (const Json& d : t["shape"]) n *= d.get<int64_t>();
    elements += n;
  }
  int64_t bytes = 0;
  for (int r = 0; r < 4; ++r) {
    char name[32];
    std::snprintf(name, sizeof name, "rank_%05d.bin", r);
    EXPECT_GT(file_size_or_zero(checkpoint / name), 0) << name;
    bytes += file_size_or_zero(checkpoint / name);
  }
  EXPECT_EQ(bytes, 12 * elements);
  // Saving gathered nothing: the step after the save (whose update waited for the background
  // copy) held no more optimizer memory than the first step, on every rank.
  std::map<int64_t, Json> records;
  {
    std::ifstream metrics(dir / "run" / "metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const Json record = Json::parse(line);
      if (record.contains("loss")) records[record["step"].get<int64_t>()] = record;
    }
  }
  ASSERT_TRUE(records.count(1) && records.count(3)) << first.output;
  ASSERT_EQ(records[3]["peak_optimizer_bytes"].size(), 4u);
  EXPECT_EQ(records[3]["peak_optimizer_bytes"], records[1]["peak_optimizer_bytes"]);

  // Resumed from step 2 on 3 ranks under another plan: the same losses, up to fp32 order.
  const auto resumed = run_mpi(3, "train --resume " + checkpoint.string() + " --plan " + three +
                                      " --steps 4 --out " + (dir / "resumed").string());
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "at step 2")) << resumed.output;
  const auto resumed_losses = step_losses(resumed.output);
  ASSERT_EQ(resumed_losses.size(), 2u) << resumed.output;
  for (int step : {3, 4}) {
    ASSERT_TRUE(resumed_losses.count(step)) << step;
    EXPECT_NEAR(resumed_losses.at(step), straight.at(step), 2e-4) << "step " << step;
  }

  // Both plans have two pipelines, so the moments were saved from the distributed optimizer's
  // shards: resumed with whole moments, the same losses; and saved whole, resumed split.
  const auto whole = run_mpi(3, "train --resume " + checkpoint.string() + " --plan " + three +
                                    " --steps 4 --no-distributed-optimizer --out " +
                                    (dir / "resumed-whole").string());
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto whole_losses = step_losses(whole.output);
  const auto saved_whole =
      run_mpi(4, "train " + tiny_flags(dir, "run-whole", 4) + " --plan " + four +
                     " --checkpoint-every 2 --no-distributed-optimizer");
  ASSERT_EQ(saved_whole.exit_code, 0) << saved_whole.output;
  const auto split = run_mpi(
      3, "train --resume " + (dir / "run-whole" / "checkpoints" / checkpoint_name(2)).string() +
             " --plan " + three + " --steps 4 --out " + (dir / "resumed-split").string());
  ASSERT_EQ(split.exit_code, 0) << split.output;
  const auto split_losses = step_losses(split.output);
  for (int step : {3, 4}) {
    ASSERT_TRUE(whole_losses.count(step)) << step;
    ASSERT_TRUE(split_losses.count(step)) << step;
    EXPECT_NEAR(whole_losses.at(step), straight.at(step), 2e-4) << "split to whole, step " << step;
    EXPECT_NEAR(split_losses.at(step), straight.at(step), 2e-4) << "whole to split, step " << step;
  }
}

TEST(CliMpi, RankKilledDuringASaveLeavesThePreviousCheckpointLatestSlow) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto first = run_mpi(4, "train " + tiny_flags(dir, "run", 2) + " --dp 4");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path checkpoints = dir / "run" / "checkpoints";
  ASSERT_EQ(read_file(checkpoints / "latest"), checkpoint_name(2) + "\n");

  // Rank 2 dies (SIGKILL, test hook) halfway through writing its part of step 4's checkpoint.
  // Disk checkpoints only: a memory copy of step 3 would (rightly) be the newer restart point.
  const auto killed =
      run_mpi(4, "train --resume " + (dir / "run").string() + " --steps 4 --no-memory-checkpoints",
              "MALLEUS_FAULT_DIE_IN_SAVE=2");
  EXPECT_NE(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.exit_code, 124) << "the job hung\n" << killed.output;
  EXPECT_TRUE(contains(killed.output, "step     4/4")) << killed.output;
  EXPECT_FALSE(contains(killed.output, "saved checkpoint")) << killed.output;
  EXPECT_EQ(read_file(checkpoints / "latest"), checkpoint_name(2) + "\n");
  EXPECT_FALSE(fs::exists(checkpoints / checkpoint_name(4)));
  // The previous checkpoint is whole: the next run resumes from it (on 2 ranks) and finishes,
  // removing what the dead save left.
  const auto resumed = run_mpi(2, "train --resume " + (dir / "run").string() + " --dp 2 --steps 4");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "at step 2")) << resumed.output;
  EXPECT_EQ(read_file(checkpoints / "latest"), checkpoint_name(4) + "\n");
  for (const auto& entry : fs::directory_iterator(checkpoints)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos)
        << entry.path() << "\n"
        << killed.output << "\n"
        << resumed.output;
  }
}

// A step whose loss or gradient norm is not finite stops every rank at that step together (the
// numbers come from one all-reduce): one message from rank 0, no MPI_Abort, a non-zero exit, and
// no checkpoint of that step or later.
TEST(CliMpi, NonFiniteStepStopsEveryRankTogether) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto r = run_mpi(2, "train " + tiny_flags(dir, "run", 6) +
                                " --lr 1e30 --warmup-steps 0 --grad-clip 0 --checkpoint-every 1");
  expect_clean_failure(r, {"is not finite (loss ", "--resume"});
  EXPECT_FALSE(contains(r.output, "MPI_ABORT")) << r.output;
  const size_t first = r.output.find("error: step ");
  ASSERT_NE(first, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("error: step ", first + 1), std::string::npos) << "said once\n"
                                                                         << r.output;
  const int stopped = std::atoi(r.output.c_str() + first + std::strlen("error: step "));
  ASSERT_GE(stopped, 2) << r.output;
  for (int step = 1; step <= 6; ++step) {
    EXPECT_EQ(fs::exists(dir / "run" / "checkpoints" / ("step_0000000" + std::to_string(step))),
              step < stopped)
        << step << "\n"
        << r.output;
  }
}

// ---- Memory copies on a host shared with other users (checkpoint/memory_folder.h) ----

namespace {

constexpr uid_t kNobody = 65534;  // Debian's "nobody": an unprivileged user
constexpr uid_t kOther = 65533;   // a uid no account has: "another user"

// The prefix that runs a command as `uid` (util-linux's setpriv), no supplementary groups.
std::string as_user(uid_t uid) {
  return "setpriv --reuid=" + std::to_string(uid) + " --regid=" + std::to_string(uid) +
         " --clear-groups ";
}

struct Owned {
  uid_t uid = 0;
  mode_t mode = 0;
};
Owned owned(const fs::path& path) {
  struct stat st;
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return {st.st_uid, st.st_mode & 07777};
}

// Gives `path` and everything under it to `uid`.
void give_to(const fs::path& path, uid_t uid) {
  ASSERT_EQ(::lchown(path.c_str(), uid, uid), 0) << path;
  if (!fs::is_directory(fs::symlink_status(path))) return;
  for (const auto& entry : fs::recursive_directory_iterator(path)) {
    ASSERT_EQ(::lchown(entry.path().c_str(), uid, uid), 0) << entry.path();
  }
}

// A run of `ranks` ranks (as `user`, a setpriv prefix or "") whose last rank dies in its disk save
// of step `steps` (the test hook MALLEUS_FAULT_DIE_IN_SAVE), with a memory copy every step: it
// leaves the memory copy of step `steps` - 1 on this host. Returns its step directory.
fs::path run_leaving_a_memory_copy(const ScratchDir& dir, int ranks, int steps,
                                   const std::string& user, const std::string& resume = "") {
  const std::string flags = resume.empty() ? tiny_flags(dir, "run", steps) : "--resume " + resume;
  const auto killed =
      run_mpi(ranks,
              "train " + flags + " --steps " + std::to_string(steps) + " --checkpoint-every " +
                  std::to_string(steps) + " --memory-checkpoint-every 1",
              "MALLEUS_FAULT_DIE_IN_SAVE=" + std::to_string(ranks - 1) + " " + user);
  EXPECT_NE(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.exit_code, 124) << "the job hung\n" << killed.output;
  const fs::path step =
      checkpoint::checkpoint_dir(checkpoint::memory_checkpoint_root(dir / "run"), steps - 1);
  EXPECT_TRUE(fs::exists(step / "manifest.json")) << killed.output;
  return step;
}

}  // namespace

TEST(MemoryCopies, AnUnprivilegedUsersCopiesAreTheirsAloneAndOthersCannotReadThem) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to run as other users (setpriv)";
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  fs::create_directories(dir / "run");
  give_to(dir / "run", kNobody);  // the user's own run directory
  const fs::path step = run_leaving_a_memory_copy(dir, 2, 3, as_user(kNobody));
  const fs::path root = step.parent_path();
  EXPECT_EQ(owned(root).uid, kNobody);
  EXPECT_EQ(owned(root).mode, 0700u);
  EXPECT_EQ(owned(step).uid, kNobody);
  EXPECT_EQ(owned(step).mode, 0700u);
  size_t files = 0;
  for (const auto& entry : fs::recursive_directory_iterator(root)) {
    if (!entry.is_regular_file()) continue;
    ++files;
    EXPECT_EQ(owned(entry.path()).uid, kNobody) << entry.path();
    EXPECT_EQ(owned(entry.path()).mode, 0600u) << entry.path();
  }
  EXPECT_GE(files, 5u);  // owner.json, 2 ranks' shards, the manifest, the tokenizer
  // Another unprivileged user can neither list the folder nor read a file in it.
  for (const std::string& command :
       {"ls " + root.string(), "cat " + (step / "manifest.json").string(),
        "cat " + (step / "rank_00000.bin").string()}) {
    const auto r = malleus::testing::run_command(as_user(kOther) + command);
    EXPECT_NE(r.exit_code, 0) << command << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "Permission denied")) << command << "\n" << r.output;
  }
  // The owner's own resume takes the copy (the disk has none yet) and ends the run, removing it.
  const auto resumed =
      run_mpi(2, "train --resume " + (dir / "run").string() + " --steps 3", as_user(kNobody));
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "(a memory checkpoint) at step 2")) << resumed.output;
  EXPECT_FALSE(fs::exists(root)) << resumed.output;
}

TEST(MemoryCopies, AForeignCopyIsRefusedNamingItsOwnerAndTheDiskIsRead) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root, to give a folder to another user";
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto first = run_mpi(2, "train " + tiny_flags(dir, "run", 2) + " --checkpoint-every 2");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  // A complete, verified memory copy of step 3, newer than the disk's of step 2 ...
  const fs::path step = run_leaving_a_memory_copy(dir, 2, 4, "", (dir / "run").string());
  const fs::path root = step.parent_path();
  const fs::path disk = dir / "run" / "checkpoints" / checkpoint_name(2);
  ASSERT_EQ(read_file(dir / "run" / "checkpoints" / "latest"), checkpoint_name(2) + "\n");
  // ... that another user placed there: the same files, another owner.
  give_to(root, kNobody);
  const std::string nobody = "belongs to user nobody (uid " + std::to_string(kNobody) + ")";
  const auto resumed = run_mpi(2, "train --resume " + (dir / "run").string() + " --steps 4");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "not resuming from memory: memory checkpoints " +
                                           root.string() + " " + nobody))
      << resumed.output;
  EXPECT_TRUE(contains(resumed.output, "resuming from " + disk.string() + " at step 2"))
      << resumed.output;
  // The run did not write into it either (memory copies off, the disk's go on), and left it as
  // it was: not its to remove.
  EXPECT_TRUE(contains(resumed.output, "warning: memory checkpoint of step 3 failed: "))
      << resumed.output;
  EXPECT_TRUE(contains(resumed.output, nobody)) << resumed.output;
  EXPECT_EQ(read_file(dir / "run" / "checkpoints" / "latest"), checkpoint_name(4) + "\n");
  EXPECT_TRUE(fs::exists(step / "manifest.json"));
  EXPECT_EQ(owned(step / "manifest.json").uid, kNobody);

  // The user's own folder that group members could write into is refused the same way.
  give_to(root, 0);
  fs::permissions(root, fs::perms::group_write, fs::perm_options::add);
  const auto again = run_mpi(2, "train --resume " + (dir / "run").string() + " --steps 5");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(contains(again.output, "not resuming from memory: memory checkpoints " +
                                         root.string() +
                                         " (owned by user root (uid 0)) has "
                                         "mode 0720"))
      << again.output;
  fs::remove_all(root);
}

// ---- Retention of disk checkpoints (checkpoint/retention.h) ----

TEST(CliMpi, ARetentionLimitKeepsExactlyThatManyLoadableCheckpoints) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const fs::path checkpoints = dir / "run" / "checkpoints";
  const auto first = run_mpi(
      2, "train " + tiny_flags(dir, "run", 7) + " --checkpoint-every 1 --keep-checkpoints 3");
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto steps_kept = [&] {
    std::vector<int> kept;
    for (const auto& entry : fs::directory_iterator(checkpoints)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("step_", 0) == 0) kept.push_back(std::atoi(name.c_str() + 5));
    }
    std::sort(kept.begin(), kept.end());
    return kept;
  };
  EXPECT_EQ(steps_kept(), (std::vector<int>{5, 6, 7})) << first.output;
  EXPECT_TRUE(contains(first.output, "removed checkpoint " +
                                         (checkpoints / checkpoint_name(4)).string() +
                                         " (--keep-checkpoints 3)"))
      << first.output;
  for (const int step : steps_kept()) {
    EXPECT_EQ(checkpoint::load_checkpoint(checkpoints / checkpoint_name(step)).step, step);
  }
  // A checkpoint marked to keep stays whatever the limit; the latest is one of the newest.
  write_file_atomic(checkpoints / checkpoint_name(5) / "keep", "");
  const auto more = run_mpi(2, "train --resume " + (dir / "run").string() + " --steps 10");
  ASSERT_EQ(more.exit_code, 0) << more.output;
  EXPECT_EQ(steps_kept(), (std::vector<int>{5, 8, 9, 10})) << more.output;
  EXPECT_EQ(read_file(checkpoints / "latest"), checkpoint_name(10) + "\n");
  for (const int step : steps_kept()) {
    EXPECT_EQ(checkpoint::load_checkpoint(checkpoints / checkpoint_name(step)).step, step);
  }
}

// A stop whose save was killed before its commit (the test hook kills rank 1 in the save): the
// run directory says which step was being saved and which checkpoint is complete, and the next
// run says so before it resumes from that one.
TEST(CliMpi, AStopKilledBeforeItsSaveIsNamedByTheNextRun) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  const auto first = run_mpi(2, "train " + tiny_flags(dir, "run", 2));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const fs::path complete = dir / "run" / "checkpoints" / checkpoint_name(2);
  {
    malleus::testing::BackgroundCommand job(
        mpi_command(2,
                    "train --resume " + (dir / "run").string() +
                        " --steps 100000 --no-memory-checkpoints",  // the disk's case
                    "-x MALLEUS_FAULT_DIE_IN_SAVE=1"),
        dir / "job.out");
    ASSERT_TRUE(job.wait_for_output("step     4/", kTimeoutS)) << job.output();
    ::kill(rank_pid(job.pid(), 0), SIGTERM);
    EXPECT_NE(job.wait(kTimeoutS), -1) << job.output();
  }
  const auto record = train::read_stop_record(dir / "run");
  ASSERT_TRUE(record.has_value());
  EXPECT_FALSE(record->saved);
  EXPECT_EQ(record->signal, "SIGTERM");
  EXPECT_GE(record->step, 4);
  EXPECT_EQ(record->previous, complete.string());
  EXPECT_EQ(read_file(dir / "run" / "checkpoints" / "latest"), checkpoint_name(2) + "\n");
  const auto next = run_mpi(2, "train --resume " + (dir / "run").string() + " --steps " +
                                   std::to_string(record->step + 1));
  ASSERT_EQ(next.exit_code, 0) << next.output;
  EXPECT_TRUE(contains(
      next.output,
      "the last run was stopped by SIGTERM after step " + std::to_string(record->step) +
          ", but killed before its checkpoint (" + record->checkpoint +
          ") was complete; the latest complete checkpoint on disk is " + complete.string()))
      << next.output;
  EXPECT_TRUE(contains(next.output, "resuming from " + complete.string() + " at step 2"))
      << next.output;
  EXPECT_FALSE(fs::exists(train::stop_record_path(dir / "run")));
}
