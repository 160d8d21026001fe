// Stopping a run cleanly on request. While a StopSignals object lives, SIGTERM (sent by batch
// schedulers, `kill`, and by mpirun to every rank when mpirun itself is terminated or
// interrupted), SIGINT (Ctrl-C) and SIGUSR1 (which mpirun forwards to every rank at once, and
// Slurm's --signal can send ahead of a time limit) only record the signal. The trainer checks it
// at every step boundary, agrees on it with the other ranks, saves a checkpoint of the step it
// stopped at and returns the signal, and the command exits with 128 + signal. A second SIGINT
// ends the process at once; SIGTERM and SIGUSR1 again change nothing (Slurm and mpirun may each
// send one): a stop that takes too long ends at the launcher's SIGKILL.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace malleus::train {

// What a stop saves, on disk where it outlives the stop's output (a terminated mpirun forwards
// none of it): rank 0 writes <run>/stop.json before the stop's save, with `saved` false, and again
// once the checkpoint is committed. So when the kill comes before the commit, the run directory
// still says which step was being saved and which checkpoint is the latest complete one; the
// supervisor and the next resume say so.
struct StopRecord {
  std::string signal;      // "SIGTERM"
  int64_t step = 0;        // the step whose checkpoint the stop saves
  std::string checkpoint;  // where
  bool saved = false;      // committed
  std::string previous;    // the latest complete checkpoint before it ("" if none)
};
std::filesystem::path stop_record_path(const std::filesystem::path& run_dir);
void write_stop_record(const std::filesystem::path& run_dir, const StopRecord& record);
// Nothing when there is none, or one this reader cannot parse.
std::optional<StopRecord> read_stop_record(const std::filesystem::path& run_dir);
// The sentence a stop, the supervisor and a resume say of it: "stopped by SIGTERM after step 18;
// its checkpoint is runs/x/checkpoints/step_00000018", or, unsaved, "stopped by SIGTERM after step
// 18, but killed before its checkpoint (runs/x/checkpoints/step_00000018) was complete; the latest
// complete checkpoint on disk is runs/x/checkpoints/step_00000010" (a memory copy may be newer).
std::string describe_stop(const StopRecord& record);

class StopSignals {
 public:
  StopSignals();   // installs the handlers and forgets any earlier signal
  ~StopSignals();  // restores the previous handlers
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first signal received while installed, or 0.
  static int received();
  // "SIGTERM", "SIGINT", ...
  static std::string name(int signal);
  // The signal `name` names, of those a stop takes; 0 for any other name.
  static int number(const std::string& name);
  // Makes stdout and stderr non-blocking when they are pipes, sockets or a terminal that is not
  // this process's controlling one (mpirun gives each rank's stdout a pseudo-terminal), for the
  // way out: a terminated mpirun no longer reads its ranks' output, and a rank must not hang
  // writing it. What no one reads is lost; the user's own terminal and a file are left alone. The
  // handler of SIGTERM and SIGINT does this itself, at once: a line written between the signal
  // and the stop must not block either.
  static void unblock_output();
};

}  // namespace malleus::train
