// plan, simulate, the presets: what `malleus plan`, `malleus simulate` and `malleus clusters` do,
// with their --json output as dicts (the same keys, less the files the CLI writes).
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "convert.h"
#include "plan/planner.h"
#include "replan/replan.h"
#include "sim/scenario.h"
#include "sim/simulator.h"

namespace malleus::python {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The cost model of the command line's --cluster, --model, --nodes, --link-rates, --global-batch,
// --micro-batch, --seq-len and --profile.
struct Setup {
  py::object cluster, model, link_rates, profile;
  int nodes = 0, global_batch = 64, micro_batch = 1, seq_len = 0;

  plan::CostModel cost_model() const {
    plan::ClusterSpec c = cluster_spec(cluster);
    check(nodes >= 0, "nodes must be positive, got " + std::to_string(nodes));
    if (nodes > 0) c.nodes = nodes;
    if (!link_rates.is_none()) {
      c.link_rates = rates(link_rates, c.nodes, "link_rates");
      c.validate("link_rates");
    }
    const model::ModelConfig m = model_config(model);
    check(seq_len >= 0, "seq_len must be positive, got " + std::to_string(seq_len));
    plan::BatchConfig batch{global_batch, micro_batch, seq_len > 0 ? seq_len : m.max_seq_len};
    batch.validate("arguments");
    return plan::CostModel(m, c, batch, python::profile(profile));
  }
};

double max_memory(const std::vector<double>& memory) {
  return memory.empty() ? 0.0 : *std::max_element(memory.begin(), memory.end());
}

// Infinite times (a gone device) cross as float('inf'), not as JSON's null.
py::object seconds(double s) {
  return py::float_(s);
}

py::dict plan_command(const Setup& setup, const py::object& rates_arg, const std::string& strategy,
                      const std::string& base, const py::object& current) {
  const plan::CostModel cost = setup.cost_model();
  const int n = cost.cluster().num_devices();
  plan::PlanRequest req;
  req.rates = rates(rates_arg, n, "rates");
  req.base = base.empty() ? plan::Shape{} : plan::Shape::parse(base);
  if (!current.is_none()) req.current = plan_of(current, cost.model());
  plan::PlannerOptions options = replan::with_migration_tie_break({}, cost);
  options.refine = sim::simulator_evaluator(cost);
  const plan::PlanResult r = plan::make_strategy(strategy, options)->plan(cost, req);
  const sim::SimResult simulated = sim::simulate(cost, r.plan, req.rates);
  py::dict d;
  d["strategy"] = r.strategy;
  d["summary"] = r.plan.summary();
  d["predicted_iteration_s"] = seconds(r.prediction.iteration_time);
  d["simulated_iteration_s"] = seconds(simulated.iteration_time);
  d["samples_per_s"] = cost.batch().global_batch / simulated.iteration_time;
  d["grad_sync_s"] = r.prediction.grad_sync_time;
  d["optimizer_s"] = r.prediction.optimizer_time;
  d["planning_s"] = r.planning_seconds;
  d["max_memory_gib"] = max_memory(r.prediction.memory_bytes) / kGiB;
  d["fits"] = r.prediction.fits;
  d["restart"] = r.restart;
  d["note"] = r.note;
  d["plan"] = py::cast(r.plan);
  return d;
}

py::dict simulate_command(const Setup& setup, const py::object& plan_arg,
                          const py::object& rates_arg) {
  const plan::CostModel cost = setup.cost_model();
  const int n = cost.cluster().num_devices();
  const plan::Rates rates = python::rates(rates_arg, n, "rates");
  const plan::Plan p = plan_of(plan_arg, cost.model());
  check(p.world_size <= n, "plan: the plan is for " + std::to_string(p.world_size) +
                               " devices, the cluster has " + std::to_string(n));
  check(p.global_batch() == cost.batch().global_batch,
        "plan: the plan's global batch is " + std::to_string(p.global_batch()) +
            ", global_batch is " + std::to_string(cost.batch().global_batch));
  // The plan as written, recomputation included, as `malleus simulate --plan`.
  const sim::SimResult r = sim::simulate(cost, p, rates, /*choose_recompute=*/false);
  const plan::Prediction pred = cost.predict(p, rates, /*choose_recompute=*/false);
  py::list devices;
  for (size_t i = 0; i < r.devices.size(); ++i) {
    const auto& dev = r.devices[i];
    py::dict x;
    x["device"] = i;
    x["used"] = dev.used;
    x["busy_s"] = dev.busy_s;
    x["idle_s"] = dev.idle_s;
    x["utilisation"] = dev.used && r.iteration_time > 0 && std::isfinite(r.iteration_time)
                           ? dev.busy_s / r.iteration_time
                           : 0.0;
    x["memory_gib"] = dev.memory_bytes / kGiB;
    x["peak_in_flight"] = dev.peak_in_flight;
    devices.append(x);
  }
  py::dict d;
  d["simulated_iteration_s"] = seconds(r.iteration_time);
  d["predicted_iteration_s"] = seconds(pred.iteration_time);
  d["samples_per_s"] =
      std::isfinite(r.iteration_time) ? cost.batch().global_batch / r.iteration_time : 0.0;
  d["pipeline_s"] = r.pipeline_times;
  d["grad_sync_s"] = r.grad_sync_time;
  d["optimizer_s"] = r.optimizer_time;
  d["mean_utilisation"] = r.mean_utilisation();
  d["fits"] = r.fits;
  d["problem"] = r.problem;
  d["devices"] = devices;
  return d;
}

py::object scenario_command(const py::object& scenario) {
  sim::Scenario sc;
  if (py::isinstance<py::str>(scenario)) {
    sc = sim::load_scenario(py::cast<std::string>(scenario));
  } else {
    sc = sim::Scenario::from_json(to_json(scenario, "scenario"), "scenario dict");
  }
  return from_json(sim::result_to_json(sim::run_scenario(sc)));
}

}  // namespace

void bind_planning(py::module_& m) {
  m.def("model_presets", &model::model_preset_names, "Names of the built-in model configs.");
  m.def("cluster_presets", &plan::cluster_preset_names, "Names of the built-in cluster specs.");
  m.def("strategies", &plan::strategy_names,
        "The planners `plan` and the simulator hold side by side (`plan` also takes "
        "\"data-parallel\").");
  m.def(
      "model_config",
      [](const py::object& model) { return from_json(model_config(model).to_json()); },
      py::arg("model"), "A model config (preset name, JSON file or dict), validated, as a dict.");
  m.def(
      "cluster",
      [](const py::object& cluster) { return from_json(cluster_spec(cluster).to_json()); },
      py::arg("cluster"), "A cluster spec (preset name, JSON file or dict), validated, as a dict.");
  m.def(
      "plan",
      [](const py::object& cluster, const py::object& model, const py::object& rates,
         const std::string& strategy, int global_batch, int micro_batch, int seq_len, int nodes,
         const std::string& base, const py::object& current, const py::object& link_rates,
         const py::object& profile) {
        const Setup setup{cluster, model,        link_rates,  profile,
                          nodes,   global_batch, micro_batch, seq_len};
        return plan_command(setup, rates, strategy, base, current);
      },
      py::arg("cluster"), py::arg("model"), py::arg("rates") = py::none(),
      py::arg("strategy") = "malleus", py::arg("global_batch") = 64, py::arg("micro_batch") = 1,
      py::arg("seq_len") = 0, py::arg("nodes") = 0, py::arg("base") = "",
      py::arg("current") = py::none(), py::arg("link_rates") = py::none(),
      py::arg("profile") = py::none());
  m.def(
      "simulate",
      [](const py::object& cluster, const py::object& model, const py::object& plan,
         const py::object& rates, int global_batch, int micro_batch, int seq_len, int nodes,
         const py::object& link_rates, const py::object& profile) {
        const Setup setup{cluster, model,        link_rates,  profile,
                          nodes,   global_batch, micro_batch, seq_len};
        return simulate_command(setup, plan, rates);
      },
      py::arg("cluster"), py::arg("model"), py::arg("plan"), py::arg("rates") = py::none(),
      py::arg("global_batch") = 64, py::arg("micro_batch") = 1, py::arg("seq_len") = 0,
      py::arg("nodes") = 0, py::arg("link_rates") = py::none(), py::arg("profile") = py::none());
  m.def("simulate_scenario", &scenario_command, py::arg("scenario"),
        "A straggler scenario (file or dict) through every strategy, as `malleus simulate "
        "--scenario --json`.");
  m.def(
      "uniform_plan",
      [](const py::object& model, int dp, int tp, int pp, int global_batch, int micro_batch,
         int world_size) {
        const model::ModelConfig config = model_config(model);
        check(dp > 0 && tp > 0 && pp > 0, "uniform_plan: dp, tp and pp must be positive");
        check(global_batch > 0 && micro_batch > 0 && global_batch % micro_batch == 0,
              "uniform_plan: the global batch must be a positive multiple of the micro-batch");
        check(world_size >= 0,
              "uniform_plan: world_size must be 0 (dp × tp × pp ranks) or a "
              "count of ranks, got " +
                  std::to_string(world_size));
        plan::Plan p =
            plan::uniform_plan(config, dp, tp, pp, global_batch, micro_batch, world_size);
        plan::validate(p, config, "uniform_plan");
        return p;
      },
      py::arg("model"), py::arg("dp"), py::arg("tp"), py::arg("pp"), py::arg("global_batch"),
      py::arg("micro_batch") = 1, py::arg("world_size") = 0);
  m.def(
      "plan_summary",
      [](const py::object& plan, const py::object& model) {
        return plan_of(plan, model_config(model)).summary();
      },
      py::arg("plan"), py::arg("model"), "The plan's compact description, validated.");
  m.def(
      "training_flops",
      [](const py::object& model, int sequences, int seq_len) {
        const model::ModelConfig config = model_config(model);
        check(sequences > 0 && seq_len > 0 && seq_len <= config.max_seq_len,
              "training_flops: sequences must be positive and seq_len in [1, " +
                  std::to_string(config.max_seq_len) + "]");
        return plan::shard_training_flops(config, sequences, seq_len, config.num_layers, true);
      },
      py::arg("model"), py::arg("sequences"), py::arg("seq_len"),
      "Forward and backward FLOPs of one micro-batch through the whole model (the runtime's "
      "count).");
}

}  // namespace malleus::python
