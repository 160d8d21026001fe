// A run directory (metrics.jsonl, checkpoints/) is owned by one run at a time. While a
// RunDirectory lives it holds an exclusive lock (flock) on <dir>/.lock, so a second run on the
// same directory is refused instead of interleaving metrics and mixing checkpoints; and a
// directory that already holds a run's files is refused unless this run resumes that very run.
// Opening it also cleans up what saves that died midway left in checkpoints/.
//
// Only rank 0 writes into the run directory, so only rank 0 opens it.
#pragma once

#include <filesystem>
#include <optional>

namespace malleus::train {

class RunDirectory {
 public:
  // Creates `dir` if needed and locks it. `resumed_run`: the run directory whose checkpoint this
  // run continues, if any. Throws Error naming the directory when another process holds the
  // lock, or when the directory holds files and is not `resumed_run`.
  RunDirectory(const std::filesystem::path& dir,
               const std::optional<std::filesystem::path>& resumed_run);
  ~RunDirectory();  // releases the lock
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::filesystem::path& path() const { return dir_; }

 private:
  std::filesystem::path dir_;
  int lock_fd_ = -1;
};

}  // namespace malleus::train
