// The 1F1B pipeline schedule (Narayanan et al., "Efficient Large-Scale Language Model Training on
// GPU Clusters Using Megatron-LM", 2021): stage s of S first runs S − s − 1 warm-up forwards,
// then alternates one forward and one backward, then drains the remaining backwards. A stage
// never holds more than S − s micro-batches of activations.
#pragma once

#include <vector>

namespace malleus::runtime {

struct PipelineOp {
  enum Kind { kForward, kBackward } kind;
  int micro_batch;
};

std::vector<PipelineOp> one_f_one_b(int stage, int num_stages, int micro_batches);

// Activation slots stage `stage` needs: the most micro-batches it holds at once.
inline int activation_slots(int stage, int num_stages, int micro_batches) {
  const int in_flight = num_stages - stage;
  return in_flight < micro_batches ? in_flight : micro_batches;
}

}  // namespace malleus::runtime
