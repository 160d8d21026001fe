// The cost model: predicted time and memory of a plan on a cluster whose devices straggle.
//
// Per layer and micro-batch (b sequences of s tokens, hidden h, FFN F, vocab V):
//   forward FLOPs  = b·s·(2·(2h² + 2h·kv)·fh + 2h·s·fh + 2·3hF·ff)    (matmuls + causal attention)
//   backward FLOPs = 2 × forward
// where fh, ff are the rank's shares of heads and FFN columns. A rank's time is FLOPs /
// throughput × its straggle rate; a TP group takes the slowest member's time plus 2 ring
// all-reduces of b·s·h activations forward and 2 backward (2(t−1)/t·bytes/bw + 2(t−1)·latency).
// The first stage adds the vocabulary-parallel embedding (one all-reduce), the last the LM head
// (2·V·h·fv FLOPs per token forward) and its input-gradient all-reduce.
//
// Pipelines run 1F1B. Closed form for a pipeline of S stages with forward F_s, backward B_s,
// point-to-point time d_s after stage s and m micro-batches:
//   T = Σ_s (F_s + B_s) + 2·Σ_s d_s + (m − 1)·period,
//   period = max_s max(F_s + B_s, (Σ_{k≥s} (F_k + B_k) + 2·Σ_{s≤k<S−1} d_k) / (S − s))
// (the second term is the round trip of the S − s micro-batches in flight below stage s).
// Under the shifted schedule a stage before the last recomputes a micro-batch (R_s, part of B_s)
// before its gradient arrives: R_s leaves the round trips (not the stage's own F_s + B_s), and
// in the first micro-batch's trip it hides in the wait for the first gradient, up to that wait
// (what the stages below take, less the stage's own warm-up forwards).
// A slow link (ClusterSpec::link_rates) divides the inter-node bandwidth of every transfer through
// it: P2P hand-offs, TP and gradient-sync rings whose members span its node.
// Ranks that take turns on shared cores (ClusterSpec::cores_per_node: more ranks than CPU cores,
// malleus's core lease) never compute at once: a TP group's members on one core add up,
// consecutive stages of a pipeline on the same cores run as one stage (the core does the other
// stage's work in what would be its bubble), the pipelines take at least the busiest core's
// compute (over every stage on it), and optimizer steps on a core follow each other. All of that
// is plan/shared_cores.h, which a cluster with a compute unit per device never enters.
// Iteration = max over pipelines + gradient sync across pipelines (every rank all-reduces the
// gradient bytes it owns with one owner per other pipeline, ring, bf16 or fp32 as the cluster
// says) + optimizer step (memory-bound: 2 × state bytes per owned parameter / memory bandwidth).
//
// Memory per rank: plan/memory_model.h.
// Sub-pipelined tensor parallelism (set_tp_subpipeline, model/transformer.h): a layer's
// micro-batch runs as two parts, so each of its 2 forward and 2 backward all-reduces becomes two
// of half the activations, c/2 = allreduce(b·s·h/2) each, and every half-reduction but the last
// of the layer runs while the other part computes: it costs max(0, c/2 − that compute), the last
// costs c/2. Split along sequences (b ≥ 2), forward overlaps the attention of the second part,
// then the MLP of the first and of the second; backward the MLP's, then the attention's. Split
// along token rows (b = 1) the attention core runs whole, so the row-wise work that overlaps is
// smaller: the o_proj of the second part (forward) and, backward, the o_proj and then the q/k/v
// projections of one part (model/transformer.cpp's order). Compute shares come from the FLOP
// count. This assumes the reduction progresses on its own (a GPU's copy engines and NICs);
// on CPU ranks it does not (docs/performance.md).
//
// Recomputation (model/recompute.h) keeps less per layer: selective drops the attention scores
// and output, full keeps only the layer's input; what is recomputed lives in one scratch layer
// per stage (per recomputing layer on stages before the last under the shifted schedule, which
// recomputes a micro-batch's layers all at once before its backward). Each stage that does not fit
// gets the cheapest recomputation that makes it fit (stage-aware, as Merak): selective costs the
// attention core's forward per layer, full the layer's forward and one all-reduce.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "plan/cluster.h"
#include "plan/memory_model.h"
#include "plan/plan.h"
#include "plan/shared_cores.h"

namespace malleus::plan {

// A rank's part of a tensor-parallel stage: the fractions of the query heads, the FFN columns and
// the vocabulary rows it holds (1: all of them, as on a rank without tensor parallelism).
struct Shares {
  double heads = 1, ffn = 1, vocab = 1;
  static Shares of(const Stage& stage, size_t member, const model::ModelConfig& model);
};

// ---- FLOPs: the one count, used by the cost model's compute times and by the runtime's work
// accounting (what a rank's measured time is divided by) ----------------------------------------

// Forward FLOPs of one micro-batch (`sequences` × `seq_len` tokens) through one transformer layer
// or the LM head, on a rank's shares. Backward costs kBackwardPerForward × forward.
double layer_forward_flops(const model::ModelConfig& model, int sequences, int seq_len,
                           const Shares& shares = {});
double head_forward_flops(const model::ModelConfig& model, int sequences, int seq_len,
                          const Shares& shares = {});
inline constexpr double kBackwardPerForward = 2;
// Forward and backward FLOPs of one micro-batch through a rank's shard: `layers` layers, and the
// LM head when the rank is on the last stage.
double shard_training_flops(const model::ModelConfig& model, int sequences, int seq_len, int layers,
                            bool last_stage, const Shares& shares = {});
// Every rank's FLOPs of one step under `plan`: its micro-batches through its shard, or the idle
// probe's (kComputeProbeFlops) for a rank the plan leaves idle. What the straggler monitor divides
// each rank's measured time by.
std::vector<double> work_flops(const Plan& plan, const model::ModelConfig& model, int seq_len);

// The link probe's fixed schedule among `nodes` nodes (the circle method: every pair of nodes
// meets once, each node in at most one pair per round): its number of rounds, and node `node`'s
// partner in round `round`, or -1 for a bye (an odd number of nodes).
int link_probe_rounds(int nodes);
int link_probe_partner(int nodes, int round, int node);

struct BatchConfig {
  // More micro-batches than this in a step are refused: no model trains on them, and the planners'
  // searches over them would run for minutes.
  static constexpr int kMaxMicroBatches = 1 << 20;
  int global_batch = 64;  // sequences per optimizer step
  int micro_batch = 1;    // sequences per micro-batch
  int seq_len = 4096;
  int micro_batches() const { return global_batch / micro_batch; }
  void validate(const std::string& source) const;
};

// Measured per-layer times of one device at one (model, micro-batch, sequence) shape; the cost
// model turns them into achieved FLOP/s and uses those instead of the cluster's peak × MFU.
struct Profile {
  std::string device;
  std::string model;
  int threads = 1;
  int micro_batch = 1, seq_len = 1;
  double layer_forward_s = 0, layer_backward_s = 0;  // one transformer block
  double head_forward_s = 0, head_backward_s = 0;    // final norm + LM head + loss
  double layer_forward_flops_per_s = 0, layer_backward_flops_per_s = 0, head_flops_per_s = 0;

  Json to_json() const;
  static Profile from_json(const Json& json, const std::string& source);
};

// Per-layer costs of one tensor-parallel group for one micro-batch; "max" over its ranks.
struct GroupCost {
  int tp = 1;
  // Compute, rates applied: of the slowest member, or of the busiest core where members take
  // turns on shared cores (ClusterSpec::cores_per_node); so are the head and attention-core times.
  double layer_forward = 0, layer_backward = 0;
  double layer_comm = 0;       // one all-reduce of b·s·h activations
  double layer_comm_half = 0;  // one of half of them (sub-pipelined TP)
  // The vocabulary-parallel loss's two small all-reduces on the last stage (each token's logit
  // maximum, then its sum of exponentials with its target's logit: b·s and 2·b·s values):
  // latency-bound, so on slow links they are not negligible next to the layers' large ones.
  double loss_comm = 0;
  // Shares of a layer's compute (slowest member) in its attention (q/k/v/o projections and the
  // core), its o projection and its q/k/v projections: what overlaps sub-pipelined reductions.
  double attention_share = 0, o_proj_share = 0, qkv_share = 0;
  double attention_core_forward = 0;           // scores and weighted values: selective recompute
  double head_forward = 0, head_backward = 0;  // last stage
  MemoryFootprint memory;                      // of the fullest member
  // A member times the link probe (CostModel::probes_links), so stage_cost counts the probe in
  // the fullest member's packing buffer: by the predicate the per-device memory (predict,
  // memory_by_kind) uses, so a stage without a node leader is not charged the probe. (With
  // uneven shares `memory` bounds the members from above, and so does this.)
  bool probes_links = false;
  bool gone = false;  // a member has rate ∞
};

// Whether stage_cost may give a stage whose plan says no recomputation the cheapest one that makes
// it fit (the planner's search), or predicts exactly the plan's (what the runtime will run).
enum class RecomputeChoice { kAsPlanned, kChooseToFit };

struct StageCost {
  double forward = 0, backward = 0;  // per micro-batch, TP communication and recomputation in
  double comm = 0;                   // the part of forward + backward spent in TP all-reduces
  model::Recompute recompute;        // as planned, or chosen to fit
  double recompute_time = 0;         // the part of backward that recomputes
  bool recompute_ahead = false;      // done before the gradient arrives (shifted schedule)
  double memory_bytes = 0;           // the fullest rank
  bool fits = true;
};

struct StagePrediction {
  StageCost cost;
  double p2p_next = 0;  // one activation to the next stage (0 for the last)
};

struct PipelinePrediction {
  double time = 0;               // first forward to last backward
  double period = 0;             // steady-state time per micro-batch
  double first_micro_batch = 0;  // Σ (F + B) + 2 Σ p2p, less hidden recomputation: m = 1
  std::vector<StagePrediction> stages;
};

struct Prediction {
  double iteration_time = 0;  // +inf when a used device is gone
  double pipeline_time = 0, grad_sync_time = 0, optimizer_time = 0;
  std::vector<PipelinePrediction> pipelines;
  std::vector<double> memory_bytes;  // per device; idle devices: idle_memory's probes
  bool fits = true;
  std::string problem;  // why it does not fit / cannot run
};

class CostModel {
 public:
  CostModel(model::ModelConfig model, ClusterSpec cluster, BatchConfig batch,
            std::optional<Profile> profile = std::nullopt);

  const model::ModelConfig& model() const { return model_; }
  const ClusterSpec& cluster() const { return cluster_; }
  // How the cluster's devices share compute units; null when each has its own (SharedCores::of).
  const SharedCores* shared_cores() const { return shared_cores_ ? &*shared_cores_ : nullptr; }
  // Whether the model may choose recomputation for stages that do not fit (default); off, a
  // stage recomputes only what its plan says (the experiments' "without recomputation").
  void allow_recompute(bool allowed) { recompute_allowed_ = allowed; }
  bool recompute_allowed() const { return recompute_allowed_; }
  // Whether the runtime runs the shifted schedule (runtime::EngineOptions::shifted_recompute):
  // stages before the last then hold a recomputation scratch per recomputing layer.
  void set_shifted_recompute(bool shifted) { shifted_recompute_ = shifted; }
  bool shifted_recompute() const { return shifted_recompute_; }
  // Whether the runtime runs sub-pipelined tensor parallelism (header comment; off by default,
  // as the runtime's option).
  void set_tp_subpipeline(bool on) { tp_subpipeline_ = on; }
  bool tp_subpipeline() const { return tp_subpipeline_; }
  // A layer's TP all-reduce time that its compute does not hide, forward or backward: 2 ×
  // layer_comm, or with sub-pipelining the overlap of the header comment.
  double exposed_layer_comm(const GroupCost& group, bool backward) const;
  // Whether plans of several pipelines split the optimizer state among the holders of each piece
  // (the runtime's distributed optimizer, on by default as there).
  void use_distributed_optimizer(bool on) { distributed_optimizer_ = on; }
  bool distributed_optimizer() const { return distributed_optimizer_; }
  // The widest TP group the planners may form (0: as wide as a node and the KV heads allow): 1
  // for a runtime without tensor parallelism (malleus.torch's pipelines).
  void limit_tensor_parallel(int max_tp) { max_tp_ = max_tp; }
  int max_tensor_parallel() const { return max_tp_; }
  // This model on the same cluster whose nodes' links are `link_rates` times slower
  // (ClusterSpec::link_rates; empty: all healthy). Throws Error for a rate below 1.
  CostModel with_link_rates(std::vector<double> link_rates) const;
  const BatchConfig& batch() const { return batch_; }

  // FLOPs of one micro-batch on a whole (unsharded) layer / LM head, forward only.
  double layer_forward_flops() const;
  double head_forward_flops() const;
  // What member `member` of `stage` holds per layer, micro-batch and position.
  MemoryFootprint footprint(const Stage& stage, size_t member) const;
  double activation_message_bytes() const;  // b·s·h activations (P2P, TP all-reduce)

  // Ring all-reduce of `bytes` over `ranks`; the slowest link sets the pace.
  double allreduce_time(const std::vector<int>& ranks, double bytes) const;
  double allreduce_time(int parts, double bytes, double bandwidth, double latency) const;
  double p2p_time(const Stage& from, const Stage& to) const;
  // Every device's link probe time per byte on this cluster's healthy links (one message of
  // kLinkProbeElements fp32 between two nodes; each node's first device probes, the others
  // report 0): the reference of the link monitor (elastic::LinkMonitor).
  std::vector<double> link_probe_seconds_per_byte() const;
  // Whether `device` times the link probe (its node's first device, on several nodes), so its
  // packing buffer also holds the probe.
  bool probes_links(int device) const;
  // What a device the plan leaves idle holds: the compute probe's three matrices (workspace)
  // and, on a node leader, the link probe in its packing buffer (communication), which an idle
  // leader still exchanges every step. A few MiB, but counted so that the per-device memory is
  // what the runtime books on every rank.
  MemoryUse idle_memory(int device) const;

  GroupCost group_cost(const Stage& stage, const Rates& rates) const;
  // Each member's compute time relative to the group's slowest member (1 for the slowest): the
  // share of a stage's compute time the member is actually busy.
  std::vector<double> member_load(const Stage& stage, const Rates& rates) const;
  // One stage of a pipeline, for stage_cost: it sets the stage's memory and its recomputation.
  // (A struct, not positional flags: callers name what they set.)
  struct StageQuery {
    int layers = 0;
    bool first = false, last = false;  // the stage's position in its pipeline
    int in_flight = 1;                 // micro-batches whose activations it holds at once
    model::Recompute planned{};        // the stage's recomputation as its plan says
    RecomputeChoice choice = RecomputeChoice::kChooseToFit;
    int pipelines = 1;  // of the plan (memory_use)
    // kAhead: the plan has the stage recompute ahead of its gradient (Stage::recompute_ahead); it
    // does on a stage before the last with it or under the shifted schedule.
    RecomputeTiming timing = RecomputeTiming::kInBackward;
  };
  StageCost stage_cost(const GroupCost& group, const StageQuery& query) const;

  // 1F1B closed form from per-stage F, B and P2P times (see the header comment).
  static PipelinePrediction pipeline_time(std::vector<StagePrediction> stages, int micro_batches);

  // `choose_recompute`: stages whose plan says no recomputation get the cheapest one that makes
  // them fit (the planner's search; write_recompute puts the choice into the plan); false
  // predicts exactly the plan's recomputation (what the runtime will run).
  Prediction predict(const Plan& plan, const Rates& rates, bool choose_recompute = true) const;
  // The recomputation `prediction` (of `plan`) chose for each stage, written into the plan.
  static void write_recompute(Plan& plan, const Prediction& prediction);
  // Merak's shifted critical path where it pays: every recomputing stage before the last whose
  // ranks all fit with a scratch per recomputing layer gets Stage::recompute_ahead. By the 1F1B
  // closed form recomputing ahead never lengthens an iteration (it leaves the round trips and
  // hides in the wait for the first gradient), and measured on CPU it was faster
  // (docs/performance.md), so memory is the only condition. Returns whether any stage got it.
  bool choose_recompute_ahead(Plan& plan) const;
  // Per device, bytes by kind (idle devices: idle_memory), for the plan's recomputation.
  std::vector<MemoryUse> memory_by_kind(const Plan& plan) const;

  // Shares of heads (whole KV groups), FFN columns and vocabulary rows that minimise the
  // slowest member's time for the given member rates (HAP-style uneven sharding); every rank
  // gets at least one KV group, column and row.
  void balance_shares(Stage& stage, const Rates& rates) const;
  void even_shares_of(Stage& stage) const;

  // Parameter elements a rank of `stage` owns (its shards of the stage's layers, embedding,
  // head and norms).
  double owned_parameters(const Stage& stage, size_t member, bool first, bool last) const;

 private:
  // Per layer, over all pipelines: whether its holders span nodes (its gradients then sync over
  // the inter-node network) and the slowest link rate among their nodes.
  struct LayerLinks {
    std::vector<bool> crosses;
    std::vector<double> slowest_link;
  };
  LayerLinks layer_links(const Plan& plan) const;
  // predict's parts: stage `j` of `p` (its time, and its ranks' memory and any problem written
  // into `out`), a pipeline's stages and 1F1B time, and the gradient sync and optimizer step.
  StagePrediction predict_stage(const Pipeline& p, size_t j, int pipelines, const Rates& rates,
                                bool choose_recompute, Prediction& out) const;
  PipelinePrediction predict_pipeline(const Pipeline& p, int pipelines, const Rates& rates,
                                      bool choose_recompute, Prediction& out) const;
  void predict_sync_and_optimizer(const Plan& plan, const Rates& rates, Prediction& out) const;
  // The memory question of stage `j` of `pipeline` (its layers, position, micro-batches in
  // flight, recomputation as planned) on device `device`, in a plan of `pipelines` pipelines.
  StageMemory stage_memory(const Pipeline& pipeline, size_t j, int pipelines, int device) const;
  // Parameter elements of one layer's shard (matmuls on the shares, both norms whole).
  double layer_parameters(const Shares& shares) const;
  // The compute unit `device` runs on: its own (the device's number) unless units are shared.
  int unit_of(int device) const { return shared_cores_ ? shared_cores_->core_of(device) : device; }

  model::ModelConfig model_;
  ClusterSpec cluster_;
  BatchConfig batch_;
  std::optional<Profile> profile_;
  // Ranks taking turns on shared units (the 2-core test bed); none with a unit per device.
  std::optional<SharedCores> shared_cores_;
  bool recompute_allowed_ = true;
  bool shifted_recompute_ = false;
  bool tp_subpipeline_ = false;
  bool distributed_optimizer_ = true;
  int max_tp_ = 0;
  double attention_params_ = 0, ffn_params_ = 0;  // per layer, matmuls
  double layer_flops_per_s_fwd_ = 0, layer_flops_per_s_bwd_ = 0, head_flops_per_s_ = 0;
};

}  // namespace malleus::plan
