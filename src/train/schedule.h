// Learning-rate schedule: linear warmup to the peak, then cosine decay to min_lr_ratio × peak at
// the last step. A pure function of the step, so resuming needs only the step counter.
#pragma once

#include <cstdint>

namespace malleus::train {

struct LrSchedule {
  double peak_lr;
  double min_lr_ratio;
  int64_t warmup_steps;
  int64_t total_steps;

  // Learning rate for the optimizer update number `step` (0-based).
  double at(int64_t step) const;
};

}  // namespace malleus::train
