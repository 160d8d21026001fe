// How steady this machine's cores are by themselves: one thread pinned to each core runs the same
// integer loop and counts its rounds every second, for `bench_core_speed [SECONDS]` (default 60).
// Prints each second's rounds per core, then per core the median, the slowest and the fastest
// second and fastest/slowest. A straggler monitor reads a rank's speed against the fastest it has
// been, so a machine whose cores swing by themselves shows healthy ranks above 1: the tolerances
// of the timing tests (tests/test_straggler_timing.cpp) come from this figure.
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "bench_args.h"
#include "common/stats.h"

namespace {

using Clock = std::chrono::steady_clock;

// Rounds of a fixed loop in each whole second of `seconds`, on core `core`.
std::vector<double> rounds_per_second(int core, int seconds) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  malleus::check(::pthread_setaffinity_np(::pthread_self(), sizeof(set), &set) == 0,
                 "cannot pin a thread to core " + std::to_string(core));
  std::vector<double> counts;
  volatile unsigned long sink = 0;
  auto next = Clock::now() + std::chrono::seconds(1);
  double rounds = 0;
  while (static_cast<int>(counts.size()) < seconds) {
    for (unsigned long i = 0; i < 100'000; ++i) sink = sink + i;
    ++rounds;
    if (Clock::now() >= next) {
      counts.push_back(rounds);
      rounds = 0;
      next += std::chrono::seconds(1);
    }
  }
  return counts;
}

}  // namespace

int main(int argc, char** argv) try {
  const int seconds = malleus::bench::positive_arg(argc, argv, 1, 60);
  cpu_set_t allowed;
  malleus::check(::sched_getaffinity(0, sizeof(allowed), &allowed) == 0, "sched_getaffinity");
  std::vector<int> cores;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cores.push_back(c);
  }
  std::printf("%zu cores, one spinning thread each, %d s\n", cores.size(), seconds);
  std::vector<std::vector<double>> counts(cores.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cores.size(); ++i) {
    threads.emplace_back([&, i] { counts[i] = rounds_per_second(cores[i], seconds); });
  }
  for (auto& t : threads) t.join();
  std::printf("second");
  for (int c : cores) std::printf("  core %d", c);
  std::printf("\n");
  for (int s = 0; s < seconds; ++s) {
    std::printf("%6d", s + 1);
    for (const auto& c : counts) std::printf("  %6.0f", c[s]);
    std::printf("\n");
  }
  for (size_t i = 0; i < cores.size(); ++i) {
    const malleus::Summary s = malleus::summarize(counts[i]);
    std::printf("core %d: median %.0f rounds/s, slowest second %.0f, fastest %.0f: %.2fx\n",
                cores[i], s.median, s.min, s.max, s.max / s.min);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_core_speed: %s\n", e.what());
  return 1;
}
