// Tests for src/comm. Registered as comm_np1 .. comm_np4: the same program under mpirun with 1 to
// 4 ranks. Every test is collective (all ranks run it, in the same order) and adapts to the world
// size. This file has its own main(): it owns MPI's lifetime, prints gtest output from rank 0
// only (other ranks print just their failures, tagged with the rank), and gives every rank the
// same verdict, so a failure on any rank fails the test on all of them.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_session.h"
#include "common/error.h"

using namespace malleus::comm;

namespace {

using malleus::Error;
using malleus::comm::Communicator;
using malleus::comm::Request;

int world_rank() {
  return Communicator::world().rank();
}
int world_size() {
  return Communicator::world().size();
}

// Fixture for every test: after the body, the ranks agree on the outcome. A failure on rank k
// shows up on every rank as "failed on rank(s) k", so rank 0's report is the job's report.
class Comm : public ::testing::Test {
 protected:
  void TearDown() override {
    const int failed = HasFailure() ? 1 : 0;
    const int size = world_size();
    std::vector<int> flags(static_cast<size_t>(size), 0);
    MPI_Allgather(&failed, 1, MPI_INT, flags.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::string others;
    for (int r = 0; r < size; ++r) {
      if (flags[static_cast<size_t>(r)] != 0 && r != world_rank()) {
        others += (others.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    if (!others.empty()) ADD_FAILURE() << "failed on rank(s) " << others;
  }
};

std::vector<int> iota_ranks(int n) {
  std::vector<int> ranks(static_cast<size_t>(n));
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}

bool contains(const std::vector<int>& ranks, int r) {
  return std::find(ranks.begin(), ranks.end(), r) != ranks.end();
}

int64_t sum_of(const std::vector<int>& ranks) {
  return std::accumulate(ranks.begin(), ranks.end(), int64_t{0});
}

// Byte i of the message that world rank `sender` sends: depends on both, not periodic in 256.
uint8_t pattern(int sender, size_t i) {
  return static_cast<uint8_t>(static_cast<size_t>(sender) * 131u + i * 7u + (i >> 13));
}

TEST_F(Comm, WorldRankAndSize) {
  const Communicator world = Communicator::world();
  int rank = -1;
  int size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_TRUE(world.valid());
  EXPECT_EQ(world.rank(), rank);
  EXPECT_EQ(world.size(), size);
  EXPECT_EQ(world.world_ranks(), iota_ranks(size));
  for (int i = 0; i < size; ++i) {
    EXPECT_EQ(world.world_rank(i), i);
    EXPECT_EQ(world.rank_of_world(i), i);
  }
  EXPECT_EQ(world.rank_of_world(-1), -1);
  EXPECT_EQ(world.rank_of_world(size), -1);
  EXPECT_THROW(world.world_rank(size), Error);
  EXPECT_THROW(world.world_rank(-1), Error);
  EXPECT_TRUE(malleus::comm::MpiSession::initialized());
}

TEST_F(Comm, AllReduceSumFloatAndDouble) {
  const Communicator world = Communicator::world();
  const int rank = world.rank();
  const int size = world.size();
  const size_t n = 1001;
  std::vector<float> f(n);
  std::vector<double> d(n);
  for (size_t i = 0; i < n; ++i) {
    f[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 17);
    d[i] = 0.5 * (rank + 1) + static_cast<double>(i);
  }
  world.all_reduce_sum(f.data(), n);
  world.all_reduce_sum(d.data(), n);
  const int s = size * (size + 1) / 2;  // sum of rank + 1
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(f[i], static_cast<float>(s) * static_cast<float>(i % 17)) << i;
    ASSERT_EQ(d[i], 0.5 * s + static_cast<double>(size) * static_cast<double>(i)) << i;
  }
  // Empty reductions are allowed (every rank passes count 0).
  world.all_reduce_sum(static_cast<float*>(nullptr), 0);
  world.all_reduce_sum(static_cast<double*>(nullptr), 0);
}

// Uneven parts, as the distributed optimizer cuts its chunks (an empty part included).
TEST_F(Comm, ReduceScatterAndAllGatherWithUnevenParts) {
  const Communicator world = Communicator::world();
  const int rank = world.rank(), size = world.size();
  std::vector<int> counts, displacements;
  int total = 0;
  for (int r = 0; r < size; ++r) {
    counts.push_back(r == 1 ? 0 : 3 + 2 * r);
    displacements.push_back(total);
    total += counts.back();
  }
  std::vector<float> send(static_cast<size_t>(total));
  for (int i = 0; i < total; ++i) send[size_t(i)] = static_cast<float>((rank + 1) * (i + 1));
  std::vector<float> mine(static_cast<size_t>(counts[size_t(rank)]) + 1, -1.0f);
  const float ranks_sum = static_cast<float>(size * (size + 1) / 2);
  for (int nonblocking = 0; nonblocking < 2; ++nonblocking) {
    if (nonblocking) {
      auto request = world.ireduce_scatter_sum(send.data(), mine.data(), counts);
      request.wait();
    } else {
      world.reduce_scatter_sum(send.data(), mine.data(), counts);
    }
    for (int i = 0; i < counts[size_t(rank)]; ++i) {
      EXPECT_EQ(mine[size_t(i)], ranks_sum * float(displacements[size_t(rank)] + i + 1));
    }
    EXPECT_EQ(mine.back(), -1.0f);  // nothing past this rank's part
    std::vector<float> gathered(static_cast<size_t>(total), 0.0f);
    std::copy_n(mine.data(), counts[size_t(rank)], gathered.data() + displacements[size_t(rank)]);
    if (nonblocking) {
      auto request = world.iall_gather_in_place(gathered.data(), counts, displacements);
      request.wait();
    } else {
      world.all_gather_in_place(gathered.data(), counts, displacements);
    }
    for (int i = 0; i < total; ++i) EXPECT_EQ(gathered[size_t(i)], ranks_sum * float(i + 1));
  }
  EXPECT_THROW(world.reduce_scatter_sum(send.data(), mine.data(), std::vector<int>(size + 1U, 1)),
               Error);
  std::vector<int> shifted = displacements;
  shifted.back() += 1;
  if (size > 1) {
    EXPECT_THROW(world.all_gather_in_place(send.data(), counts, shifted), Error);
  }
}

TEST_F(Comm, AllReduceMaxFloatAndDouble) {
  const Communicator world = Communicator::world();
  const int rank = world.rank();
  const int size = world.size();
  const size_t n = 777;
  auto fvalue = [](int r, size_t i) {
    return static_cast<float>((static_cast<size_t>(r) * 7 + i * 3) % 11) - 5.0f;
  };
  auto dvalue = [](int r, size_t i) {
    return -static_cast<double>(r + 1) * (static_cast<double>(i) + 0.25);
  };
  std::vector<float> f(n);
  std::vector<double> d(n);
  for (size_t i = 0; i < n; ++i) {
    f[i] = fvalue(rank, i);
    d[i] = dvalue(rank, i);
  }
  world.all_reduce_max(f.data(), n);
  world.all_reduce_max(d.data(), n);
  for (size_t i = 0; i < n; ++i) {
    float fmax = fvalue(0, i);
    double dmax = dvalue(0, i);
    for (int r = 1; r < size; ++r) {
      fmax = std::max(fmax, fvalue(r, i));
      dmax = std::max(dmax, dvalue(r, i));
    }
    ASSERT_EQ(f[i], fmax) << i;
    ASSERT_EQ(d[i], dmax) << i;
  }
}

TEST_F(Comm, ScalarReductions) {
  const Communicator world = Communicator::world();
  const int rank = world.rank();
  const int size = world.size();
  EXPECT_EQ(world.all_reduce_sum(0.5 * (rank + 1)), 0.25 * size * (size + 1));
  // Needs all 64 bits.
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(world.all_reduce_sum(big + rank), big * size + int64_t{size} * (size - 1) / 2);
  EXPECT_EQ(world.all_reduce_max(static_cast<double>(rank) - 0.5), size - 1.5);
}

TEST_F(Comm, BroadcastFromEveryRoot) {
  const Communicator world = Communicator::world();
  const int rank = world.rank();
  const size_t n = 100003;
  for (int root = 0; root < world.size(); ++root) {
    std::vector<uint8_t> buffer(n, 0);
    if (rank == root) {
      for (size_t i = 0; i < n; ++i) buffer[i] = pattern(root, i);
    }
    world.broadcast(buffer.data(), n, root);
    size_t mismatches = 0;
    for (size_t i = 0; i < n; ++i) mismatches += buffer[i] != pattern(root, i);
    EXPECT_EQ(mismatches, 0u) << "root " << root;
  }
  uint8_t byte = 0;
  EXPECT_THROW(world.broadcast(&byte, 1, world.size()), Error);
  EXPECT_THROW(world.broadcast(&byte, 1, -1), Error);
}

TEST_F(Comm, Barrier) {
  const Communicator world = Communicator::world();
  for (int i = 0; i < 10; ++i) world.barrier();
}

void expect_group(const Communicator& group, const std::vector<int>& ranks) {
  const int me = world_rank();
  ASSERT_TRUE(group.valid());
  EXPECT_EQ(group.size(), static_cast<int>(ranks.size()));
  const auto position = std::find(ranks.begin(), ranks.end(), me) - ranks.begin();
  EXPECT_EQ(group.rank(), static_cast<int>(position));
  EXPECT_EQ(group.world_ranks(), ranks);
  for (size_t i = 0; i < ranks.size(); ++i) {
    EXPECT_EQ(group.world_rank(static_cast<int>(i)), ranks[i]);
    EXPECT_EQ(group.rank_of_world(ranks[i]), static_cast<int>(i));
  }
  for (int w = 0; w < world_size(); ++w) {
    if (!contains(ranks, w)) {
      EXPECT_EQ(group.rank_of_world(w), -1) << w;
    }
  }
  // Reductions see exactly the members.
  EXPECT_EQ(group.all_reduce_sum(int64_t{me}), sum_of(ranks));
  std::vector<double> values(5, static_cast<double>(me));
  group.all_reduce_max(values.data(), values.size());
  for (double v : values) EXPECT_EQ(v, *std::max_element(ranks.begin(), ranks.end()));
}

TEST_F(Comm, EvenAndOddGroupsConcurrently) {
  const Communicator world = Communicator::world();
  std::vector<int> even;
  std::vector<int> odd;
  for (int r = 0; r < world.size(); ++r) (r % 2 == 0 ? even : odd).push_back(r);
  const std::vector<int>& mine = world.rank() % 2 == 0 ? even : odd;
  const Communicator group = world.subgroup(mine);
  expect_group(group, mine);
  EXPECT_EQ(group.rank(), world.rank() / 2);
}

TEST_F(Comm, ReversedGroupOrdersRanksAsListed) {
  const Communicator world = Communicator::world();
  const int size = world.size();
  std::vector<int> reversed = iota_ranks(size);
  std::reverse(reversed.begin(), reversed.end());
  const Communicator group = world.subgroup(reversed);
  expect_group(group, reversed);
  EXPECT_EQ(group.rank(), size - 1 - world.rank());
  // Point-to-point addresses ranks of the group: the message from group rank g-1 comes from
  // world rank world_rank(g-1).
  const int n = group.size();
  const int from = (group.rank() - 1 + n) % n;
  int32_t sent = world.rank();
  int32_t received = -1;
  Request recv = group.irecv(&received, sizeof received, from, 5);
  Request send = group.isend(&sent, sizeof sent, (group.rank() + 1) % n, 5);
  recv.wait();
  send.wait();
  EXPECT_EQ(received, group.world_rank(from));
}

TEST_F(Comm, OverlappingGroupsCreatedInTheSameOrder) {
  const Communicator world = Communicator::world();
  const int size = world.size();
  const int me = world.rank();
  // A plan-like list of groups: neighbour pairs (i, i+1) around the ring and all prefixes
  // {0..k}. Every rank walks the list in the same order and creates the groups it is in.
  std::vector<std::vector<int>> groups;
  if (size >= 2) {
    for (int i = 0; i < size; ++i) groups.push_back({i, (i + 1) % size});
  }
  for (int k = 1; k <= size; ++k) groups.push_back(iota_ranks(k));
  std::vector<std::pair<std::vector<int>, Communicator>> mine;
  for (const auto& ranks : groups) {
    if (contains(ranks, me)) mine.emplace_back(ranks, world.subgroup(ranks));
  }
  // Then use them, again in the same global order.
  for (const auto& [ranks, group] : mine) expect_group(group, ranks);
}

TEST_F(Comm, SubgroupOfSubgroup) {
  const Communicator world = Communicator::world();
  const int me = world.rank();
  std::vector<int> mine;
  for (int r = me % 2; r < world.size(); r += 2) mine.push_back(r);
  const Communicator parity = world.subgroup(mine);
  // The first two members (or the only one), in reverse order.
  std::vector<int> inner(mine.begin(),
                         mine.begin() + std::min<std::ptrdiff_t>(2, std::ssize(mine)));
  std::reverse(inner.begin(), inner.end());
  if (contains(inner, me)) {
    const Communicator nested = parity.subgroup(inner);
    expect_group(nested, inner);
  }
  // A world rank outside the parent cannot be in a subgroup of it (checked before any MPI call).
  if (world.size() >= 2) {
    EXPECT_THROW(parity.subgroup({me, me % 2 == 0 ? 1 : 0}), Error);
  }
}

TEST_F(Comm, SingleRankGroup) {
  const Communicator world = Communicator::world();
  const Communicator self = world.subgroup({world.rank()});
  expect_group(self, {world.rank()});
  EXPECT_EQ(self.all_reduce_sum(3.5), 3.5);
  uint64_t sent = 0x0123456789abcdefull;
  uint64_t received = 0;
  Request recv = self.irecv(&received, sizeof received, 0, 1);
  Request send = self.isend(&sent, sizeof sent, 0, 1);
  recv.wait();
  send.wait();
  EXPECT_EQ(received, sent);
  self.barrier();
}

TEST_F(Comm, SubgroupMisuseThrows) {
  const Communicator world = Communicator::world();
  const int me = world.rank();
  const int size = world.size();
  EXPECT_THROW(world.subgroup({}), Error);
  EXPECT_THROW(world.subgroup({me, me}), Error);
  EXPECT_THROW(world.subgroup({me, size}), Error);
  EXPECT_THROW(world.subgroup({-1, me}), Error);
  if (size >= 2) {
    EXPECT_THROW(world.subgroup({(me + 1) % size}), Error);  // caller not a member
  }
  const Communicator empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_THROW(empty.rank(), Error);
  EXPECT_THROW(empty.subgroup({me}), Error);
  EXPECT_THROW(empty.barrier(), Error);
}

TEST_F(Comm, ManyGroupsAreCreatedAndFreed) {
  const Communicator world = Communicator::world();
  const int size = world.size();
  for (int i = 0; i < 300; ++i) {
    std::vector<int> rotated = iota_ranks(size);
    std::rotate(rotated.begin(), rotated.begin() + i % size, rotated.end());
    const Communicator group = world.subgroup(rotated);
    ASSERT_EQ(group.all_reduce_sum(int64_t{1}), size);
    const Communicator copy = group;  // shared: freed once, by the last copy
    ASSERT_EQ(copy.world_rank(0), rotated[0]);
  }
}

// Each rank sends `bytes` to (r+1)%n and receives from (r-1+n)%n of `comm`; both are posted
// before waiting, so a rendezvous-size message cannot deadlock.
void ring_exchange(const Communicator& comm, size_t bytes, int tag, bool use_wait_all) {
  const int n = comm.size();
  const int next = (comm.rank() + 1) % n;
  const int prev = (comm.rank() - 1 + n) % n;
  std::vector<uint8_t> out(bytes);
  std::vector<uint8_t> in(bytes, 0);
  const int me = comm.world_rank(comm.rank());
  const int from = comm.world_rank(prev);
  for (size_t i = 0; i < bytes; ++i) out[i] = pattern(me, i);
  if (use_wait_all) {
    std::vector<Request> requests;
    requests.push_back(comm.irecv(in.data(), bytes, prev, tag));
    requests.push_back(comm.isend(out.data(), bytes, next, tag));
    Request::wait_all(requests);
    for (const Request& r : requests) EXPECT_FALSE(r.pending());
    Request::wait_all(requests);  // idempotent
  } else {
    Request send = comm.isend(out.data(), bytes, next, tag);
    Request recv = comm.irecv(in.data(), bytes, prev, tag);
    send.wait();
    recv.wait();
    EXPECT_FALSE(send.pending());
    EXPECT_FALSE(recv.pending());
    recv.wait();  // idempotent
    send.wait();
  }
  size_t mismatches = 0;
  for (size_t i = 0; i < bytes; ++i) mismatches += in[i] != pattern(from, i);
  EXPECT_EQ(mismatches, 0u) << bytes << " bytes";
}

TEST_F(Comm, RingExchangeSmall) {
  const Communicator world = Communicator::world();
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4096}}) ring_exchange(world, bytes, 7, true);
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4096}}) ring_exchange(world, bytes, 8, false);
}

TEST_F(Comm, RingExchangeLarge) {
  const Communicator world = Communicator::world();
  ring_exchange(world, size_t{8} << 20, 9, true);
  ring_exchange(world, (size_t{8} << 20) + 3, 10, false);
}

TEST_F(Comm, TestPollsUntilComplete) {
  const Communicator world = Communicator::world();
  const int n = world.size();
  std::vector<int32_t> out(1 << 18, world.rank());
  std::vector<int32_t> in(1 << 18, -1);
  Request recv = world.irecv(in.data(), in.size() * sizeof(int32_t), (world.rank() - 1 + n) % n, 3);
  Request send = world.isend(out.data(), out.size() * sizeof(int32_t), (world.rank() + 1) % n, 3);
  bool received = false;
  bool sent = false;
  while (!received || !sent) {
    received = recv.test();  // test() both each time: progress on either side
    sent = send.test();
  }
  EXPECT_TRUE(recv.test());
  EXPECT_EQ(std::count(in.begin(), in.end(), (world.rank() - 1 + n) % n), std::ssize(in));
}

TEST_F(Comm, RequestDestructorWaits) {
  const Communicator world = Communicator::world();
  const int n = world.size();
  const int prev = (world.rank() - 1 + n) % n;
  std::vector<int32_t> out(1 << 20, world.rank());  // 4 MiB: beyond the eager limit
  std::vector<int32_t> in(1 << 20, -1);
  {
    Request recv = world.irecv(in.data(), in.size() * sizeof(int32_t), prev, 4);
    Request send = world.isend(out.data(), out.size() * sizeof(int32_t), (world.rank() + 1) % n, 4);
  }  // no wait(): the destructors complete both
  EXPECT_EQ(std::count(in.begin(), in.end(), prev), std::ssize(in));

  // Moves transfer the pending operation; assigning over a pending request completes it first.
  std::fill(in.begin(), in.end(), -1);
  Request a = world.irecv(in.data(), 4 * sizeof(int32_t), prev, 6);
  Request b = std::move(a);
  EXPECT_FALSE(a.pending());  // NOLINT(bugprone-use-after-move): moved-from is complete
  Request send = world.isend(out.data(), 4 * sizeof(int32_t), (world.rank() + 1) % n, 6);
  b = Request();  // waits for the receive
  EXPECT_FALSE(b.pending());
  EXPECT_EQ(in[0], prev);
  EXPECT_EQ(in[3], prev);
  EXPECT_EQ(in[4], -1);
  a.wait();  // no-op
}

TEST_F(Comm, MessageLengthAndArgumentChecks) {
  const Communicator world = Communicator::world();
  const int n = world.size();
  // A receive posted for 16 bytes that gets a 10-byte message reports the mismatch on wait().
  std::vector<uint8_t> out(10, 1);
  std::vector<uint8_t> in(16, 0);
  Request recv = world.irecv(in.data(), in.size(), (world.rank() - 1 + n) % n, 11);
  Request send = world.isend(out.data(), out.size(), (world.rank() + 1) % n, 11);
  EXPECT_THROW(recv.wait(), Error);
  EXPECT_FALSE(recv.pending());
  send.wait();

  uint8_t byte = 0;
  const size_t too_big = static_cast<size_t>(INT_MAX) + 1;
  EXPECT_THROW(world.isend(&byte, too_big, 0, 0), Error);
  EXPECT_THROW(world.irecv(&byte, too_big, 0, 0), Error);
  EXPECT_THROW(world.isend(&byte, 1, n, 0), Error);
  EXPECT_THROW(world.irecv(&byte, 1, -1, 0), Error);
  EXPECT_THROW(world.isend(&byte, 1, 0, -1), Error);
  EXPECT_THROW(world.isend(nullptr, 1, 0, 0), Error);
}

}  // namespace
