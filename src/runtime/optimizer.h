// AdamW over the flat parameter buffer: the two moment buffers share the parameter layout, and
// the update runs tensor by tensor so norm gains can be exempt from weight decay.
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
  AdamW(backend::Backend<float>& backend, const model::ParameterLayout& layout, AdamWConfig config);

  // One update of every tensor; grad_scale multiplies the gradients first (clipping).
  void step(float* params, const float* grads, float lr, float grad_scale);

  float* first_moment() { return m_.data(); }
  float* second_moment() { return v_.data(); }
  int64_t steps_done() const { return steps_done_; }
  void set_steps_done(int64_t steps) { steps_done_ = steps; }

 private:
  backend::Backend<float>& backend_;
  const model::ParameterLayout& layout_;
  AdamWConfig config_;
  backend::Buffer<float> m_, v_;
  int64_t steps_done_ = 0;
};

}  // namespace malleus::runtime
