// The size of a live migration, read off the same redistribution plan the runtime executes
// (Engine::migrate), so the estimate the controller and the simulator weigh against a re-plan's
// gain is what the engine then sends.
#pragma once

#include <cstdint>
#include <vector>

#include "layout/redistribution.h"
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

MigrationVolume migration_volume(const RedistributionPlan& plan);
// Switching a model's state from one plan to another (both of the same world size).
MigrationVolume migration_volume(const model::ModelConfig& model, const plan::Plan& from,
                                 const plan::Plan& to);

}  // namespace malleus::layout
