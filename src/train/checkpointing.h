// A run's checkpoints: when they are due and what they hold. Disk checkpoints come every
// checkpoint_every steps and at the end (sharded: each rank writes the pieces it owns, in the
// background; checkpoint/checkpoint_writer.h); memory checkpoints (checkpoint/memory_checkpoint.h)
// every memory_every() steps, a cadence chosen from their measured cost when the config leaves it
// to malleus. Also what passes between the engine's state and a checkpoint, both ways.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_writer.h"
#include "checkpoint/memory_checkpoint.h"
#include "comm/communicator.h"
#include "runtime/engine.h"
#include "train/config.h"

namespace malleus::train {

// With memory_checkpoint_every 0, memory checkpoints come every K steps, K the fewest that keep a
// save's measured time under this share of the steps' (Checkpointing::save_to_memory).
inline constexpr double kMemoryCheckpointBudget = 0.05;
// ... measured over the saves so far, once there are this many (one every step until then).
inline constexpr size_t kMemoryCheckpointProbes = 3;

class Checkpointing {
 public:
  // Disk checkpoints only, until start_memory_checkpoints.
  Checkpointing(comm::Communicator world, const TrainConfig& config);

  // Collective, when the config asks for memory checkpoints (else nothing): copies in memory of
  // the run in config.out_dir, on ranks of hosts `hosts` (runtime::host_indices).
  void start_memory_checkpoints(const std::vector<int>& hosts);

  // Collective: starts a sharded checkpoint of `header`'s step under `root` from this rank's
  // `state` (in the background unless config.async_checkpoints is off: the copy of the state too,
  // which the next update waits for, wait_for_copy); poll commits it once every rank has written
  // its part, finish waits for that.
  void save(const std::filesystem::path& root, const checkpoint::Checkpoint& header,
            std::vector<checkpoint::SavedKind> state);
  void poll();
  void finish();
  // Not collective: returns once no save in flight reads the live state any more.
  void wait_for_copy() { writer_.wait_for_copy(); }
  // Whether a save in flight may still read the live state.
  bool copying() const { return writer_.copying(); }
  // The last committed disk checkpoint (rank 0's figures).
  const std::optional<checkpoint::SaveStats>& last_saved() const { return writer_.last(); }

  // Whether a memory checkpoint is due after step `step` (every memory_every() steps).
  bool memory_due(int64_t step) const { return memory_ && step % memory_every_ == 0; }
  // Collective, when memory_due: the memory checkpoint of `header`'s step from this rank's
  // `state`; with memory_checkpoint_every 0, memory_every() is then chosen again from the save's
  // time and `step_s`, the recent step time. A save that fails turns memory checkpoints off for
  // the rest of the run, with a warning: the disk checkpoints go on.
  void save_to_memory(const checkpoint::Checkpoint& header,
                      const std::vector<checkpoint::SavedKind>& state, double step_s);
  // Collective: this run's memory copies removed (the run ended, or a fresh run supersedes them).
  void clear_memory();
  // Rank 0's line at the end of a run: how many memory saves, and what they took.
  void report_memory() const;
  int64_t memory_every() const { return memory_every_; }

 private:
  // "saved checkpoint ..." on rank 0 after a commit.
  void report_saved();
  bool is_root() const { return world_.rank() == 0; }

  comm::Communicator world_;
  TrainConfig config_;
  checkpoint::CheckpointWriter writer_;
  std::unique_ptr<checkpoint::MemoryCheckpointer> memory_;  // null: memory checkpoints off
  int64_t memory_every_ = 1;                                // steps between memory checkpoints
  std::vector<double> memory_save_s_, memory_step_s_;  // each save's time and the step time then
};

// What this rank of `engine` writes in a checkpoint of `model`: the pieces it owns, straight out
// of where it keeps them (its parameters' owned pieces, and its Adam moments': the blocks of its
// optimizer shard when they are split): nothing gathered, no moments of the whole local layout
// allocated. Empty on an idle rank.
std::vector<checkpoint::SavedKind> saved_state(runtime::Engine& engine,
                                               const model::ModelConfig& model, int rank);

// Collective: `engine`'s state read from `checkpoint` (whose model is `model`). A sharded one is
// read by every rank, the pieces its own shard needs under this plan, whatever the plan and world
// size that wrote them (one rank's damaged file stops every rank with its message); a single-file
// one is scattered from rank 0's buffers. The engine's step count becomes the checkpoint's.
void load_engine_state(runtime::Engine& engine, const checkpoint::Checkpoint& checkpoint,
                       const model::ModelConfig& model, comm::Communicator& world);

}  // namespace malleus::train
