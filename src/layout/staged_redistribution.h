// A redistribution run band by band, so that a live migration never holds two whole copies of
// a rank's state: its extra memory is bounded by a configured bucket (docs/elastic.md, "Bounded
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
//
// The state is of several kinds, each laid out its own way (layout::Block): parameters in each
// rank's local layout, Adam moments there too or in its optimizer shard (the distributed
// optimizer's blocks of rows, layout/optimizer_shard.h). Bands are also cut at every block's first
// and last row, so that each kind's part of a piece in a band has whole blocks as holders on both
// sides; a band moves every kind of it together. Each new holder of a kind's part takes it from its
// own old block when it has one, else from the sender the redistribution plan chose for that
// piece when that rank holds it, else from the one old holder that does (the optimizer shard's
// owner).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "layout/redistribution.h"

namespace malleus::layout {

// One kind of state that moves: `buffers` buffers of `element_bytes` each, laid out alike (the
// same offsets in each), held on every rank as the blocks of `from` before and of `to` after.
struct StateKind {
  int buffers = 1;
  int element_bytes = 4;
  std::vector<Blocks> from, to;  // per rank
  int64_t unit() const { return int64_t{buffers} * element_bytes; }
};

// A piece of one band of one kind: rows [row_begin, row_end) of a column-sharded tensor's piece,
// or, for other tensors, the part of the piece inside the band (row range unused, -1).
struct BandMove {
  int kind = 0;  // index into the staged kinds
  Piece part;
  int64_t row_begin = -1, row_end = -1;
  int source = 0, destination = 0;
  int source_block = 0, destination_block = 0;  // in the kind's from / to blocks of each rank
  int64_t elements = 0;                         // per buffer
};

// One rank's part of a band in its flat buffers of one kind (the same offsets in every buffer).
struct BandRange {
  int rank = 0;
  int kind = 0;
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
  std::vector<int> kind_buffers;  // buffers of each kind
  // Per rank, the bytes its state and messages exceed max(old state, new state) by at the worst
  // moment, as the order predicts (the bound the runtime's ledger is held against).
  std::vector<int64_t> predicted_extra_bytes;
  // Per rank, the bytes it receives from other ranks (every kind, every buffer).
  std::vector<int64_t> received_bytes;
};

// `plan` must be plan_redistribution(model, from, to) of the layouts the parameters are in; each
// kind's blocks must lie inside those layouts (every block of a rank's within what the rank holds
// on that side). bucket_bytes ≥ 4 × Σ(kind units) × the longest row; a smaller bucket still
// works, a row at a time, above the bound.
StagedRedistribution stage_redistribution(const model::ModelConfig& model,
                                          const RedistributionPlan& plan,
                                          const std::vector<StateKind>& kinds,
                                          int64_t bucket_bytes);
// One kind: `buffers` buffers of `element_bytes` each, laid out by `from` and `to` (parameters and
// whole Adam moments: 3 × 4 bytes).
StagedRedistribution stage_redistribution(const model::ModelConfig& model,
                                          const RedistributionPlan& plan, const Layout& from,
                                          const Layout& to, int64_t bucket_bytes, int buffers,
                                          int element_bytes);

// How this rank's memory follows a staged redistribution: commit(kind, offset, count) before the
// first write into those elements of every new buffer of that kind, release(kind, offset, count)
// after the last read of those elements of every old buffer of that kind.
struct StateMemory {
  std::function<void(int kind, int64_t offset, int64_t count)> commit, release;
};

// One kind of state on this rank, on one side: its blocks (the kind's from or to blocks of this
// rank) and its buffers, or nothing when it holds none. The buffers lie in `memory` (a backend's
// device memory; null: host memory), reached through its copies.
template <typename T>
struct KindState {
  const Blocks* blocks = nullptr;
  std::vector<T*> buffers;
  const DeviceMemory* memory = nullptr;
};

// Runs `staged` on this rank: collective over `world` (every rank calls it with the same staged
// plan; ranks with nothing to do in a band skip it). from[k] and to[k] are this rank's state of
// kind k. Messages are booked in the memory ledger as communication. Returns the bytes this rank
// received from other ranks.
template <typename T>
int64_t redistribute_staged(const StagedRedistribution& staged, comm::Communicator& world,
                            const std::vector<KindState<const T>>& from,
                            const std::vector<KindState<T>>& to, const StateMemory& memory);

// `staged` with only its bands [first, end): the bands of one part of a move (its predicted extra
// and received bytes stay the whole plan's).
StagedRedistribution band_range(const StagedRedistribution& staged, size_t first, size_t end);

// A staged redistribution run in the background of other work on this rank (the overlapped
// switch, runtime/engine.h): poll() posts bands without waiting — local pieces copied, messages
// packed and posted — while this rank's messages in flight stay under window_bytes (one band at
// least), and unpacks the bands whose messages have all arrived; finish() posts the rest and waits
// for everything. A band's old parts are released as soon as it is posted (its messages and local
// copies hold what they need) and its new parts committed then. Messages carry `tag` on `world`,
// so they pass beside other point-to-point traffic of the same communicator that uses other tags.
// Collective in effect: every rank must run the same staged plan, and call finish() at the same
// point of its program, since finish() waits for the other ranks' messages. `from`, `to` and the
// blocks they point to must outlive the object; finish() runs in the destructor too.
template <typename T>
class BackgroundRedistribution {
 public:
  BackgroundRedistribution(StagedRedistribution staged, comm::Communicator& world,
                           std::vector<KindState<const T>> from, std::vector<KindState<T>> to,
                           StateMemory memory, int64_t window_bytes, int tag);
  ~BackgroundRedistribution();
  BackgroundRedistribution(const BackgroundRedistribution&) = delete;
  BackgroundRedistribution& operator=(const BackgroundRedistribution&) = delete;

  // Does not wait. Returns whether every band has moved.
  bool poll();
  void finish();
  bool done() const;
  int64_t received_bytes() const { return received_; }

 private:
  struct Mover;
  void post_next();
  StagedRedistribution staged_;
  comm::Communicator& world_;
  std::vector<KindState<const T>> from_;
  std::vector<KindState<T>> to_;
  StateMemory memory_;
  int64_t window_bytes_ = 0;
  std::unique_ptr<Mover> mover_;
  size_t next_band_ = 0;
  int64_t received_ = 0;
};

}  // namespace malleus::layout
