// Everything this rank needs to know about the plan it runs, kept in one place (as Megatron-Core's
// parallel_state does): its role, its shard, its pipeline neighbours, and the communicators of its
// tensor-parallel group and of the gradient-sync groups it belongs to. Built collectively from a
// plan; building another one for a new plan is how communicators are rebuilt after a re-plan.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "layout/grad_sync_plan.h"
#include "layout/layout.h"
#include "model/tensor_parallel.h"
#include "plan/plan.h"
#include "runtime/core_lease.h"

namespace malleus::runtime {

struct Role {
  int pipeline = -1, stage = -1, tp_rank = -1;  // -1: idle under this plan
  bool idle() const { return pipeline < 0; }
};

// The model's tensor-parallel collectives over an MPI communicator. They run inside the compute
// sections the monitor times, so the group keeps the elapsed (wall) time spent inside them: a
// rank's compute is its section's elapsed time less the time it waited for its peers. While
// inside a collective the rank gives back its core lease (if it shares a core), or a peer on the
// same core could never reach the collective.
class MpiTensorParallelGroup final : public model::TensorParallelGroup<float> {
 public:
  MpiTensorParallelGroup(comm::Communicator comm, CoreLease* lease)
      : comm_(std::move(comm)), lease_(lease) {}
  int size() const override { return comm_.size(); }
  void all_reduce_sum(float* data, size_t count) override;
  void all_reduce_max(float* data, size_t count) override;
  // MPI_Iallreduce; the time to start it and to wait for it counts as time inside collectives
  // (the compute in between does not). Waiting gives back the core lease as the blocking forms
  // do. Above INT_MAX elements, the blocking sum (and null).
  std::unique_ptr<Pending> start_all_reduce_sum(float* data, size_t count) override;
  // Wall seconds spent inside collectives (and taking the core lease back after them) so far.
  double wait_seconds() const { return wait_seconds_; }
  // Sums started with start_all_reduce_sum so far.
  int64_t started_sums() const { return started_sums_; }
  // Called before each wait is timed: waits for the device's queued compute, which would
  // otherwise count as waiting (backend::RegionTimer::settle; the engine sets it).
  void set_settle(std::function<void()> settle) { settle_ = std::move(settle); }

 private:
  void settle() const {
    if (settle_) settle_();
  }
  comm::Communicator comm_;
  CoreLease* lease_;
  std::function<void()> settle_;
  double wait_seconds_ = 0;
  int64_t started_sums_ = 0;
};

// Which host each rank of `world` runs on: hosts numbered in the order of their lowest rank, a
// host being a distinct host name (one per machine, or per emulated host of scripts/hosts.sh).
// Collective.
std::vector<int> host_indices(const comm::Communicator& world);
// Each host's leader (its lowest rank), by host index, from host_indices' result.
std::vector<int> host_leaders(const std::vector<int>& hosts);

class ParallelState {
 public:
  // Collective over `world`: every rank calls it with the same (validated) plan. `lease`, when
  // set, is this rank's core lease (runtime/core_lease.h), given back inside TP collectives.
  ParallelState(const plan::Plan& plan, const model::ModelConfig& model, comm::Communicator world,
                CoreLease* lease = nullptr);

  const plan::Plan& plan() const { return plan_; }
  const layout::Layout& layout() const { return layout_; }
  const Role& role() const { return role_; }
  comm::Communicator& world() { return world_; }
  int rank() const { return world_.rank(); }

  // This rank's shard (nullopt when idle) and tensor-parallel group (null when idle or alone).
  const std::optional<model::ShardSpec>& shard() const {
    return layout_.shards[static_cast<size_t>(rank())];
  }
  MpiTensorParallelGroup* tensor_parallel() { return tp_.get(); }
  const plan::Pipeline& pipeline() const {
    return plan_.pipelines.at(static_cast<size_t>(role_.pipeline));
  }
  const plan::Stage& stage() const {
    return pipeline().stages.at(static_cast<size_t>(role_.stage));
  }
  int num_stages() const { return static_cast<int>(pipeline().stages.size()); }
  bool first_stage() const { return role_.stage == 0; }
  bool last_stage() const { return role_.stage + 1 == num_stages(); }
  // World ranks of the previous / next stage of this pipeline (empty at the ends).
  const std::vector<int>& previous_stage_ranks() const { return previous_; }
  const std::vector<int>& next_stage_ranks() const { return next_; }
  // Index in the global batch of this pipeline's first sequence: pipelines take consecutive
  // ranges of the batch in plan order.
  int first_sample() const { return first_sample_; }

  const layout::GradSyncPlan& grad_sync() const { return grad_sync_; }
  // The communicator of grad_sync().groups[group] (this rank must be a member).
  comm::Communicator& grad_sync_comm(size_t group) { return *group_comms_.at(group); }

 private:
  plan::Plan plan_;
  comm::Communicator world_;
  layout::Layout layout_;
  Role role_;
  std::unique_ptr<MpiTensorParallelGroup> tp_;
  std::vector<int> previous_, next_;
  int first_sample_ = 0;
  layout::GradSyncPlan grad_sync_;
  std::vector<std::optional<comm::Communicator>> group_comms_;
};

}  // namespace malleus::runtime
