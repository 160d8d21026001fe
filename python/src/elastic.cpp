// The straggler loop's pieces: the rate monitor and the controller's decision, the very classes
// the C++ trainer uses (elastic/monitor.h, elastic/controller.h).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <limits>

#include "common/error.h"
#include "convert.h"
#include "elastic/controller.h"
#include "elastic/monitor.h"

namespace malleus::python {

namespace {

py::dict decision_dict(const elastic::Decision& d) {
  py::dict x;
  x["asked"] = d.asked;
  x["take"] = d.plan.has_value();
  x["plan"] = d.plan ? from_json(d.plan->to_json()) : py::none();
  x["step"] = d.step;
  x["rates"] = d.rates;
  x["link_rates"] = d.link_rates;
  x["old_plan"] = d.old_plan;
  x["new_plan"] = d.new_plan;
  x["current_step_s"] = d.question.current_step_s;
  x["proposed_step_s"] = d.question.proposed_step_s;
  x["switch_s"] = d.question.switch_s;
  x["horizon_steps"] = d.question.horizon_steps;
  x["same_plan"] = d.question.same_plan;
  x["gain_s"] = d.verdict.gain_s;
  x["reason"] = d.verdict.reason;
  x["planning_s"] = d.planning_s;
  x["incremental"] = d.incremental;
  x["held"] = d.held;
  return x;
}

// One per rank's (seconds, FLOPs): the monitor's flat form.
std::vector<double> measurements(const std::vector<double>& seconds,
                                 const std::vector<double>& flops) {
  check(seconds.size() == flops.size(), "monitor: " + std::to_string(seconds.size()) +
                                            " times but " + std::to_string(flops.size()) +
                                            " FLOP counts");
  std::vector<double> m;
  for (size_t r = 0; r < seconds.size(); ++r) {
    check(seconds[r] >= 0 && flops[r] >= 0,
          "monitor: rank " + std::to_string(r) + "'s time and FLOPs must not be negative");
    m.push_back(seconds[r]);
    m.push_back(flops[r]);
  }
  return m;
}

void check_rates(const std::vector<double>& rates, int world) {
  check(static_cast<int>(rates.size()) == world, "controller: expected a rate for each of the " +
                                                     std::to_string(world) + " ranks, got " +
                                                     std::to_string(rates.size()));
  for (size_t r = 0; r < rates.size(); ++r) {
    check(rates[r] > 0, "controller: rank " + std::to_string(r) + "'s rate must be positive");
  }
}

// A Controller with what it was built from, to parse plans and check arguments.
struct PyController {
  model::ModelConfig model;
  int world_size = 0;
  elastic::Controller controller;
};

PyController make_controller(const py::object& model, const py::object& cluster, int world_size,
                             int global_batch, int micro_batch, int seq_len,
                             const std::string& strategy, double straggler_threshold,
                             double hysteresis, int horizon_steps, int min_samples,
                             bool distributed_optimizer, const py::object& profile) {
  check(world_size > 0,
        "controller: world_size must be positive, got " + std::to_string(world_size));
  const model::ModelConfig config = model_config(model);
  plan::ClusterSpec spec;
  if (py::isinstance<py::str>(cluster)) {
    spec = elastic::local_cluster(py::cast<std::string>(cluster), world_size);
  } else {
    spec = cluster_spec(cluster);
    check(spec.num_devices() == world_size,
          "controller: the cluster has " + std::to_string(spec.num_devices()) +
              " devices, world_size is " + std::to_string(world_size));
  }
  check(seq_len >= 0, "controller: seq_len must be positive");
  plan::BatchConfig batch{global_batch, micro_batch, seq_len > 0 ? seq_len : config.max_seq_len};
  batch.validate("controller");
  check(straggler_threshold >= 1, "controller: straggler_threshold must be >= 1");
  check(hysteresis > 0, "controller: hysteresis must be positive");
  check(horizon_steps > 0 && min_samples > 0,
        "controller: horizon_steps and min_samples must be positive");
  plan::make_strategy(strategy);  // names the strategies when it is not one
  plan::CostModel cost(config, spec, batch, python::profile(profile));
  cost.use_distributed_optimizer(distributed_optimizer);
  elastic::ControllerOptions options;
  options.straggler_threshold = straggler_threshold;
  options.hysteresis = hysteresis;
  options.horizon_steps = horizon_steps;
  options.min_samples = min_samples;
  options.strategy = strategy;
  return PyController{config, world_size, elastic::Controller(std::move(cost), options)};
}

// The caller's broadcast (rank 0's text in, the same text out on every rank), checked: it must
// return a str; on rank 0, the text it was given; elsewhere, a decision as rank 0 writes it ('0'
// or '1', then nothing or a plan's JSON). A transport that breaks this would otherwise leave
// ranks on different plans, or fail with a parser's message. None: no broadcast (one process).
elastic::Controller::BroadcastText checked_broadcast(const py::object& broadcast, bool root) {
  if (broadcast.is_none()) return nullptr;
  check(PyCallable_Check(broadcast.ptr()) != 0,
        "controller: broadcast must be a function (rank 0's text in, the same text out), got " +
            py::cast<std::string>(py::repr(broadcast)));
  return [broadcast, root](const std::string& sent) {
    const py::object got = broadcast(sent);
    check(py::isinstance<py::str>(got),
          "controller: broadcast must return a str (rank 0's text), got " +
              py::cast<std::string>(py::repr(got)).substr(0, 100));
    std::string text = py::cast<std::string>(got);
    if (root) {
      check(text == sent,
            "controller: on rank 0 the broadcast must return the text it was given, got " +
                py::cast<std::string>(py::repr(got)).substr(0, 100));
      return text;
    }
    const bool decision = !text.empty() && (text[0] == '0' || text[0] == '1');
    bool plan = text.size() <= 1;
    if (decision && !plan) plan = Json::accept(text.substr(1));
    check(decision && plan,
          "controller: the broadcast brought text that is not rank 0's "
          "decision ('0' or '1', then a plan's JSON): " +
              py::cast<std::string>(py::repr(got)).substr(0, 100));
    return text;
  };
}

}  // namespace

void bind_elastic(py::module_& m) {
  py::class_<elastic::Monitor>(m, "Monitor",
                               "Per-rank straggle rates against each rank's own healthy speed "
                               "(elastic/monitor.h).")
      .def(py::init([](int world_size, int window, int block, double calibration_tolerance) {
             return elastic::Monitor(world_size,
                                     elastic::MonitorOptions{window, block, calibration_tolerance});
           }),
           py::arg("world_size"), py::arg("window") = 3, py::arg("block") = 8,
           py::arg("calibration_tolerance") = 1.2)
      .def(
          "observe",
          [](elastic::Monitor& self, const std::vector<double>& seconds,
             const std::vector<double>& flops, const std::vector<std::string>& geometries) {
            return self.observe(measurements(seconds, flops), geometries);
          },
          py::arg("seconds"), py::arg("flops"), py::arg("geometries"),
          "Adds one step: every rank's compute seconds, the FLOPs of its work and the geometry of "
          "that work. Returns the rates.")
      .def_property_readonly("rates", &elastic::Monitor::rates)
      .def_property_readonly("step_rates", &elastic::Monitor::step_rates,
                             "The last step's rates alone, unsmoothed.")
      .def_property_readonly("samples", &elastic::Monitor::samples)
      .def("note_replan", &elastic::Monitor::note_replan)
      .def(
          "reference",
          [](const elastic::Monitor& self, int rank, int world) {
            check(rank >= 0 && rank < world, "monitor: no rank " + std::to_string(rank));
            return self.reference(rank);
          },
          py::arg("rank"), py::arg("world_size"));

  py::class_<PyController>(m, "Controller",
                           "When the rates moved: a plan for them, switched to only when the "
                           "shared switch rule says it pays (elastic/controller.h).")
      .def(py::init(&make_controller), py::arg("model"), py::arg("cluster") = "cpu-local",
           py::arg("world_size"), py::arg("global_batch"), py::arg("micro_batch") = 1,
           py::arg("seq_len") = 0, py::arg("strategy") = "malleus",
           py::arg("straggler_threshold") = 1.2, py::arg("hysteresis") = 0.3,
           py::arg("horizon_steps") = 50, py::arg("min_samples") = 3,
           py::arg("distributed_optimizer") = true, py::arg("profile") = py::none())
      .def(
          "decide",
          [](PyController& self, const py::object& current, const std::vector<double>& rates,
             int monitored_steps, int64_t step, int64_t remaining_steps, bool root,
             const py::object& broadcast) {
            check_rates(rates, self.world_size);
            const plan::Plan plan = plan_of(current, self.model);
            elastic::Controller::BroadcastText transport = checked_broadcast(broadcast, root);
            if (!transport) {
              check(root, "controller: a rank other than 0 needs a broadcast");
              transport = [](const std::string& text) { return text; };
            }
            return decision_dict(self.controller.decide(root, transport, plan, rates,
                                                        monitored_steps, step, remaining_steps));
          },
          py::arg("current"), py::arg("rates"), py::arg("monitored_steps"), py::arg("step"),
          py::arg("remaining_steps"), py::arg("root") = true, py::arg("broadcast") = py::none(),
          "Collective over `broadcast` (rank 0's plan text in, on every rank out; None: one "
          "process): asks the planner when the rates moved, switches when the rule says so.")
      .def(
          "note_step_rates",
          [](PyController& self, const std::vector<double>& rates) {
            check_rates(rates, self.world_size);
            self.controller.note_step_rates(rates);
          },
          py::arg("rates"),
          "The rates of the step just run, unsmoothed (Monitor.step_rates): what the "
          "controller counts its switches' realised gains with. Call before decide().")
      .def_property_readonly("holding",
                             [](const PyController& self) { return self.controller.holding(); })
      .def(
          "propose",
          [](const PyController& self, const py::object& current, const std::vector<double>& rates,
             int64_t step, int64_t remaining_steps) {
            check_rates(rates, self.world_size);
            return decision_dict(self.controller.propose(plan_of(current, self.model), rates, step,
                                                         remaining_steps));
          },
          py::arg("current"), py::arg("rates"), py::arg("step") = 0,
          py::arg("remaining_steps") = 50,
          "What rank 0 decides for these rates, whether or not they moved.");
}

}  // namespace malleus::python
