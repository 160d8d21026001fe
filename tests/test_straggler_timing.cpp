// The straggler monitor end to end, on real time: `malleus train` under mpirun, slowed from
// outside malleus (a busy process on a rank's core, started and stopped by scripts/slow_rank.sh
// as the run reaches given steps) or by injection, and the rates read back from metrics.jsonl.
//
// These tests need the whole machine (their figures are timings), so CTest runs them alone
// (RUN_SERIAL) and they run in a session of their own (run_in_own_session); "Slow" in the name
// keeps them out of the sanitizer build, whose timings mean nothing. Whatever slows a rank is
// stopped by slow_rank.sh when the run ends or the test's shell is interrupted, and carries its own
// time limit besides.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <vector>

#include "common/json.h"
#include "test_util.h"
#include "watchdog/watchdog.h"

using namespace malleus;
namespace fs = std::filesystem;
using malleus::testing::CommandResult;
using malleus::testing::run_command;
using malleus::testing::ScratchDir;

namespace {

struct Step {
  double time_s = 0;
  std::vector<double> rates;
  std::vector<double> compute_s;  // every rank's measured compute time
  std::string plan;
};

struct TrainingRun {
  std::map<int, Step> steps;
  std::vector<int> replans;  // steps at which the plan changed
  std::string output;
};

TrainingRun read_run(const fs::path& dir, const std::string& output) {
  TrainingRun run;
  run.output = output;
  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const Json r = Json::parse(line);
    if (r.contains("event")) {
      if (r["event"] == "replan") run.replans.push_back(r["step"].get<int>());
    } else if (r.contains("step_time_s")) {
      Step& s = run.steps[r["step"].get<int>()];
      s.time_s = r["step_time_s"].get<double>();
      s.rates = r["rates"].get<std::vector<double>>();
      s.compute_s = r["compute_s"].get<std::vector<double>>();
      s.plan = r["plan"].get<std::string>();
    }
  }
  return run;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
}

double median_step_time(const TrainingRun& run, int first, int last) {
  std::vector<double> times;
  for (int s = first; s <= last; ++s) times.push_back(run.steps.at(s).time_s);
  return median(times);
}

double median_compute(const TrainingRun& run, size_t rank, int first, int last) {
  std::vector<double> seconds;
  for (int s = first; s <= last; ++s) seconds.push_back(run.steps.at(s).compute_s.at(rank));
  return median(seconds);
}

double median_rate(const TrainingRun& run, size_t rank, int first, int last) {
  std::vector<double> rates;
  for (int s = first; s <= last; ++s) rates.push_back(run.steps.at(s).rates.at(rank));
  return median(rates);
}

// The first step in [first, last] at which `pred` holds for that step, or -1.
template <typename Pred>
int first_step(const TrainingRun& run, int first, int last, Pred pred) {
  for (int s = first; s <= last; ++s) {
    if (run.steps.count(s) && pred(run.steps.at(s))) return s;
  }
  return -1;
}

// Every step's rates, for the failure message.
std::string rate_table(const TrainingRun& run) {
  std::ostringstream out;
  for (const auto& [step, s] : run.steps) {
    out << "step " << step << ": " << s.time_s << " s, rates";
    for (double r : s.rates) out << " " << r;
    out << " | " << s.plan << "\n";
  }
  return out.str();
}

// The demo model at sequence 128 and micro-batches of 1 (a ~50 ms forward and backward per
// micro-batch on one core: long against the scheduler's few-ms time slices, so a shared core
// shows as a steady slowdown), trained on the synthetic corpus with one thread per rank.
std::string train_flags(const ScratchDir& dir, const std::string& run, int steps,
                        int global_batch) {
  std::ostringstream f;
  f << "train --model demo --seq-len 128 --micro-batch 1 --global-batch " << global_batch
    << " --threads 1 --steps " << steps << " --warmup-steps 2 --lr 1e-3 --eval-every 0"
    << " --checkpoint-every 0 --val-data '' --train-data '" << (dir / "data").string()
    << "/train_*.bin' --out " << (dir / run).string();
  return f.str();
}

std::string mpirun(int ranks, const std::string& placement) {
  return malleus::testing::kMpiEnvironment + "timeout 300 " MALLEUS_MPIRUN " " + placement +
         " -np " + std::to_string(ranks) + " " MALLEUS_BINARY " ";
}

// Runs a bash script in a session of its own (tests/own_session.sh: on a machine shared with
// other people's builds a timing test would otherwise get a fraction of the cores that changes
// from one step to the next). Everything the test starts — the ranks and the busy processes meant
// to slow one of them — is in that one session, so they still share a core among themselves as
// Linux shares any core.
CommandResult run_in_own_session(const ScratchDir& dir, const std::string& script) {
  const fs::path path = dir / "run.sh";
  std::ofstream(path) << script << "\n";
  return run_command(MALLEUS_SOURCE_DIR "/tests/own_session.sh bash " + path.string());
}

// A step that took this long stalled: the busy-core runs' steps take 0.3-1 s.
constexpr double kStalledStepS = 20;

// `malleus train` on 2 ranks bound one per core, with busy processes on rank 1's core from
// step `from` to step `to` (scripts/slow_rank.sh). The script waits for both and stops the
// slower on the way out; the busy processes carry a time limit of their own besides.
TrainingRun train_with_busy_core(const ScratchDir& dir, const std::string& name, int steps,
                                 int from, int to, const std::string& extra) {
  const std::string out = (dir / name).string();
  const std::string script =
      "cd " MALLEUS_SOURCE_DIR "\nexport SLOW_RANK_LIMIT_S=300\nscripts/slow_rank.sh " + out +
      " 1 " + std::to_string(from) + " " + std::to_string(to) +
      " busy:2 &\nslower=$!\ntrap 'kill $slower 2> /dev/null' EXIT\n" +
      mpirun(2, "--bind-to core --map-by core") + train_flags(dir, name, steps, 16) +
      " --watchdog-floor " + std::to_string(static_cast<int>(kStalledStepS)) + " " + extra +
      "\nstatus=$?\nwait $slower\nexit $status";
  CommandResult r = run_in_own_session(dir, script);
  // A stall inside the re-plan's switch, seen in CI a few times in 30 runs of the tier and never
  // alone: the watchdog ended it (rank 1 in munmap as the old model was freed, rank 0 waiting for
  // it in the switch's all-reduce), or the switch took 83 s and the controller then rightly held
  // still, so nothing was re-planned after the busy processes ended. Cause not proven; the kernel
  // state of the last one (2026-11-28, the first test of the tier) points at the machine: rank 1
  // waited 120 s uninterruptible in anon_vma_clone (munmap's split_vma) with 3.6 s of CPU, rank 0
  // spun in MPI's sched_yield on the other core at the session's nice -20, and this VM runs a
  // DAMON pageout scheme (kdamond.0, physical addresses) that walks and unmaps pages under the
  // same locks at nice 0. The watchdog's floor is kStalledStepS here (not 120 s), so a stall ends
  // in 20 s. The run's output (with the watchdog's stacks and the kernel's state of each rank's
  // thread, if it hung) is printed in full and the run made once more, so that a rare stall
  // neither hides what this test measures nor goes unseen; two in a row fail.
  const auto stalled = [](const TrainingRun& run) {
    return std::any_of(run.steps.begin(), run.steps.end(),
                       [](const auto& s) { return s.second.time_s > kStalledStepS; });
  };
  TrainingRun run = read_run(dir / name, r.output);
  if (r.exit_code == malleus::watchdog::kHangExitCode || stalled(run)) {
    std::printf(
        "  the run stalled (exit %d; steps take about a second, one over %.0f s); its "
        "output, then a second try:\n%s\n%s\n",
        r.exit_code, kStalledStepS, rate_table(run).c_str(), r.output.c_str());
    fs::remove_all(out);
    r = run_in_own_session(dir, script);
    run = read_run(dir / name, r.output);
  }
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return run;
}

}  // namespace

TEST(SlowStragglerTiming, ABusyProcessOnARanksCoreIsMeasuredReplannedAroundAndSeenToEnd) {
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  constexpr int kFrom = 10, kTo = 20, kSteps = 30;

  // The slowdown itself, without re-planning: how much longer rank 1's compute took with two
  // busy processes on its core than just before they started (the elapsed time of the same work
  // under the same plan), and how much longer the job's steps took (rank 1 paces every step of
  // the uniform plan, so they must be slower too; on a machine shared with other work, rank 0 may
  // have paced the healthy steps, so this one is only a check that the slowdown is real). This
  // run ends 5 slowed steps after the sliding median has turned, sooner than the re-planning run
  // below.
  constexpr int kFixedTo = kFrom + 6;
  const TrainingRun fixed =
      train_with_busy_core(dir, "fixed", kFixedTo, kFrom, kFixedTo, "--no-replan");
  ASSERT_EQ(fixed.steps.size(), size_t{kFixedTo}) << fixed.output;
  const double slowdown =
      median_compute(fixed, 1, kFrom + 2, kFixedTo) / median_compute(fixed, 1, 3, kFrom - 1);
  const double step_slowdown =
      median_step_time(fixed, kFrom + 2, kFixedTo) / median_step_time(fixed, 3, kFrom - 1);
  std::printf("  slowdown without re-planning: rank 1's compute %.2fx, the job's steps %.2fx\n",
              slowdown, step_slowdown);
  ASSERT_GT(step_slowdown, 1.5) << "two busy processes should slow rank 1, and the job, about 3x\n"
                                << rate_table(fixed);
  // The monitor reads that slowdown under that plan. Its rates are against the fastest the rank
  // has been (its healthy reference), and a core shared with other work can already read above
  // 1 before the busy processes start (CI measured 1.37), so it is the rise in the rate across
  // the same two windows that must match the rise in compute time.
  const double rate_rise =
      median_rate(fixed, 1, kFrom + 2, kFixedTo) / median_rate(fixed, 1, 3, kFrom - 1);
  EXPECT_NEAR(rate_rise, slowdown, 0.25 * slowdown) << rate_table(fixed);

  const TrainingRun run = train_with_busy_core(dir, "replan", kSteps, kFrom, kTo, "");
  ASSERT_EQ(run.steps.size(), size_t{kSteps}) << run.output;
  const std::string table = rate_table(run) + run.output;
  // Seen within 3 steps of the start: rank 1 reads at least 1.5 (above the controller's
  // straggler threshold, 1.2). How accurately it reads is checked above, against the slowdown of
  // the same run: two runs on a shared machine need not slow rank 1 by the same factor (measured
  // 2.3x in one and 2.9x in the next), so comparing this run's rate with the other run's slowdown
  // would test the machine, not the monitor.
  const int seen = first_step(run, kFrom, kTo, [&](const Step& s) { return s.rates[1] >= 1.5; });
  EXPECT_GE(seen, kFrom) << table;
  EXPECT_LE(seen, kFrom + 2) << table;
  // Re-planned around, while it lasts.
  const auto replan = std::find_if(run.replans.begin(), run.replans.end(),
                                   [&](int s) { return s >= kFrom && s <= kTo; });
  ASSERT_NE(replan, run.replans.end()) << table;
  // Under the new plan rank 1 still reads slow, so the re-plan is not undone by a mismeasure.
  EXPECT_GT(median_rate(run, 1, *replan + 1, kTo), 1.5) << table;
  // Healthy again within 3 steps of the busy processes ending (after step kTo is logged), and
  // re-planned for it: below the controller's straggler threshold (1.2), or where the machine's
  // other work had rank 1 above it before the slowdown, back within 15 % of that level.
  const double healthy_rate = std::max(1.2, 1.15 * median_rate(run, 1, 3, kFrom - 1));
  const int healed =
      first_step(run, kTo + 1, kSteps, [&](const Step& s) { return s.rates[1] <= healthy_rate; });
  EXPECT_GE(healed, kTo + 1) << table;
  EXPECT_LE(healed, kTo + 3) << table;
  EXPECT_TRUE(std::any_of(run.replans.begin(), run.replans.end(), [&](int s) { return s > kTo; }))
      << table;
}

TEST(SlowStragglerTiming, TwoInjectedStragglersOnFourRanksAreEachMeasured) {
  // 4 ranks on 2 cores (malleus binds them and lets the two ranks of a core take turns), rank 0
  // made 2x and rank 2 5x slower by injection — which only makes them compute longer; the rates
  // come from measured time like any other. Re-planning is off so every rank keeps its work.
  ScratchDir dir;
  malleus::testing::write_synthetic_corpus(dir / "data");
  constexpr int kFrom = 6, kSteps = 15;  // 8 slowed steps judged, from kFrom + 2
  const std::string from = std::to_string(kFrom);
  const CommandResult r = run_in_own_session(
      dir, mpirun(4, "--oversubscribe") + train_flags(dir, "run", kSteps, 16) +
               " --no-replan --straggler 0:2:" + from + "- --straggler 2:5:" + from + "-");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("take turns (core lease"), std::string::npos) << r.output;
  const TrainingRun run = read_run(dir / "run", r.output);
  ASSERT_EQ(run.steps.size(), size_t{kSteps}) << r.output;
  const std::string table = rate_table(run);
  // Over the slowed steps (from the second on, once the sliding median has turned) each slowed
  // rank's rate is within 20 % of its slowdown, and no single step is off by more than 35 %.
  // A healthy rank reads the machine's other work as well: rates are against the fastest the rank
  // has been, and this machine's cores change speed by themselves (bench_core_speed: a core's
  // fastest second 1.6-1.9x its slowest, on the idle machine; CI read both healthy ranks at
  // 1.43-1.52 for two or three steps, in the tier's first minute). So a healthy
  // rank's median is 1 ± 0.25, and each step below 2, the smaller slowdown: the failure this test
  // is for, a rank taking turns with a slowed one reading that rank's 2x or 5x, fails both.
  const std::vector<double> truth = {2, 1, 5, 1};
  // A step at which every rank reads above its own slowdown is a stall of the whole machine, not
  // a rank reading its neighbour's: CI saw all four ranks at 1.25-2.66x their slowdown for two
  // steps (a pause of ~0.1 s added to every rank's compute weighs 2.5x on a healthy rank's and
  // 1.25x on the 5x rank's). The failure this test is for leaves the slowed ranks at their own
  // rate, so it cannot hide there. Such steps are left out of the per-step checks, at most 3 of
  // the 8; the medians keep them.
  const auto stalled = [&](int s) {
    for (size_t rank = 0; rank < 4; ++rank) {
      if (run.steps.at(s).rates.at(rank) < 1.15 * truth[rank]) return false;
    }
    return true;
  };
  int stalls = 0;
  for (int s = kFrom + 2; s <= kSteps; ++s) stalls += stalled(s) ? 1 : 0;
  ASSERT_LE(stalls, 3) << "the whole machine stalled at " << stalls << " of the judged steps\n"
                       << table;
  for (size_t rank = 0; rank < 4; ++rank) {
    const bool slow = truth[rank] > 1;
    EXPECT_NEAR(median_rate(run, rank, kFrom + 2, kSteps), truth[rank],
                slow ? 0.2 * truth[rank] : 0.25)
        << "rank " << rank << "\n"
        << table;
    for (int s = kFrom + 2; s <= kSteps; ++s) {
      if (stalled(s)) continue;
      const double rate = run.steps.at(s).rates[rank];
      if (slow) {
        EXPECT_NEAR(rate, truth[rank], 0.35 * truth[rank])
            << "step " << s << ", rank " << rank << "\n"
            << table;
      } else {
        EXPECT_LT(rate, 2.0) << "step " << s << ", rank " << rank << "\n" << table;
      }
    }
  }
}
