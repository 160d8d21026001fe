// What a run tells: rank 0's header of a run on stdout and where each rank runs (ranks.json), and
// per step its line on stdout and its records in the metrics file (a re-plan's too).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "metrics/metrics.h"
#include "model/config.h"
#include "runtime/core_lease.h"
#include "runtime/engine.h"
#include "train/config.h"

namespace malleus::train {

// One step as Trainer::train_step returns it: its metrics record (the plan and ETA are filled
// when it is logged) and the controller's decision when it was asked.
struct StepStats : metrics::StepRecord {
  std::optional<metrics::ReplanRecord> replan;
  // The background part of an overlapped switch that this step finished: bytes over all ranks,
  // times and memory the most of any rank's.
  std::optional<runtime::BackgroundStats> switch_background;
};

// The engine's figures of a step into its record: every rank's compute time, peak memory by
// kind, and the recomputation issued ahead (every rank's, when some rank recomputed ahead).
void record_step_figures(const runtime::StepResult& result, StepStats* stats);

// What a run's header says besides its config and model.
struct RunHeader {
  int64_t train_tokens = 0;  // in the training data
  int world_size = 1;
  int threads = 1;        // per rank
  std::string plan_text;  // the plan's summary
  const runtime::CoreSharing* cores = nullptr;
  std::string devices;  // where the ranks compute on GPUs (open_devices); empty on the CPU
};

// Rank 0's header of a run on stdout (model, data, plan, cores, devices), and <out>/ranks.json:
// where each rank runs, for tools that slow a rank from outside (scripts/slow_rank.sh).
void announce(const std::filesystem::path& out, const model::ModelConfig& model,
              const TrainConfig& config, const RunHeader& header);

// The step line on stdout and its record (and any re-plan record) in the metrics file; `eta`: the
// time left, `restarts`: of the job before this run (by malleus launch).
void log_step(StepStats s, double eta, const std::string& plan_text, int64_t steps, int restarts,
              metrics::MetricsLog& metrics);

}  // namespace malleus::train
