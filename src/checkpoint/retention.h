// Which disk checkpoints a run keeps: after each commit, rank 0 removes the checkpoints of the run
// beyond the newest `keep` (train's --keep-checkpoints; 0 keeps all), except
//
// - the one `latest` names (the latest complete checkpoint),
// - any the user marked to keep: a file named `keep` in its directory
//   (`touch runs/x/checkpoints/step_00000100/keep`),
// - any a reader holds: every reader of a checkpoint (a resume, eval, export, ...) holds a shared
//   lock on its manifest.json while it reads (CheckpointReadLock, taken by CheckpointIndex and
//   load_checkpoint); a checkpoint whose manifest cannot be locked exclusively at once is left for
//   a later pass.
//
// A removal first renames the directory to "<dir>.tmp.<pid>" (atomic: the checkpoint is whole or
// no longer a checkpoint), then removes that; a removal that fails half-way leaves only a
// temporary, which clean_stale_temporaries removes once this process is gone. So a deletion that
// fails leaves a checkpoint that loads, or none.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace malleus::checkpoint {

// The file that marks a checkpoint to be kept whatever the retention limit.
inline constexpr const char* kKeepMarker = "keep";

// A shared lock on `dir`/manifest.json while it lives (flock; a file system without locks gives
// none, silently). Throws Error naming the checkpoint when its manifest is not there, or was
// removed or replaced while the lock was being taken.
class CheckpointReadLock {
 public:
  explicit CheckpointReadLock(const std::filesystem::path& dir);
  ~CheckpointReadLock();
  CheckpointReadLock(const CheckpointReadLock&) = delete;
  CheckpointReadLock& operator=(const CheckpointReadLock&) = delete;
  // The manifest's text, read through the locked file.
  std::string manifest_text() const;

 private:
  std::filesystem::path dir_;
  int fd_ = -1;
};

// What one pass of retention did.
struct RetentionPass {
  std::vector<std::filesystem::path> removed;
  std::vector<std::string> left;  // "<dir>: <why>" for a checkpoint past the limit that stays
};

// Removes the complete checkpoints (step_N directories with a manifest) of `root` past the newest
// `keep`, as described above; keep <= 0 removes nothing. Never throws: a checkpoint it cannot
// remove is named in `left`.
RetentionPass prune_checkpoints(const std::filesystem::path& root, int keep);

}  // namespace malleus::checkpoint
