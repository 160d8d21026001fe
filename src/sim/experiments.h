// The experiments report (bench/results/experiments.md, `malleus experiments`,
// scripts/experiments.sh): every straggler scenario run through the simulator against every
// strategy, then the planner's stage-aware recomputation, the distributed optimizer and
// recomputation under harder memory conditions on each single situation; optionally the same
// strategies at 4,096-16,384 devices with the planning times. One function builds each table; the
// report joins them.
#pragma once

#include <string>
#include <vector>

namespace malleus::sim {

struct ExperimentsReport {
  std::string markdown;  // the whole document, for --out
  std::string console;   // the tables and verdicts without the prose and the details
};

struct ExperimentsRequest {
  std::vector<std::string> files;  // the scenarios of every table
  // Scenarios at thousands of devices (configs/scenarios/scale): only their strategy table and
  // our planner's planning times, in a section of their own at the end; none: no such section.
  std::vector<std::string> scale_files;
  std::string out;      // where the caller writes the markdown (charts are linked relative to it)
  std::string svg_dir;  // non-empty: each trace's chart is written there as <name>.svg
  int jobs = 1;         // scenarios simulated at once (each on its own thread)
};

// Runs the scenarios (reporting each to stderr as it starts) and composes the report.
ExperimentsReport run_experiments(const ExperimentsRequest& request);

}  // namespace malleus::sim
