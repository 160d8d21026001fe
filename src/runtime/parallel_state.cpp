#include "runtime/parallel_state.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <map>

#include "common/error.h"

namespace malleus::runtime {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

void MpiTensorParallelGroup::all_reduce_sum(float* data, size_t count) {
  settle();
  const auto start = Clock::now();
  runtime::all_reduce_sum(comm_, data, count, lease_);
  wait_seconds_ += seconds_since(start);
}

namespace {

// A started MPI_Iallreduce of the group; waiting adds to the group's time inside collectives.
class PendingMpiSum final : public model::TensorParallelGroup<float>::Pending {
 public:
  PendingMpiSum(comm::Request request, CoreLease* lease, double* wait_seconds,
                std::function<void()> settle)
      : request_(std::move(request)),
        lease_(lease),
        wait_seconds_(wait_seconds),
        settle_(std::move(settle)) {}
  ~PendingMpiSum() override {
    if (request_.pending()) wait();
  }
  void wait() override {
    if (settle_) settle_();
    const auto start = Clock::now();
    runtime::wait(request_, lease_);
    *wait_seconds_ += seconds_since(start);
  }

 private:
  comm::Request request_;
  CoreLease* lease_;
  double* wait_seconds_;
  std::function<void()> settle_;
};

}  // namespace

std::unique_ptr<model::TensorParallelGroup<float>::Pending>
MpiTensorParallelGroup::start_all_reduce_sum(float* data, size_t count) {
  if (count > static_cast<size_t>(INT_MAX)) {
    all_reduce_sum(data, count);
    return nullptr;
  }
  settle();
  const auto start = Clock::now();
  comm::Request request = comm_.iall_reduce_sum(data, count);
  wait_seconds_ += seconds_since(start);
  ++started_sums_;
  return std::make_unique<PendingMpiSum>(std::move(request), lease_, &wait_seconds_, settle_);
}

void MpiTensorParallelGroup::all_reduce_max(float* data, size_t count) {
  settle();
  const auto start = Clock::now();
  runtime::all_reduce_max(comm_, data, count, lease_);
  wait_seconds_ += seconds_since(start);
}

std::vector<int> host_indices(const comm::Communicator& world) {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  // Every rank's name in its own slot of one all-reduce (names are short; longer ones are cut,
  // which only matters for two hosts whose first 255 characters agree).
  constexpr size_t kWidth = 256;
  const size_t ranks = static_cast<size_t>(world.size());
  std::vector<double> all(kWidth * ranks, 0.0);
  for (size_t i = 0; i < kWidth && name[i] != 0; ++i) {
    all[kWidth * static_cast<size_t>(world.rank()) + i] = static_cast<unsigned char>(name[i]);
  }
  world.all_reduce_sum(all.data(), all.size());
  std::map<std::vector<double>, int> index;
  std::vector<int> hosts(ranks);
  for (size_t r = 0; r < ranks; ++r) {
    const std::vector<double> key(all.begin() + static_cast<long>(kWidth * r),
                                  all.begin() + static_cast<long>(kWidth * (r + 1)));
    hosts[r] = index.emplace(key, static_cast<int>(index.size())).first->second;
  }
  return hosts;
}

std::vector<int> host_leaders(const std::vector<int>& hosts) {
  std::vector<int> leaders;
  for (size_t r = 0; r < hosts.size(); ++r) {
    const auto host = static_cast<size_t>(hosts[r]);
    if (host >= leaders.size()) leaders.resize(host + 1, -1);
    if (leaders[host] < 0) leaders[host] = static_cast<int>(r);
  }
  return leaders;
}

ParallelState::ParallelState(const plan::Plan& plan, const model::ModelConfig& model,
                             comm::Communicator world, CoreLease* lease)
    : plan_(plan), world_(std::move(world)), layout_(layout::plan_layout(plan, model)) {
  check(plan.world_size == world_.size(), "the plan is for " + std::to_string(plan.world_size) +
                                              " ranks but " + std::to_string(world_.size()) +
                                              " are running");
  const int me = world_.rank();
  int samples = 0;
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    const auto& stages = plan.pipelines[p].stages;
    for (size_t s = 0; s < stages.size(); ++s) {
      const auto& ranks = stages[s].ranks;
      const auto it = std::find(ranks.begin(), ranks.end(), me);
      if (it == ranks.end()) continue;
      role_ = {static_cast<int>(p), static_cast<int>(s), static_cast<int>(it - ranks.begin())};
      first_sample_ = samples;
      if (s > 0) previous_ = stages[s - 1].ranks;
      if (s + 1 < stages.size()) next_ = stages[s + 1].ranks;
    }
    samples += plan.pipelines[p].micro_batches * plan.micro_batch_size;
  }

  // Communicators are created in one global order (TP groups in plan order, then gradient-sync
  // groups in their sorted order); each rank creates those it belongs to, so creation never
  // waits in a cycle.
  for (const auto& pipeline : plan.pipelines) {
    for (const auto& stage : pipeline.stages) {
      if (stage.tp() > 1 &&
          std::find(stage.ranks.begin(), stage.ranks.end(), me) != stage.ranks.end()) {
        tp_ = std::make_unique<MpiTensorParallelGroup>(world_.subgroup(stage.ranks), lease);
      }
    }
  }
  grad_sync_ = layout::plan_grad_sync(model, layout_);
  group_comms_.resize(grad_sync_.groups.size());
  for (size_t g = 0; g < grad_sync_.groups.size(); ++g) {
    const auto& ranks = grad_sync_.groups[g].ranks;
    if (std::find(ranks.begin(), ranks.end(), me) != ranks.end()) {
      group_comms_[g] = world_.subgroup(ranks);
    }
  }
}

}  // namespace malleus::runtime
