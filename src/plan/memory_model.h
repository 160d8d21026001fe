// The memory model: bytes per rank by kind, the one formula the planner's memory limits, a
// prediction's per-device memory and the runtime's own account of its allocations share. The
// CostModel members that apply it to a plan (footprint, idle_memory, memory_by_kind, the
// recomputation a stage needs to fit) are defined in memory_model.cpp.
//
// Memory per rank (MemoryFootprint, memory_use), kind by kind what the runtime allocates
// (backend/memory.h): parameters, gradients and optimizer state of the rank's shard (precision
// from the cluster); activations: per micro-batch in flight under 1F1B (stage s of S holds
// min(S − s, m)) each layer's kept tensors (its input, norm outputs, q/k/v, attention
// scores unless the cluster has flash attention, attention output, MLP intermediates, shares of
// the TP group; norm and residual tensors split over the group only with sequence parallelism)
// and the stage output, the tokens on the first stage and the logits and loss statistics on the
// last; the backward workspace shared by all micro-batches; the gradient-sync packing buffer.
#pragma once

#include "model/recompute.h"

namespace malleus::plan {

// ---- memory: the one formula, used for the planner's memory limits and for a prediction's
// per-device memory, and held against the runtime's own account of its allocations. New kinds
// of state are new components here; callers only ask for memory_use(...). -----------------------

// Bytes one rank of a stage needs, by component, before the stage's layer count, position,
// micro-batches in flight and recomputation are known.
struct MemoryFootprint {
  double params_per_layer = 0, embedding_params = 0, head_params = 0;   // elements
  double largest_layer_tensor = 0, vocabulary_tensor = 0;               // elements
  double parameter_bytes = 0, gradient_bytes = 0, optimizer_bytes = 0;  // per parameter
  // One micro-batch through one layer: what it keeps until its backward, by RecomputeMode, and
  // what is live while a layer of that mode is recomputed (once per stage).
  double layer_kept[3] = {0, 0, 0}, recompute_scratch[3] = {0, 0, 0};
  double stage_output = 0;                         // one micro-batch
  double embedding_inputs = 0, head_kept = 0;      // one micro-batch, first / last stage
  double layer_workspace = 0, head_workspace = 0;  // backward scratch, once per stage
  // Component-wise maximum: the footprint of a group's fullest rank.
  void include(const MemoryFootprint& other);
};

// The runtime sums gradients across pipelines in packed chunks of at most this many elements (a
// larger single piece alone), which bounds its packing buffer.
inline constexpr double kGradSyncChunkElements = 16.0 * 1024 * 1024;
// On several nodes each node's first rank (its leader) exchanges a fixed probe of this many fp32
// elements (512 KiB) each way with every other node's leader each step, twice, one partner per
// round of link_probe_partner's schedule, timed for the link monitor (runtime::Engine), through
// the ranks' packing buffer (send and receive halves). Large against a token-bucket shaper's
// burst, so that a throttled link shows at its rate, and small against a step (about 2 ms a round
// on the test bed's healthy links, 20 ms on one throttled to a tenth).
inline constexpr double kLinkProbeElements = 128.0 * 1024;
// A rank the plan leaves idle multiplies two kComputeProbeSize² fp32 matrices into a third (its
// workspace) every step, so that the monitor keeps measuring its device and sees it recover
// (runtime::Engine::run_probe).
inline constexpr int kComputeProbeSize = 256;
// ... 16 times: ~0.5 GFLOP, ~10 ms on one core, long enough against the scheduler's time slices
// (a few ms) to see a shared core.
inline constexpr int kComputeProbeRepeats = 16;
inline constexpr double kComputeProbeFlops =
    2.0 * kComputeProbeRepeats * kComputeProbeSize * kComputeProbeSize * kComputeProbeSize;
// Bytes by kind, as backend::MemoryKind names them.
struct MemoryUse {
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0, workspace = 0,
         communication = 0;
  double total() const {
    return parameters + gradients + optimizer + activations + workspace + communication;
  }
};

// How a stage's rank holds its state, besides the footprint.
enum class OptimizerSharding {
  kWhole,        // every holder keeps the whole optimizer state of its parameters
  kDistributed,  // ZeRO-1: with P pipelines each holder keeps 1/P of it (and of the summed grads)
};
enum class RecomputeTiming {
  kInBackward,  // one recomputation scratch per stage
  kAhead,       // before the gradient arrives (the shifted schedule): a scratch per layer
};
enum class LinkProbe { kNone, kHeld };  // the rank's packing buffer holds the link probe

// Where a stage sits and what it runs: the question memory_use answers.
struct StageMemory {
  int layers = 0;
  bool first = false, last = false;  // the stage's position in its pipeline
  int in_flight = 1;                 // micro-batches whose activations it holds at once
  model::Recompute recompute{};      // applied to its first layers
  int pipelines = 1;                 // of the plan
  OptimizerSharding optimizer = OptimizerSharding::kDistributed;
  RecomputeTiming timing = RecomputeTiming::kInBackward;
  LinkProbe probe = LinkProbe::kNone;
};

// A footprint on a stage of `q.layers` layers holding `q.in_flight` micro-batches at once, with
// `q.recompute` applied to its first layers, in a plan of `q.pipelines` pipelines. With more than
// one, the rank packs its gradients for the sync in chunks of kGradSyncChunkElements (otherwise
// the pack buffer only ever holds one tensor, for the gradient norm), and with the distributed
// optimizer (ZeRO-1) every piece has `pipelines` holders: each keeps 1/pipelines of the
// optimizer state (fp32 master weights and moments, optimizer_bytes) and of the summed gradients
// (a shard of its own next to the full gradients). RecomputeTiming::kAhead: the stage recomputes
// ahead of its backward (the shifted schedule), with a scratch per recomputing layer.
// LinkProbe::kHeld: the rank is its node's leader in a job of several nodes
// (CostModel::probes_links), so its packing buffer also holds the link probe (2 ×
// kLinkProbeElements: what it sends and receives). For a stage's fullest member
// (GroupCost::memory), whether any member probes (GroupCost::probes_links).
MemoryUse memory_use(const MemoryFootprint& footprint, const StageMemory& q);

}  // namespace malleus::plan
