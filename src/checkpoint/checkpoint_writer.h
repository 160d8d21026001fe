// Saving sharded checkpoints from a run on several ranks, synchronously or in the background.
//
// A save starts collectively: rank 0 makes the temporary directory every rank writes into, and
// each rank copies the pieces it owns (checkpoint/checkpoint.h) out of its live state into host
// memory. That copy is all the training step waits for: a background thread then writes the
// rank's file while training goes on. The copy itself can run in the background too (CheckFreq,
// Mohan et al., FAST 2021): the parameters and moments change only at the optimizer's update, so
// it may overlap the next step's forward and backward, and the step waits for it (wait_for_copy)
// only if it is not done by its update. The commit is collective too, and happens at the first
// poll() after every rank's file is on disk (or at wait()): rank 0 writes the manifest, renames
// the directory into place, and only then points `latest` at it; every rank learns the verdict
// before it returns, so no rank ever looks for a file of a checkpoint not yet committed.
//
// The writer thread does no MPI (the job's MPI is single-threaded): the agreement that all files
// are written is an all-reduce on the training thread, at poll().
#pragma once

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "layout/layout.h"
#include "model/parameters.h"

namespace malleus::checkpoint {

// What one finished save took, as rank 0 saw it.
struct SaveStats {
  std::filesystem::path dir;
  double stall_s = 0;  // the saving step's wait: the copy to host memory, or what was left of
                       // it at wait_for_copy (for a synchronous save, also the writing and the
                       // commit)
  double total_s = 0;  // from the start of the save to its commit
  int64_t bytes = 0;   // written by all ranks
  // Retention after the commit (set_keep; checkpoint/retention.h): the checkpoints it removed,
  // and "<dir>: <why>" for those past the limit it left.
  std::vector<std::filesystem::path> removed;
  std::vector<std::string> left;
};

class CheckpointWriter {
 public:
  explicit CheckpointWriter(comm::Communicator world) : world_(std::move(world)) {}
  // Waits for a writer thread still running; an uncommitted save is left as its temporary
  // directory (clean_stale_temporaries removes it), the previous checkpoint stays `latest`.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Collective. Starts saving `header` (model, config, progress, tokenizer: its buffers are not
  // used) and this rank's `state` (saved_state: its parameters, and its Adam moments when saved;
  // empty on a rank holding nothing) into <root>/step_N. A save still in flight is committed
  // first. With `background` false the save is committed before it returns. Throws Error on
  // every rank if any rank failed.
  //
  // With `copy_in_background` (and `background`) the copy too runs on the writer's thread: the
  // buffers `state` points into must then stay alive and unchanged until wait_for_copy() (or
  // poll() or wait() committing the save) has returned.
  void begin(const std::filesystem::path& root, const Checkpoint& header,
             std::vector<SavedKind> state, bool background, bool copy_in_background = false);
  // Not collective. Returns once the save in flight (if any) holds its own copy of the state, so
  // that the buffers passed to begin() may change; its wait counts into the save's stall.
  void wait_for_copy();
  // Whether a save in flight may still be reading the buffers passed to begin().
  bool copying() const { return pending_.has_value() && !pending_->copied.load(); }
  // Collective. Commits the save in flight if every rank has written its file; returns whether
  // it did. No communication when nothing is in flight.
  bool poll();
  // Collective. Waits for the save in flight (if any) and commits it.
  void wait();
  bool in_flight() const { return pending_.has_value(); }
  // The last committed save (rank 0's figures).
  const std::optional<SaveStats>& last() const { return last_; }
  // After each commit, rank 0 keeps the newest `keep` checkpoints of the root and removes older
  // ones (checkpoint/retention.h); 0 (the default) keeps all.
  void set_keep(int keep) { keep_ = keep; }

 private:
  struct Pending {
    std::filesystem::path root, dir, tmp;
    Checkpoint header;
    int kinds = 0;  // of state saved: parameters, and the moments too
    bool background = true;
    double started = 0, stall_s = 0;
    // What the copy reads (empty when this rank holds no state), and the memory it may reuse.
    int rank = 0;
    std::vector<SavedKind> state;
    std::unique_ptr<ShardSnapshot> reuse;
    std::unique_ptr<ShardSnapshot> snapshot;
    std::thread thread;
    std::atomic<bool> copied{false}, done{false};
    std::mutex mutex;  // with `copy_done`: wait_for_copy's wait for `copied`
    std::condition_variable copy_done;
    std::string entry;  // write_shard's result, or {"error": ...}, as JSON text
  };
  // The snapshot of the pending save's state, then `copied` set.
  static void copy_state(Pending& p);
  static void mark_copied(Pending& p);
  void commit();

  comm::Communicator world_;
  // The last save's host copy, written and kept for the next: a save then copies into memory
  // already mapped (4 bytes per parameter and 8 per moment element this rank writes stay
  // allocated between saves).
  std::unique_ptr<ShardSnapshot> spare_;
  std::optional<Pending> pending_;
  std::optional<SaveStats> last_;
  int keep_ = 0;
};

}  // namespace malleus::checkpoint
