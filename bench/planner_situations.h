// The straggler situations the planner benchmark and its quality oracle share: llama-70b on A800
// nodes of 8 devices, 16 sequences of 4096 tokens per node and step (issue 25's setting), under a
// few rate patterns that scale with the cluster.
#pragma once

#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "plan/cluster.h"

namespace malleus::bench {

struct RatePattern {
  std::string name;
  plan::Rates rates;
};

// The rate patterns on `devices` devices (8 per node).
inline std::vector<RatePattern> rate_patterns(int devices) {
  const auto n = static_cast<size_t>(devices);
  const double gone = std::numeric_limits<double>::infinity();
  std::vector<RatePattern> out;
  out.push_back({"healthy", plan::Rates(n, 1.0)});
  plan::Rates three(n, 1.0);
  three[3] = 2.0;
  three[static_cast<size_t>(devices / 3 + 5)] = 3.0;
  three[static_cast<size_t>(2 * devices / 3 + 9)] = 5.0;
  out.push_back({"3 slow (2x, 3x, 5x)", three});
  plan::Rates one_gone(n, 1.0);
  one_gone[1] = gone;
  out.push_back({"one gone", one_gone});
  plan::Rates node(n, 1.0);
  for (size_t d = 8; d < 16; ++d) node[d] = 2.0;
  node[1] = gone;
  out.push_back({"node 2x + one gone", node});
  // 5 % of the devices slow at random rates in [1.5, 10].
  std::mt19937 rng(42);
  plan::Rates mixed(n, 1.0);
  std::uniform_int_distribution<int> pick(0, devices - 1);
  std::uniform_real_distribution<double> rate(1.5, 10.0);
  for (int i = 0; i < std::max(2, devices / 20); ++i) {
    mixed[static_cast<size_t>(pick(rng))] = rate(rng);
  }
  out.push_back({"5% mixed slow", mixed});
  return out;
}

}  // namespace malleus::bench
