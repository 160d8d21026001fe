// The experiments report (docs/experiments.md, `malleus experiments`, scripts/experiments.sh):
// every straggler scenario run through the simulator against every strategy, then the planner's
// stage-aware recomputation, the distributed optimizer and recomputation under harder memory
// conditions on each single situation. One function builds each table; the report joins them.
#pragma once

#include <string>
#include <vector>

namespace malleus::sim {

struct ExperimentsReport {
  std::string markdown;  // the whole document, for --out
  std::string console;   // the tables and verdicts without the prose and the details
};

// Runs the scenarios in `files` (reporting each to stderr as it starts). With a non-empty
// `svg_dir`, writes each trace's chart there as <name>.svg and links it relative to the folder
// of `out`, where the caller writes the markdown.
ExperimentsReport run_experiments(const std::vector<std::string>& files, const std::string& out,
                                  const std::string& svg_dir);

}  // namespace malleus::sim
