// The straggler loop: the one object every training engine runs between its steps — the C++
// trainer (src/train), and through the Python binding malleus.torch's data parallelism and its
// pipelines. It owns the running plan, the monitor, the link monitor and the controller, so the
// protocol is written here once: each step it takes one observation (every rank's compute time;
// on several hosts the link probes), rates every rank against its own healthy speed in the
// geometry the running plan gives it, asks the controller when the rates moved (collectively),
// checks the plan it switches to, adopts it, and returns the decision: a switch or nothing.
//
// A plan may be anything the planner's strategies make: several stages per pipeline, unlike
// pipelines (layers per stage, micro-batches per pipeline), tensor-parallel shares, idle ranks.
// The FLOPs a rank's time is divided by and the geometry it is rated in come from the running
// plan (plan::work_flops, work_geometries), unless the caller measured other FLOPs.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "elastic/controller.h"
#include "elastic/monitor.h"
#include "plan/cost_model.h"
#include "plan/plan.h"

namespace malleus::elastic {

struct LoopOptions {
  MonitorOptions monitor = {};
  ControllerOptions controller = {};
  bool replan = true;      // false (and on one rank): rates measured, the controller never asked
  bool plan_links = true;  // false: links measured and logged, planned for as healthy
  // The cluster node of every rank when the ranks span several hosts: the links between them are
  // monitored, against the cost model's healthy probe time. Empty: one host, no link monitor.
  std::vector<int> node_of_rank = {};
};

// One step's figures, the same on every rank (each rank's own, gathered).
struct Observation {
  int64_t step = 0;                  // updates made, this step's included
  int64_t remaining_steps = 0;       // steps left in the run (the horizon is at most this)
  std::vector<double> seconds = {};  // every rank's compute time of its work this step (no waits)
  std::vector<double> flops = {};    // that work's FLOPs; empty: the running plan's (work_flops())
  // Every rank's (seconds, bytes) of its link probe (0, 0: none); empty without a link monitor.
  std::vector<double> link_measurements = {};
};

class StragglerLoop {
 public:
  // `cost`: the job's cluster (one device per rank), model and batch; `running`: the plan the job
  // starts with (validated against them).
  StragglerLoop(plan::CostModel cost, plan::Plan running, LoopOptions options = {});

  // One step. Every rank calls it with the same observation; collective over `transport` when
  // the controller is asked. Returns nothing when it was not asked, else its decision; when that
  // switches (decision.plan), the loop runs the new plan from here on (plan(), work_flops(),
  // geometries()), and the caller moves its state to it and tells note_migration_seconds what the
  // move took.
  std::optional<Decision> observe(const Observation& observation, const Transport& transport);
  // The wall time of the switch just made: the controller's switch cost is at least this.
  void note_migration_seconds(double seconds);
  // Runs `plan` from the next step on, imposed by the caller (validated as the start plan); the
  // monitor counts its steps from here, as after a switch.
  void set_plan(plan::Plan plan);

  const plan::Plan& plan() const { return plan_; }
  const plan::CostModel& cost() const { return cost_; }
  int world_size() const { return plan_.world_size; }
  const std::vector<double>& rates() const { return monitor_.rates(); }
  const std::vector<double>& step_rates() const { return monitor_.step_rates(); }
  // Every node's link rate; empty without a link monitor.
  const std::vector<double>& link_rates() const;
  bool monitors_links() const { return links_ != nullptr; }
  // Steps observed since the last switch (or the start).
  int monitored_steps() const { return monitor_.samples(); }
  // Every rank's work under the running plan: its geometry ("probe" when idle) and FLOPs per step.
  const std::vector<std::string>& geometries() const { return geometries_; }
  const std::vector<double>& work_flops() const { return work_flops_; }
  bool replans() const { return controller_ != nullptr; }
  bool holding() const { return controller_ && controller_->holding(); }
  // The controller, for what its record shows (nullptr when it is never asked).
  const Controller* controller() const { return controller_.get(); }

 private:
  void run(plan::Plan plan);

  plan::CostModel cost_;
  LoopOptions options_;
  plan::Plan plan_;
  Monitor monitor_;
  std::unique_ptr<LinkMonitor> links_;
  std::unique_ptr<Controller> controller_;
  std::vector<std::string> geometries_;
  std::vector<double> work_flops_;
};

}  // namespace malleus::elastic
