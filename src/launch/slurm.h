// `malleus launch` inside a Slurm allocation (sbatch, salloc): the nodes and tasks per node come
// from the allocation's environment, jobs start with `srun` (Slurm's own launcher, the ranks
// wired up over PMIx), and before every restart Slurm is asked which nodes may still be used:
// a node that Slurm drained, took down or lost contact with, or that left the job's allocation,
// is left out, with a line saying which and why. Why srun rather than mpirun: docs/slurm.md.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "launch/supervisor.h"

namespace malleus::launch {

// The allocation a job step runs in, from Slurm's environment.
struct Allocation {
  std::string job_id;       // SLURM_JOB_ID
  std::vector<Host> nodes;  // SLURM_JOB_NODELIST, each with its tasks (SLURM_TASKS_PER_NODE)
  int tasks() const;        // every node's tasks together
};

// The allocation named by the environment `get` reads (std::getenv by default), or nothing
// outside one (no SLURM_JOB_ID). Tasks per node: SLURM_TASKS_PER_NODE ("2(x3),1"), else
// SLURM_NTASKS_PER_NODE on every node; the node list: SLURM_JOB_NODELIST, else SLURM_NODELIST.
// Throws Error naming the variable when one is missing, malformed, or when the lists disagree.
using Environment = std::function<const char*(const char*)>;
std::optional<Allocation> slurm_allocation(const Environment& get = nullptr);

// How often this Slurm job was requeued (SLURM_RESTART_COUNT; 0 outside Slurm or when never).
// A requeued job runs its batch script again with the same arguments, so `malleus train` then
// continues the run in --out (cli/training_commands.cpp). Throws Error for a malformed value.
int slurm_restart_count(const Environment& get = nullptr);

// One node as Slurm sees it (`scontrol show node -o`).
struct NodeState {
  std::string state;   // "ALLOCATED", "MIXED+DRAIN", "IDLE+NOT_RESPONDING", ...
  std::string reason;  // the Reason= an operator or Slurm gave, "" if none
};
// Nodes by name from `scontrol show node -o` output (one line per node).
std::map<std::string, NodeState> parse_node_states(const std::string& output);
// Why a node in `state` must not run ranks ("drained", "down", "not responding", ...), or ""
// when it may.
std::string unusable_because(const std::string& state);

// The nodes a job holds now, from `scontrol show job -o` output (its NodeList=); nothing if the
// output names none.
std::optional<std::vector<std::string>> parse_job_nodes(const std::string& output);

// Ranks that srun reports killed by a signal ("srun: error: node2: tasks 2-3: Killed"), before
// srun began to end the step for them: the ranks srun ended afterwards were not lost. A rank
// ended by a stop signal (SIGTERM, SIGINT, SIGUSR1) was stopped, not lost. `detail` gets srun's
// lines for them.
std::vector<int> srun_killed_ranks(const std::string& output, std::string* detail);

// Runs `scontrol ARGS` (under a time limit) and returns its output; nothing when it failed.
using Scontrol = std::function<std::optional<std::string>(const std::vector<std::string>& args)>;
std::optional<std::string> run_scontrol(const std::vector<std::string>& args);

// The nodes of an allocation jobs may use now: those the job still holds and that Slurm has not
// drained, taken down or lost contact with. When Slurm cannot be asked, every node of the
// allocation (with a warning). A node Slurm marks not responding may be busy ending the last
// job's step (its slurmd waits for it): it gets up to `settle_s` to answer again before it is left
// out.
class SlurmNodes {
 public:
  explicit SlurmNodes(Allocation allocation, Scontrol scontrol = run_scontrol,
                      double settle_s = 60);

  // The usable nodes with their tasks, in the allocation's order. Says on stdout which node is
  // left out and why, when that changed since the last call; `left_out()` keeps it.
  std::vector<Host> usable();
  const std::map<std::string, std::string>& left_out() const { return left_out_; }
  const Allocation& allocation() const { return allocation_; }

 private:
  // Node states, asked again while a node is only not responding, for up to settle_s_.
  std::map<std::string, NodeState> settled_states(const std::string& names);

  Allocation allocation_;
  Scontrol scontrol_;
  double settle_s_;
  std::map<std::string, std::string> left_out_;  // node -> why
};

// srun's command line for a job with rank r on ranks[r]: every rank placed by the node list
// (--distribution=arbitrary), ranks wired up by PMIx, the step ended as soon as a rank dies
// (--kill-on-bad-exit), then `extra` (which may override any of these), then the program.
std::vector<std::string> srun_command(const std::string& srun,
                                      const std::vector<std::string>& extra,
                                      const std::vector<std::string>& ranks,
                                      const std::vector<std::string>& program);

}  // namespace malleus::launch
