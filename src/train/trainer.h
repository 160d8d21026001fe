// The training loop over any parallel plan: each step samples the global batch (the same
// sequences whatever the plan), runs the runtime engine (1F1B, tensor and data parallelism,
// gradient sync, clipping, AdamW), and on schedule evaluates, logs (rank 0) and checkpoints
// (sharded: each rank writes the pieces it owns, in the background;
// checkpoint/checkpoint_writer.h). Resuming from a checkpoint — under the same plan or another —
// continues exactly where it stopped.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/memory_checkpoint.h"
#include "comm/communicator.h"
#include "data/dataset.h"
#include "elastic/controller.h"
#include "elastic/monitor.h"
#include "elastic/stragglers.h"
#include "metrics/metrics.h"
#include "plan/plan.h"
#include "runtime/core_lease.h"
#include "runtime/engine.h"
#include "train/config.h"
#include "train/schedule.h"

namespace malleus::train {

class Watchdog;

// One step as train_step returns it: its metrics record (the plan and ETA are filled when it is
// logged) and the controller's decision when it was asked.
struct StepStats : metrics::StepRecord {
  std::optional<metrics::ReplanRecord> replan;
  // The background part of an overlapped switch that this step finished: bytes over all ranks,
  // times and memory the most of any rank's.
  std::optional<runtime::BackgroundStats> switch_background;
};

// With memory_checkpoint_every 0, memory checkpoints come every K steps, K the fewest that keep a
// save's measured time under this share of the steps' (Trainer::save_to_memory).
inline constexpr double kMemoryCheckpointBudget = 0.05;
// ... measured over the saves so far, once there are this many (one every step until then).
inline constexpr size_t kMemoryCheckpointProbes = 3;

// The "plan" value that asks for the planner's plan (malleus launch restarts with it, on however
// many ranks are left).
inline constexpr const char* kPlannerPlan = "auto";

// The plan a config asks for on `world_size` ranks: its plan file, the planner's plan for the
// cluster preset with every rank healthy ("auto"), or the uniform dp × tp × pp plan. Validated
// against the model, the world size and the global batch; throws Error otherwise.
plan::Plan resolve_plan(const TrainConfig& config, const model::ModelConfig& model, int world_size);

// The run stopped at a step whose loss or gradient norm was not finite (Trainer::run).
class Diverged : public Error {
 public:
  using Error::Error;
};

// How a Trainer's model state starts: initialised from the config's seed (a fresh run), or left
// for restore() to fill (a resumed run: initialising parameters that a checkpoint then
// overwrites took most of a large model's restart, docs/performance.md#recovery).
enum class InitialState { kFromSeed, kRestoredLater };

class Trainer {
 public:
  // Collective over `world`. The model is fitted to the training data's tokenizer
  // (fit_model_to_tokenizer), which every checkpoint of the run records. With
  // InitialState::kRestoredLater the parameters are allocated but not initialised: training
  // (run, train_step, evaluate, snapshot) throws Error until a restore() has succeeded.
  Trainer(const TrainConfig& config, const model::ModelConfig& model_config,
          comm::Communicator world, InitialState initial = InitialState::kFromSeed);

  // Collective: continues from a checkpoint whose buffers are read on rank 0 (other ranks may
  // pass a checkpoint without buffers; see load_checkpoint_on_root). Throws Error if the
  // checkpoint's tokenizer differs from the training data's, or if it is damaged (a sharded one
  // is read by every rank: the first rank's error, on every rank); the trainer's state is then
  // not usable until another restore() succeeds, unless it had been initialised and nothing was
  // read yet.
  void restore(const checkpoint::Checkpoint& checkpoint);
  // Collective: the whole state, on rank 0 (other ranks get empty buffers).
  checkpoint::Checkpoint snapshot();

  // One step. Its loss and gradient norm may be non-finite (then nothing was updated): run()
  // stops there.
  StepStats train_step();
  // Mean token loss over up to max_samples sequences of `pattern` (all of them if fewer), in a
  // fixed order that depends on neither the plan nor the batch size. Collective.
  double evaluate(const std::string& pattern, int max_samples);
  double evaluate(const data::TokenDataset& dataset, int max_samples);

  // The whole run from the current step to config.steps: step lines on stdout and metrics in
  // <out_dir>/metrics.jsonl (rank 0), evaluations, checkpoints in <out_dir>/checkpoints.
  // Returns 0, or the signal that stopped it early (train/stop_signal.h: a signal received on any
  // rank stops every rank after the same step, with a checkpoint of that step). Collective.
  // A step whose loss or gradient norm is not finite (the same on every rank: one all-reduce
  // carries both) updates nothing and ends the run on every rank together: the checkpoint in
  // flight, of an earlier step, is committed, nothing more is saved, and every rank throws
  // Diverged naming the step and the last checkpoint (docs/running.md).
  int run();

  // Restarts of the job before this run (by malleus launch): shown in the step lines.
  void set_restarts(int restarts) { restarts_ = restarts; }

  int64_t step() const { return step_; }
  int64_t consumed_samples() const { return consumed_samples_; }
  const TrainConfig& config() const { return config_; }
  runtime::Engine& engine() { return *engine_; }
  bool is_root() const { return world_.rank() == 0; }

 private:
  // Collective: starts a sharded checkpoint of this step (in the background unless
  // config.async_checkpoints is off); poll_checkpoint commits it once every rank has written its
  // part, finish_checkpoint waits for that.
  void save(const std::filesystem::path& root);
  // The checkpoint header of this step (model, config, progress, tokenizer) and this rank's part
  // of the state, as both kinds of save take them.
  checkpoint::Checkpoint checkpoint_header() const;
  std::vector<checkpoint::SavedKind> saved_state() const;
  // Collective: the memory checkpoint of this step when one is due (every memory_every_ steps);
  // with memory_checkpoint_every 0, memory_every_ is then chosen again from the save's time and
  // `step_s`, the recent step time. A save that fails turns memory checkpoints off for the rest
  // of the run, with a warning: the disk checkpoints go on.
  void save_to_memory_if_due(double step_s);
  // Collective: this run's memory copies removed (the run ended, or a fresh run supersedes them).
  void clear_memory_checkpoints();
  // Rank 0's line at the end of a run: how many memory saves, and what they took.
  void report_memory_checkpoints() const;
  void poll_checkpoint();
  void finish_checkpoint();
  // "saved checkpoint ..." on rank 0 after a commit.
  void report_saved();
  // The stop signal any rank received (train/stop_signal.h), or 0. Collective.
  int agreed_stop_signal();
  // After a stop signal: this step's checkpoint (saved already if `saved`) committed, the memory
  // copies removed, every rank waiting for them. Collective.
  void stop_for_signal(int signal, bool saved, const std::filesystem::path& out);
  [[noreturn]] void stop_diverged(const StepStats& s);
  // Throws Error when the model state was neither initialised nor restored.
  void check_state_ready(const char* what) const;
  // The step's measurements into `stats` (train_step, after the engine's step).
  void record_measurements(const runtime::StepResult& result, StepStats* stats);
  // The controller's decision on the rates just measured, and the migration it asks for.
  void replan_if_asked(StepStats* stats);
  void collect_switch_background(StepStats* stats);
  // Rank 0's header of a run on stdout, and <out>/ranks.json.
  void announce(const std::filesystem::path& out, const std::string& plan_text);
  // Hang detection: only with several ranks (one rank waits for nobody). Collective.
  void start_watchdog(const std::filesystem::path& out, std::optional<Watchdog>* watchdog);
  // The step line on stdout and its record (and any re-plan record) in the metrics file.
  void log_step(StepStats s, double eta, const std::string& plan_text,
                metrics::MetricsLog& metrics);

  TrainConfig config_;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer_;  // before model_config_: it fits it
  model::ModelConfig model_config_;
  comm::Communicator world_;
  runtime::CoreSharing cores_;  // where the ranks run; the core lease when they share cores
  runtime::EngineOptions engine_options_;
  std::unique_ptr<runtime::Engine> engine_;
  LrSchedule schedule_;
  elastic::StragglerSchedule stragglers_;
  elastic::Monitor monitor_;
  std::unique_ptr<elastic::Controller> controller_;  // null when re-planning is off
  // Links between hosts; null when the job runs on one host.
  std::unique_ptr<elastic::LinkMonitor> link_monitor_;
  data::TokenDataset train_data_;
  data::Sampler sampler_;
  int64_t step_ = 0;
  int64_t consumed_samples_ = 0;
  int restarts_ = 0;
  bool state_ready_ = false;  // initialised from the seed, or restored
  checkpoint::CheckpointWriter writer_;
  std::unique_ptr<checkpoint::MemoryCheckpointer> memory_;  // null: memory checkpoints off
  int64_t memory_every_ = 1;                                // steps between memory checkpoints
  std::vector<double> memory_save_s_, memory_step_s_;  // each save's time and the step time then
};

// Every rank gets the checkpoint's config and progress (rank 0 reads manifest.json, verifies it and
// sends its text). A single-file checkpoint's buffers are read on rank 0 only (restore scatters
// them); a sharded checkpoint's on restore, by each rank for itself (Checkpoint::sharded). Throws
// the same Error on every rank if the checkpoint is bad. Collective.
checkpoint::Checkpoint load_checkpoint_on_root(const std::filesystem::path& dir,
                                               comm::Communicator& world,
                                               bool with_optimizer = true);

// The model state rank `rank` holds under `plan`, in bytes, as the engine and the checkpoint
// writer allocate it (fp32), from the same functions they use: parameters and gradients of its
// local layout, plus the gradient shard the distributed optimizer reduces into; both Adam moments
// of its optimizer shard when the moments are split (layout::splits_moments), else of its whole
// local layout; and the host copy of what it writes in a checkpoint (saved_state, kept allocated
// between saves). All zero on a rank the plan leaves idle.
struct ModelStateBytes {
  int64_t held_elements = 0;    // parameter elements of its local layout
  int64_t moment_elements = 0;  // elements whose Adam moments it keeps
  bool moments_split = false;   // the distributed optimizer splits the moments under this plan
  int64_t parameters = 0, gradients = 0;  // of the local layout
  int64_t gradient_shard = 0;             // the summed gradients of its optimizer shard, if split
  int64_t optimizer = 0;                  // both Adam moments
  int64_t checkpoint_copy = 0;
  // What the backend ledger books as parameters, gradients and optimizer after construction.
  int64_t engine_state() const { return parameters + gradients + gradient_shard + optimizer; }
  int64_t total() const { return engine_state() + checkpoint_copy; }
};
ModelStateBytes model_state_bytes(const model::ModelConfig& model, const plan::Plan& plan, int rank,
                                  bool distributed_optimizer);

// Throws Error, naming the parts and their sizes, if rank `rank`'s model state under `plan`
// (model_state_bytes) exceeds its share of `available_bytes` among `ranks_here` ranks. The trainer
// calls it before anything is allocated, with the machine's available memory. Activations come on
// top, so passing is necessary, not sufficient.
void check_model_state_fits(const model::ModelConfig& model, const plan::Plan& plan, int rank,
                            bool distributed_optimizer, int64_t available_bytes, int ranks_here);

// Threads per rank for a configured value (0: the machine's cores shared among the ranks on it).
// Throws Error if more threads are asked for than the CPUs this process may run on.
int resolve_threads(int configured, int ranks);

// The tokenizer saved beside the shards of `pattern` (by prepare-data), or null when there is none
// (e.g. shards made by llm.c's scripts).
std::shared_ptr<const tokenizer::Tokenizer> data_tokenizer(const std::string& pattern);

// The model config a run trains with data made by `tokenizer`: special token ids are the
// tokenizer's, and the vocabulary grows to the tokenizer's if it is smaller (a larger one is kept:
// rows past the tokenizer's ids are never seen). Unchanged without a tokenizer.
model::ModelConfig fit_model_to_tokenizer(model::ModelConfig model,
                                          const tokenizer::Tokenizer* tokenizer);

}  // namespace malleus::train
