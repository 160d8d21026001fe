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
  int world_size = 0;
  std::vector<RefinedPiece> pieces;    // holders[0]: old layout, holders[1]: new layout
  std::vector<Transfer> transfers;     // source != destination, sorted by (source, destination)
  std::vector<Transfer> local_copies;  // source == destination
  // Elements sent between ranks, per buffer: exactly the pieces whose new holder did not hold them.
  int64_t elements_moved() const;
};

// ranks_per_node: consecutive ranks share a node (for choosing senders); 0: all on one node.
RedistributionPlan plan_redistribution(const model::ModelConfig& model, const Layout& from,
                                       const Layout& to, int ranks_per_node = 0);

// One side of a redistribution on this rank: its own parameter layout and the buffers laid out by
// it (parameters, Adam moments, ...), or nothing when the rank holds nothing on that side. The
// buffers lie in `memory` (a backend's device memory; null: host memory): pieces are packed into
// and unpacked from host messages through its copies.
template <typename T>
struct LocalState {
  const model::ParameterLayout* layout = nullptr;
  std::vector<T*> buffers;
  const DeviceMemory* memory = nullptr;
};

template <typename T>
LocalState<const T> read_only(const LocalState<T>& state) {
  return {state.layout, {state.buffers.begin(), state.buffers.end()}, state.memory};
}

// Runs `plan` on this rank, moving every buffer of `from` (this rank's old state) into the same
// buffer of `to`. Collective over `world` (every rank calls it with the same plan). Messages are
// split into buckets of at most `bucket_elements` elements so the extra memory stays bounded.
// Returns the bytes this rank received from other ranks.
template <typename T>
int64_t redistribute(const RedistributionPlan& plan, comm::Communicator& world,
                     const LocalState<const T>& from, const LocalState<T>& to,
                     int64_t bucket_elements = int64_t{1} << 24);

}  // namespace malleus::layout
