// malleus.Plan: a parallel plan (plan/plan.h) as a Python class. Made from its JSON form (a dict
// or a file) and a model, validated; to_dict() gives the JSON form back, role(rank) what one rank
// runs under it (what an engine in Python needs to build its part).
#include <pybind11/stl.h>

#include "common/error.h"
#include "convert.h"
#include "plan/cost_model.h"

namespace malleus::python {

namespace {

// What `rank` runs under `p`, or None when the plan leaves it idle.
py::object role(const plan::Plan& p, int rank) {
  check(rank >= 0 && rank < p.world_size,
        "plan: no rank " + std::to_string(rank) + " in a plan of " + std::to_string(p.world_size));
  for (size_t i = 0; i < p.pipelines.size(); ++i) {
    const plan::Pipeline& pipeline = p.pipelines[i];
    for (size_t s = 0; s < pipeline.stages.size(); ++s) {
      const plan::Stage& stage = pipeline.stages[s];
      for (size_t k = 0; k < stage.ranks.size(); ++k) {
        if (stage.ranks[k] != rank) continue;
        py::dict r;
        r["pipeline"] = i;
        r["stage"] = s;
        r["stages"] = pipeline.stages.size();
        r["layers"] = py::make_tuple(stage.layer_begin, stage.layer_end);
        r["micro_batches"] = pipeline.micro_batches;
        r["tp_rank"] = k;
        r["tp_ranks"] = stage.ranks;
        // The neighbouring stages' ranks (their first rank; an empty list at either end).
        r["previous_ranks"] = s > 0 ? pipeline.stages[s - 1].ranks : std::vector<int>{};
        r["next_ranks"] =
            s + 1 < pipeline.stages.size() ? pipeline.stages[s + 1].ranks : std::vector<int>{};
        return r;
      }
    }
  }
  return py::none();
}

}  // namespace

void bind_plan(py::module_& m) {
  py::class_<plan::Plan>(m, "Plan",
                         "A parallel plan (docs/plan-format.md): pipelines of stages of "
                         "tensor-parallel ranks, unlike pipelines and idle ranks allowed.")
      .def(py::init([](const py::object& plan, const py::object& model) {
             return plan_of(plan, model_config(model));
           }),
           py::arg("plan"), py::arg("model"),
           "From its JSON form (a dict or a file path), validated against `model`.")
      .def_readonly("world_size", &plan::Plan::world_size)
      .def_readonly("micro_batch_size", &plan::Plan::micro_batch_size)
      .def_property_readonly("global_batch", &plan::Plan::global_batch,
                             "Sequences per step: micro-batches x micro_batch_size.")
      .def_property_readonly("summary", &plan::Plan::summary)
      .def_property_readonly("idle_ranks", &plan::Plan::idle_ranks)
      .def_property_readonly(
          "pipelines", [](const plan::Plan& p) { return from_json(p.to_json().at("pipelines")); },
          "The pipelines in their JSON form (a list of dicts).")
      .def("to_dict", [](const plan::Plan& p) { return from_json(p.to_json()); })
      .def("role", &role, py::arg("rank"),
           "What `rank` runs: a dict with pipeline, stage, stages, layers (begin, end), "
           "micro_batches, tp_rank, tp_ranks, previous_ranks, next_ranks; None when idle.")
      .def(
          "work_flops",
          [](const plan::Plan& p, const py::object& model, int seq_len) {
            const model::ModelConfig config = model_config(model);
            check(seq_len > 0 && seq_len <= config.max_seq_len,
                  "work_flops: seq_len must be in [1, " + std::to_string(config.max_seq_len) + "]");
            return plan::work_flops(p, config, seq_len);
          },
          py::arg("model"), py::arg("seq_len"),
          "Every rank's training FLOPs per step under the plan (the idle probe's for an idle "
          "rank): what the monitor divides its time by.")
      .def("__eq__",
           [](const plan::Plan& a, const py::object& b) {
             return py::isinstance<plan::Plan>(b) &&
                    a.to_json() == py::cast<const plan::Plan&>(b).to_json();
           })
      .def("__hash__",
           [](const plan::Plan& p) { return std::hash<std::string>{}(p.to_json().dump()); })
      .def("__repr__", [](const plan::Plan& p) { return "Plan(" + p.summary() + ")"; });
}

}  // namespace malleus::python
