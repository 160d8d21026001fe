// A cluster spec: nodes × devices, what one device can compute and hold, and how fast devices
// talk inside a node and across nodes. The planner, cost model and simulator read every
// hardware number from here, so a cluster far larger than the development machine can be
// studied by writing (or choosing) a spec. Presets are configs/clusters/*.json, compiled in.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "common/json.h"

namespace malleus::plan {

struct ClusterSpec {
  std::string name = "custom";
  int nodes = 1;
  int devices_per_node = 1;
  double memory_bytes = 0;          // per device
  double peak_flops = 0;            // dense peak per device in the training precision
  double mfu = 1;                   // achievable fraction of peak for transformer layers
  double memory_bandwidth = 0;      // device memory, bytes/s (optimizer step)
  double intra_node_bandwidth = 0;  // per device, bytes/s, achieved collective bandwidth
  double intra_node_latency = 0;    // s per message
  double inter_node_bandwidth = 0;  // per device (its share of the node's NICs), bytes/s
  double inter_node_latency = 0;
  // Precision: bytes per parameter of weights + gradients + optimizer state held on a device,
  // of one gradient element in the cross-pipeline sync, and of one activation element.
  double state_bytes_per_param = 16;
  double grad_bytes = 2;
  double activation_bytes = 2;
  // What the training runtime keeps of activations (the cost model's memory formula follows it):
  // fused attention keeps no b·heads·s² scores (flash attention, as on GPUs); sequence
  // parallelism splits the norms' and residuals' activations over the TP group (Megatron-LM).
  // malleus's CPU runtime does neither: its presets set both false.
  bool flash_attention = true;
  bool sequence_parallel = true;
  double usable_memory_fraction = 0.9;  // the rest is allocator slack, workspace, the runtime
  // Compute units a node's devices run on; 0 (the default): one each. Fewer than
  // devices_per_node: device i of a node runs on unit i mod cores_per_node and takes turns on it
  // with the node's other devices there (malleus's core lease, runtime/core_lease.h, when more
  // ranks than CPU cores share a host), at peak_flops × mfu while it computes; its compute never
  // overlaps theirs.
  int cores_per_node = 0;
  double restart_seconds = 300;  // a full stop-and-restart (elastic baselines)

  // Per node, how many times slower than inter_node_bandwidth says its link to the other nodes
  // now is (a slow NIC, cable or switch port; measured by the link monitor, elastic/monitor.h):
  // 1 = healthy, missing = 1. Not part of the JSON spec: it describes a moment, as device rates do.
  std::vector<double> link_rates;

  int num_devices() const { return nodes * devices_per_node; }
  int node_of(int device) const { return device / devices_per_node; }
  // Whether devices take turns on shared units; what the cost model then does differently is
  // plan/shared_cores.h.
  bool cores_shared() const { return cores_per_node > 0 && cores_per_node < devices_per_node; }
  double flops() const { return peak_flops * mfu; }  // what the cost model divides by
  double usable_memory() const { return memory_bytes * usable_memory_fraction; }
  double link_rate(int node) const {
    return node >= 0 && static_cast<size_t>(node) < link_rates.size() ? link_rates[node] : 1.0;
  }
  // Bandwidth of a path between two devices: a slow link slows every transfer through it.
  double bandwidth(int a, int b) const {
    const int na = node_of(a), nb = node_of(b);
    return na == nb ? intra_node_bandwidth
                    : inter_node_bandwidth / std::max(link_rate(na), link_rate(nb));
  }
  double latency(int a, int b) const {
    return node_of(a) == node_of(b) ? intra_node_latency : inter_node_latency;
  }
  // The bandwidth and latency of the slowest path among `devices` (a ring collective or a set of
  // point-to-point transfers goes at the pace of its slowest link).
  double span_bandwidth(const std::vector<int>& devices) const;
  double span_latency(const std::vector<int>& devices) const;

  // Throws Error naming `source` and the key if a number is impossible.
  void validate(const std::string& source) const;
  // Units in JSON: GiB, TFLOPS, GB/s, µs (see docs/planner.md).
  static ClusterSpec from_json(const Json& json, const std::string& source);
  Json to_json() const;
};

// `name_or_path`: a preset name (cluster_preset_names) or a JSON file.
ClusterSpec load_cluster(const std::string& name_or_path);
std::vector<std::string> cluster_preset_names();

// Per-device straggle rates: 1 = healthy, r = r times slower, +inf = gone.
using Rates = std::vector<double>;

// Parses {"3": 2.0, "17": "inf"} (device index → rate; missing = 1.0) for `devices` devices.
// `text_or_path` is inline JSON (starts with '{') or a file. Errors name the source and key.
Rates parse_rates(const std::string& text_or_path, int devices);
Rates rates_from_json(const Json& json, int devices, const std::string& source);
Json rates_to_json(const Rates& rates);  // only the devices whose rate is not 1
bool is_gone(double rate);
// What the devices not gone can do, in healthy devices: Σ 1/r over them.
double remaining_capacity(const Rates& rates);

}  // namespace malleus::plan
