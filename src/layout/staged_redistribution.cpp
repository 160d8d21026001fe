#include "layout/staged_redistribution.h"

#include <algorithm>
#include <limits>
#include <map>

#include "backend/memory.h"
#include "common/error.h"

namespace malleus::layout {

namespace {

bool column_sharded(const model::TensorSpec& t) {
  return t.shard_axis == model::ShardAxis::kColumns;
}

// Elements of one row of the full tensor along the band axis.
int64_t row_width(const model::TensorSpec& full) {
  return full.full_shape.size() > 1 ? full.full_shape[1] : 1;
}

// The part of rows [begin, end) that `block` holds, as a range of its rank's flat buffers.
BandRange local_part(int rank, int kind, const Block& block, int64_t begin, int64_t end) {
  const int64_t lo = std::max(begin, block.row_begin), hi = std::min(end, block.row_end);
  if (lo >= hi) return {rank, kind, 0, 0};
  const model::TensorSpec& local = block.spec;
  if (column_sharded(local)) {
    const int64_t cols = local.shape[1];
    return {rank, kind, local.offset + lo * cols, (hi - lo) * cols};
  }
  const int64_t row = local.shape.size() > 1 ? local.shape[1] : 1;
  return {rank, kind, local.offset + (lo - local.shard_begin) * row, (hi - lo) * row};
}

// `local` seen as only rows [move.row_begin, move.row_end) of it, for a column-sharded move.
model::TensorSpec band_view(const model::TensorSpec& local, const BandMove& move) {
  return rows_view(local, move.row_begin, move.row_end);
}

// Bytes of the parts `rank` has among `parts`.
int64_t bytes_of(const std::vector<BandRange>& parts, int rank, const std::vector<int64_t>& unit) {
  int64_t bytes = 0;
  for (const BandRange& p : parts) {
    if (p.rank == rank) bytes += p.count * unit[static_cast<size_t>(p.kind)];
  }
  return bytes;
}

// What one band costs rank `rank` at its worst moment, in bytes, beyond its state before the
// band: its new parts, then the larger of a local copy's scratch and its messages (everything it
// receives, and one message it sends, at once).
int64_t band_transient(const Band& band, int rank, const std::vector<int64_t>& unit) {
  int64_t scratch = 0, received = 0, largest_send = 0;
  std::map<int, int64_t> sent;  // by destination
  for (const BandMove& m : band.moves) {
    const int64_t bytes = m.elements * unit[static_cast<size_t>(m.kind)];
    if (m.source == rank && m.destination == rank) scratch = std::max(scratch, bytes);
    if (m.destination == rank && m.source != rank) received += bytes;
    if (m.source == rank && m.destination != rank) sent[m.destination] += bytes;
  }
  for (const auto& [destination, bytes] : sent) largest_send = std::max(largest_send, bytes);
  return bytes_of(band.new_parts, rank, unit) + std::max(scratch, received + largest_send);
}

// A block's holder: the rank and the block's index in its list.
struct BlockRef {
  int rank = 0, block = 0;
  const Block* of = nullptr;
};

// Bytes per element of every buffer of each kind (checking the kinds), and the kinds' buffer
// counts into `staged`.
std::vector<int64_t> kind_units(const std::vector<StateKind>& kinds, int world,
                                StagedRedistribution* staged) {
  check(!kinds.empty(), "staged redistribution: no state to move");
  std::vector<int64_t> unit;
  for (const StateKind& kind : kinds) {
    check(kind.buffers > 0 && kind.element_bytes > 0, "staged redistribution: no state to move");
    check(kind.from.size() == size_t(world) && kind.to.size() == size_t(world),
          "staged redistribution: blocks for another world size");
    unit.push_back(kind.unit());
    staged->kind_buffers.push_back(kind.buffers);
  }
  return unit;
}

// What cutting the state into bands looks up: each kind's holders of every tensor on either side,
// the refined pieces of each tensor, and the sender the plan chose for each (piece, new holder).
struct StateIndex {
  using Holders = std::vector<std::vector<BlockRef>>;  // per tensor
  std::vector<Holders> old_holders, new_holders;       // per kind
  std::vector<std::vector<size_t>> pieces_of;          // per tensor, indices into plan.pieces
  std::map<std::pair<size_t, int>, int> chosen;

  StateIndex(const RedistributionPlan& plan, const std::vector<StateKind>& kinds, size_t tensors)
      : old_holders(kinds.size(), Holders(tensors)),
        new_holders(kinds.size(), Holders(tensors)),
        pieces_of(tensors) {
    for (size_t k = 0; k < kinds.size(); ++k) {
      for (int r = 0; r < plan.world_size; ++r) {
        const Blocks& before = kinds[k].from[size_t(r)];
        for (size_t i = 0; i < before.size(); ++i) {
          old_holders[k][size_t(before[i].tensor)].push_back({r, int(i), &before[i]});
        }
        const Blocks& after = kinds[k].to[size_t(r)];
        for (size_t i = 0; i < after.size(); ++i) {
          new_holders[k][size_t(after[i].tensor)].push_back({r, int(i), &after[i]});
        }
      }
    }
    for (size_t p = 0; p < plan.pieces.size(); ++p) {
      pieces_of[size_t(plan.pieces[p].piece.tensor)].push_back(p);
    }
    for (const auto* list : {&plan.transfers, &plan.local_copies}) {
      for (const Transfer& t : *list) {
        for (const PieceMove& m : t.moves) chosen[{size_t(m.piece), t.destination}] = t.source;
      }
    }
  }
};

// Where tensor `f`'s bands begin and end: every chunk's worth of rows and every block's first and
// last row, sorted; nothing when no kind holds the tensor on either side.
std::vector<int64_t> band_cuts(const StateIndex& index, size_t f, const model::TensorSpec& spec,
                               int64_t chunk_elements) {
  std::vector<int64_t> cuts;
  for (size_t k = 0; k < index.old_holders.size(); ++k) {
    for (const auto* side : {&index.old_holders[k][f], &index.new_holders[k][f]}) {
      for (const BlockRef& h : *side) {
        cuts.push_back(h.of->row_begin);
        cuts.push_back(h.of->row_end);
      }
    }
  }
  if (cuts.empty()) return cuts;
  const int64_t rows = spec.full_shape[0];
  const int64_t height = std::max<int64_t>(1, chunk_elements / row_width(spec));
  for (int64_t row = 0; row < rows; row += height) cuts.push_back(row);
  cuts.push_back(rows);
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

// The moves of plan piece `p` within `band`, every kind: from each new holder's preferred source
// (itself, else the plan's chosen sender, else the first old holder).
void add_piece_moves(const RedistributionPlan& plan, const StateIndex& index,
                     const model::TensorSpec& spec, size_t p, Band* band) {
  const size_t f = size_t(band->tensor);
  const bool columns = column_sharded(spec);
  const Piece& piece = plan.pieces[p].piece;
  BandMove m;
  m.part = piece;
  if (columns) {
    m.row_begin = band->begin;
    m.row_end = band->end;
    m.elements = (band->end - band->begin) * (piece.end - piece.begin);
  } else {
    m.part.begin = std::max(piece.begin, band->begin);
    m.part.end = std::min(piece.end, band->end);
    if (m.part.begin >= m.part.end) return;
    m.elements = (m.part.end - m.part.begin) * row_width(spec);
  }
  // The rows of the full tensor the part spans.
  const int64_t first = columns ? band->begin : m.part.begin;
  const int64_t last = columns ? band->end : m.part.end;
  auto holds = [&](const Block& b) {
    return b.axis_begin() <= m.part.begin && m.part.end <= b.axis_end() && b.row_begin <= first &&
           last <= b.row_end;
  };
  for (size_t k = 0; k < index.old_holders.size(); ++k) {
    std::vector<const BlockRef*> sources;
    for (const BlockRef& h : index.old_holders[k][f]) {
      if (holds(*h.of)) sources.push_back(&h);
    }
    for (const BlockRef& to : index.new_holders[k][f]) {
      if (!holds(*to.of)) continue;
      check(!sources.empty(), "redistribution: part of tensor " + spec.name +
                                  " is held by no rank in the old layout");
      const BlockRef* from = nullptr;
      const auto sender = index.chosen.find({p, to.rank});
      for (int preferred : {to.rank, sender == index.chosen.end() ? -1 : sender->second}) {
        for (const BlockRef* s : sources) {
          if (from == nullptr && s->rank == preferred) from = s;
        }
      }
      if (from == nullptr) from = sources.front();
      BandMove move = m;
      move.kind = int(k);
      move.source = from->rank;
      move.destination = to.rank;
      move.source_block = from->block;
      move.destination_block = to.block;
      band->moves.push_back(move);
    }
  }
}

// Rows [begin, end) of tensor `f`: every rank's old and new parts of it, and its moves sorted by
// (source, destination).
Band make_band(const RedistributionPlan& plan, const StateIndex& index,
               const model::TensorSpec& spec, size_t f, int64_t begin, int64_t end) {
  Band band;
  band.tensor = static_cast<int>(f);
  band.begin = begin;
  band.end = end;
  for (size_t k = 0; k < index.old_holders.size(); ++k) {
    for (const BlockRef& h : index.old_holders[k][f]) {
      const BandRange part = local_part(h.rank, int(k), *h.of, band.begin, band.end);
      if (part.count > 0) band.old_parts.push_back(part);
    }
    for (const BlockRef& h : index.new_holders[k][f]) {
      const BandRange part = local_part(h.rank, int(k), *h.of, band.begin, band.end);
      if (part.count > 0) band.new_parts.push_back(part);
    }
  }
  for (size_t p : index.pieces_of[f]) add_piece_moves(plan, index, spec, p, &band);
  std::stable_sort(band.moves.begin(), band.moves.end(), [](const BandMove& a, const BandMove& b) {
    return std::pair(a.source, a.destination) < std::pair(b.source, b.destination);
  });
  return band;
}

// How far each rank's state may grow while the bands run: to max(old, new) + one chunk between
// bands (cap + slack over its old state, in bytes); what it has grown by so far.
class GrowthBound {
 public:
  GrowthBound(const std::vector<Band>& bands, const std::vector<int64_t>& unit, int world,
              int64_t slack)
      : unit_(unit), cap_(size_t(world)), grown_(size_t(world), 0), slack_(slack) {
    std::vector<int64_t> old_total(static_cast<size_t>(world), 0), new_total(old_total);
    for (const Band& band : bands) {
      for (const BandRange& p : band.old_parts) old_total[size_t(p.rank)] += bytes(p);
      for (const BandRange& p : band.new_parts) new_total[size_t(p.rank)] += bytes(p);
    }
    for (size_t r = 0; r < cap_.size(); ++r) {
      cap_[r] = std::max<int64_t>(0, new_total[r] - old_total[r]);
    }
  }

  // The most any rank would exceed its bound by after `band`.
  int64_t overshoot(const Band& band) const {
    std::map<int, int64_t> delta;
    for (const BandRange& p : band.new_parts) delta[p.rank] += bytes(p);
    for (const BandRange& p : band.old_parts) delta[p.rank] -= bytes(p);
    int64_t worst = std::numeric_limits<int64_t>::min();
    for (const auto& [rank, d] : delta) {
      const auto r = static_cast<size_t>(rank);
      worst = std::max(worst, grown_[r] + d - cap_[r] - slack_);
    }
    return worst;
  }

  // Runs `band` next: its ranks' predicted peaks and received bytes go into `staged`.
  void run(const Band& band, StagedRedistribution* staged) {
    std::map<int, bool> involved;
    for (const BandRange& p : band.old_parts) involved[p.rank] = true;
    for (const BandRange& p : band.new_parts) involved[p.rank] = true;
    for (const BandMove& m : band.moves) {
      involved[m.source] = involved[m.destination] = true;
      if (m.source != m.destination) {
        staged->received_bytes[size_t(m.destination)] += m.elements * unit_[size_t(m.kind)];
      }
    }
    for (const auto& [rank, yes] : involved) {
      const auto r = static_cast<size_t>(rank);
      const int64_t peak = grown_[r] + band_transient(band, rank, unit_) - cap_[r];
      staged->predicted_extra_bytes[r] = std::max(staged->predicted_extra_bytes[r], peak);
      grown_[r] += bytes_of(band.new_parts, rank, unit_) - bytes_of(band.old_parts, rank, unit_);
    }
  }

 private:
  int64_t bytes(const BandRange& p) const { return p.count * unit_[size_t(p.kind)]; }

  const std::vector<int64_t>& unit_;
  std::vector<int64_t> cap_, grown_;
  int64_t slack_;
};

// The bands in the order they run, into `staged`: each time the first band in tensor order that
// keeps every rank within its bound, else the one that exceeds it least.
void order_bands(std::vector<Band> bands, const std::vector<int64_t>& unit, int world,
                 int64_t slack, StagedRedistribution* staged) {
  GrowthBound bound(bands, unit, world, slack);
  staged->predicted_extra_bytes.assign(static_cast<size_t>(world), 0);
  staged->received_bytes.assign(static_cast<size_t>(world), 0);
  std::vector<bool> done(bands.size(), false);
  size_t first = 0;
  for (size_t step = 0; step < bands.size(); ++step) {
    while (done[first]) ++first;
    size_t best = first;
    int64_t best_overshoot = std::numeric_limits<int64_t>::max();
    for (size_t g = first; g < bands.size(); ++g) {
      if (done[g]) continue;
      const int64_t over = bound.overshoot(bands[g]);
      if (over < best_overshoot) {
        best = g;
        best_overshoot = over;
      }
      if (over <= 0) break;  // the first band in tensor order that fits
    }
    done[best] = true;
    bound.run(bands[best], staged);
    staged->bands.push_back(std::move(bands[best]));
  }
}

}  // namespace

StagedRedistribution stage_redistribution(const model::ModelConfig& model,
                                          const RedistributionPlan& plan,
                                          const std::vector<StateKind>& kinds,
                                          int64_t bucket_bytes) {
  check(bucket_bytes > 0, "migration bucket must be positive, got " + std::to_string(bucket_bytes));
  const model::ParameterLayout full(model);
  StagedRedistribution staged;
  const std::vector<int64_t> unit = kind_units(kinds, plan.world_size, &staged);
  int64_t all_units = 0;
  for (int64_t u : unit) all_units += u;
  staged.chunk_elements = std::max<int64_t>(1, bucket_bytes / (4 * all_units));
  const StateIndex index(plan, kinds, full.tensors().size());
  // Bands in tensor order: rows cut every chunk and at every block's first and last row.
  std::vector<Band> bands;
  for (size_t f = 0; f < full.tensors().size(); ++f) {
    const model::TensorSpec& spec = full.tensor(static_cast<int>(f));
    const std::vector<int64_t> cuts = band_cuts(index, f, spec, staged.chunk_elements);
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      Band band = make_band(plan, index, spec, f, cuts[c], cuts[c + 1]);
      if (!band.old_parts.empty() || !band.new_parts.empty()) bands.push_back(std::move(band));
    }
  }
  order_bands(std::move(bands), unit, plan.world_size, staged.chunk_elements * all_units, &staged);
  return staged;
}

StagedRedistribution stage_redistribution(const model::ModelConfig& model,
                                          const RedistributionPlan& plan, const Layout& from,
                                          const Layout& to, int64_t bucket_bytes, int buffers,
                                          int element_bytes) {
  StateKind kind;
  kind.buffers = buffers;
  kind.element_bytes = element_bytes;
  kind.from = layout_blocks(model, from);
  kind.to = layout_blocks(model, to);
  return stage_redistribution(model, plan, {kind}, bucket_bytes);
}

namespace {

// A message's values, booked in the ledger as communication while they live.
template <typename T>
struct Message {
  explicit Message(size_t elements)
      : values(elements),
        booking(backend::MemoryKind::kCommunication, static_cast<int64_t>(elements * sizeof(T))) {}
  std::vector<T> values;
  backend::MemoryBooking booking;
};

// Calls fn(first, end, values) for each run of moves [first, end) between the same pair of ranks
// (the moves are sorted by source, then destination): each run travels as one message of
// `values` values (every buffer of each move's kind).
template <typename Fn>
void for_each_message(const std::vector<BandMove>& moves, const std::vector<int>& kind_buffers,
                      Fn&& fn) {
  for (size_t first = 0; first < moves.size();) {
    size_t end = first;
    size_t values = 0;
    while (end < moves.size() && moves[end].source == moves[first].source &&
           moves[end].destination == moves[first].destination) {
      values += static_cast<size_t>(moves[end].elements) *
                static_cast<size_t>(kind_buffers[static_cast<size_t>(moves[end].kind)]);
      ++end;
    }
    fn(first, end, values);
    first = end;
  }
}

// Runs the bands of a staged redistribution on this rank: packs its moves from `from`, unpacks
// them into `to`, sends and receives the moves between ranks as one message per pair of ranks.
template <typename T>
class BandMover {
 public:
  BandMover(const StagedRedistribution& staged, comm::Communicator& world,
            const std::vector<KindState<const T>>& from, const std::vector<KindState<T>>& to,
            int tag = 0)
      : staged_(staged), world_(world), from_(from), to_(to), me_(world.rank()), tag_(tag) {}

  // One band's moves; returns the bytes this rank received.
  int64_t run(const Band& band) {
    copy_locally(band);
    std::vector<Incoming> incoming;
    std::vector<comm::Request> requests;
    const int64_t received = post_receives(band, &incoming, &requests);
    send(band);
    comm::Request::wait_all(requests);
    for (const Incoming& in : incoming) {
      const T* cursor = in.message.values.data();
      for (size_t k = in.first; k < in.end; ++k) {
        unpack(band.moves[k], cursor);
        cursor += static_cast<size_t>(band.moves[k].elements) * buffers_of(band.moves[k]);
      }
    }
    return received;
  }

  // A message from another rank: its moves [first, end) and their values.
  struct Incoming {
    size_t first, end;
    Message<T> message;
  };
  // A band posted without waiting: its messages, and the requests that carry them.
  struct Posted {
    const Band* band = nullptr;
    std::vector<Incoming> incoming;
    std::vector<Message<T>> outgoing;
    std::vector<comm::Request> requests;
    int64_t received = 0, bytes = 0;  // bytes received; bytes of all its messages
  };

  // Copies the band's local pieces and posts its messages, every send packed at once.
  Posted post(const Band& band) {
    Posted posted;
    posted.band = &band;
    copy_locally(band);
    posted.received = post_receives(band, &posted.incoming, &posted.requests);
    posted.bytes = posted.received;
    for_each_message(band.moves, staged_.kind_buffers,
                     [&](size_t first, size_t end, size_t values) {
                       const BandMove& m = band.moves[first];
                       if (m.source != me_ || m.destination == me_) return;
                       posted.outgoing.push_back(pack_message(band, first, end, values));
                       const std::vector<T>& out = posted.outgoing.back().values;
                       posted.requests.push_back(
                           world_.isend(out.data(), out.size() * sizeof(T), m.destination, tag_));
                       posted.bytes += static_cast<int64_t>(out.size() * sizeof(T));
                     });
    return posted;
  }

  // Whether every message of `posted` has gone and arrived (tests, does not wait).
  static bool arrived(Posted& posted) {
    return std::all_of(posted.requests.begin(), posted.requests.end(),
                       [](comm::Request& r) { return r.test(); });
  }

  // Unpacks a posted band's received messages (every request complete).
  void unpack_arrived(const Posted& posted) const {
    for (const Incoming& in : posted.incoming) {
      const T* cursor = in.message.values.data();
      for (size_t k = in.first; k < in.end; ++k) {
        unpack(posted.band->moves[k], cursor);
        cursor +=
            static_cast<size_t>(posted.band->moves[k].elements) * buffers_of(posted.band->moves[k]);
      }
    }
  }

 private:
  // Moves [first, end) of a band, packed into one message.
  Message<T> pack_message(const Band& band, size_t first, size_t end, size_t values) const {
    Message<T> message(values);
    T* cursor = message.values.data();
    for (size_t k = first; k < end; ++k) {
      pack(band.moves[k], cursor);
      cursor += static_cast<size_t>(band.moves[k].elements) * buffers_of(band.moves[k]);
    }
    return message;
  }

  size_t buffers_of(const BandMove& m) const {
    return static_cast<size_t>(staged_.kind_buffers[static_cast<size_t>(m.kind)]);
  }

  // A move's values, buffer after buffer.
  void pack(const BandMove& m, T* out) const {
    const KindState<const T>& state = from_[static_cast<size_t>(m.kind)];
    const model::TensorSpec view =
        band_view((*state.blocks)[static_cast<size_t>(m.source_block)].spec, m);
    for (size_t b = 0; b < buffers_of(m); ++b) {
      pack_piece(state.buffers[b], view, m.part, out + b * static_cast<size_t>(m.elements),
                 state.memory);
    }
  }

  void unpack(const BandMove& m, const T* in) const {
    const KindState<T>& state = to_[static_cast<size_t>(m.kind)];
    const model::TensorSpec view =
        band_view((*state.blocks)[static_cast<size_t>(m.destination_block)].spec, m);
    for (size_t b = 0; b < buffers_of(m); ++b) {
      unpack_piece(in + b * static_cast<size_t>(m.elements), view, m.part, state.buffers[b],
                   state.memory);
    }
  }

  // Local copies, one piece at a time.
  void copy_locally(const Band& band) const {
    for (const BandMove& m : band.moves) {
      if (m.source != me_ || m.destination != me_) continue;
      Message<T> scratch(static_cast<size_t>(m.elements) * buffers_of(m));
      pack(m, scratch.values.data());
      unpack(m, scratch.values.data());
    }
  }

  // Receives first (every rank posts its own before sending, so the sends always find them), one
  // message per source holding all its pieces, buffer after buffer per piece. Returns its bytes.
  int64_t post_receives(const Band& band, std::vector<Incoming>* incoming,
                        std::vector<comm::Request>* requests) {
    for_each_message(band.moves, staged_.kind_buffers,
                     [&](size_t first, size_t end, size_t values) {
                       const BandMove& m = band.moves[first];
                       if (m.destination == me_ && m.source != me_) {
                         incoming->push_back({first, end, Message<T>(values)});
                       }
                     });
    int64_t received = 0;
    for (Incoming& in : *incoming) {
      requests->push_back(world_.irecv(in.message.values.data(),
                                       in.message.values.size() * sizeof(T),
                                       band.moves[in.first].source, tag_));
      received += static_cast<int64_t>(in.message.values.size() * sizeof(T));
    }
    return received;
  }

  // Sends one message at a time, so at most one is held.
  void send(const Band& band) {
    for_each_message(
        band.moves, staged_.kind_buffers, [&](size_t first, size_t end, size_t values) {
          const BandMove& m = band.moves[first];
          if (m.source != me_ || m.destination == me_) return;
          const Message<T> message = pack_message(band, first, end, values);
          comm::Request sent = world_.isend(message.values.data(),
                                            message.values.size() * sizeof(T), m.destination, tag_);
          sent.wait();
        });
  }

  const StagedRedistribution& staged_;
  comm::Communicator& world_;
  const std::vector<KindState<const T>>& from_;
  const std::vector<KindState<T>>& to_;
  const int me_;
  const int tag_;
};

}  // namespace

StagedRedistribution band_range(const StagedRedistribution& staged, size_t first, size_t end) {
  check(first <= end && end <= staged.bands.size(), "band_range: bands out of range");
  StagedRedistribution part;
  part.bands.assign(staged.bands.begin() + static_cast<std::ptrdiff_t>(first),
                    staged.bands.begin() + static_cast<std::ptrdiff_t>(end));
  part.chunk_elements = staged.chunk_elements;
  part.kind_buffers = staged.kind_buffers;
  part.predicted_extra_bytes = staged.predicted_extra_bytes;
  part.received_bytes = staged.received_bytes;
  return part;
}

template <typename T>
struct BackgroundRedistribution<T>::Mover {
  Mover(const StagedRedistribution& staged, comm::Communicator& world,
        const std::vector<KindState<const T>>& from, const std::vector<KindState<T>>& to, int tag)
      : bands(staged, world, from, to, tag) {}
  BandMover<T> bands;
  std::deque<typename BandMover<T>::Posted> in_flight;  // in band order
  int64_t bytes_in_flight = 0;
};

template <typename T>
BackgroundRedistribution<T>::BackgroundRedistribution(
    StagedRedistribution staged, comm::Communicator& world, std::vector<KindState<const T>> from,
    std::vector<KindState<T>> to, StateMemory memory, int64_t window_bytes, int tag)
    : staged_(std::move(staged)),
      world_(world),
      from_(std::move(from)),
      to_(std::move(to)),
      memory_(std::move(memory)),
      window_bytes_(window_bytes) {
  mover_ = std::make_unique<Mover>(staged_, world_, from_, to_, tag);
}

template <typename T>
BackgroundRedistribution<T>::~BackgroundRedistribution() {
  finish();
}

template <typename T>
bool BackgroundRedistribution<T>::done() const {
  return next_band_ == staged_.bands.size() && mover_->in_flight.empty();
}

// The next band: its new parts booked, posted, its old parts given back.
template <typename T>
void BackgroundRedistribution<T>::post_next() {
  const int me = world_.rank();
  const Band& band = staged_.bands[next_band_++];
  for (const BandRange& p : band.new_parts) {
    if (p.rank == me) memory_.commit(p.kind, p.offset, p.count);
  }
  mover_->in_flight.push_back(mover_->bands.post(band));
  mover_->bytes_in_flight += mover_->in_flight.back().bytes;
  received_ += mover_->in_flight.back().received;
  for (const BandRange& p : band.old_parts) {
    if (p.rank == me) memory_.release(p.kind, p.offset, p.count);
  }
}

template <typename T>
bool BackgroundRedistribution<T>::poll() {
  auto& in_flight = mover_->in_flight;
  while (!in_flight.empty() && BandMover<T>::arrived(in_flight.front())) {
    mover_->bands.unpack_arrived(in_flight.front());
    mover_->bytes_in_flight -= in_flight.front().bytes;
    in_flight.pop_front();
  }
  while (next_band_ < staged_.bands.size() &&
         (in_flight.empty() || mover_->bytes_in_flight < window_bytes_)) {
    post_next();
  }
  return done();
}

template <typename T>
void BackgroundRedistribution<T>::finish() {
  auto& in_flight = mover_->in_flight;
  while (!done()) {
    if (poll()) break;
    // Bands complete in order on every rank: waiting for the oldest one cannot wait on a band
    // another rank has yet to post behind it.
    if (!in_flight.empty()) comm::Request::wait_all(in_flight.front().requests);
  }
}

template class BackgroundRedistribution<float>;

template <typename T>
int64_t redistribute_staged(const StagedRedistribution& staged, comm::Communicator& world,
                            const std::vector<KindState<const T>>& from,
                            const std::vector<KindState<T>>& to, const StateMemory& memory) {
  const size_t kinds = staged.kind_buffers.size();
  check(from.size() == kinds && to.size() == kinds,
        "redistribute_staged: state of another number of kinds than planned");
  for (size_t k = 0; k < kinds; ++k) {
    const size_t buffers = static_cast<size_t>(staged.kind_buffers[k]);
    check((from[k].buffers.empty() || from[k].buffers.size() == buffers) &&
              (to[k].buffers.empty() || to[k].buffers.size() == buffers),
          "redistribute_staged: buffer lists differ in length from the plan's");
  }
  const int me = world.rank();
  BandMover<T> mover(staged, world, from, to);
  int64_t received = 0;
  for (const Band& band : staged.bands) {
    for (const BandRange& p : band.new_parts) {
      if (p.rank == me) memory.commit(p.kind, p.offset, p.count);
    }
    received += mover.run(band);
    for (const BandRange& p : band.old_parts) {
      if (p.rank == me) memory.release(p.kind, p.offset, p.count);
    }
  }
  return received;
}

template int64_t redistribute_staged<float>(const StagedRedistribution&, comm::Communicator&,
                                            const std::vector<KindState<const float>>&,
                                            const std::vector<KindState<float>>&,
                                            const StateMemory&);

}  // namespace malleus::layout
