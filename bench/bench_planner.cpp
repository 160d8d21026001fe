// Planning time and memory of the malleus planner against the number of devices (issue 25):
// llama-70b on A800 nodes of 8, 16 sequences per node and step, under the rate patterns of
// bench/planner_situations.h. Per size and pattern: the full search as `malleus plan` runs it
// (the simulator re-ranking its best candidates), where its time went by phase, the incremental
// re-plan after a few devices' rates change from there (PlanRequest::previous_rates), and the
// peak resident memory of a process that does only that (each measurement runs in a child
// process). Targets: full ≤ 1 s at 1,024 devices and ≤ 10 s at 16,384; incremental ≤ 1 s at
// 16,384; one thread.
//
//   build/bench/bench_planner [MAX_DEVICES [REPEATS]]   (defaults 16384, 1)
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "bench/planner_situations.h"
#include "common/stats.h"
#include "model/config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/planner.h"
#include "replan/replan.h"
#include "sim/scenario.h"

using namespace malleus;

namespace {

// What one child process measured.
struct Measurement {
  double full_s = 0, incremental_s = 0;
  double phases[8] = {};  // full search by phase, in PlanResult::phases order
  char phase_names[8][16] = {};
  int phase_count = 0;
  double incremental_phases[8] = {};  // the incremental re-plan's, likewise
  char incremental_phase_names[8][16] = {};
  int incremental_phase_count = 0;
  double full_iteration = 0, incremental_iteration = 0, full_replan_iteration = 0;
  int changed = 0;
  bool incremental_used = false;
  char summary[96] = {};
};

// The rates after a change of a few devices from `rates`: two more devices slow, one slow device
// recovers (8 devices at most change, as the incremental re-plan expects).
plan::Rates changed_rates(plan::Rates rates) {
  const size_t n = rates.size();
  rates[n / 2 + 3] = 4.0;
  rates[n - 5] = 2.5;
  for (size_t d = 0; d < n; ++d) {
    if (rates[d] > 1 && !plan::is_gone(rates[d]) && d != n / 2 + 3 && d != n - 5) {
      rates[d] = 1.0;
      break;
    }
  }
  return rates;
}

Measurement measure(const plan::CostModel& cost, const plan::Rates& rates, int repeats) {
  Measurement m;
  plan::PlannerOptions options = replan::with_migration_tie_break({}, cost);
  options.refine = sim::simulator_evaluator(cost);
  const auto planner = plan::make_strategy("malleus", options);
  std::vector<double> full, incremental;
  plan::PlanResult r;
  for (int i = 0; i < repeats; ++i) {
    r = planner->plan(cost, {rates, plan::Shape{}, std::nullopt});
    full.push_back(r.planning_seconds);
  }
  m.full_s = median(full);
  m.full_iteration = r.prediction.iteration_time;
  m.phase_count = static_cast<int>(std::min<size_t>(r.phases.size(), 8));
  for (int p = 0; p < m.phase_count; ++p) {
    m.phases[p] = r.phases[static_cast<size_t>(p)].seconds;
    std::snprintf(m.phase_names[p], sizeof m.phase_names[p], "%s",
                  r.phases[static_cast<size_t>(p)].name.c_str());
  }
  std::snprintf(m.summary, sizeof m.summary, "%s", r.plan.summary().c_str());
  // The incremental re-plan from that plan, after a few rates change.
  const plan::Rates after = changed_rates(rates);
  for (size_t d = 0; d < after.size(); ++d) m.changed += after[d] != rates[d] ? 1 : 0;
  plan::PlanRequest request{after, plan::Shape{}, r.plan};
  request.previous_rates = rates;
  plan::PlanResult inc;
  for (int i = 0; i < repeats; ++i) {
    inc = planner->plan(cost, request);
    incremental.push_back(inc.planning_seconds);
  }
  m.incremental_s = median(incremental);
  m.incremental_iteration = inc.prediction.iteration_time;
  m.incremental_used = inc.incremental;
  m.incremental_phase_count = static_cast<int>(std::min<size_t>(inc.phases.size(), 8));
  for (int p = 0; p < m.incremental_phase_count; ++p) {
    m.incremental_phases[p] = inc.phases[static_cast<size_t>(p)].seconds;
    std::snprintf(m.incremental_phase_names[p], sizeof m.incremental_phase_names[p], "%s",
                  inc.phases[static_cast<size_t>(p)].name.c_str());
  }
  // What the full search gives for the new rates, for comparison.
  m.full_replan_iteration =
      planner->plan(cost, {after, plan::Shape{}, std::nullopt}).prediction.iteration_time;
  return m;
}

// Runs `measure` in a child process; returns its result and the child's peak resident memory.
bool measure_in_child(const plan::CostModel& cost, const plan::Rates& rates, int repeats,
                      Measurement& out, double& peak_mib) {
  int fds[2];
  if (pipe(fds) != 0) return false;
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const Measurement m = measure(cost, rates, repeats);
    const ssize_t wrote = write(fds[1], &m, sizeof m);
    _exit(wrote == static_cast<ssize_t>(sizeof m) ? 0 : 1);
  }
  close(fds[1]);
  const ssize_t got = read(fds[0], &out, sizeof out);
  close(fds[0]);
  int status = 0;
  rusage usage{};
  wait4(pid, &status, 0, &usage);
  peak_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;
  return got == static_cast<ssize_t>(sizeof out) && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int max_devices = bench::positive_arg(argc, argv, 1, 16384);
  const int repeats = bench::positive_arg(argc, argv, 2, 1);
  const model::ModelConfig model = model::load_model_config("llama-70b");
  std::printf("%7s  %-20s %8s %8s %8s  %-62s %s\n", "devices", "rates", "full s", "incr s",
              "peak MiB", "full search by phase (s)",
              "after the change: predicted iteration, incremental / full re-plan; devices changed");
  for (int devices = 64; devices <= max_devices; devices *= 4) {
    plan::ClusterSpec cluster = plan::load_cluster("a800-8x8");
    cluster.nodes = devices / cluster.devices_per_node;
    const plan::CostModel cost(model, cluster, plan::BatchConfig{16 * cluster.nodes, 1, 4096});
    for (const auto& pattern : bench::rate_patterns(devices)) {
      if (pattern.name != "3 slow (2x, 3x, 5x)" && pattern.name != "node 2x + one gone") continue;
      Measurement m;
      double peak = 0;
      if (!measure_in_child(cost, pattern.rates, repeats, m, peak)) {
        std::printf("%7d  %-20s failed\n", devices, pattern.name.c_str());
        continue;
      }
      std::string phases;
      for (int p = 0; p < m.phase_count; ++p) {
        char buf[48];
        std::snprintf(buf, sizeof buf, "%s%s %.2f", p ? ", " : "", m.phase_names[p], m.phases[p]);
        phases += buf;
      }
      std::printf("%7d  %-20s %8.3f %8.3f %8.0f  %-62s %.4f / %.4f s (%+.2f %%); %d%s\n", devices,
                  pattern.name.c_str(), m.full_s, m.incremental_s, peak, phases.c_str(),
                  m.incremental_iteration, m.full_replan_iteration,
                  100 * (m.incremental_iteration / m.full_replan_iteration - 1), m.changed,
                  m.incremental_used ? "" : " (fell back to the full search)");
      std::string inc;
      for (int p = 0; p < m.incremental_phase_count; ++p) {
        char buf[48];
        std::snprintf(buf, sizeof buf, "%s%s %.2f", p ? ", " : "", m.incremental_phase_names[p],
                      m.incremental_phases[p]);
        inc += buf;
      }
      std::printf("%7s  %-20s %8s %8s %8s  incremental by phase (s): %s\n", "", "", "", "", "",
                  inc.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
