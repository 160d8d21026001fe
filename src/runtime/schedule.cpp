#include "runtime/schedule.h"

#include <algorithm>

#include "common/error.h"

namespace malleus::runtime {

std::vector<PipelineOp> one_f_one_b(int stage, int num_stages, int micro_batches) {
  check(num_stages > 0 && stage >= 0 && stage < num_stages && micro_batches > 0,
        "1F1B schedule: invalid stage " + std::to_string(stage) + " of " +
            std::to_string(num_stages) + " with " + std::to_string(micro_batches) +
            " micro-batches");
  const int warmup = std::min(num_stages - stage - 1, micro_batches);
  std::vector<PipelineOp> ops;
  for (int j = 0; j < warmup; ++j) ops.push_back({PipelineOp::kForward, j});
  for (int i = 0; i < micro_batches - warmup; ++i) {
    ops.push_back({PipelineOp::kForward, warmup + i});
    ops.push_back({PipelineOp::kBackward, i});
  }
  for (int j = micro_batches - warmup; j < micro_batches; ++j) {
    ops.push_back({PipelineOp::kBackward, j});
  }
  return ops;
}

}  // namespace malleus::runtime
