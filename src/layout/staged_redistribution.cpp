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

// The part of rows [begin, end) that `local` holds, as a range of its rank's flat buffers.
BandRange local_part(int rank, const model::TensorSpec& local, int64_t begin, int64_t end) {
  if (column_sharded(local)) {
    const int64_t cols = local.shape[1];
    return {rank, local.offset + begin * cols, (end - begin) * cols};
  }
  const int64_t row = local.shape.size() > 1 ? local.shape[1] : 1;
  const int64_t lo = std::max(begin, local.shard_begin);
  const int64_t hi = std::min(end, local.shard_begin + local.shape[0]);
  if (lo >= hi) return {rank, 0, 0};
  return {rank, local.offset + (lo - local.shard_begin) * row, (hi - lo) * row};
}

// `local` seen as only rows [move.row_begin, move.row_end) of it, for a column-sharded move.
model::TensorSpec band_view(const model::TensorSpec& local, const BandMove& move) {
  if (move.row_begin < 0) return local;
  model::TensorSpec view = local;
  view.offset += move.row_begin * local.shape[1];
  view.shape[0] = move.row_end - move.row_begin;
  view.size = view.shape[0] * view.shape[1];
  return view;
}

int64_t count_of(const std::vector<BandRange>& parts, int rank) {
  for (const BandRange& p : parts) {
    if (p.rank == rank) return p.count;
  }
  return 0;
}

// What one band costs rank `rank` at its worst moment, in elements per buffer, beyond its state
// before the band: its new part, then the larger of a local copy's scratch and its messages
// (everything it receives, and one message it sends, at once).
int64_t band_transient(const Band& band, int rank) {
  int64_t scratch = 0, received = 0, largest_send = 0;
  std::map<int, int64_t> sent;  // by destination
  for (const BandMove& m : band.moves) {
    if (m.source == rank && m.destination == rank) scratch = std::max(scratch, m.elements);
    if (m.destination == rank && m.source != rank) received += m.elements;
    if (m.source == rank && m.destination != rank) sent[m.destination] += m.elements;
  }
  for (const auto& [destination, elements] : sent) largest_send = std::max(largest_send, elements);
  return count_of(band.new_parts, rank) + std::max(scratch, received + largest_send);
}

}  // namespace

StagedRedistribution stage_redistribution(const model::ModelConfig& model,
                                          const RedistributionPlan& plan, const Layout& from,
                                          const Layout& to, int64_t bucket_bytes, int buffers,
                                          int element_bytes) {
  check(bucket_bytes > 0, "migration bucket must be positive, got " + std::to_string(bucket_bytes));
  check(buffers > 0 && element_bytes > 0, "staged redistribution: no state to move");
  const model::ParameterLayout full(model);
  const auto old_locals = local_layouts(model, from);
  const auto new_locals = local_layouts(model, to);
  const int world = plan.world_size;
  const int64_t unit = int64_t{buffers} * element_bytes;  // bytes per element of every buffer
  StagedRedistribution staged;
  staged.chunk_elements = std::max<int64_t>(1, bucket_bytes / (4 * unit));

  // Who holds each tensor on either side, and the moves of each tensor.
  const size_t tensors = full.tensors().size();
  std::vector<std::map<int, int>> old_holders(tensors), new_holders(tensors);  // rank → local
  for (const RefinedPiece& p : plan.pieces) {
    const auto f = static_cast<size_t>(p.piece.tensor);
    for (const Holder& h : p.holders[0]) old_holders[f][h.rank] = h.local_tensor;
    for (const Holder& h : p.holders[1]) new_holders[f][h.rank] = h.local_tensor;
  }
  std::vector<std::vector<std::pair<const Transfer*, const PieceMove*>>> moves_of(tensors);
  for (const auto* list : {&plan.transfers, &plan.local_copies}) {
    for (const Transfer& t : *list) {
      for (const PieceMove& m : t.moves) {
        const auto f = static_cast<size_t>(plan.pieces[static_cast<size_t>(m.piece)].piece.tensor);
        moves_of[f].emplace_back(&t, &m);
      }
    }
  }

  // Bands in tensor order.
  std::vector<Band> bands;
  for (size_t f = 0; f < tensors; ++f) {
    if (old_holders[f].empty() && new_holders[f].empty()) continue;
    const model::TensorSpec& spec = full.tensor(static_cast<int>(f));
    const bool columns = column_sharded(spec);
    const int64_t rows = spec.full_shape[0];
    const int64_t height = std::max<int64_t>(1, staged.chunk_elements / row_width(spec));
    for (int64_t begin = 0; begin < rows; begin += height) {
      Band band;
      band.tensor = static_cast<int>(f);
      band.begin = begin;
      band.end = std::min(rows, begin + height);
      for (const auto& [rank, local] : old_holders[f]) {
        const BandRange part = local_part(
            rank, old_locals[static_cast<size_t>(rank)]->tensor(local), band.begin, band.end);
        if (part.count > 0) band.old_parts.push_back(part);
      }
      for (const auto& [rank, local] : new_holders[f]) {
        const BandRange part = local_part(
            rank, new_locals[static_cast<size_t>(rank)]->tensor(local), band.begin, band.end);
        if (part.count > 0) band.new_parts.push_back(part);
      }
      for (const auto& [transfer, move] : moves_of[f]) {
        const Piece& piece = plan.pieces[static_cast<size_t>(move->piece)].piece;
        BandMove m{piece,
                   -1,
                   -1,
                   transfer->source,
                   transfer->destination,
                   move->source_tensor,
                   move->destination_tensor,
                   0};
        if (columns) {
          m.row_begin = band.begin;
          m.row_end = band.end;
          m.elements = (band.end - band.begin) * (piece.end - piece.begin);
        } else {
          m.part.begin = std::max(piece.begin, band.begin);
          m.part.end = std::min(piece.end, band.end);
          if (m.part.begin >= m.part.end) continue;
          m.elements = (m.part.end - m.part.begin) * row_width(spec);
        }
        band.moves.push_back(m);
      }
      std::stable_sort(
          band.moves.begin(), band.moves.end(), [](const BandMove& a, const BandMove& b) {
            return std::pair(a.source, a.destination) < std::pair(b.source, b.destination);
          });
      if (!band.old_parts.empty() || !band.new_parts.empty()) bands.push_back(std::move(band));
    }
  }

  // Each rank's state may grow to max(old, new) + one chunk between bands: cap + slack over its
  // old state.
  std::vector<int64_t> old_total(static_cast<size_t>(world), 0), new_total(old_total);
  for (const Band& band : bands) {
    for (const BandRange& p : band.old_parts) old_total[static_cast<size_t>(p.rank)] += p.count;
    for (const BandRange& p : band.new_parts) new_total[static_cast<size_t>(p.rank)] += p.count;
  }
  std::vector<int64_t> cap(static_cast<size_t>(world));
  for (size_t r = 0; r < cap.size(); ++r)
    cap[r] = std::max<int64_t>(0, new_total[r] - old_total[r]);
  const int64_t slack = staged.chunk_elements;
  std::vector<int64_t> grown(static_cast<size_t>(world), 0);  // new booked − old given back
  auto overshoot = [&](const Band& band) {
    // The most any rank would exceed its bound by after this band.
    std::map<int, int64_t> delta;
    for (const BandRange& p : band.new_parts) delta[p.rank] += p.count;
    for (const BandRange& p : band.old_parts) delta[p.rank] -= p.count;
    int64_t worst = std::numeric_limits<int64_t>::min();
    for (const auto& [rank, d] : delta) {
      const auto r = static_cast<size_t>(rank);
      worst = std::max(worst, grown[r] + d - cap[r] - slack);
    }
    return worst;
  };
  staged.predicted_extra_bytes.assign(static_cast<size_t>(world), 0);
  std::vector<bool> done(bands.size(), false);
  size_t first = 0;
  for (size_t step = 0; step < bands.size(); ++step) {
    while (done[first]) ++first;
    size_t best = first;
    int64_t best_overshoot = std::numeric_limits<int64_t>::max();
    for (size_t g = first; g < bands.size(); ++g) {
      if (done[g]) continue;
      const int64_t over = overshoot(bands[g]);
      if (over < best_overshoot) {
        best = g;
        best_overshoot = over;
      }
      if (over <= 0) break;  // the first band in tensor order that fits
    }
    done[best] = true;
    Band& band = bands[best];
    std::map<int, bool> involved;
    for (const BandRange& p : band.old_parts) involved[p.rank] = true;
    for (const BandRange& p : band.new_parts) involved[p.rank] = true;
    for (const BandMove& m : band.moves) involved[m.source] = involved[m.destination] = true;
    for (const auto& [rank, yes] : involved) {
      const auto r = static_cast<size_t>(rank);
      const int64_t peak = grown[r] + band_transient(band, rank) - cap[r];
      staged.predicted_extra_bytes[r] = std::max(staged.predicted_extra_bytes[r], peak * unit);
      grown[r] += count_of(band.new_parts, rank) - count_of(band.old_parts, rank);
    }
    staged.bands.push_back(std::move(band));
  }
  return staged;
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

// Calls fn(first, end, elements) for each run of moves [first, end) between the same pair of ranks
// (the moves are sorted by source, then destination): each run travels as one message.
template <typename Fn>
void for_each_message(const std::vector<BandMove>& moves, Fn&& fn) {
  for (size_t first = 0; first < moves.size();) {
    size_t end = first;
    int64_t elements = 0;
    while (end < moves.size() && moves[end].source == moves[first].source &&
           moves[end].destination == moves[first].destination) {
      elements += moves[end++].elements;
    }
    fn(first, end, elements);
    first = end;
  }
}

}  // namespace

template <typename T>
int64_t redistribute_staged(const StagedRedistribution& staged, comm::Communicator& world,
                            const LocalState<const T>& from, const LocalState<T>& to,
                            const StateMemory& memory) {
  const size_t buffers = std::max(from.buffers.size(), to.buffers.size());
  check((from.buffers.empty() || from.buffers.size() == buffers) &&
            (to.buffers.empty() || to.buffers.size() == buffers),
        "redistribute_staged: buffer lists differ in length");
  const int me = world.rank();
  int64_t received = 0;
  auto pack = [&](const BandMove& m, T* out) {
    const model::TensorSpec view = band_view(from.layout->tensor(m.source_tensor), m);
    for (size_t b = 0; b < buffers; ++b) {
      pack_piece(from.buffers[b], view, m.part, out + b * static_cast<size_t>(m.elements));
    }
  };
  auto unpack = [&](const BandMove& m, const T* in) {
    const model::TensorSpec view = band_view(to.layout->tensor(m.destination_tensor), m);
    for (size_t b = 0; b < buffers; ++b) {
      unpack_piece(in + b * static_cast<size_t>(m.elements), view, m.part, to.buffers[b]);
    }
  };

  for (const Band& band : staged.bands) {
    const int64_t new_count = count_of(band.new_parts, me);
    if (new_count > 0) {
      for (const BandRange& p : band.new_parts) {
        if (p.rank == me) memory.commit(p.offset, p.count);
      }
    }
    // Local copies, one piece at a time.
    for (const BandMove& m : band.moves) {
      if (m.source != me || m.destination != me) continue;
      Message<T> scratch(static_cast<size_t>(m.elements) * buffers);
      pack(m, scratch.values.data());
      unpack(m, scratch.values.data());
    }
    // Receives first (every rank posts its own before sending, so the sends below always find
    // them), one message per source holding all its pieces, buffer after buffer per piece.
    struct Incoming {
      size_t first, end;  // its moves
      Message<T> message;
    };
    std::vector<Incoming> incoming;
    std::vector<comm::Request> requests;
    for_each_message(band.moves, [&](size_t first, size_t end, int64_t elements) {
      const BandMove& m = band.moves[first];
      if (m.destination == me && m.source != me) {
        incoming.push_back({first, end, Message<T>(static_cast<size_t>(elements) * buffers)});
      }
    });
    for (Incoming& in : incoming) {
      requests.push_back(world.irecv(in.message.values.data(), in.message.values.size() * sizeof(T),
                                     band.moves[in.first].source, 0));
      received += static_cast<int64_t>(in.message.values.size() * sizeof(T));
    }
    // Sends one message at a time, so at most one is held.
    for_each_message(band.moves, [&](size_t first, size_t end, int64_t elements) {
      const BandMove& m = band.moves[first];
      if (m.source != me || m.destination == me) return;
      Message<T> message(static_cast<size_t>(elements) * buffers);
      T* cursor = message.values.data();
      for (size_t k = first; k < end; ++k) {
        pack(band.moves[k], cursor);
        cursor += static_cast<size_t>(band.moves[k].elements) * buffers;
      }
      comm::Request send =
          world.isend(message.values.data(), message.values.size() * sizeof(T), m.destination, 0);
      send.wait();
    });
    comm::Request::wait_all(requests);
    for (const Incoming& in : incoming) {
      const T* cursor = in.message.values.data();
      for (size_t k = in.first; k < in.end; ++k) {
        unpack(band.moves[k], cursor);
        cursor += static_cast<size_t>(band.moves[k].elements) * buffers;
      }
    }
    incoming.clear();
    for (const BandRange& p : band.old_parts) {
      if (p.rank == me) memory.release(p.offset, p.count);
    }
  }
  return received;
}

template int64_t redistribute_staged<float>(const StagedRedistribution&, comm::Communicator&,
                                            const LocalState<const float>&,
                                            const LocalState<float>&, const StateMemory&);

}  // namespace malleus::layout
