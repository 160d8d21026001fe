#include "replan/replan.h"

#include <cmath>
#include <limits>

#include "layout/migration.h"

namespace malleus::replan {

MigrationEstimate estimate_migration(const plan::CostModel& cost, const plan::Plan& from,
                                     const plan::Plan& to) {
  const layout::MigrationVolume volume =
      layout::migration_volume(cost.model(), from, to, cost.distributed_optimizer());
  MigrationEstimate estimate;
  estimate.total_bytes = volume.total_bytes();
  estimate.max_rank_bytes = volume.max_received_bytes();
  // Conservative: as if every byte crossed nodes, although senders on the receiver's node are
  // preferred.
  estimate.seconds =
      static_cast<double>(estimate.max_rank_bytes) / cost.cluster().inter_node_bandwidth;
  return estimate;
}

plan::PlannerOptions with_migration_tie_break(plan::PlannerOptions options,
                                              const plan::CostModel& cost) {
  options.migration = [model = cost.model(), split = cost.distributed_optimizer()](
                          const plan::Plan& from, const plan::Plan& to) {
    return static_cast<double>(layout::migration_volume(model, from, to, split).total_bytes());
  };
  return options;
}

SwitchVerdict weigh_switch(const SwitchQuestion& q) {
  SwitchVerdict v;
  v.gain_s = std::isfinite(q.current_step_s)
                 ? (q.current_step_s - q.proposed_step_s) * q.horizon_steps
                 : std::numeric_limits<double>::infinity();
  if (q.same_plan) {
    v.reason = "the current plan is still the best";
  } else if (!(v.gain_s > q.switch_s)) {
    v.reason = "predicted gain over the horizon does not pay for the migration";
  } else {
    v.take = true;
  }
  return v;
}

}  // namespace malleus::replan
