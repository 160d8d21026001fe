// Everything that defines a training run besides the model shape: data, batch, optimizer, LR
// schedule, logging and checkpointing. Read from a JSON file (configs/train/*.json) with strict
// keys; the command line may override single fields.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/json.h"

namespace malleus::train {

struct TrainConfig {
  std::string model = "demo";  // preset name or model JSON file
  std::string train_data = "data/fortunes/train_*.bin";
  std::string val_data = "data/fortunes/val_*.bin";  // empty: no evaluation
  int seq_len = 256;
  int micro_batch_size = 2;
  int global_batch_size = 16;  // sequences per optimizer step; a multiple of micro_batch_size
  int64_t steps = 300;
  uint64_t seed = 1234;  // parameter init and data order

  // AdamW with linear warmup then cosine decay to min_lr_ratio × lr.
  float lr = 2e-3f;
  float min_lr_ratio = 0.1f;
  int64_t warmup_steps = 30;
  float weight_decay = 0.1f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float adam_eps = 1e-8f;
  float grad_clip = 1.0f;  // global gradient-norm clip; 0 disables

  int64_t eval_every = 100;  // steps; 0 disables periodic evaluation
  int eval_samples = 64;     // validation sequences per evaluation (capped at the split's size)
  int64_t checkpoint_every = 100;     // steps; 0: only at the end
  std::string out_dir = "runs/demo";  // metrics.jsonl and checkpoints/
  int threads = 0;  // per rank; 0: the machine's cores shared among the ranks on it

  // The parallel plan: a plan file (docs/plan-format.md), or else the uniform dp × tp × pp plan
  // (dp = 0: as many pipelines as the ranks allow).
  std::string plan;
  int dp = 0, tp = 1, pp = 1;

  // Straggler tolerance: re-plan when the monitored rates move (elastic/controller.h), planning
  // for the cluster preset `cluster` with one device per rank.
  bool replan = true;
  std::string cluster = "cpu-local";
  // A `malleus profile` file: the controller's cost model then uses these measured layer times
  // instead of the cluster's peak × MFU (scaled by each rank's share of the cores when more ranks
  // than cores run on this machine).
  std::string profile;
  int monitor_window = 3;   // steps in the monitor's sliding median
  int replan_horizon = 50;  // steps over which a re-plan's gain must pay for its migration
  // Injected stragglers for experiments: "RANK:RATE:FROM-TO" entries and/or a trace file.
  std::vector<std::string> stragglers;
  std::string straggler_trace;

  int64_t tokens_per_step() const { return int64_t{global_batch_size} * seq_len; }

  void validate(const std::string& source) const;
  static TrainConfig from_json(const Json& json, const std::string& source);
  Json to_json() const;
};

}  // namespace malleus::train
