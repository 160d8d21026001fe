// Runs training steps of one plan on this rank: its model shard through the 1F1B schedule (with
// activations and gradients exchanged with neighbouring stages by non-blocking MPI), gradient
// sync over the refinement groups, global-norm clipping and AdamW on the shard it holds.
//
// The numerics do not depend on the plan: every sample of the global batch is the same sequence
// in every plan (the caller's sample function decides it), every token's loss is weighted by
// 1 / (tokens in the global batch), and gradients are summed once per pipeline, so the update is
// the single-device update up to floating-point summation order.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "model/transformer.h"
#include "runtime/optimizer.h"
#include "runtime/parallel_state.h"

namespace malleus::runtime {

struct EngineOptions {
  int seq_len = 0;
  int threads = 1;
  AdamWConfig adamw;
};

// Fills inputs and targets [seq_len] of sequence `index` (0-based) of the current global batch.
using SampleFn = std::function<void(int index, int32_t* inputs, int32_t* targets)>;

struct StepResult {
  double loss = 0;       // mean token loss of the global batch (on every rank)
  double grad_norm = 0;  // before clipping
};

// The full model state gathered on one rank (params, Adam moments in the full model's layout).
struct FullState {
  std::vector<float> params, adam_m, adam_v;
};

class Engine {
 public:
  // Collective: every rank of `world` constructs its engine with the same plan.
  Engine(const model::ModelConfig& model, const plan::Plan& plan, comm::Communicator world,
         const EngineOptions& options);

  const model::ModelConfig& model_config() const { return model_config_; }
  ParallelState& state() { return *state_; }
  const plan::Plan& plan() const { return state_->plan(); }
  int rank() const { return state_->rank(); }
  int64_t steps_done() const { return steps_done_; }

  void init_parameters(uint64_t seed);
  StepResult step(const SampleFn& sample, float lr, float grad_clip);
  // Forward only: the mean token loss over sequences 0 .. count−1 of `sample`, micro-batches
  // dealt round-robin to the pipelines. Collective; the result is on every rank.
  double evaluate(const SampleFn& sample, int count);

  // Collective. Gathers the whole model state on rank `root` (other ranks get empty buffers),
  // through the same redistribution that moves state between plans.
  FullState gather(int root = 0);
  // Collective. Sets the state from `full`, read on rank `root` only, and the step counter.
  void scatter(const FullState& full, int64_t steps_done, int root = 0);

 private:
  void zero_grads();
  void sync_gradients();
  double local_norm_squares();

  model::ModelConfig model_config_;
  EngineOptions options_;
  std::unique_ptr<ParallelState> state_;
  std::unique_ptr<backend::Backend<float>> backend_;
  std::unique_ptr<model::Transformer<float>> model_;  // null when idle
  std::unique_ptr<AdamW> optimizer_;
  int64_t steps_done_ = 0;  // kept on idle ranks too
  std::vector<float> pack_buffer_;
  std::vector<int32_t> inputs_, targets_;
};

}  // namespace malleus::runtime
