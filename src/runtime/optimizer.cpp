#include "runtime/optimizer.h"

namespace malleus::runtime {

AdamW::AdamW(backend::Backend<float>& backend, const model::ParameterLayout& layout,
             AdamWConfig config)
    : backend_(backend),
      layout_(layout),
      config_(config),
      m_(backend, static_cast<size_t>(layout.total_size()), backend::MemoryKind::kOptimizer),
      v_(backend, static_cast<size_t>(layout.total_size()), backend::MemoryKind::kOptimizer) {}

void AdamW::step(float* params, const float* grads, float lr, float grad_scale) {
  ++steps_done_;
  backend::AdamWStep hyper;
  hyper.lr = lr;
  hyper.beta1 = config_.beta1;
  hyper.beta2 = config_.beta2;
  hyper.eps = config_.eps;
  hyper.grad_scale = grad_scale;
  hyper.step = steps_done_;
  for (const auto& t : layout_.tensors()) {
    hyper.weight_decay = t.weight_decay ? config_.weight_decay : 0.0f;
    backend_.adamw_update(params + t.offset, grads + t.offset, m_.data() + t.offset,
                          v_.data() + t.offset, static_cast<size_t>(t.size), hyper);
  }
}

}  // namespace malleus::runtime
