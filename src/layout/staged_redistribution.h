// A redistribution run band by band, so that a live migration never holds two whole copies of
// a rank's state: its extra memory is bounded by a configured bucket (docs/runtime.md, "Bounded
// migration memory").
//
// Every tensor is cut into bands of whole rows (rows of the full tensor along its sharded axis,
// or along its first axis for column-sharded tensors, whose rows every holder has in full), each
// band at most chunk_elements of the full tensor. A band is the unit of memory: before a band
// moves, each new holder books its part of it (commit); once it has moved, each old holder gives
// its part back (release), since nothing reads it again. A band's pieces travel as one message
// per pair of ranks, packed by the same pack_piece / unpack_piece as every other redistribution.
//
// Bands run one at a time, in an order chosen so that no rank's state — old parts not yet given
// back plus new parts booked — grows past max(its old state, its new state) + one chunk: the first
// band in tensor order that keeps every rank within that bound (a rank that moves from the last
// stage to the first and its partner that moves the other way take turns). Inside a band a rank
// holds at most three chunks more (its new part, the messages it receives, the message it
// sends), so with chunk = bucket / 4 (over all buffers) the extra memory stays under the bucket.
// Every rank computes the same order from the shared plan, so no extra communication decides it.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "layout/redistribution.h"

namespace malleus::layout {

// A piece of one band: rows [row_begin, row_end) of a column-sharded tensor's piece, or, for
// other tensors, the part of the piece inside the band (row range unused, -1).
struct BandMove {
  Piece part;
  int64_t row_begin = -1, row_end = -1;
  int source = 0, destination = 0;
  int source_tensor = 0, destination_tensor = 0;  // local tensor indices
  int64_t elements = 0;                           // per buffer
};

// One rank's part of a band in its flat buffers (the same offsets in every buffer).
struct BandRange {
  int rank = 0;
  int64_t offset = 0, count = 0;
};

struct Band {
  int tensor = 0;               // in the full model's ParameterLayout
  int64_t begin = 0, end = 0;   // rows of the full tensor
  std::vector<BandMove> moves;  // sorted by (source, destination); local copies included
  std::vector<BandRange> old_parts, new_parts;
};

struct StagedRedistribution {
  std::vector<Band> bands;  // in the order they run
  int64_t chunk_elements = 0;
  // Per rank, the bytes its state and messages exceed max(old state, new state) by at the worst
  // moment, as the order predicts (the bound the runtime's ledger is held against).
  std::vector<int64_t> predicted_extra_bytes;
};

// `plan` must be plan_redistribution(model, from, to). `buffers` state buffers of
// `element_bytes` each move together (parameters and Adam moments: 3 × 4 bytes). bucket_bytes ≥
// 4 × buffers × element_bytes × the longest row; a smaller bucket still works, a row at a time,
// above the bound.
StagedRedistribution stage_redistribution(const model::ModelConfig& model,
                                          const RedistributionPlan& plan, const Layout& from,
                                          const Layout& to, int64_t bucket_bytes, int buffers,
                                          int element_bytes);

// How this rank's memory follows a staged redistribution: commit(offset, count) before the first
// write into those elements of every new buffer, release(offset, count) after the last read of
// those elements of every old buffer.
struct StateMemory {
  std::function<void(int64_t offset, int64_t count)> commit, release;
};

// Runs `staged` on this rank: collective over `world` (every rank calls it with the same staged
// plan; ranks with nothing to do in a band skip it). Messages are booked in the memory ledger as
// communication. Returns the bytes this rank received from other ranks.
template <typename T>
int64_t redistribute_staged(const StagedRedistribution& staged, comm::Communicator& world,
                            const LocalState<const T>& from, const LocalState<T>& to,
                            const StateMemory& memory);

}  // namespace malleus::layout
