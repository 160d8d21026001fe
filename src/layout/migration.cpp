#include "layout/migration.h"

#include <algorithm>
#include <limits>
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
  // One band per stretch of rows: the bytes do not depend on the bucket.
  const StagedRedistribution staged =
      stage_redistribution(model, plan,
                           migrated_state(model, before, sync_before ? &*sync_before : nullptr,
                                          after, sync_after ? &*sync_after : nullptr),
                           std::numeric_limits<int64_t>::max() / 2);
  MigrationVolume volume;
  volume.received_bytes = staged.received_bytes;
  return volume;
}

}  // namespace malleus::layout
