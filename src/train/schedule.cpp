#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace malleus::train {

double LrSchedule::at(int64_t step) const {
  if (step < warmup_steps) {
    return peak_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  const double min_lr = peak_lr * min_lr_ratio;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - warmup_steps - 1);
  const double progress = std::clamp(
      static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
  return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace malleus::train
