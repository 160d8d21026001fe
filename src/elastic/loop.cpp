#include "elastic/loop.h"

#include <string>
#include <utility>

#include "common/error.h"
#include "layout/layout.h"

namespace malleus::elastic {

namespace {

std::string ranks_text(size_t n) {
  return std::to_string(n) + (n == 1 ? " rank" : " ranks");
}

}  // namespace

StragglerLoop::StragglerLoop(plan::CostModel cost, plan::Plan running, LoopOptions options)
    : cost_(std::move(cost)),
      options_(std::move(options)),
      monitor_(running.world_size, options_.monitor) {
  const int world = cost_.cluster().num_devices();
  plan::validate(running, cost_.model(), world, cost_.batch().global_batch, "straggler loop");
  if (!options_.node_of_rank.empty()) {
    check(static_cast<int>(options_.node_of_rank.size()) == world,
          "straggler loop: a node for each of the " + ranks_text(size_t(world)) + ", got " +
              std::to_string(options_.node_of_rank.size()));
    links_ = std::make_unique<LinkMonitor>(options_.node_of_rank, options_.monitor,
                                           cost_.link_probe_seconds_per_byte());
  }
  if (options_.replan && world > 1) {
    controller_ = std::make_unique<Controller>(cost_, options_.controller);
  }
  run(std::move(running));
}

void StragglerLoop::run(plan::Plan plan) {
  plan_ = std::move(plan);
  geometries_ = work_geometries(layout::plan_layout(plan_, cost_.model()));
  work_flops_ = plan::work_flops(plan_, cost_.model(), cost_.batch().seq_len);
}

const std::vector<double>& StragglerLoop::link_rates() const {
  static const std::vector<double> none;
  return links_ ? links_->node_rates() : none;
}

std::optional<Decision> StragglerLoop::observe(const Observation& o, const Transport& transport) {
  const size_t world = static_cast<size_t>(world_size());
  check(o.seconds.size() == world, "straggler loop: a compute time for each of the " +
                                       ranks_text(world) + ", got " +
                                       std::to_string(o.seconds.size()));
  check(o.flops.empty() || o.flops.size() == world,
        "straggler loop: a FLOP count for each of the " + ranks_text(world) + ", got " +
            std::to_string(o.flops.size()));
  const std::vector<double>& flops = o.flops.empty() ? work_flops_ : o.flops;
  std::vector<double> measurements;
  measurements.reserve(2 * world);
  for (size_t r = 0; r < world; ++r) {  // the monitor checks the values
    measurements.push_back(o.seconds[r]);
    measurements.push_back(flops[r]);
  }
  monitor_.observe(measurements, geometries_);
  if (links_ && !o.link_measurements.empty()) links_->observe(o.link_measurements);
  if (!controller_) return std::nullopt;

  const std::vector<double> no_links;
  std::optional<Decision> decision =
      controller_->decide({.current = plan_,
                           .rates = monitor_.rates(),
                           .step_rates = monitor_.step_rates(),
                           .link_rates = options_.plan_links ? link_rates() : no_links,
                           .monitored_steps = monitor_.samples(),
                           .step = o.step,
                           .remaining_steps = o.remaining_steps},
                          transport);
  if (decision && decision->plan) {
    plan::validate(*decision->plan, cost_.model(), static_cast<int>(world),
                   cost_.batch().global_batch, "re-plan");
    run(*decision->plan);
    monitor_.note_replan();
  }
  return decision;
}

void StragglerLoop::set_plan(plan::Plan plan) {
  plan::validate(plan, cost_.model(), world_size(), cost_.batch().global_batch, "plan");
  run(std::move(plan));
  monitor_.note_replan();
}

void StragglerLoop::note_migration_seconds(double seconds) {
  if (controller_) controller_->note_migration_seconds(seconds);
}

}  // namespace malleus::elastic
