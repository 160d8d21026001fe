// Stopping a run cleanly on request. While a StopSignals object lives, SIGTERM (sent by batch
// schedulers, `kill`, and by mpirun to every rank when mpirun itself is terminated or
// interrupted), SIGINT (Ctrl-C) and SIGUSR1 (which mpirun forwards to every rank at once, and
// Slurm's --signal can send ahead of a time limit) only record the signal. The trainer checks it
// at every step boundary, agrees on it with the other ranks, saves a checkpoint of the step it
// stopped at and returns the signal, and the command exits with 128 + signal. A second signal of
// the same kind gets the default action: the process ends at once.
#pragma once

#include <string>

namespace malleus::train {

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
  // Makes stdout and stderr non-blocking when they are pipes or sockets, for the way out: a
  // terminated mpirun no longer reads its ranks' output, and a rank must not hang writing it.
  // What no one reads is lost; a terminal or a file is left alone. The handler of SIGTERM and
  // SIGINT does this itself, at once: a line written between the signal and the stop must not
  // block either.
  static void unblock_output();
};

}  // namespace malleus::train
