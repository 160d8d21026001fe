// Activation recomputation of a model shard: what a micro-batch keeps between its forward and its
// backward, traded against computing part of the forward again in backward.
//
//  - none:      every block keeps all its activations.
//  - selective: a block keeps the outputs of its matmuls (q, k, v, the norms, the MLP) but not the
//               attention core (the softmax probabilities, b·heads·s² values, and the attention
//               output), which backward recomputes from the kept q, k, v (Korthikanti et al.,
//               "Reducing Activation Recomputation in Large Transformer Models", 2022).
//  - full:      a block keeps only its input; backward runs its forward again first.
//
// The first `layers` blocks of a shard recompute (Megatron-LM's "block" method), the others keep
// everything. The recomputed values are the same operations on the same inputs, so losses and
// gradients are bit-identical to a run without recomputation.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace malleus::model {

enum class RecomputeMode { kNone, kSelective, kFull };

// "none", "selective", "full": the names in plan files and metrics.
const char* recompute_mode_name(RecomputeMode mode);
std::optional<RecomputeMode> parse_recompute_mode(std::string_view name);

struct Recompute {
  RecomputeMode mode = RecomputeMode::kNone;
  int layers = 0;  // the shard's first `layers` blocks recompute

  bool recomputes(int block) const { return mode != RecomputeMode::kNone && block < layers; }
  bool operator==(const Recompute&) const = default;
};

}  // namespace malleus::model
