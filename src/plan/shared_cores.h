// Ranks that take turns on shared compute units: the 2-core test bed, where a host runs more
// ranks than it has CPU cores and malleus's core lease (runtime/core_lease.h) has them take turns
// (ClusterSpec::cores_per_node below devices_per_node). Everything the cost model predicts
// differently for such ranks is here, behind one object: a TP group's members on one unit add up,
// consecutive stages of a pipeline on the same units run as one stage, the pipelines take at
// least the busiest unit's compute, and optimizer steps on a unit follow each other.
//
// A cluster with a compute unit per device has no SharedCores (SharedCores::of gives nothing, the
// cost model then holds none), so no code of this file runs for it: it cannot change a plan or a
// prediction there (tests/test_cost_model.cpp, CostModel.DevicePerRankClusters...).
#pragma once

#include <optional>
#include <vector>

#include "plan/cluster.h"
#include "plan/plan.h"

namespace malleus::plan {

struct StagePrediction;
struct PipelinePrediction;

class SharedCores {
 public:
  // The sharing of `cluster`'s devices, or nothing when every device has a unit of its own.
  static std::optional<SharedCores> of(const ClusterSpec& cluster);

  // The unit (numbered over the cluster) device `device` runs on: device i of a node on unit
  // i mod cores_per_node of its node.
  int core_of(int device) const;
  // The units a stage's ranks run on, sorted.
  std::vector<int> cores_of(const Stage& stage) const;

  // `stages` (of `pipeline`) with every run of consecutive stages on the same units made one
  // stage: forward, backward, TP and recomputation times add up; the hand-offs inside the run are
  // the unit's own order of work and leave the critical path. Recomputation is no longer ahead
  // of a gradient: the unit does it when it is its turn.
  std::vector<StagePrediction> merge_stages(const Pipeline& pipeline,
                                            const std::vector<StagePrediction>& stages) const;
  // The most compute any unit does in an iteration: every stage's compute (forward and backward
  // less its TP communication, as its busiest unit does it) for each of its pipeline's
  // micro-batches, summed over the stages on the unit.
  double busiest_core_compute(const Plan& plan,
                              const std::vector<PipelinePrediction>& pipelines) const;

 private:
  SharedCores(int devices_per_node, int cores_per_node)
      : devices_per_node_(devices_per_node), cores_per_node_(cores_per_node) {}

  int devices_per_node_ = 1;
  int cores_per_node_ = 1;
};

}  // namespace malleus::plan
