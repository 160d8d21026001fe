// Progress output: the human-readable step line and the JSONL metrics file carry the same fields.
// The records of metrics.jsonl are declared here once, as structs with one field list each
// (metrics.cpp); the trainer writes them and `malleus report` reads them back through the same
// lists, so writer and reader cannot disagree on a key.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common/json.h"

namespace malleus::metrics {

// Numbers that are unknown are NaN: left out when written, and NaN when absent or null on reading
// (nlohmann writes NaN and infinity as null).
inline constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();

// One optimizer step.
struct StepRecord {
  int64_t step = 0;  // 1-based number of the update just made
  double loss = kUnknown, lr = kUnknown, grad_norm = kUnknown;
  double tokens_per_s = kUnknown, step_time_s = kUnknown, eta_s = kUnknown;
  int64_t consumed_samples = 0;
  std::string plan;                // the plan's summary
  std::vector<double> rates;       // monitored straggle rate of every rank; empty when not measured
  std::vector<double> injected;    // injected rate of every rank; empty when nothing was injected
  std::vector<double> compute_s;   // every rank's measured compute time (the monitor's input)
  std::vector<double> link_rates;  // monitored rate of every node's link; empty on one host
  std::vector<double> link_s;      // every rank's measured link probe time (the link monitor's
                                   // input); empty on one host
  double monitor_overhead_s = kUnknown;  // monitoring and deciding, a re-plan's migration included
  // Every rank's peak memory during the step, from its own allocations: the peak of the total,
  // and each kind's own peak (backend/memory.h), in bytes.
  std::vector<double> peak_memory_bytes;
  std::vector<double> peak_parameters_bytes, peak_gradients_bytes, peak_optimizer_bytes,
      peak_activations_bytes, peak_workspace_bytes, peak_communication_bytes;
  // Every rank's recomputation done ahead of the gradient it waits for (the shifted schedule),
  // and the part of it done while the gradient was still on its way (a lower bound), in seconds;
  // empty when no rank recomputes ahead.
  std::vector<double> recompute_ahead_s, recompute_overlapped_s;
};

// One evaluation on held-out data.
struct EvalRecord {
  int64_t step = 0;
  double val_loss = kUnknown;
};

// One decision of the straggler loop's controller (elastic/loop.h): the one record of it, which
// the metrics line, the log line (describe) and Python's Decision all show, by the keys of its
// field list (metrics/schema.h). "event" is "replan" when it switched, "replan_declined" when not.
// Its numbers are rank 0's reasoning, broadcast with the plan, so every rank holds the same record.
struct ReplanRecord {
  bool switched = false;
  int64_t step = 0;
  std::vector<double> rates;       // the (effective) rates planned for
  std::vector<double> link_rates;  // and link rates, per node (empty on one host)
  std::string old_plan, new_plan;  // summaries; new_plan is empty when no plan was found
  std::string reason;              // why declined (also why no plan was found)
  // How the plan was searched: "incremental" (from the running plan: few devices' rates moved) or
  // "full"; empty when no plan was weighed.
  std::string search;
  bool held = false;  // on hold: a plan the switch rule (or the mean rates) would take was declined
  // The switch rule's question (replan::SwitchQuestion) and answer: the predicted time per step of
  // the running plan and of the proposed one, their difference, the predicted cost of switching,
  // the steps the gain is counted over; unknown when no plan was weighed.
  double predicted_old_s = kUnknown, predicted_new_s = kUnknown, predicted_gain_s = kUnknown;
  double predicted_migration_s = kUnknown;
  int64_t horizon_steps = 0;
  double planning_s = kUnknown;
  int64_t bytes_moved = 0;        // measured by the engine (switched only)
  double migration_s = kUnknown;  // measured wall time (switched only)
  // The most any rank's memory rose above max(its memory before, after) while migrating, from the
  // memory ledger, and the bound it was given (switched only).
  int64_t migration_peak_extra_bytes = 0, migration_bucket_bytes = 0;
  // An overlapped switch: the Adam moments' bytes (not in bytes_moved) that moved in the
  // background of the new plan's first step; bytes_moved and migration_s are the part before it.
  int64_t migration_background_bytes = 0;
};

// The log line of a decision: "re-plan at step N: old -> new | predicted ... (planning ...)" or
// "re-plan declined at step N: why".
std::string describe(const ReplanRecord& record);

// One restart of the job by `malleus launch` after it lost ranks: "event" is "restart".
struct RestartRecord {
  int64_t step = 0;                 // the checkpoint the job restarts from
  int64_t restart = 0;              // 1 for the first restart of the run
  int64_t failed_at_step = 0;       // the last step the failed job logged
  int64_t steps_lost = 0;           // failed_at_step - step: work done again
  std::string reason;               // "killed", "hung"
  std::string detail;               // mpirun's or the watchdog's words
  std::vector<int64_t> lost_ranks;  // ranks of the failed job
  int64_t ranks_before = 0, ranks_after = 0;
  double failed_at = kUnknown;  // Unix time the failed job ended
  // The hosts the watchdog found cut off from the others (reason "cut off"), left out.
  std::vector<std::string> cut_off_hosts;
  // "mpirun": it ended the failed job itself; "launch": it had not within the grace period, and the
  // supervisor ended it and its local ranks.
  std::string ended_by;
  // Ranks of the failed job still running after the supervisor ended what it could (on hosts it
  // cannot reach), and the words naming them ("rank 2 (pid 1234 on node1)").
  std::vector<int64_t> unended_ranks;
  std::string unended;
};

using MetricsRecord = std::variant<StepRecord, EvalRecord, ReplanRecord, RestartRecord>;

Json to_json(const MetricsRecord& record);
// The record of one line. nullopt for a kind this reader does not know (newer trainers may add
// some); unknown keys are ignored. Throws Error naming `where` and the key for a known key of the
// wrong type or a missing required key ("step"; "val_loss" of an evaluation).
std::optional<MetricsRecord> parse_record(const Json& object, const std::string& where);

// Appends one JSON object per line. A line is in the file whole or not at all: a write that fails
// (a full disk) is cut back off before the error is thrown, and a torn last line left by a crash
// in the middle of a write is removed, with a warning, when the file is opened again; so readers
// (`malleus report`) never meet half a record, and later runs append after whole lines.
class MetricsLog {
 public:
  explicit MetricsLog(const std::filesystem::path& path);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const MetricsRecord& record);
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace malleus::metrics
