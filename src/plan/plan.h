// A parallel plan: how a model is trained on a set of ranks. It is a list of pipelines
// (data-parallel replicas that may differ from each other); each pipeline has its own number of
// micro-batches and its own stages; each stage holds a contiguous range of layers and is run by a
// tensor-parallel group in which every rank has its own share of the attention heads, the FFN
// columns and the vocabulary rows (shares may be uneven). Ranks not named anywhere are idle.
//
// JSON form (docs/plan-format.md):
//   {"world_size": 8, "micro_batch_size": 2,
//    "pipelines": [
//      {"micro_batches": 6,
//       "stages": [{"layers": [0, 3], "ranks": [0, 1], "heads": [6, 2], "ffn": [512, 256],
//                   "vocab": [200, 57]},
//                  {"layers": [3, 4], "ranks": [2]}]},
//      {"micro_batches": 2, "stages": [{"layers": [0, 4], "ranks": [3]}]}]}
// "layers" is a half-open range [begin, end). Omitted shares are split as evenly as the units
// allow (heads in whole KV groups). A stage may add "recompute": "none" | "selective" | "full"
// and "recompute_layers": k (its first k layers recompute; default all of them), and
// "recompute_ahead": true (a stage before the last recomputes ahead of its gradient, Merak's
// shifted critical path).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json.h"
#include "model/config.h"
#include "model/recompute.h"

namespace malleus::plan {

struct Stage {
  int layer_begin = 0, layer_end = 0;  // [begin, end)
  std::vector<int> ranks;              // the tensor-parallel group, in shard order
  std::vector<int> heads;              // query heads per rank (whole KV groups)
  std::vector<int> ffn;                // FFN columns per rank
  std::vector<int> vocab;              // vocabulary rows per rank (used by first and last stage)
  // Activation recomputation of every rank of the stage: its first `recompute.layers` layers
  // (model/recompute.h). Chosen by the planner where memory requires it, or written by hand.
  model::Recompute recompute;
  // The stage recomputes a micro-batch before its output gradient arrives instead of inside its
  // backward (Merak's shifted critical path; runtime::EngineOptions::shifted_recompute), at the
  // price of a scratch per recomputing layer. Only on a recomputing stage before the last. The
  // planner sets it where that memory fits (CostModel::choose_recompute_ahead).
  bool recompute_ahead = false;

  int tp() const { return static_cast<int>(ranks.size()); }
  int num_layers() const { return layer_end - layer_begin; }
};

struct Pipeline {
  int micro_batches = 0;
  std::vector<Stage> stages;
};

struct Plan {
  int world_size = 0;
  int micro_batch_size = 1;  // sequences per micro-batch, the same in every pipeline
  std::vector<Pipeline> pipelines;

  // Sequences per optimizer step: Σ micro_batches × micro_batch_size.
  int global_batch() const;
  // Ranks that appear in no stage.
  std::vector<int> idle_ranks() const;
  // Compact description, e.g. "2 pipelines: [pp2 tp2,1 m6] [pp1 tp1 m2] idle 4-7"; a pipeline
  // with recomputation adds it per stage: "[pp2 tp1,1 m8 rc f2,-]" (full on 2 layers, none).
  std::string summary() const;

  Json to_json() const;
  // Parses and fills omitted shares; validate() separately against a model.
  static Plan from_json(const Json& json, const model::ModelConfig& model,
                        const std::string& source);
};

// Throws Error with a message naming `source` and the problem: an empty plan, a pipeline without
// stages, layers not covered exactly once in order, a rank out of range or used twice, shares of
// the wrong length or not summing to the model's heads / FFN columns / vocabulary, heads not in
// whole KV groups, a micro-batch count below one.
void validate(const Plan& plan, const model::ModelConfig& model, const std::string& source);
// Also checks the world size and the global batch the run expects.
void validate(const Plan& plan, const model::ModelConfig& model, int world_size, int global_batch,
              const std::string& source);

// Shares of `total` units over `parts` ranks as even as possible (earlier ranks get the
// remainder), in multiples of `granularity`.
std::vector<int> even_shares(int total, int parts, int granularity = 1);

// The usual uniform plan: dp pipelines of pp stages of tp ranks, ranks numbered with TP
// fastest, then PP, then DP (Megatron-LM's order); layers split as evenly as possible (earlier
// stages get the remainder); global_batch / micro_batch_size micro-batches split evenly over the
// pipelines. world_size may exceed dp × tp × pp; the rest are idle.
Plan uniform_plan(const model::ModelConfig& model, int dp, int tp, int pp, int global_batch,
                  int micro_batch_size, int world_size = 0);

}  // namespace malleus::plan
