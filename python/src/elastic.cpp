// The straggler loop for Python: malleus.StragglerLoop is the C++ trainer's own loop object
// (elastic/loop.h: the monitor, the link monitor, the controller and the running plan), and
// malleus.Decision its decision, whose attributes are the keys of the one decision record
// (metrics/schema.h); malleus.Monitor is the rate monitor alone.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <tuple>

#include "common/error.h"
#include "convert.h"
#include "elastic/controller.h"
#include "elastic/loop.h"
#include "elastic/monitor.h"
#include "metrics/schema.h"
#include "plan/memory_model.h"

namespace malleus::python {

namespace {

// One per rank's (seconds, FLOPs): the monitor's flat form.
std::vector<double> measurements(const std::vector<double>& seconds,
                                 const std::vector<double>& flops) {
  check(seconds.size() == flops.size(), "monitor: " + std::to_string(seconds.size()) +
                                            " times but " + std::to_string(flops.size()) +
                                            " FLOP counts");
  std::vector<double> m;  // their values are the monitor's to check (elastic::Monitor::observe)
  for (size_t r = 0; r < seconds.size(); ++r) {
    m.push_back(seconds[r]);
    m.push_back(flops[r]);
  }
  return m;
}

// The decision record's field list (and `switched`, the record's event).
constexpr auto decision_fields() {
  return metrics::fields(static_cast<const metrics::ReplanRecord*>(nullptr));
}

py::dict decision_dict(const elastic::Decision& d) {
  py::dict x;
  x["switched"] = d.record.switched;
  std::apply([&](const auto&... f) { ((x[f.key] = py::cast(d.record.*(f.member))), ...); },
             decision_fields());
  x["plan"] = d.plan ? py::cast(*d.plan) : py::none();
  return x;
}

void bind_decision(py::module_& m) {
  py::class_<elastic::Decision> cls(
      m, "Decision",
      "One decision of the straggler loop's controller: `plan` is the plan switched to (None: "
      "kept), the rest the record of what was weighed and why (the metrics line's keys; str() "
      "is the log line). The same on every rank.");
  cls.def_property_readonly("switched",
                            [](const elastic::Decision& d) { return d.record.switched; });
  std::apply(
      [&](const auto&... f) {
        (cls.def_property_readonly(
             f.key, [member = f.member](const elastic::Decision& d) { return d.record.*member; }),
         ...);
      },
      decision_fields());
  cls.def_property_readonly("plan", [](const elastic::Decision& d) -> py::object {
    return d.plan ? py::cast(*d.plan) : py::none();
  });
  cls.def("to_dict", &decision_dict, "Every field by its key, and the plan (None when kept).");
  cls.def("__str__", [](const elastic::Decision& d) { return metrics::describe(d.record); });
  cls.def("__repr__", [](const elastic::Decision& d) {
    return "<malleus.Decision " + metrics::describe(d.record) + ">";
  });
  py::tuple keys(std::tuple_size_v<decltype(decision_fields())> + 2);
  size_t i = 0;
  keys[i++] = "switched";
  std::apply([&](const auto&... f) { ((keys[i++] = py::str(f.key)), ...); }, decision_fields());
  keys[i++] = "plan";
  cls.attr("fields") = keys;
}

// The loop with what it was built from.
struct PyLoop {
  model::ModelConfig model;
  int horizon_steps = 0;
  elastic::StragglerLoop loop;
};

struct LoopArgs {
  py::object plan, model, cluster, profile;
  int seq_len = 0;
  std::string strategy;
  bool replan = true;
  int monitor_window = 3, horizon_steps = 50;
  double straggler_threshold = 1.2, hysteresis = 0.3;
  bool distributed_optimizer = true, recompute = true;
  int max_tp = 0;  // widest TP group the planner forms (0: no limit)
};

PyLoop make_loop(const LoopArgs& a) {
  const model::ModelConfig config = model_config(a.model);
  const plan::Plan running = plan_of(a.plan, config);
  const int world = running.world_size;
  plan::ClusterSpec spec;
  if (py::isinstance<py::str>(a.cluster)) {
    spec = elastic::local_cluster(py::cast<std::string>(a.cluster), world);
  } else {
    spec = cluster_spec(a.cluster);
    check(spec.num_devices() == world,
          "straggler loop: the cluster has " + std::to_string(spec.num_devices()) +
              " devices, the plan " + std::to_string(world) + " ranks");
  }
  check(a.seq_len >= 0 && a.seq_len <= config.max_seq_len,
        "straggler loop: seq_len must be in [1, " + std::to_string(config.max_seq_len) +
            "] (0: the model's), got " + std::to_string(a.seq_len));
  const plan::BatchConfig batch{running.global_batch(), running.micro_batch_size,
                                a.seq_len > 0 ? a.seq_len : config.max_seq_len};
  check(a.straggler_threshold >= 1, "straggler loop: straggler_threshold must be >= 1");
  check(a.hysteresis > 0, "straggler loop: hysteresis must be positive");
  check(a.horizon_steps > 0 && a.monitor_window > 0,
        "straggler loop: horizon_steps and monitor_window must be positive");
  plan::make_strategy(a.strategy);  // names the strategies when it is not one
  plan::CostModel cost(config, spec, batch, python::profile(a.profile));
  cost.use_distributed_optimizer(a.distributed_optimizer);
  cost.allow_recompute(a.recompute);
  check(a.max_tp >= 0, "straggler loop: max_tp must not be negative (0: no limit), got " +
                           std::to_string(a.max_tp));
  cost.limit_tensor_parallel(a.max_tp);
  elastic::LoopOptions options;
  options.monitor.window = a.monitor_window;
  options.monitor.block = std::max(options.monitor.block, a.monitor_window);
  options.controller.straggler_threshold = a.straggler_threshold;
  options.controller.hysteresis = a.hysteresis;
  options.controller.horizon_steps = a.horizon_steps;
  options.controller.min_samples = a.monitor_window;
  options.controller.strategy = a.strategy;
  options.replan = a.replan;
  return PyLoop{config, a.horizon_steps,
                elastic::StragglerLoop(std::move(cost), running, std::move(options))};
}

// The caller's broadcast (rank 0's text in, the same text out on every rank), checked: it must
// return a str; on rank 0, the text it was given; elsewhere, a decision as rank 0 writes it ('0'
// or '1', then the record and plan as JSON). A transport that breaks this would otherwise leave
// ranks on different plans, or fail with a parser's message. None: no broadcast (one process).
std::function<std::string(const std::string&)> checked_broadcast(const py::object& broadcast,
                                                                 bool root) {
  if (broadcast.is_none()) return nullptr;
  check(PyCallable_Check(broadcast.ptr()) != 0,
        "straggler loop: broadcast must be a function (rank 0's text in, the same text out), got " +
            py::cast<std::string>(py::repr(broadcast)));
  return [broadcast, root](const std::string& sent) {
    const py::object got = broadcast(sent);
    check(py::isinstance<py::str>(got),
          "straggler loop: broadcast must return a str (rank 0's text), got " +
              py::cast<std::string>(py::repr(got)).substr(0, 100));
    std::string text = py::cast<std::string>(got);
    if (root) {
      check(text == sent,
            "straggler loop: on rank 0 the broadcast must return the text it was given, got " +
                py::cast<std::string>(py::repr(got)).substr(0, 100));
      return text;
    }
    const bool decision = !text.empty() && (text[0] == '0' || text[0] == '1');
    check(decision && Json::accept(text.substr(1)),
          "straggler loop: the broadcast brought text that is not rank 0's "
          "decision ('0' or '1', then its JSON): " +
              py::cast<std::string>(py::repr(got)).substr(0, 100));
    return text;
  };
}

std::optional<elastic::Decision> observe(PyLoop& self, int64_t step,
                                         const std::vector<double>& seconds,
                                         const std::optional<std::vector<double>>& flops,
                                         const std::optional<int64_t>& remaining, bool root,
                                         const py::object& broadcast) {
  check(step >= 0, "straggler loop: step must not be negative");
  check(!remaining || *remaining >= 0, "straggler loop: remaining_steps must not be negative");
  elastic::Transport transport{.root = root, .broadcast = checked_broadcast(broadcast, root)};
  if (!transport.broadcast) {
    check(root, "straggler loop: a rank other than 0 needs a broadcast");
    transport = elastic::Transport::alone();
  }
  return self.loop.observe({.step = step,
                            .remaining_steps = remaining ? *remaining : self.horizon_steps,
                            .seconds = seconds,
                            .flops = flops ? *flops : std::vector<double>{}},
                           transport);
}

void bind_loop(py::module_& m) {
  py::class_<PyLoop>(m, "StragglerLoop",
                     "The straggler loop (elastic/loop.h), the one the C++ trainer runs: each step "
                     "one observation (every rank's compute seconds) in, a switch or nothing out.")
      .def(py::init([](const py::object& plan, const py::object& model, const py::object& cluster,
                       int seq_len, const std::string& strategy, bool replan, int monitor_window,
                       double straggler_threshold, double hysteresis, int horizon_steps,
                       bool distributed_optimizer, const py::object& profile, bool recompute,
                       int max_tp) {
             return make_loop({plan, model, cluster, profile, seq_len, strategy, replan,
                               monitor_window, horizon_steps, straggler_threshold, hysteresis,
                               distributed_optimizer, recompute, max_tp});
           }),
           py::arg("plan"), py::arg("model"), py::kw_only(), py::arg("cluster") = "cpu-local",
           py::arg("seq_len") = 0, py::arg("strategy") = "malleus", py::arg("replan") = true,
           py::arg("monitor_window") = 3, py::arg("straggler_threshold") = 1.2,
           py::arg("hysteresis") = 0.3, py::arg("horizon_steps") = 50,
           py::arg("distributed_optimizer") = true, py::arg("profile") = py::none(),
           py::arg("recompute") = true, py::arg("max_tp") = 0)
      .def("observe", &observe, py::arg("step"), py::arg("seconds"), py::kw_only(),
           py::arg("flops") = py::none(), py::arg("remaining_steps") = py::none(),
           py::arg("root") = true, py::arg("broadcast") = py::none(),
           "One step: every rank's compute seconds (the same list on every rank). Collective over "
           "`broadcast` (rank 0's text in, on every rank out; None: one process) when the "
           "controller is asked. Returns None, or the Decision; when it switched, `plan` is the "
           "plan running from now on.")
      .def(
          "note_migration_seconds",
          [](PyLoop& self, double seconds) {
            check(seconds >= 0, "straggler loop: a migration's seconds must not be negative");
            self.loop.note_migration_seconds(seconds);
          },
          py::arg("seconds"), "What moving to the plan just switched to took (wall time).")
      .def(
          "set_plan",
          [](PyLoop& self, const py::object& plan) {
            self.loop.set_plan(plan_of(plan, self.model));
          },
          py::arg("plan"),
          "Runs `plan` from the next step on, imposed by the caller (every rank the same); the "
          "monitor counts its steps from here, as after a switch.")
      .def_property_readonly("plan", [](const PyLoop& self) { return self.loop.plan(); })
      .def_property_readonly("world_size",
                             [](const PyLoop& self) { return self.loop.world_size(); })
      .def_property_readonly("rates", [](const PyLoop& self) { return self.loop.rates(); })
      .def_property_readonly("step_rates",
                             [](const PyLoop& self) { return self.loop.step_rates(); })
      .def_property_readonly("monitored_steps",
                             [](const PyLoop& self) { return self.loop.monitored_steps(); })
      .def_property_readonly("geometries",
                             [](const PyLoop& self) { return self.loop.geometries(); })
      .def_property_readonly("work_flops",
                             [](const PyLoop& self) { return self.loop.work_flops(); })
      .def_property_readonly("replans", [](const PyLoop& self) { return self.loop.replans(); })
      .def_property_readonly("holding", [](const PyLoop& self) { return self.loop.holding(); })
      .def_property_readonly("horizon_steps",
                             [](const PyLoop& self) { return self.horizon_steps; });
}

}  // namespace

void bind_elastic(py::module_& m) {
  m.attr("PROBE_SIZE") = plan::kComputeProbeSize;
  m.attr("PROBE_REPEATS") = plan::kComputeProbeRepeats;
  m.attr("PROBE_FLOPS") = plan::kComputeProbeFlops;
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

  bind_decision(m);
  bind_loop(m);
}

}  // namespace malleus::python
