#include "layout/redistribution.h"

#include <algorithm>
#include <map>

#include "common/error.h"

namespace malleus::layout {

int64_t RedistributionPlan::elements_moved() const {
  int64_t total = 0;
  for (const Transfer& t : transfers) total += t.elements;
  return total;
}

RedistributionPlan plan_redistribution(const model::ModelConfig& model, const Layout& from,
                                       const Layout& to, int ranks_per_node) {
  check(from.world_size() == to.world_size(), "redistribution between different world sizes");
  RedistributionPlan plan;
  plan.world_size = from.world_size();
  plan.pieces = common_refinement(model, {&from, &to});
  const model::ParameterLayout full(model);
  auto node = [&](int rank) { return ranks_per_node > 0 ? rank / ranks_per_node : 0; };
  std::vector<int64_t> load(static_cast<size_t>(from.world_size()), 0);  // elements sent so far
  std::map<std::pair<int, int>, Transfer> by_pair;
  for (size_t p = 0; p < plan.pieces.size(); ++p) {
    const auto& old_holders = plan.pieces[p].holders[0];
    const auto& new_holders = plan.pieces[p].holders[1];
    const int64_t elements = plan.pieces[p].elements;
    for (const Holder& dst : new_holders) {
      const Holder* source = nullptr;
      for (const Holder& h : old_holders) {
        if (h.rank == dst.rank) source = &h;
      }
      if (source == nullptr) {
        check(!old_holders.empty(), "redistribution: piece of tensor " +
                                        full.tensor(plan.pieces[p].piece.tensor).name +
                                        " is held by no rank in the old layout");
        // Same node first, then the least-loaded sender, then the lowest rank.
        auto better = [&](const Holder& a, const Holder& b) {
          const bool a_near = node(a.rank) == node(dst.rank),
                     b_near = node(b.rank) == node(dst.rank);
          if (a_near != b_near) return a_near;
          const int64_t la = load[static_cast<size_t>(a.rank)],
                        lb = load[static_cast<size_t>(b.rank)];
          return la != lb ? la < lb : a.rank < b.rank;
        };
        source = &*std::min_element(old_holders.begin(), old_holders.end(), better);
        load[static_cast<size_t>(source->rank)] += elements;
      }
      Transfer& t = by_pair[{source->rank, dst.rank}];
      t.source = source->rank;
      t.destination = dst.rank;
      t.moves.push_back({static_cast<int>(p), source->local_tensor, dst.local_tensor});
      t.elements += elements;
    }
  }
  for (auto& [pair, transfer] : by_pair) {
    (pair.first == pair.second ? plan.local_copies : plan.transfers).push_back(std::move(transfer));
  }
  return plan;
}

namespace {

// Moves of one transfer cut into buckets of at most `limit` elements (over all buffers); a piece
// larger than the limit travels alone.
std::vector<std::vector<PieceMove>> buckets_of(const Transfer& t,
                                               const std::vector<RefinedPiece>& pieces,
                                               int64_t limit, size_t buffers) {
  std::vector<std::vector<PieceMove>> buckets(1);
  int64_t filled = 0;
  for (const PieceMove& m : t.moves) {
    const int64_t size =
        pieces[static_cast<size_t>(m.piece)].elements * static_cast<int64_t>(buffers);
    if (filled > 0 && filled + size > limit) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(m);
    filled += size;
  }
  return buckets;
}

// A transfer of this rank's, cut into buckets; round k moves every pair's k-th bucket.
struct Active {
  const Transfer* transfer;
  std::vector<std::vector<PieceMove>> buckets;
};

int64_t elements_of(const RedistributionPlan& plan, const PieceMove& m) {
  return plan.pieces[static_cast<size_t>(m.piece)].elements;
}

// The pieces this rank copies from its old layout into its new one, one at a time.
template <typename T>
void copy_locally(const RedistributionPlan& plan, int me, const LocalState<const T>& from,
                  const LocalState<T>& to, size_t buffers) {
  for (const Transfer& t : plan.local_copies) {
    if (t.source != me) continue;
    std::vector<T> scratch;
    for (const PieceMove& m : t.moves) {
      const Piece& piece = plan.pieces[static_cast<size_t>(m.piece)].piece;
      scratch.resize(static_cast<size_t>(elements_of(plan, m)));
      for (size_t b = 0; b < buffers; ++b) {
        pack_piece(from.buffers[b], from.layout->tensor(m.source_tensor), piece, scratch.data(),
                   from.memory);
        unpack_piece(scratch.data(), to.layout->tensor(m.destination_tensor), piece, to.buffers[b],
                     to.memory);
      }
    }
  }
}

// Round `round` of this rank's transfers: every pair's bucket of that round sent and received at
// once, buffer after buffer. Returns the bytes received.
template <typename T>
int64_t move_round(const RedistributionPlan& plan, comm::Communicator& world,
                   const std::vector<Active>& mine, size_t round, const LocalState<const T>& from,
                   const LocalState<T>& to, size_t buffers) {
  const int me = world.rank();
  int64_t received = 0;
  std::vector<std::vector<T>> messages;
  std::vector<comm::Request> requests;
  std::vector<std::pair<const Active*, size_t>> receives;
  messages.reserve(mine.size());
  for (const Active& a : mine) {
    if (round >= a.buckets.size()) continue;
    const auto& bucket = a.buckets[round];
    int64_t size = 0;
    for (const PieceMove& m : bucket) size += elements_of(plan, m);
    messages.emplace_back(static_cast<size_t>(size) * buffers);
    std::vector<T>& message = messages.back();
    const int tag = static_cast<int>(round);
    if (a.transfer->source == me) {
      T* cursor = message.data();
      for (size_t b = 0; b < buffers; ++b) {
        for (const PieceMove& m : bucket) {
          pack_piece(from.buffers[b], from.layout->tensor(m.source_tensor),
                     plan.pieces[static_cast<size_t>(m.piece)].piece, cursor, from.memory);
          cursor += elements_of(plan, m);
        }
      }
      requests.push_back(
          world.isend(message.data(), message.size() * sizeof(T), a.transfer->destination, tag));
    } else {
      requests.push_back(
          world.irecv(message.data(), message.size() * sizeof(T), a.transfer->source, tag));
      receives.emplace_back(&a, messages.size() - 1);
      received += static_cast<int64_t>(message.size() * sizeof(T));
    }
  }
  comm::Request::wait_all(requests);
  for (const auto& [active, index] : receives) {
    const T* cursor = messages[index].data();
    for (size_t b = 0; b < buffers; ++b) {
      for (const PieceMove& m : active->buckets[round]) {
        unpack_piece(cursor, to.layout->tensor(m.destination_tensor),
                     plan.pieces[static_cast<size_t>(m.piece)].piece, to.buffers[b], to.memory);
        cursor += elements_of(plan, m);
      }
    }
  }
  return received;
}

}  // namespace

template <typename T>
int64_t redistribute(const RedistributionPlan& plan, comm::Communicator& world,
                     const LocalState<const T>& from, const LocalState<T>& to,
                     int64_t bucket_elements) {
  // A rank that holds nothing on one side passes no buffers for that side.
  const size_t buffers = std::max(from.buffers.size(), to.buffers.size());
  check((from.buffers.empty() || from.buffers.size() == buffers) &&
            (to.buffers.empty() || to.buffers.size() == buffers),
        "redistribute: buffer lists differ in length");
  const int me = world.rank();
  copy_locally(plan, me, from, to, buffers);
  std::vector<Active> mine;
  size_t rounds = 0;
  for (const Transfer& t : plan.transfers) {
    if (t.source != me && t.destination != me) continue;
    mine.push_back({&t, buckets_of(t, plan.pieces, bucket_elements, buffers)});
    rounds = std::max(rounds, mine.back().buckets.size());
  }
  // Every rank must agree on the number of rounds only pairwise: a pair's bucket count is
  // computed identically on both sides from the shared plan.
  int64_t received = 0;
  for (size_t round = 0; round < rounds; ++round) {
    received += move_round(plan, world, mine, round, from, to, buffers);
  }
  return received;
}

template int64_t redistribute<float>(const RedistributionPlan&, comm::Communicator&,
                                     const LocalState<const float>&, const LocalState<float>&,
                                     int64_t);

}  // namespace malleus::layout
