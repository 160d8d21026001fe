// Moving model state from one layout to another: live migration after a re-plan, and saving or
// loading a checkpoint (a checkpoint is the layout in which one rank holds everything).
//
// Every piece of the common refinement of the two layouts goes to each of its new holders: from
// the holder's own old copy when it has one (no transfer), else from one old holder — on the same
// node if possible, the least-loaded one first. All pieces between a pair of ranks travel as one
// message, for every buffer at once (parameters and both Adam moments).
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "layout/layout.h"

namespace malleus::layout {

struct PieceMove {
  int piece = 0;                                  // index into RedistributionPlan::pieces
  int source_tensor = 0, destination_tensor = 0;  // local tensor indices on each side
};

struct Transfer {
  int source = 0, destination = 0;
  std::vector<PieceMove> moves;
  int64_t elements = 0;  // per buffer
};

struct RedistributionPlan {
  std::vector<RefinedPiece> pieces;    // holders[0]: old layout, holders[1]: new layout
  std::vector<Transfer> transfers;     // source != destination, sorted by (source, destination)
  std::vector<Transfer> local_copies;  // source == destination
  // Elements sent between ranks, per buffer: exactly the pieces whose new holder did not hold them.
  int64_t elements_moved() const;
};

// ranks_per_node: consecutive ranks share a node (for choosing senders); 0: all on one node.
RedistributionPlan plan_redistribution(const model::ModelConfig& model, const Layout& from,
                                       const Layout& to, int ranks_per_node = 0);

// Runs `plan` on this rank: from_buffers[i] laid out by `from_local` (this rank's old layout, or
// null if it held nothing) into to_buffers[i] laid out by `to_local`. Collective over `world`
// (every rank calls it with the same plan). Messages are split into buckets of at most
// `bucket_elements` elements so the extra memory stays bounded.
template <typename T>
void redistribute(const RedistributionPlan& plan, const model::ModelConfig& model,
                  comm::Communicator& world, const model::ParameterLayout* from_local,
                  const std::vector<const T*>& from_buffers, const model::ParameterLayout* to_local,
                  const std::vector<T*>& to_buffers, int64_t bucket_elements = int64_t{1} << 24);

}  // namespace malleus::layout
