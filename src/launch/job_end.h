// Ending a job that does not end by itself. Once a job has failed (the watchdog wrote hang.json,
// or mpirun said it is aborting the job), mpirun normally ends every rank and returns within a
// second or two; but it waits without limit for the daemon of a host it cannot reach (a link that
// went down). So the supervisor gives it a grace period (`malleus launch --exit-grace`), then ends
// mpirun and every process under it on its own machine itself (its local ranks, the launch agents),
// and names the ranks it could not end: those whose heartbeats still beat afterwards (on a host it
// cannot reach; they end when their host's watchdog or operator ends them).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace malleus::launch {

// The signs in mpirun's output that it is ending a failed job (a rank exited with an error or on a
// signal, or it lost a daemon); nullopt when `output` has none. Returns the line that says so.
std::optional<std::string> job_abort_sign(const std::string& output);

// `root` and every live process descending from it (by the parent pids of /proc), parents first.
std::vector<pid_t> process_tree(pid_t root);

// Stops `root`'s whole tree (SIGSTOP until no new process appears, so none forks while it is
// ended), then kills it (SIGKILL), and removes the session directories Open MPI's mpirun and
// daemons among them would have removed on their way out ($TMPDIR/ompi.<host>.<uid>/pid.<pid>).
// Returns the processes killed.
std::vector<pid_t> kill_process_tree(pid_t root);

// A rank of a failed job that was still running after the supervisor ended what it could.
struct UnendedRank {
  int rank = 0;
  int64_t pid = 0;
  std::string host;
  double beat = 0;  // its latest heartbeat (Unix time)
};
// The ranks among the first `world_size` of `run_dir`'s heartbeats that beat after `since` (Unix
// time, on the ranks' clocks: hosts in step, as the watchdog needs anyway).
std::vector<UnendedRank> ranks_beating_since(const std::filesystem::path& run_dir, int world_size,
                                             double since);
// "rank 2 (pid 1234 on node1)", joined by "; ".
std::string describe(const std::vector<UnendedRank>& ranks);

}  // namespace malleus::launch
