#include "plan/cluster.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>

#include "common/error.h"

namespace malleus::plan {

// Generated at configure time from configs/clusters/*.json (see src/plan/CMakeLists.txt).
const std::map<std::string, std::string>& embedded_cluster_presets();

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kGB = 1e9;
constexpr double kTera = 1e12;
constexpr double kMicro = 1e-6;

}  // namespace

void ClusterSpec::validate(const std::string& source) const {
  auto positive = [&](const char* key, double value) {
    check(value > 0 && std::isfinite(value),
          source + ": \"" + key + "\" must be positive (got " + std::to_string(value) + ")");
  };
  auto non_negative = [&](const char* key, double value) {
    check(value >= 0 && std::isfinite(value),
          source + ": \"" + key + "\" must not be negative (got " + std::to_string(value) + ")");
  };
  positive("nodes", nodes);
  positive("devices_per_node", devices_per_node);
  positive("memory_gib", memory_bytes);
  positive("peak_tflops", peak_flops);
  positive("mfu", mfu);
  check(mfu <= 1, source + ": \"mfu\" must be at most 1 (got " + std::to_string(mfu) + ")");
  positive("memory_bandwidth_gbs", memory_bandwidth);
  positive("intra_node_bandwidth_gbs", intra_node_bandwidth);
  positive("inter_node_bandwidth_gbs", inter_node_bandwidth);
  non_negative("intra_node_latency_us", intra_node_latency);
  non_negative("inter_node_latency_us", inter_node_latency);
  positive("state_bytes_per_param", state_bytes_per_param);
  positive("grad_bytes", grad_bytes);
  positive("activation_bytes", activation_bytes);
  positive("usable_memory_fraction", usable_memory_fraction);
  check(usable_memory_fraction <= 1, source + ": \"usable_memory_fraction\" must be at most 1");
  non_negative("restart_s", restart_seconds);
  check(cores_per_node >= 0 && cores_per_node <= devices_per_node,
        source + ": \"cores_per_node\" must be between 1 and devices_per_node (" +
            std::to_string(devices_per_node) + "), got " + std::to_string(cores_per_node));
  check(link_rates.size() <= static_cast<size_t>(nodes),
        source + ": " + std::to_string(link_rates.size()) + " link rates for " +
            std::to_string(nodes) + " nodes");
  for (size_t n = 0; n < link_rates.size(); ++n) {
    check(link_rates[n] >= 1 && std::isfinite(link_rates[n]),
          source + ": the link rate of node " + std::to_string(n) +
              " must be at least 1 and finite (got " + std::to_string(link_rates[n]) + ")");
  }
}

double ClusterSpec::span_bandwidth(const std::vector<int>& devices) const {
  if (devices.empty()) return intra_node_bandwidth;
  const int first = node_of(devices.front());
  bool crosses = false;
  double slowest = 1;
  for (int d : devices) {
    crosses = crosses || node_of(d) != first;
    slowest = std::max(slowest, link_rate(node_of(d)));
  }
  return crosses ? inter_node_bandwidth / slowest : intra_node_bandwidth;
}

double ClusterSpec::span_latency(const std::vector<int>& devices) const {
  for (int d : devices) {
    if (node_of(d) != node_of(devices.front())) return inter_node_latency;
  }
  return intra_node_latency;
}

ClusterSpec ClusterSpec::from_json(const Json& json, const std::string& source) {
  JsonReader r(json, source);
  ClusterSpec c;
  c.name = r.optional<std::string>("name", c.name);
  c.nodes = r.required<int>("nodes");
  c.devices_per_node = r.required<int>("devices_per_node");
  c.memory_bytes = r.required<double>("memory_gib") * kGiB;
  c.peak_flops = r.required<double>("peak_tflops") * kTera;
  c.mfu = r.optional<double>("mfu", c.mfu);
  c.memory_bandwidth = r.required<double>("memory_bandwidth_gbs") * kGB;
  c.intra_node_bandwidth = r.required<double>("intra_node_bandwidth_gbs") * kGB;
  c.intra_node_latency = r.optional<double>("intra_node_latency_us", 0) * kMicro;
  c.inter_node_bandwidth = r.required<double>("inter_node_bandwidth_gbs") * kGB;
  c.inter_node_latency = r.optional<double>("inter_node_latency_us", 0) * kMicro;
  c.state_bytes_per_param = r.optional<double>("state_bytes_per_param", c.state_bytes_per_param);
  c.grad_bytes = r.optional<double>("grad_bytes", c.grad_bytes);
  c.activation_bytes = r.optional<double>("activation_bytes", c.activation_bytes);
  c.flash_attention = r.optional<bool>("flash_attention", c.flash_attention);
  c.sequence_parallel = r.optional<bool>("sequence_parallel", c.sequence_parallel);
  c.usable_memory_fraction = r.optional<double>("usable_memory_fraction", c.usable_memory_fraction);
  c.restart_seconds = r.optional<double>("restart_s", c.restart_seconds);
  if (r.has("cores_per_node")) {
    c.cores_per_node = r.required<int>("cores_per_node");
    check(c.cores_per_node >= 1, source + ": \"cores_per_node\" must be at least 1 (got " +
                                     std::to_string(c.cores_per_node) + ")");
  }
  if (r.has("comment")) r.optional<std::string>("comment", "");
  r.finish();
  c.validate(source);
  return c;
}

Json ClusterSpec::to_json() const {
  Json json{{"name", name},
            {"nodes", nodes},
            {"devices_per_node", devices_per_node},
            {"memory_gib", memory_bytes / kGiB},
            {"peak_tflops", peak_flops / kTera},
            {"mfu", mfu},
            {"memory_bandwidth_gbs", memory_bandwidth / kGB},
            {"intra_node_bandwidth_gbs", intra_node_bandwidth / kGB},
            {"intra_node_latency_us", intra_node_latency / kMicro},
            {"inter_node_bandwidth_gbs", inter_node_bandwidth / kGB},
            {"inter_node_latency_us", inter_node_latency / kMicro},
            {"state_bytes_per_param", state_bytes_per_param},
            {"grad_bytes", grad_bytes},
            {"activation_bytes", activation_bytes},
            {"flash_attention", flash_attention},
            {"sequence_parallel", sequence_parallel},
            {"usable_memory_fraction", usable_memory_fraction},
            {"restart_s", restart_seconds}};
  if (cores_shared()) json["cores_per_node"] = cores_per_node;
  return json;
}

ClusterSpec load_cluster(const std::string& name_or_path) {
  const auto& presets = embedded_cluster_presets();
  if (auto it = presets.find(name_or_path); it != presets.end()) {
    const std::string source = "cluster preset \"" + name_or_path + "\"";
    return ClusterSpec::from_json(parse_json(it->second, source), source);
  }
  if (!std::filesystem::exists(name_or_path)) {
    std::string names;
    for (const auto& [name, text] : presets) {
      names += ' ';
      names += name;
    }
    throw Error("cluster \"" + name_or_path + "\" is neither a preset (" + names.substr(1) +
                ") nor an existing file");
  }
  return ClusterSpec::from_json(read_json_file(name_or_path), name_or_path);
}

std::vector<std::string> cluster_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, text] : embedded_cluster_presets()) names.push_back(name);
  return names;
}

bool is_gone(double rate) {
  return !std::isfinite(rate);
}

double remaining_capacity(const Rates& rates) {
  double sum = 0;
  for (double r : rates) sum += is_gone(r) ? 0.0 : 1.0 / r;
  return sum;
}

Rates rates_from_json(const Json& json, int devices, const std::string& source) {
  check(json.is_object(), source + ": rates must be a JSON object {\"device\": rate, ...}");
  Rates rates(static_cast<size_t>(devices), 1.0);
  for (const auto& [key, value] : json.items()) {
    int device = -1;
    try {
      size_t used = 0;
      device = std::stoi(key, &used);
      if (used != key.size()) device = -1;
    } catch (const std::exception&) {
      device = -1;
    }
    check(device >= 0 && device < devices, source + ": key \"" + key +
                                               "\" is not a device index in [0, " +
                                               std::to_string(devices) + ")");
    double rate = 0;
    if (value.is_string()) {
      const std::string text = value.get<std::string>();
      check(text == "inf",
            source + ": key \"" + key + "\" has rate \"" + text + "\" (a number ≥ 1 or \"inf\")");
      rate = std::numeric_limits<double>::infinity();
    } else {
      check(value.is_number(), source + ": key \"" + key + "\" has a rate that is not a number (" +
                                   value.dump() + ")");
      rate = value.get<double>();
      check(rate >= 1 && std::isfinite(rate), source + ": key \"" + key + "\" has rate " +
                                                  value.dump() + " (a number ≥ 1 or \"inf\")");
    }
    rates[static_cast<size_t>(device)] = rate;
  }
  return rates;
}

Rates parse_rates(const std::string& text_or_path, int devices) {
  if (text_or_path.empty()) return Rates(static_cast<size_t>(devices), 1.0);
  const size_t first = text_or_path.find_first_not_of(" \t\n");
  if (first != std::string::npos && text_or_path[first] == '{') {
    return rates_from_json(parse_json(text_or_path, "--rates"), devices, "--rates");
  }
  return rates_from_json(read_json_file(text_or_path), devices, text_or_path);
}

Json rates_to_json(const Rates& rates) {
  Json json = Json::object();
  for (size_t d = 0; d < rates.size(); ++d) {
    if (is_gone(rates[d])) {
      json[std::to_string(d)] = "inf";
    } else if (rates[d] != 1.0) {
      json[std::to_string(d)] = rates[d];
    }
  }
  return json;
}

}  // namespace malleus::plan
