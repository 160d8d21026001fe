#include "plan/shared_cores.h"

#include <algorithm>
#include <map>

#include "plan/cost_model.h"

namespace malleus::plan {

std::optional<SharedCores> SharedCores::of(const ClusterSpec& cluster) {
  if (!cluster.cores_shared()) return std::nullopt;
  return SharedCores(cluster.devices_per_node, cluster.cores_per_node);
}

int SharedCores::core_of(int device) const {
  return device / devices_per_node_ * cores_per_node_ +
         (device % devices_per_node_) % cores_per_node_;
}

std::vector<int> SharedCores::cores_of(const Stage& stage) const {
  std::vector<int> cores;
  for (int r : stage.ranks) cores.push_back(core_of(r));
  std::sort(cores.begin(), cores.end());
  cores.erase(std::unique(cores.begin(), cores.end()), cores.end());
  return cores;
}

std::vector<StagePrediction> SharedCores::merge_stages(
    const Pipeline& pipeline, const std::vector<StagePrediction>& stages) const {
  std::vector<StagePrediction> merged;
  std::vector<int> last_cores;
  for (size_t j = 0; j < stages.size(); ++j) {
    std::vector<int> cores = cores_of(pipeline.stages[j]);
    if (merged.empty() || cores != last_cores) {
      merged.push_back(stages[j]);
      last_cores = std::move(cores);
      continue;
    }
    StageCost& c = merged.back().cost;
    const StageCost& next = stages[j].cost;
    c.forward += next.forward;
    c.backward += next.backward;
    c.comm += next.comm;
    c.recompute_time += next.recompute_time;
    c.recompute_ahead = false;
    c.memory_bytes = std::max(c.memory_bytes, next.memory_bytes);
    c.fits = c.fits && next.fits;
    merged.back().p2p_next = stages[j].p2p_next;
  }
  return merged;
}

double SharedCores::busiest_core_compute(const Plan& plan,
                                         const std::vector<PipelinePrediction>& pipelines) const {
  std::map<int, double> per_core;
  for (size_t p = 0; p < plan.pipelines.size() && p < pipelines.size(); ++p) {
    const Pipeline& pipeline = plan.pipelines[p];
    for (size_t j = 0; j < pipeline.stages.size() && j < pipelines[p].stages.size(); ++j) {
      const StageCost& c = pipelines[p].stages[j].cost;
      const double compute = pipeline.micro_batches * (c.forward + c.backward - c.comm);
      for (int core : cores_of(pipeline.stages[j])) per_core[core] += compute;
    }
  }
  double busiest = 0;
  for (const auto& [core, compute] : per_core) busiest = std::max(busiest, compute);
  return busiest;
}

}  // namespace malleus::plan
