#include "runtime/optimizer.h"

#include "common/error.h"

namespace malleus::runtime {

AdamW::AdamW(backend::Backend<float>& backend, int64_t elements, AdamWConfig config)
    : backend_(backend),
      config_(config),
      m_(backend, static_cast<size_t>(elements), backend::MemoryKind::kOptimizer),
      v_(backend, static_cast<size_t>(elements), backend::MemoryKind::kOptimizer) {}

void AdamW::step(const model::ParameterLayout& layout, float* params, const float* grads, float lr,
                 float grad_scale) {
  check(layout.total_size() == elements(), "AdamW: the layout does not match the moments");
  begin_step();
  for (const auto& t : layout.tensors()) {
    update(params + t.offset, grads + t.offset, t.offset, t.size, t.weight_decay, lr, grad_scale);
  }
}

void AdamW::update(float* params, const float* grads, int64_t moment_offset, int64_t count,
                   bool weight_decay, float lr, float grad_scale) {
  backend::AdamWStep hyper;
  hyper.lr = lr;
  hyper.beta1 = config_.beta1;
  hyper.beta2 = config_.beta2;
  hyper.eps = config_.eps;
  hyper.grad_scale = grad_scale;
  hyper.step = steps_done_;
  hyper.weight_decay = weight_decay ? config_.weight_decay : 0.0f;
  backend_.adamw_update(params, grads, m_.data() + moment_offset, v_.data() + moment_offset,
                        static_cast<size_t>(count), hyper);
}

}  // namespace malleus::runtime
