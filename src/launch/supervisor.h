// The supervisor behind `malleus launch`: it starts a training job with mpirun on a set of
// devices (the slots of a hostfile, or local slots), forwards its output, and when the job ends
// because ranks were lost — a rank killed (mpirun names it), or a rank hung (the watchdog's
// <run>/hang.json names it, watchdog/watchdog.h) — it restarts the job from the run's latest
// complete checkpoint on the devices that are left, with the planner's plan for them
// (`--plan auto`; a checkpoint reshards to any plan and world size). Each restart is a record in
// metrics.jsonl and a line on stdout, and the step lines of the restarted job count the restarts.
//
// It stops with an error, never looping, when fewer than --min-ranks devices are left, when the
// job fails again without having checkpointed any further (the same failure repeating), after
// --max-restarts restarts, or when the job ended for any other reason than a lost rank (bad input,
// a stop signal: those are not recovered from).
//
// Devices come back with the hostfile: it is read again at every restart, and once its content
// has changed since a device was excluded, the exclusions are forgotten (the operator's list is
// the truth), so a host listed again is used by the next restart.
//
// Inside a Slurm allocation (Launcher::kSrun, launch/slurm.h) the devices are the allocation's
// tasks, jobs start with srun, and before every restart Slurm is asked which nodes are left: a
// node drained, down or gone from the allocation is left out (and said so), one resumed comes back.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/json.h"

namespace malleus::launch {

// One line of an Open MPI hostfile: "node0 slots=8" ("max_slots=" is accepted and ignored).
struct Host {
  std::string name;
  int slots = 1;
};
// Throws Error naming the source and line for anything else ("#" starts a comment).
std::vector<Host> parse_hostfile(const std::string& text, const std::string& source);

// How a job ended, from mpirun's exit status, its output and the watchdog's report.
struct Outcome {
  enum class Kind {
    kFinished,  // exit status 0
    kStopped,   // a stop signal (SIGTERM, SIGINT, SIGUSR1): a checkpoint was written, on purpose
    kLost,      // ranks were lost: killed, or hung
    kFailed,    // anything else (bad input, a crash that took mpirun with it): not restarted
  };
  Kind kind = Kind::kFailed;
  std::string reason;  // "killed", "hung"; for kFailed and kStopped, what was seen
  std::string detail;  // mpirun's or the watchdog's words
  std::vector<int> lost_ranks;
  std::vector<std::string> cut_off_hosts;  // "cut off": the hosts the watchdog found cut off
};
// `status`: mpirun's exit status (128 + n when mpirun itself died of signal n). `output`: what
// mpirun printed (its "process rank R ... exited on signal S" lines name killed ranks), or srun
// ("srun: error: node2: task 2: Killed", launch/slurm.h).
// `hang_report`: <run>/hang.json, if the watchdog wrote one.
Outcome classify(int status, const std::string& output, const std::optional<Json>& hang_report);

// What starts the ranks of a job.
enum class Launcher {
  kMpirun,  // mpirun, on a hostfile's slots or local ones
  kSrun,    // srun, on the tasks of the Slurm allocation this runs in (launch/slurm.h)
};

struct LaunchOptions {
  int np = 0;            // ranks to run (0: every slot of the hostfile, or of the allocation)
  std::string hostfile;  // empty: np local slots
  int min_ranks = 1;
  int max_restarts = 3;
  std::string mpirun = "mpirun";
  std::vector<std::string> mpirun_args;  // extra arguments for mpirun, e.g. --oversubscribe
  Launcher launcher = Launcher::kMpirun;
  std::string srun = "srun";
  std::vector<std::string> srun_args;  // extra arguments for srun, after malleus's own
  std::string binary;                  // the malleus executable the ranks run
  std::vector<std::string> command;    // "train" and its arguments
  // After a job failed (job_end.h), how long mpirun may take to end it before the supervisor ends
  // mpirun and its local ranks itself.
  double exit_grace_s = 5;
  // A job that has printed nothing on stdout this long after its start is ended (mpirun waits
  // without limit for a host it cannot reach at the start too), and not restarted. 0: no limit.
  double start_timeout_s = 300;
};

// Runs the job to its end, restarting it as described above. Returns the exit status for the
// command: 0 when the run finished; the job's status when it stopped or failed; throws Error
// (the message says why no restart was made) when too few devices are left or a failure repeats.
int supervise(const LaunchOptions& options);

}  // namespace malleus::launch
