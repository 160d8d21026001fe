// The training loop over any parallel plan: each step samples the global batch (the same
// sequences whatever the plan), runs the runtime engine (1F1B, tensor and data parallelism,
// gradient sync, clipping, AdamW), measures every rank (the straggler loop: monitor, controller,
// migration), and on schedule evaluates, logs (rank 0) and checkpoints. Resuming from a checkpoint
// — under the same plan or another — continues exactly where it stopped. The loop's parts:
// train/setup.h (plan, threads, tokenizer, memory fit), train/checkpointing.h (when checkpoints
// are due, the engine's state in and out of them), train/run_log.h (what a run prints and records).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "data/dataset.h"
#include "elastic/loop.h"
#include "elastic/stragglers.h"
#include "metrics/metrics.h"
#include "runtime/core_lease.h"
#include "runtime/engine.h"
#include "train/checkpointing.h"
#include "train/config.h"
#include "train/run_log.h"
#include "train/schedule.h"
#include "train/setup.h"
#include "train/stopping.h"

namespace malleus::watchdog {
class Watchdog;
}

namespace malleus::train {

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
  // pass a checkpoint without buffers: the collective checkpoint::load_checkpoint). Throws Error if
  // the checkpoint's tokenizer differs from the training data's, or if it is damaged (a sharded one
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
  // The checkpoint header of this step (model, config, progress, tokenizer) and this rank's part
  // of the state, as both kinds of save take them.
  checkpoint::Checkpoint checkpoint_header() const;
  std::vector<checkpoint::SavedKind> saved_state() const;
  // This run's ranks, checkpoints, directory and step, for an early end (train/stopping.h).
  RunEnd run_end();
  // Throws Error when the model state was neither initialised nor restored.
  void check_state_ready(const char* what) const;
  // The straggler loop after the engine's step: its measurements into `stats` and the loop, and
  // the migration to the plan it switches to, if it does.
  void straggler_loop(const runtime::StepResult& result, StepStats* stats);
  void collect_switch_background(StepStats* stats);

  TrainConfig config_;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer_;  // before model_config_: it fits it
  model::ModelConfig model_config_;
  comm::Communicator world_;
  runtime::CoreSharing cores_;  // where the ranks run; the core lease when they share cores
  runtime::EngineOptions engine_options_;
  std::string devices_line_;  // the header's line on the ranks' devices; empty on the CPU
  std::unique_ptr<runtime::Engine> engine_;
  LrSchedule schedule_;
  elastic::StragglerSchedule stragglers_;
  // The monitor, the link monitor and the controller (elastic/loop.h), on the engine's plan.
  std::unique_ptr<elastic::StragglerLoop> loop_;
  data::TokenDataset train_data_;
  data::Sampler sampler_;
  int64_t step_ = 0;
  int64_t consumed_samples_ = 0;
  int restarts_ = 0;
  bool state_ready_ = false;   // initialised from the seed, or restored
  Checkpointing checkpoints_;  // disk and memory checkpoints: when they are due, and the writers
  watchdog::Watchdog* watchdog_ = nullptr;  // while run() runs with one: the phases it watches
};

}  // namespace malleus::train
