// Which gradients must be summed with which ranks after the backward pass. Every piece of the
// common refinement of a plan's layout is held by one rank per pipeline (and, for replicated
// tensors, by every rank of the stage's tensor-parallel group). Each distinct set of holders is
// one group: one collective per group, over all its pieces packed into one buffer.
#pragma once

#include <vector>

#include "layout/layout.h"

namespace malleus::layout {

struct GradSyncGroup {
  std::vector<int> ranks;   // sorted world ranks
  std::vector<int> pieces;  // indices into GradSyncPlan::pieces, in order
  int64_t elements = 0;
};

struct GradSyncPlan {
  std::vector<RefinedPiece> pieces;   // refinement of the one layout: holders[0]
  std::vector<GradSyncGroup> groups;  // holder sets of two or more ranks, sorted by rank list
};

GradSyncPlan plan_grad_sync(const model::ModelConfig& model, const Layout& layout);

// The gradient of a piece is added once per pipeline: by the first holder (lowest rank) of each
// replica group; the other holders of a replicated tensor computed the same values and add zero.
bool contributes(const RefinedPiece& piece, int rank);
// The one rank that counts a piece in the global gradient norm (each element exactly once).
int norm_owner(const RefinedPiece& piece);

}  // namespace malleus::layout
