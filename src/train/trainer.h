// The single-rank training loop: sample the global batch micro-batch by micro-batch, accumulate
// gradients of the global-batch mean loss, clip by global norm, AdamW step; evaluate, log and
// checkpoint on schedule. Resuming from a checkpoint continues bit-exactly.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "data/dataset.h"
#include "model/transformer.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace malleus::train {

struct StepStats {
  int64_t step = 0;  // 1-based number of the update just made
  double loss = 0;   // mean token loss of the global batch
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double step_time_s = 0;
  double tokens_per_s = 0;
};

class Trainer {
 public:
  // A fresh run: parameters initialised from config.seed.
  Trainer(const TrainConfig& config, const model::ModelConfig& model_config);

  // Continues from a checkpoint (parameters, moments, step, data position).
  void restore(const Checkpoint& checkpoint);
  Checkpoint snapshot();

  StepStats train_step();
  // Mean token loss over up to max_samples sequences of `pattern` (all of them if fewer).
  double evaluate(const std::string& pattern, int max_samples);

  // The whole run from the current step to config.steps, with step lines on stdout, metrics in
  // <out_dir>/metrics.jsonl, evaluations and checkpoints in <out_dir>/checkpoints.
  void run();

  int64_t step() const { return step_; }
  int64_t consumed_samples() const { return consumed_samples_; }
  const TrainConfig& config() const { return config_; }
  model::Transformer<float>& model() { return model_; }

 private:
  void save(const std::filesystem::path& root);

  TrainConfig config_;
  std::unique_ptr<backend::Backend<float>> backend_;
  model::Transformer<float> model_;
  AdamW optimizer_;
  LrSchedule schedule_;
  data::TokenDataset train_data_;
  data::Sampler sampler_;
  std::vector<int32_t> inputs_, targets_;
  int64_t step_ = 0;
  int64_t consumed_samples_ = 0;
};

// Mean token loss of `model` over up to max_samples windows of `dataset` (in a fixed order that
// does not depend on the batch size), shared by training-time evaluation and `malleus eval`.
double evaluate_loss(model::Transformer<float>& model, const data::TokenDataset& dataset,
                     int max_samples);

// Threads to use for a configured value of 0 (all cores) or n.
int resolve_threads(int configured);

}  // namespace malleus::train
