// What a run is set up from before its first step, each part decided once and checked before
// anything is allocated or any rank communicates: the plan (a plan file, the planner's, or the
// uniform one), threads per rank, the training data's tokenizer and the model fitted to it, the
// memory fit of the model state, the injected stragglers, and the straggler loop. The Trainer
// (train/trainer.h) calls these in its constructor.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "comm/communicator.h"
#include "elastic/loop.h"
#include "elastic/stragglers.h"
#include "model/config.h"
#include "plan/plan.h"
#include "runtime/core_lease.h"
#include "runtime/engine.h"
#include "tokenizer/tokenizer.h"
#include "train/config.h"

namespace malleus::train {

// The "plan" value that asks for the planner's plan (malleus launch restarts with it, on however
// many ranks are left).
inline constexpr const char* kPlannerPlan = "auto";

// The plan a config asks for on `world_size` ranks: its plan file, the planner's plan for the
// cluster preset with every rank healthy ("auto"), or the uniform dp × tp × pp plan. Validated
// against the model, the world size and the global batch; throws Error otherwise.
plan::Plan resolve_plan(const TrainConfig& config, const model::ModelConfig& model, int world_size);

// The batch a config trains with, as the cost model takes it.
plan::BatchConfig batch_config(const TrainConfig& config);

// Threads per rank for a configured value (0: the machine's cores shared among the ranks on it).
// Throws Error if more threads are asked for than the CPUs this process may run on.
int resolve_threads(int configured, int ranks);

// Ranks sharing this machine: Open MPI's mpirun or Slurm's srun says so in the environment
// (OMPI_COMM_WORLD_LOCAL_SIZE; SLURM_STEP_TASKS_PER_NODE at SLURM_NODEID); otherwise all of them.
int ranks_on_this_node(int world_size);

// The engine's options from a config on `world_size` ranks (threads resolved; the core lease and
// the hosts are filled later, by the trainer).
runtime::EngineOptions engine_options(const TrainConfig& config, int world_size);

// Opens this rank's device for the engine (options->make_backend, from the config's backend,
// devices and cuda_math); one rank's failure (no device, a --devices entry the node lacks) stops
// every rank with its message. Collective. Returns rank 0's header line saying where each rank
// computes and how device buffers reach MPI, or "" on other ranks and when every rank is on the
// CPU.
std::string open_devices(const TrainConfig& config, const comm::Communicator& world,
                         runtime::EngineOptions* options);

// What a run's engine is built from, decided and checked in this order before anything is
// allocated: the config and the plan; the engine's options with this rank's device opened; each
// rank's host; the memory fit of the model state (with the memory copies when they are on); and
// how the ranks share cores (runtime/core_lease.h: ranks that share cores take turns on them, so
// each rank's measured compute time is its time on a whole core). Collective over `world`.
struct EngineSetup {
  plan::Plan plan;
  runtime::EngineOptions options;  // hosts and core lease filled in
  std::string devices_line;        // open_devices' line for the run's header
  runtime::CoreSharing cores;
};
EngineSetup set_up_engine(const TrainConfig& config, const model::ModelConfig& model,
                          const comm::Communicator& world);

// The injected stragglers of a config. Throws Error when a spec or the trace names a rank outside
// the job (built before the data is read, so a bad trace is reported first).
elastic::StragglerSchedule injected_stragglers(const TrainConfig& config, int world_size);

// The straggler loop of a run starting on `plan`, its ranks on hosts `hosts`
// (runtime::host_indices) with `threads` each: the monitor; the links between hosts monitored
// per node of the cluster the controller plans for when the ranks span several hosts; the
// controller unless re-planning is off or there is one rank (no other plan to switch to). Reads
// the config's profile, if any.
std::unique_ptr<elastic::StragglerLoop> make_straggler_loop(const TrainConfig& config,
                                                            const model::ModelConfig& model,
                                                            const plan::Plan& plan,
                                                            const std::vector<int>& hosts,
                                                            int threads);

// The tokenizer saved beside the shards of `pattern` (by prepare-data), or null when there is none
// (e.g. shards made by llm.c's scripts).
std::shared_ptr<const tokenizer::Tokenizer> data_tokenizer(const std::string& pattern);

// The model config a run trains with data made by `tokenizer`: special token ids are the
// tokenizer's, and the vocabulary grows to the tokenizer's if it is smaller (a larger one is kept:
// rows past the tokenizer's ids are never seen). Unchanged without a tokenizer.
model::ModelConfig fit_model_to_tokenizer(model::ModelConfig model,
                                          const tokenizer::Tokenizer* tokenizer);

// Checks that a run of `model` (fitted to `tokenizer`, the training data's, if known) on data
// `train_data` can go on from `checkpoint`, and returns the tokenizer it goes on with: the data's,
// which must then be the checkpoint's when that records one, else the checkpoint's. A checkpoint
// written before its data recorded a tokenizer is taken with the fitted special ids. Throws Error
// naming what differs.
std::shared_ptr<const tokenizer::Tokenizer> check_resumable(
    const checkpoint::Checkpoint& checkpoint, const model::ModelConfig& model,
    std::shared_ptr<const tokenizer::Tokenizer> tokenizer, const std::string& train_data);

// The model state rank `rank` holds under `plan`, in bytes, as the engine and the checkpoint
// writer allocate it (fp32), from the same functions they use: parameters and gradients of its
// local layout, plus the gradient shard the distributed optimizer reduces into; both Adam moments
// of its optimizer shard when the moments are split (layout::splits_moments), else of its whole
// local layout; and the host copy of what it writes in a checkpoint (saved_state, kept allocated
// between saves). All zero on a rank the plan leaves idle.
struct ModelStateBytes {
  int64_t held_elements = 0;    // parameter elements of its local layout
  int64_t moment_elements = 0;  // elements whose Adam moments it keeps
  bool moments_split = false;   // the distributed optimizer splits the moments under this plan
  int64_t parameters = 0, gradients = 0;  // of the local layout
  int64_t gradient_shard = 0;             // the summed gradients of its optimizer shard, if split
  int64_t optimizer = 0;                  // both Adam moments
  int64_t checkpoint_copy = 0;
  // What the backend ledger books as parameters, gradients and optimizer after construction.
  int64_t engine_state() const { return parameters + gradients + gradient_shard + optimizer; }
  int64_t total() const { return engine_state() + checkpoint_copy; }
};
ModelStateBytes model_state_bytes(const model::ModelConfig& model, const plan::Plan& plan, int rank,
                                  bool distributed_optimizer);

// Throws Error, naming the parts and their sizes, if rank `rank`'s model state under `plan`
// (model_state_bytes) exceeds its share of `available_bytes` among `ranks_here` ranks. With
// `memory_hosts` (each rank's host; memory checkpoints on) the memory copies count too: the host
// buffers and the files in host memory that checkpoint::memory_copy_bytes gives for this rank's
// shard and the one it receives. The trainer calls it before anything is allocated, with the
// machine's available memory. Activations come on top, so passing is necessary, not sufficient.
void check_model_state_fits(const model::ModelConfig& model, const plan::Plan& plan, int rank,
                            bool distributed_optimizer, int64_t available_bytes, int ranks_here,
                            const std::vector<int>* memory_hosts = nullptr);

}  // namespace malleus::train
