#include "layout/migration.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>

#include "layout/optimizer_shard.h"

namespace malleus::layout {

int64_t MigrationVolume::total_bytes() const {
  return std::accumulate(received_bytes.begin(), received_bytes.end(), int64_t{0});
}

int64_t MigrationVolume::max_received_bytes() const {
  return received_bytes.empty() ? 0
                                : *std::max_element(received_bytes.begin(), received_bytes.end());
}

MigrationVolume migration_volume(const RedistributionPlan& plan) {
  MigrationVolume volume;
  volume.received_bytes.assign(static_cast<size_t>(plan.world_size), 0);
  for (const Transfer& t : plan.transfers) {
    volume.received_bytes[static_cast<size_t>(t.destination)] +=
        t.elements * kMigratedBytesPerElement;
  }
  return volume;
}

namespace {

// Elements of the full tensor that blocks `a` and `b` (of the same tensor) both hold.
int64_t shared_elements(const model::ParameterLayout& full, const Block& a, const Block& b) {
  const int64_t rows = std::min(a.row_end, b.row_end) - std::max(a.row_begin, b.row_begin);
  if (rows <= 0) return 0;
  const model::TensorSpec& spec = full.tensor(a.tensor);
  if (spec.shard_axis == model::ShardAxis::kColumns) {
    const int64_t columns =
        std::min(a.axis_end(), b.axis_end()) - std::max(a.axis_begin(), b.axis_begin());
    return std::max<int64_t>(0, columns) * rows;
  }
  return rows * (spec.full_shape.size() > 1 ? spec.full_shape[1] : 1);
}

}  // namespace

std::vector<StateKind> migrated_state(const model::ModelConfig& model, const Layout& from,
                                      const GradSyncPlan* from_sync, const Layout& to,
                                      const GradSyncPlan* to_sync) {
  std::vector<StateKind> kinds(2);
  kinds[0].buffers = 1;
  kinds[0].from = layout_blocks(model, from);
  kinds[0].to = layout_blocks(model, to);
  kinds[1].buffers = kMigratedBuffers - 1;
  kinds[1].from = from_sync ? moment_blocks(model, from, from_sync) : kinds[0].from;
  kinds[1].to = to_sync ? moment_blocks(model, to, to_sync) : kinds[0].to;
  for (StateKind& kind : kinds) kind.element_bytes = sizeof(float);
  return kinds;
}

MigrationVolume migration_volume(const model::ModelConfig& model, const plan::Plan& from,
                                 const plan::Plan& to, bool distributed_optimizer) {
  const Layout before = plan_layout(from, model), after = plan_layout(to, model);
  const RedistributionPlan plan = plan_redistribution(model, before, after);
  const bool split_before = splits_moments(from, distributed_optimizer),
             split_after = splits_moments(to, distributed_optimizer);
  if (!split_before && !split_after) return migration_volume(plan);
  std::optional<GradSyncPlan> sync_before, sync_after;
  if (split_before) sync_before = plan_grad_sync(model, before);
  if (split_after) sync_after = plan_grad_sync(model, after);
  const std::vector<StateKind> kinds =
      migrated_state(model, before, sync_before ? &*sync_before : nullptr, after,
                     sync_after ? &*sync_after : nullptr);
  // What the staged redistribution sends, without staging it (which costs far more than this
  // count, and the planner asks for it per candidate): the parameters as the plan's transfers;
  // of the moments, a new holder receives every element of its blocks that its own old blocks do
  // not hold (those it copies locally), each once.
  MigrationVolume volume;
  volume.received_bytes.assign(static_cast<size_t>(plan.world_size), 0);
  for (const Transfer& t : plan.transfers) {
    volume.received_bytes[static_cast<size_t>(t.destination)] += t.elements * kinds[0].unit();
  }
  const model::ParameterLayout full(model);
  for (size_t r = 0; r < volume.received_bytes.size(); ++r) {
    std::multimap<int, const Block*> held;  // by tensor
    for (const Block& b : kinds[1].from[r]) held.emplace(b.tensor, &b);
    int64_t lacking = 0;
    for (const Block& b : kinds[1].to[r]) {
      lacking += shared_elements(full, b, b);
      const auto [first, last] = held.equal_range(b.tensor);
      for (auto it = first; it != last; ++it) lacking -= shared_elements(full, b, *it->second);
    }
    volume.received_bytes[r] += lacking * kinds[1].unit();
  }
  return volume;
}

}  // namespace malleus::layout
