#include "elastic/monitor.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "common/stats.h"

namespace malleus::elastic {

namespace {

// The world size, checked before anything is allocated for it.
size_t checked_world_size(int world_size) {
  check(world_size > 0, "monitor: the world size must be positive");
  check(world_size <= Monitor::kMaxRanks,
        "monitor: " + std::to_string(world_size) + " ranks is more than the " +
            std::to_string(Monitor::kMaxRanks) + " a monitor takes");
  return static_cast<size_t>(world_size);
}

}  // namespace

Monitor::Monitor(int world_size, MonitorOptions options)
    : options_(options),
      ranks_(checked_world_size(world_size)),
      rates_(ranks_.size(), 1.0),
      step_rates_(rates_) {
  check(options.window >= 1 && options.block >= options.window,
        "monitor: the window must be at least 1 and the block at least the window");
  check(options.calibration_tolerance >= 1, "monitor: the calibration tolerance must be >= 1");
}

double Monitor::reference(int rank) const {
  const RankState& st = ranks_.at(static_cast<size_t>(rank));
  const auto it = st.references.find(st.geometry);
  return it == st.references.end() ? 0 : it->second.value;
}

void Monitor::set_reference(int rank, const std::string& geometry, double value) {
  check(rank >= 0 && static_cast<size_t>(rank) < ranks_.size(),
        "monitor: no rank " + std::to_string(rank) + " to set the reference of");
  check(value > 0, "monitor: a reference must be positive, got " + std::to_string(value));
  Reference& ref = ranks_[static_cast<size_t>(rank)].references[geometry];
  ref.value = value;
  ref.fixed = true;
}

double Monitor::peer_seed(size_t rank, const std::string& geometry, const std::string& from) const {
  const auto known = [](const RankState& st, const std::string& g) {
    const auto it = st.references.find(g);
    return it == st.references.end() ? 0.0 : it->second.value;
  };
  const RankState& own = ranks_[rank];
  // Where the two devices are compared, in order: first where this rank came from, then every
  // other geometry it has a reference for.
  std::vector<std::string> compared = {from};
  for (const auto& [g, ref] : own.references) {
    if (g != from && g != geometry) compared.push_back(g);
  }
  std::vector<double> seeds;
  for (size_t p = 0; p < ranks_.size(); ++p) {
    const double theirs = p == rank ? 0 : known(ranks_[p], geometry);
    if (theirs <= 0) continue;
    // The two devices compared where both have a reference.
    double scale = 1;
    for (const std::string& g : compared) {
      const double mine = known(own, g), peer = known(ranks_[p], g);
      if (g != geometry && mine > 0 && peer > 0) {
        scale = mine / peer;
        break;
      }
    }
    seeds.push_back(theirs * scale);
  }
  return seeds.empty() ? 0 : median(seeds);
}

const std::vector<double>& Monitor::observe(const std::vector<double>& measurements,
                                            const std::vector<std::string>& geometries) {
  const size_t n = ranks_.size();
  check(measurements.size() == 2 * n && geometries.size() == n,
        "monitor: expected (seconds, FLOPs) and a geometry for each of the " + std::to_string(n) +
            " ranks");
  // All checked before any is taken: a refused step leaves the monitor as it was.
  for (size_t r = 0; r < n; ++r) {
    const double seconds = measurements[2 * r], flops = measurements[2 * r + 1];
    check(std::isfinite(seconds) && std::isfinite(flops) && seconds >= 0 && flops >= 0,
          "monitor: rank " + std::to_string(r) +
              "'s time and FLOPs must be finite and not negative, got " + std::to_string(seconds) +
              " s and " + std::to_string(flops) + " FLOPs");
  }
  const size_t window = static_cast<size_t>(options_.window);
  std::vector<size_t> calibrated;  // ranks whose first reference was set this step
  std::vector<double> step_times(n, 0.0);
  for (size_t r = 0; r < n; ++r) {
    RankState& st = ranks_[r];
    const double seconds = measurements[2 * r], flops = measurements[2 * r + 1];
    if (!(seconds > 0 && flops > 0)) continue;  // nothing measured (timing off): rate unchanged
    step_times[r] = seconds / flops;
    const double t = seconds / flops;
    if (geometries[r] != st.geometry) {
      const std::string from = st.geometry;
      st.entry_rate = from.empty() ? 0 : st.rate;
      st.entry_reference = from.empty() ? 0 : st.references[from].value;
      st.geometry = geometries[r];
      st.window.clear();
      Reference& entered = st.references[st.geometry];
      if (!from.empty() && entered.value == 0) entered.value = peer_seed(r, st.geometry, from);
    }
    Reference& ref = st.references[st.geometry];
    ref.block.push_back(t);
    if (ref.block.size() > static_cast<size_t>(options_.block)) ref.block.pop_front();
    st.window.push_back(t);
    if (st.window.size() > window) st.window.pop_front();
    const double now = median({st.window.begin(), st.window.end()});
    if (ref.value == 0 && st.window.size() == window) {
      if (st.entry_rate > 0) {
        ref.value = now / st.entry_rate;  // seeded: the slowdown carried across the switch
      } else {
        ref.value = now;  // the run's first geometry: calibrated
        calibrated.push_back(r);
      }
    }
    if (ref.value > 0) {
      if (ref.block.size() >= window && !ref.fixed) {
        ref.value = std::min(ref.value, median({ref.block.begin(), ref.block.end()}));
      }
      st.rate = now / ref.value;
    } else {
      st.rate = st.entry_rate > 0 ? st.entry_rate : 1.0;  // settling: keep what was known
    }
  }
  // A first calibration far slower than an identical peer's is a device slow from the start.
  for (size_t r : calibrated) {
    RankState& st = ranks_[r];
    Reference& ref = st.references[st.geometry];
    double fastest = ref.value;
    for (size_t p = 0; p < n; ++p) {
      if (ranks_[p].geometry != st.geometry) continue;
      const auto it = ranks_[p].references.find(st.geometry);
      if (it != ranks_[p].references.end() && it->second.value > 0) {
        fastest = std::min(fastest, it->second.value);
      }
    }
    if (ref.value > options_.calibration_tolerance * fastest) {
      st.rate *= ref.value / fastest;
      ref.value = fastest;
    }
  }
  for (size_t r = 0; r < n; ++r) {
    rates_[r] = ranks_[r].rate;
    // Settling in a new geometry: against the reference of the one it came from.
    double ref = reference(static_cast<int>(r));
    if (ref == 0) ref = ranks_[r].entry_reference;
    step_rates_[r] = step_times[r] > 0 && ref > 0 ? step_times[r] / ref : rates_[r];
  }
  ++samples_;
  return rates_;
}

namespace {

// Ranks' probe times differ by their place in the collective, not by their links' health, so a
// rank is never rated against a peer's first calibration (as a slow device would be): every
// rank's reference is its own.
MonitorOptions own_references_only(MonitorOptions options) {
  options.calibration_tolerance = std::numeric_limits<double>::infinity();
  return options;
}

}  // namespace

LinkMonitor::LinkMonitor(std::vector<int> node_of_rank, MonitorOptions options,
                         const std::vector<double>& expected_seconds_per_byte)
    : node_of_rank_(std::move(node_of_rank)),
      ranks_(static_cast<int>(node_of_rank_.size()), own_references_only(options)) {
  int nodes = 0;
  for (int n : node_of_rank_) {
    check(n >= 0, "link monitor: a rank's node must not be negative");
    nodes = std::max(nodes, n + 1);
  }
  check(
      expected_seconds_per_byte.empty() || expected_seconds_per_byte.size() == node_of_rank_.size(),
      "link monitor: expected a healthy probe time for each of the " +
          std::to_string(node_of_rank_.size()) + " ranks, got " +
          std::to_string(expected_seconds_per_byte.size()));
  for (size_t r = 0; r < expected_seconds_per_byte.size(); ++r) {
    if (expected_seconds_per_byte[r] > 0) {  // 0: a rank that does not probe
      ranks_.set_reference(static_cast<int>(r), "probe", expected_seconds_per_byte[r]);
    }
  }
  node_rates_.assign(static_cast<size_t>(nodes), 1.0);
}

const std::vector<double>& LinkMonitor::observe(const std::vector<double>& link_measurements) {
  const std::vector<double>& rates =
      ranks_.observe(link_measurements, std::vector<std::string>(node_of_rank_.size(), "probe"));
  std::vector<std::vector<double>> by_node(node_rates_.size());
  for (size_t r = 0; r < rates.size(); ++r) {
    if (link_measurements[2 * r] > 0 && link_measurements[2 * r + 1] > 0) {
      by_node[static_cast<size_t>(node_of_rank_[r])].push_back(rates[r]);
    }
  }
  for (size_t n = 0; n < by_node.size(); ++n) {
    if (!by_node[n].empty()) node_rates_[n] = median(by_node[n]);
  }
  return node_rates_;
}

std::vector<std::string> work_geometries(const layout::Layout& layout) {
  std::vector<std::string> geometries;
  for (const auto& shard : layout.shards) {
    if (!shard) {
      geometries.emplace_back("probe");
      continue;
    }
    // Not the layer count: layers of one shape run at one time per FLOP, so a stage given more
    // or fewer layers keeps its reference (a seed taken while the rank's slowdown changed would
    // otherwise hold it on the stage the controller gave it, docs/elastic.md).
    std::string g = "heads " + std::to_string(shard->heads) + ", ffn " + std::to_string(shard->ffn);
    if (shard->has_embedding) g += ", embedding";
    if (shard->has_head) g += ", head (vocab " + std::to_string(shard->vocab) + ")";
    geometries.push_back(std::move(g));
  }
  return geometries;
}

}  // namespace malleus::elastic
