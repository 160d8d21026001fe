// Measures what the cost model's cluster spec needs about the links between ranks: latency and
// bandwidth of an all-reduce inside a pair of ranks (a tensor-parallel group) and of a one-way
// message (a pipeline hand-off), as medians of repeated timings. Run it under mpirun with the
// rank count and placement of the jobs it should describe, e.g.
//   mpirun --oversubscribe -np 4 build/bench/bench_comm
// (configs/clusters/cpu-local.json quotes its numbers).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_session.h"
#include "common/stats.h"

using namespace malleus;
using Clock = std::chrono::steady_clock;

namespace {

template <typename F>
double median_seconds(int repeats, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    f();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return median(t);
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  comm::Communicator world = comm::Communicator::world();
  if (world.size() < 2 || world.size() % 2 != 0) {
    if (world.rank() == 0) std::fprintf(stderr, "run with an even number of ranks\n");
    return 1;
  }
  const int me = world.rank(), peer = me ^ 1;
  comm::Communicator pair = world.subgroup({std::min(me, peer), std::max(me, peer)});
  if (me == 0) std::printf("%d ranks, pairs (0,1) (2,3) ...; medians of 50\n", world.size());
  for (size_t floats : {size_t(256), size_t(1) << 16, size_t(1) << 20}) {
    std::vector<float> data(floats, 1.0f);
    for (int i = 0; i < 5; ++i) pair.all_reduce_sum(data.data(), data.size());
    world.barrier();
    const double all_reduce =
        median_seconds(50, [&] { pair.all_reduce_sum(data.data(), data.size()); });
    world.barrier();
    // One-way time: half a round trip of the same message.
    const double one_way =
        median_seconds(50,
                       [&] {
                         if (me < peer) {
                           world.isend(data.data(), floats * sizeof(float), peer, 0).wait();
                           world.irecv(data.data(), floats * sizeof(float), peer, 1).wait();
                         } else {
                           world.irecv(data.data(), floats * sizeof(float), peer, 0).wait();
                           world.isend(data.data(), floats * sizeof(float), peer, 1).wait();
                         }
                       }) /
        2;
    if (me == 0) {
      std::printf("  %8zu bytes: pair all-reduce %8.1f us, one-way message %8.1f us\n",
                  floats * sizeof(float), all_reduce * 1e6, one_way * 1e6);
    }
  }
  return 0;
}
