#include "layout/migration.h"

#include <algorithm>
#include <numeric>

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

MigrationVolume migration_volume(const model::ModelConfig& model, const plan::Plan& from,
                                 const plan::Plan& to) {
  return migration_volume(
      plan_redistribution(model, plan_layout(from, model), plan_layout(to, model)));
}

}  // namespace malleus::layout
