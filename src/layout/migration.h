// The size of a live migration, read off the same redistribution plan the runtime executes
// (Engine::migrate), so the estimate the controller and the simulator weigh against a re-plan's
// gain is what the engine then sends.
#pragma once

#include <cstdint>
#include <vector>

#include "layout/grad_sync_plan.h"
#include "layout/redistribution.h"
#include "layout/staged_redistribution.h"
#include "model/config.h"
#include "plan/plan.h"

namespace malleus::layout {

// What a migration moves per parameter element: the parameter and AdamW's two moments, fp32 each.
// Gradients are not moved (the next step recomputes them).
inline constexpr int kMigratedBuffers = 3;
inline constexpr int64_t kMigratedBytesPerElement = kMigratedBuffers * int64_t{sizeof(float)};

struct MigrationVolume {
  std::vector<int64_t> received_bytes;  // per rank, from other ranks (local copies are free)
  int64_t total_bytes() const;
  int64_t max_received_bytes() const;
};

// The state a migration moves, as kinds of a staged redistribution: the parameters (kind 0) in
// each side's local layouts, and both Adam moments (kind 1) in each rank's optimizer shard on a
// side whose moments are split (its plan_grad_sync given), else whole in its local layouts.
std::vector<StateKind> migrated_state(const model::ModelConfig& model, const Layout& from,
                                      const GradSyncPlan* from_sync, const Layout& to,
                                      const GradSyncPlan* to_sync);

// Moments whole on both sides: the plan's transfers, every buffer along.
MigrationVolume migration_volume(const RedistributionPlan& plan);
// Switching a model's state from one plan to another (both of the same world size), with the
// distributed optimizer asked for or not (splits_moments decides each side): what the staged
// redistribution the engine runs sends (moments that split differently travel even between
// holders of the same parameters).
MigrationVolume migration_volume(const model::ModelConfig& model, const plan::Plan& from,
                                 const plan::Plan& to, bool distributed_optimizer);

}  // namespace malleus::layout
