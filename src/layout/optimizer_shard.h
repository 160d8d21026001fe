// The distributed optimizer's layout (ZeRO-1): which part of the Adam moments, and of the update,
// each rank owns. One more layout over the common refinement of the plan's layout
// (DESIGN.md, "One algebra for three jobs"): the pieces of a gradient-sync group (one holder
// set) are packed in the group's order into chunks, exactly as the gradient sync packs them, and
// each chunk is cut into n near-equal contiguous slices, slice i to the group's i-th rank (by
// rank), at whole rows of the pieces (so that a slice is a set of blocks of rows, which a
// migration moves like any other layout: layout/staged_redistribution.h). Pieces a rank holds
// alone stay its own (one slice: the whole chunk).
//
// A rank's optimizer shard is the concatenation of its slices, in the order of `chunks`: its Adam
// moments and its summed gradients live there, contiguously.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "layout/grad_sync_plan.h"
#include "plan/plan.h"

namespace malleus::layout {

// The pieces of `pieces` (indices into sync.pieces) in chunks of at most `chunk_elements`
// elements (a larger piece alone): [begin, end) index ranges into `pieces`. The gradient sync and
// the optimizer shard cut the same chunks.
std::vector<std::pair<size_t, size_t>> pack_chunks(const GradSyncPlan& sync,
                                                   const std::vector<int>& pieces,
                                                   double chunk_elements);

struct ShardChunk {
  int group = -1;           // index into GradSyncPlan::groups; -1: pieces this rank holds alone
  std::vector<int> pieces;  // indices into GradSyncPlan::pieces, in packed order
  int64_t elements = 0;     // of the packed chunk
  // Member i (the group's i-th rank) owns elements [bounds[i], bounds[i + 1]) of the chunk.
  std::vector<int64_t> bounds;
  int member = 0;            // this rank's index among the members
  int64_t shard_offset = 0;  // where this rank's slice starts in its shard
  int64_t slice_begin() const { return bounds[static_cast<size_t>(member)]; }
  int64_t slice_end() const { return bounds[static_cast<size_t>(member) + 1]; }
  int64_t slice_elements() const { return slice_end() - slice_begin(); }
};

struct OptimizerShard {
  std::vector<ShardChunk> chunks;  // the chunks this rank takes part in
  int64_t elements = 0;            // of this rank's shard: Σ its slices
};

// Rank `rank`'s part of the distributed optimizer under the layout `sync` was planned for.
OptimizerShard optimizer_shard(const GradSyncPlan& sync, int rank, double chunk_elements);

// Whether a plan's Adam moments are split among holders when the distributed optimizer is asked
// for: where it saves memory, with several pipelines (every piece then has a holder in each; a
// single pipeline's holder sets of two or more ranks are its tensor-parallel groups' copies of
// the norm gains, too small to split).
inline bool splits_moments(const plan::Plan& plan, bool distributed_optimizer) {
  return distributed_optimizer && plan.pipelines.size() > 1;
}

// The blocks of rows (layout::Block) a rank's optimizer shard holds, at their offsets in it.
// `full`: the model's whole ParameterLayout.
Blocks shard_blocks(const model::ParameterLayout& full, const GradSyncPlan& sync,
                    const OptimizerShard& shard);

// Where every rank keeps its Adam moments under `layout`: its optimizer shard's blocks when
// `sync` (the layout's plan_grad_sync) is given, else whole, in its local layout.
std::vector<Blocks> moment_blocks(const model::ModelConfig& model, const Layout& layout,
                                  const GradSyncPlan* sync);

}  // namespace malleus::layout
