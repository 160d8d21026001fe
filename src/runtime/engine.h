// Runs training steps of one plan on this rank: its model shard through the 1F1B schedule (with
// activations and gradients exchanged with neighbouring stages by non-blocking MPI), gradient
// sync over the refinement groups, global-norm clipping and AdamW on the shard it holds.
//
// The numerics do not depend on the plan: every sample of the global batch is the same sequence
// in every plan (the caller's sample function decides it), every token's loss is weighted by
// 1 / (tokens in the global batch), and gradients are summed once per pipeline, so the update is
// the single-device update up to floating-point summation order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "common/host_pages.h"
#include "layout/optimizer_shard.h"
#include "layout/redistribution.h"
#include "model/transformer.h"
#include "runtime/optimizer.h"
#include "runtime/parallel_state.h"

namespace malleus::layout {
struct StagedRedistribution;
struct StateKind;
}  // namespace malleus::layout

namespace malleus::runtime {

struct EngineOptions {
  int seq_len = 0;
  int threads = 1;
  // Makes the backend this rank computes with (device/device.h: the CPU, or a CUDA device); null:
  // the CPU backend with `threads` threads. Called again for the engine of each new plan.
  backend::BackendFactory make_backend;
  AdamWConfig adamw;
  // This rank's turn on cores it shares with other ranks (CoreSharing::detect); null when its
  // cores are its own. Held while computing, given back while waiting for communication.
  std::shared_ptr<CoreLease> core_lease;
  // Time the compute sections for the straggler monitor (off only to measure what timing costs;
  // an injected slowdown still times the sections it lengthens).
  bool measure = true;
  // The host each rank runs on (host_indices(world)); on several hosts every step the hosts'
  // leaders also time a fixed probe of their links for the link monitor. Empty: one host.
  std::vector<int> hosts;
  // The shifted critical path (Merak) for stages that recompute activations: a stage other than
  // the last posts the receive of a micro-batch's output gradient, recomputes that micro-batch's
  // forward, then waits, so the recomputation overlaps the wait instead of following it. Costs a
  // scratch per recomputing layer instead of one per stage (plan::memory_use). The last stage
  // recomputes in its backward as before: its gradient comes from its own loss, with no wait.
  // On every recomputing stage before the last; off, on those the plan marks
  // (plan::Stage::recompute_ahead).
  bool shifted_recompute = false;
  // A live migration's extra memory, over max(the memory before it, the memory after it), stays
  // under this many bytes per rank (layout/staged_redistribution.h).
  int64_t migration_bucket_bytes = int64_t{64} << 20;
  // The overlapped switch (Engine::switch_to): the old plan's Adam moments a rank may still hold
  // while the new plan's first step runs. Moments beyond this move before that step, with the
  // parameters; 0 moves everything first.
  int64_t migration_overlap_bytes = int64_t{256} << 20;
  // Sub-pipelined tensor parallelism (model::Transformer::set_tp_subpipeline): every rank of the
  // job must set the same.
  bool tp_subpipeline = false;
  // ZeRO-1: Adam moments and the update split among the holders of each piece
  // (layout::OptimizerShard); gradients reduce-scattered, parameters all-gathered. Used where it
  // saves memory: in plans of two or more pipelines (plan::memory_use models the same).
  bool distributed_optimizer = true;
};

// Fills inputs and targets [seq_len] of sequence `index` (0-based) of the current global batch.
using SampleFn = std::function<void(int index, int32_t* inputs, int32_t* targets)>;

struct StepResult {
  double loss = 0;       // mean token loss of the global batch (on every rank)
  double grad_norm = 0;  // before clipping
  // This rank's own measurement, for the straggler monitor: the elapsed (wall) time of its
  // compute sections — forward and backward passes, less the time inside tensor-parallel
  // collectives, with any injected slowdown — and the training FLOPs the plan gave it. A rank
  // idle under the plan times a fixed probe instead, so a recovered device is noticed.
  double compute_seconds = 0, flops = 0;
  // The two figures above of every rank, in rank order (gathered with the loss).
  std::vector<double> measurements;
  // Every rank's peak memory during the step (its forwards, backwards and gradient sync), from
  // its own allocations (backend::memory_ledger), in rank order: by kind, and the peak total.
  std::vector<backend::MemoryFigures> peak_memory;
  std::vector<double> peak_memory_total;
  // This rank's link probe, for the link monitor (on several hosts; 0 on one, and on every rank
  // but a host's leader, its lowest rank): the fastest of the leader's timed exchanges of
  // plan::kLinkProbeElements floats each way with the other hosts' leaders (Engine::probe_links),
  // and the bytes sent each way. The same probe under every plan: a link is measured whether or
  // not the plan sends anything across it, and its healthy reference never changes with the plan.
  double link_seconds = 0, link_bytes = 0;
  // The two figures above of every rank, in rank order (gathered with the loss).
  std::vector<double> link_measurements;
  // This rank's recomputation issued ahead of the gradient it waits for (shifted_recompute):
  // its elapsed time, and the part of it done while the gradient had not yet arrived (to the
  // layer: the receive is tested after each recomputed layer).
  double recompute_ahead_seconds = 0, recompute_overlapped_seconds = 0;
  // The two figures above of every rank, in rank order (gathered with the loss).
  std::vector<double> recompute_ahead_measurements;
};

// What a migration to a new plan did: bytes sent between ranks (parameters and both Adam moments,
// counted from the messages themselves), over all ranks and into this one.
struct MigrationStats {
  int64_t bytes_moved = 0;     // over all ranks (the same on every rank)
  int64_t bytes_received = 0;  // by this rank
  double seconds = 0;          // wall time, building the new communicators included
  // The most any rank's memory ledger rose above max(its total before the migration, its total
  // after it) while migrating (over all ranks). The old engine gives back its gradients,
  // activations and workspace first, which leaves room; state_extra_bytes is the same peak
  // measured against max(old state, new state) alone (the ledger's totals just before and just
  // after the state moves), which the staged order bounds, and predicted_extra_bytes is that
  // order's own prediction of it (layout::StagedRedistribution::predicted_extra_bytes).
  int64_t peak_extra_bytes = 0, state_extra_bytes = 0, predicted_extra_bytes = 0;
  // An overlapped switch (Engine::switch_to): the bytes of Adam moments (over all ranks, not in
  // bytes_moved) left to move in the background of the new plan's first step. The figures above
  // are the part done before switch_to returned, which training waits for.
  int64_t background_bytes = 0;
};

// The background part of an overlapped switch, on this rank, once the new plan's first step has
// finished it (Engine::take_background_stats).
struct BackgroundStats {
  int64_t bytes_received = 0;  // by this rank
  double poll_seconds = 0;     // posting, packing and unpacking between the step's micro-batches
  double wait_seconds = 0;     // waiting for the rest before the update, ending the old engine
  // This rank's memory at its highest while the old moments were still held (from the step's
  // start), over max(its memory before the switch, its memory after it).
  int64_t peak_extra_bytes = 0;
};

// This rank's state where the engine keeps it, nothing gathered or copied: parameters in its local
// layout, Adam moments in `moment_blocks` (its optimizer shard's blocks of rows when the moments
// are split among holders, else the local layout's tensors). What checkpoints write and read,
// each rank its own part. Null pointers on an idle rank.
struct HeldState {
  const model::ParameterLayout* layout = nullptr;
  float* params = nullptr;
  const layout::Blocks* moment_blocks = nullptr;
  float* adam_m = nullptr;
  float* adam_v = nullptr;
  bool moments_split = false;  // moment_blocks are the optimizer shard's
};

// The full model state gathered on one rank (params, Adam moments in the full model's layout).
struct FullState {
  std::vector<float> params, adam_m, adam_v;
};

class Engine {
 public:
  ~Engine();
  // Collective: every rank of `world` constructs its engine with the same plan.
  Engine(const model::ModelConfig& model, const plan::Plan& plan, comm::Communicator world,
         const EngineOptions& options);

  const model::ModelConfig& model_config() const { return model_config_; }
  ParallelState& state() { return *state_; }
  const plan::Plan& plan() const { return state_->plan(); }
  int rank() const { return state_->rank(); }
  int64_t steps_done() const { return steps_done_; }
  // Training FLOPs of this rank's work per step (0 when idle): what its compute time is for.
  double work_flops() const { return work_flops_; }

  void init_parameters(uint64_t seed);
  // `slowdown` ≥ 1 makes this rank an injected straggler: at the end of each of its compute
  // sections (and of its optimizer step) it keeps computing — busy work, not sleep — for
  // (slowdown − 1) × the section's compute time (its waits for other ranks left out), inside the
  // timed section; it reports nothing else, so the monitor measures it like any other slowdown.
  //
  // `before_update`, when given, runs just before the optimizer changes the parameters and
  // moments (the forward, backward and gradient sync have only read them): a checkpoint copying
  // this state in the background waits there (checkpoint/checkpoint_writer.h). Moments lent out by
  // local_state() stay until then.
  //
  // A step whose loss or gradient norm is not finite changes no parameter or moment.
  StepResult step(const SampleFn& sample, float lr, float grad_clip, double slowdown = 1.0,
                  const std::function<void()>& before_update = {});
  // Forward only: the mean token loss over sequences 0 .. count−1 of `sample`, micro-batches
  // dealt round-robin to the pipelines. Collective; the result is on every rank.
  double evaluate(const SampleFn& sample, int count);

  // Collective. Gathers the whole model state on rank `root` (other ranks get empty buffers),
  // through the same redistribution that moves state between plans.
  FullState gather(int root = 0);
  // Collective. Sets the state from `full`, read on rank `root` only, and the step counter.
  void scatter(const FullState& full, int64_t steps_done, int root = 0);

  // Collective. An engine for `plan` holding this engine's state (parameters, Adam moments, step
  // counter), moved through the layout algebra: pieces a rank already holds are copied locally,
  // the rest travel once, batched per pair of ranks. The move runs band by band
  // (layout::redistribute_staged): this engine gives back its gradients, activations and
  // workspace first, then each band of its state once sent, while the new engine books its state
  // band by band as it arrives and the rest of its memory at the end, so the extra memory stays
  // under options.migration_bucket_bytes. This engine is left without use (and without memory).
  std::unique_ptr<Engine> migrate(const plan::Plan& plan, MigrationStats* stats = nullptr);
  // Collective. The overlapped switch: the same state, moved by the same staged redistribution,
  // but only the parameters (and the moments over options.migration_overlap_bytes) move before
  // this returns; the Adam moments move in the background of the new engine's first step — its
  // forward and backward do not read them — polled between micro-batches, and the step waits for
  // what is left just before its update. The old engine lives on inside the new one holding its
  // moments, giving each band back once sent. The numerics are migrate()'s, bit for bit. When no
  // moments would cross ranks in the background (local copies only) they all move first.
  static std::unique_ptr<Engine> switch_to(std::unique_ptr<Engine> old, const plan::Plan& plan,
                                           MigrationStats* stats = nullptr);
  // The figures of the last background move, once finished (then cleared); none otherwise.
  std::optional<BackgroundStats> take_background_stats();
  // Collective in effect: waits for a background move still under way (a no-op without one).
  // Every method that reads or writes the moments calls it first.
  void finish_background();

  // This rank's state as it lies (not collective): what a checkpoint copies out of. On a backend
  // whose memory is a device's (Backend::device_memory) the pointers are a host copy of it, made
  // once per state (kept, and refreshed only after the state changed).
  HeldState held_state();
  // What a checkpoint reads into: `write` gets the same pointers as held_state() and fills them;
  // on a device backend the host copy then goes back to the device. Not collective.
  void restore_held_state(const std::function<void(const HeldState&)>& write);

  // Parameters and both Adam moments in this rank's layout (nothing when idle): what a gather to
  // one rank and a scatter from it move.
  // With the distributed optimizer the moments are gathered within each holder set into buffers
  // of the whole local layout (collective over the ranks holding state; the extra memory is the
  // moments of the local layout, what the rank held before the distributed optimizer), kept
  // until release_local_state(), commit_local_state() or the next step.
  layout::LocalState<float> local_state();
  // The same buffers to be written (nothing gathered, not collective); commit_local_state() then
  // takes this rank's slices of the moments from them.
  layout::LocalState<float> writable_local_state();
  void commit_local_state();
  void release_local_state();
  // Whether this plan's Adam moments are split among holders (EngineOptions and the plan; on idle
  // ranks too, which hold none).
  bool distributed_optimizer() const { return distributed_optimizer_; }
  // Elements of Adam moments (each of the two) this rank holds.
  int64_t optimizer_elements() const { return optimizer_ ? optimizer_->elements() : 0; }
  // The optimizer steps done, after the state was set from a checkpoint.
  void set_steps_done(int64_t steps);

 private:
  struct Background;  // engine_background.h
  // While `deferred`, the engine's memory is reserved but not booked (a migration books it).
  Engine(const model::ModelConfig& model, const plan::Plan& plan, comm::Communicator world,
         const EngineOptions& options, bool deferred);
  void zero_grads();
  // The 1F1B schedule over this rank's micro-batches (a rank holding a stage): forwards and
  // backwards, activations and their gradients exchanged with the neighbouring stages. Adds the
  // compute sections' times to `result`; returns the sum of the token losses (on the last
  // stage's sending rank; 0 elsewhere).
  double run_pipeline(const SampleFn& sample, float loss_scale, double slowdown,
                      StepResult* result);
  // Receives a micro-batch's output gradient from the next stage, recomputing its forward while
  // it travels where the stage recomputes ahead (EngineOptions::shifted_recompute).
  void receive_output_grad(int slot, int micro_batch, double slowdown, StepResult* result);
  // Syncs gradients, sums their squares and probes the links, then the step's one all-reduce
  // (StepExchange): sets the loss, the gradient norm and every rank's measurements in `result`.
  void exchange_figures(double loss_sum, int64_t global_tokens, StepResult* result);
  // The optimizer's update with the gradients scaled by `clip` (nothing on an idle rank).
  void update(float lr, float clip, double slowdown);
  // Moves this engine's parameters and Adam moments into `next`'s as `staged` orders them,
  // booking and giving back memory band by band; returns the bytes this rank received.
  int64_t move_state(Engine& next, const layout::StagedRedistribution& staged,
                     const std::vector<layout::StateKind>& kinds);
  // The same for one kind of state (0: parameters, 1: Adam moments) with a one-kind staged plan.
  int64_t move_kind(Engine& next, const layout::StagedRedistribution& staged,
                    const layout::StateKind& kind, int which);
  // This engine's buffers of state kind `which` (0: parameters, 1: both Adam moments); none idle.
  std::vector<float*> state_buffers(int which) const;
  // The kinds of state a migration to `next` moves (layout::migrated_state).
  std::vector<layout::StateKind> migrated_kinds(const Engine& next) const;
  // Gives back what the next step recomputes (gradients, activations, workspace, the packing
  // buffer) before the state moves.
  void give_back_working_memory();
  // Makes `old`'s moments of `part` (its bands still to run) this engine's background move.
  void start_background(std::unique_ptr<Background> background, std::unique_ptr<Engine> old,
                        layout::StagedRedistribution part);
  // Between micro-batches of a step: moves on the background move, if any (never waits).
  void poll_background();
  // Sums gradients over the refinement groups.
  void sync_gradients();
  // On every host's leader (a no-op elsewhere): times the link probe with the other leaders;
  // returns this rank's (seconds, bytes).
  std::pair<double, double> probe_links();
  double local_norm_squares();
  // The distributed optimizer's update of this rank's slices, then the all-gather of parameters;
  // with `time_waits` (an injected straggler's update), returns the wall seconds spent in the
  // all-gathers, else 0.
  double distributed_update(float lr, float grad_scale, bool time_waits);
  // Runs `section` holding the core lease and returns its elapsed time less the time inside TP
  // collectives, after keeping busy for (slowdown − 1) × that time (an emulated slow device).
  template <typename Section>
  double timed(Section&& section, double slowdown);
  // The fixed work an idle rank times instead of training; returns its FLOPs.
  double run_probe(double slowdown, double* seconds);
  CoreLease* lease() const { return options_.core_lease.get(); }
  // Bytes of one micro-batch's activations (or their gradient) between pipeline stages.
  size_t activation_bytes() const;
  // The stage input of a micro-batch from the previous stage (nothing on the first stage).
  void receive_input(int slot, int micro_batch);
  // The stage output to every rank of the next stage; only the group's first rank sends.
  void send_output(int slot, int micro_batch, std::vector<comm::Request>* sends);
  // This rank's local tensor holding a piece of the gradient-sync refinement (it must hold it).
  const model::TensorSpec& my_part(const layout::RefinedPiece& piece) const;

  model::ModelConfig model_config_;
  EngineOptions options_;
  std::unique_ptr<ParallelState> state_;
  std::unique_ptr<backend::Backend<float>> backend_;
  std::unique_ptr<model::Transformer<float>> model_;  // null when idle
  std::unique_ptr<AdamW> optimizer_;
  // The distributed optimizer: this rank's shard, and its summed gradients in that shard's order.
  bool distributed_optimizer_ = false;
  std::optional<layout::OptimizerShard> shard_;  // none on idle ranks
  backend::Buffer<float> grad_shard_;
  layout::Blocks moment_blocks_;  // where the Adam moments lie (HeldState), once asked for
  // Both moments in the local layout, while local_state() lends them out.
  backend::Buffer<float> staged_m_, staged_v_;
  int64_t steps_done_ = 0;  // kept on idle ranks too
  // Gradients and parameters packed for the collectives, in the backend's memory (a device's
  // stays there; the communicator stages it around MPI). Grows as a std::vector would, booked as
  // communication.
  backend::Buffer<float> pack_buffer_;
  size_t pack_size_ = 0;
  // Sizes pack_buffer_ (its values are not kept) and returns it.
  float* pack_buffer(size_t elements);
  // The host copy held_state() gives on a device backend, and whether it holds the state as it is.
  struct HostCopy {
    PageBuffer<float> params, adam_m, adam_v;
    bool fresh = false;
  } host_copy_;
  void copy_state_to_host();
  double work_flops_ = 0;  // per step, of this rank's shard
  backend::Buffer<float> probe_a_, probe_b_, probe_c_;
  std::vector<int32_t> inputs_, targets_;
  // An overlapped switch's moments still moving into this engine (engine_switch.cpp).
  std::unique_ptr<Background> background_;
  std::optional<BackgroundStats> background_stats_;
};

}  // namespace malleus::runtime
