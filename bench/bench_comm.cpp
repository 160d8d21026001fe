// Measures what the cost model's cluster spec needs about the links between ranks: latency and
// bandwidth of an all-reduce inside a pair of ranks (a tensor-parallel group) and of a one-way
// message (a pipeline hand-off), as medians of repeated timings. Run it under mpirun with the
// rank count and placement of the jobs it should describe, e.g.
//   mpirun --oversubscribe -np 4 build/bench/bench_comm
// (configs/clusters/cpu-local.json quotes its numbers). Pairs are (r, r xor 1) — neighbours,
// inside one host when ranks fill hosts in order — and, with 4 or more ranks, also
// (r, r xor size/2), which crosses hosts on 2 hosts (scripts/hosts.sh mpirun -np 4
// build/bench/bench_comm gives both figures of configs/clusters/cpu-bed-2x2.json). Each table
// says whether its pairs share a host (MPI's processor name) and fits latency + bytes / bandwidth
// to the one-way times of its smallest and largest message.
//
// Where ranks outnumber their host's cores, the runtime does not use MPI's own waits: the ranks of
// a core take turns (runtime::CoreSharing, core lease), and a rank waiting for a message gives its
// core back and polls gently. Every exchange then also waits for the partner's turn. The same
// pairs are measured a second time that way (each rank holds its lease between exchanges, as it
// does while computing between two collectives): the figures a cluster file of such a machine
// needs (`turns` in the output; bench/bench_bed.sh fits configs/clusters/cpu-bed-2x2-turns.json's
// links to its pair all-reduces).
//
// Usage: bench_comm [--json FILE]: with --json, rank 0 also writes every table's figures to FILE
// for programs to read (bench/bench_bed.sh).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <mpi.h>

#include "bench_args.h"
#include "comm/communicator.h"
#include "comm/mpi_session.h"
#include "common/files.h"
#include "common/json.h"
#include "common/stats.h"
#include "runtime/core_lease.h"

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

std::string processor_name() {
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  return std::string(name, static_cast<size_t>(length));
}

// Times every rank's pair with rank `me xor distance`; rank 0 prints its pair's figures and
// returns them (null elsewhere). With a core lease, each exchange is waited for as the runtime
// waits while ranks take turns on cores.
Json measure_pairs(const comm::Communicator& world, int distance, runtime::CoreLease* lease) {
  const int me = world.rank(), peer = me ^ distance;
  comm::Communicator pair = world.subgroup({std::min(me, peer), std::max(me, peer)});
  // Whether rank 0's pair shares a host: the higher rank of each pair sends the lower its name.
  std::string name = processor_name();
  name.resize(MPI_MAX_PROCESSOR_NAME, '\0');
  std::string peer_name = name;
  pair.broadcast(peer_name.data(), peer_name.size(), 1);
  const bool same_host = peer_name == name;
  if (me == 0) {
    std::printf("pairs (r, r xor %d), %s%s; medians of 50\n", distance,
                same_host ? "inside one host" : "across hosts",
                lease ? ", turns (ranks of a core take turns, as the runtime runs them)" : "");
  }
  Json figures = {{"distance", distance},
                  {"same_host", same_host},
                  {"turns", lease != nullptr},
                  {"sizes", Json::array()}};
  std::vector<double> sizes, one_ways;
  for (size_t floats : {size_t(256), size_t(1) << 16, size_t(1) << 20}) {
    std::vector<float> data(floats, 1.0f);
    // The rank holds its turn on the core between exchanges (as between two collectives of a
    // computing rank); the runtime's waits give it back while the exchange is under way.
    auto all_reduce_once = [&] {
      runtime::CoreLease::Hold turn(lease);
      runtime::all_reduce_sum(pair, data.data(), data.size(), lease);
    };
    auto transfer = [&](bool send, int tag) {
      comm::Request request = send ? world.isend(data.data(), floats * sizeof(float), peer, tag)
                                   : world.irecv(data.data(), floats * sizeof(float), peer, tag);
      runtime::wait(request, lease);
    };
    for (int i = 0; i < 5; ++i) all_reduce_once();
    world.barrier();
    const double all_reduce = median_seconds(50, all_reduce_once);
    world.barrier();
    // One-way time: half a round trip of the same message.
    const double one_way = median_seconds(50,
                                          [&] {
                                            runtime::CoreLease::Hold turn(lease);
                                            transfer(me < peer, 0);
                                            transfer(me > peer, 1);
                                          }) /
                           2;
    sizes.push_back(static_cast<double>(floats * sizeof(float)));
    one_ways.push_back(one_way);
    if (me == 0) {
      std::printf("  %8zu bytes: pair all-reduce %8.1f us, one-way message %8.1f us\n",
                  floats * sizeof(float), all_reduce * 1e6, one_way * 1e6);
      figures["sizes"].push_back({{"bytes", floats * sizeof(float)},
                                  {"all_reduce_us", all_reduce * 1e6},
                                  {"one_way_us", one_way * 1e6}});
    }
  }
  if (me == 0) {
    const double bandwidth = (sizes.back() - sizes.front()) / (one_ways.back() - one_ways.front());
    std::printf("  one-way fit: latency %.1f us, bandwidth %.3f GB/s\n", one_ways.front() * 1e6,
                bandwidth / 1e9);
    figures["one_way_fit"] = {{"latency_us", one_ways.front() * 1e6},
                              {"bandwidth_gbs", bandwidth / 1e9}};
    return figures;
  }
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  comm::MpiSession session(&argc, &argv);
  comm::Communicator world = comm::Communicator::world();
  std::string json_path;
  try {
    json_path = bench::take_option(argc, argv, "--json");
  } catch (const Error& e) {
    if (world.rank() == 0) std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  if (world.size() < 2 || world.size() % 2 != 0) {
    if (world.rank() == 0) std::fprintf(stderr, "run with an even number of ranks\n");
    return 1;
  }
  const bool across = world.size() >= 4 && (world.size() & (world.size() - 1)) == 0;
  Json pairs = Json::array();
  pairs.push_back(measure_pairs(world, 1, nullptr));
  if (across) pairs.push_back(measure_pairs(world, world.size() / 2, nullptr));
  const runtime::CoreSharing sharing = runtime::CoreSharing::detect(world, 1);
  if (sharing.lease) {
    if (world.rank() == 0) std::printf("cores: %s\n", sharing.summary.c_str());
    pairs.push_back(measure_pairs(world, 1, sharing.lease.get()));
    if (across) pairs.push_back(measure_pairs(world, world.size() / 2, sharing.lease.get()));
  }
  if (world.rank() == 0 && !json_path.empty()) {
    write_file_atomic(json_path, Json{{"pairs", pairs}}.dump(2) + "\n");
  }
  return 0;
}
