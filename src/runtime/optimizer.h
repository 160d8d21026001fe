// AdamW over flat buffers. Either over a rank's whole parameter layout (the two moment buffers
// share it, and the update runs tensor by tensor so norm gains can be exempt from weight decay),
// or, for the distributed optimizer, over this rank's optimizer shard
// (layout::OptimizerShard): the caller updates range by range, each range inside one tensor.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "model/parameters.h"

namespace malleus::runtime {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
};

class AdamW {
 public:
  // Moments for `elements` elements, zero.
  AdamW(backend::Backend<float>& backend, int64_t elements, AdamWConfig config);

  // One update of every tensor of `layout` (the moments laid out by it too); grad_scale
  // multiplies the gradients first (clipping).
  void step(const model::ParameterLayout& layout, float* params, const float* grads, float lr,
            float grad_scale);
  // One update range by range: begin_step(), then update() for each range of the moments.
  void begin_step() { ++steps_done_; }
  void update(float* params, const float* grads, int64_t moment_offset, int64_t count,
              bool weight_decay, float lr, float grad_scale);

  int64_t elements() const { return static_cast<int64_t>(m_.size()); }
  float* first_moment() { return m_.data(); }
  float* second_moment() { return v_.data(); }
  int64_t steps_done() const { return steps_done_; }
  void set_steps_done(int64_t steps) { steps_done_ = steps; }

 private:
  backend::Backend<float>& backend_;
  AdamWConfig config_;
  backend::Buffer<float> m_, v_;
  int64_t steps_done_ = 0;
};

}  // namespace malleus::runtime
