// `malleus report`: reads a run's metrics.jsonl and draws what the straggler-tolerance loop did
// (throughput, per-rank straggle rates, loss, re-plans) as one self-contained SVG, plus a short
// text summary. Records are read through the metrics schema the trainer writes with
// (metrics/metrics.h); the chart is drawn with the shared SVG writer (svg/svg.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "metrics/metrics.h"

namespace malleus::report {

// A record and its 1-based line in the file, which orders records of different kinds.
template <typename Record>
struct Numbered : Record {
  size_t line = 0;
};

using StepRecord = Numbered<metrics::StepRecord>;
using EvalRecord = Numbered<metrics::EvalRecord>;
using ReplanRecord = Numbered<metrics::ReplanRecord>;

struct Report {
  std::string source;  // the file name, for titles and messages
  std::vector<StepRecord> steps;
  std::vector<EvalRecord> evals;
  std::vector<ReplanRecord> replans;   // the controller switched plans
  std::vector<ReplanRecord> declined;  // it was asked and kept the plan

  // Ranks seen in any step record's rates or injected rates.
  size_t num_ranks() const;
};

// Reads a metrics file. Throws Error for a missing file, and, naming the file and line, for a line
// that is not a JSON object or whose known keys have the wrong type. Unknown keys, unknown record
// kinds and blank lines are skipped, so newer trainers stay readable.
Report read_metrics(const std::filesystem::path& path);
// The same on text already in memory; `source` names it in error messages.
Report parse_metrics(const std::string& text, const std::string& source);

// The steps run under one plan: the step records between two re-plan records (in file order).
struct PlanSegment {
  std::string plan;  // of the segment's first step record ("" if the trainer wrote none)
  int64_t first_step = 0, last_step = 0;
  size_t num_steps = 0;
  double mean_tokens_per_s = 0;  // arithmetic mean over steps with a value; NaN if none
};
std::vector<PlanSegment> plan_segments(const Report& report);

// Steps, throughput overall and per plan segment, re-plans and bytes moved; several lines, each
// ending in '\n'.
std::string summarize(const Report& report);

struct RenderOptions {
  std::string title;  // default: "malleus timeline: <source>"
  int width = 1100;   // pixels; the height follows from the content
};

// Three panels on one step axis: throughput (with a moving median), per-rank straggle rates
// (measured solid, injected dashed) and loss (train line, val points); dashed vertical lines at
// re-plans with a tooltip of bytes moved and migration time, grey markers at declined re-plans.
std::string render_svg(const Report& report, const RenderOptions& options = {});

}  // namespace malleus::report
