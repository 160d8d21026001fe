// Conversions between Python objects and the C++ library's types: JSON-shaped values cross as
// Python dicts and lists; a model, cluster or profile is given as a preset name, a JSON file or a
// dict, as on the command line.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <string>

#include "common/json.h"
#include "model/config.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "plan/plan.h"

namespace malleus::python {

namespace py = pybind11;

// Any JSON-shaped Python value (dict, list, str, int, float, bool, None) to JSON and back.
Json to_json(const py::handle& value, const std::string& what);
py::object from_json(const Json& json);

// A preset name or file path (str), or a dict of the JSON form.
model::ModelConfig model_config(const py::handle& model);
plan::ClusterSpec cluster_spec(const py::handle& cluster);
// None, a file path, or a dict (the form `malleus profile` writes).
std::optional<plan::Profile> profile(const py::handle& profile);
// None (every device healthy), a dict {device: rate} (rate a number or "inf") or a list of rates.
plan::Rates rates(const py::handle& rates, int devices, const std::string& what);
// A plan as a malleus.Plan, a dict (the JSON form) or a file path, validated against `model`.
plan::Plan plan_of(const py::handle& plan, const model::ModelConfig& model);

}  // namespace malleus::python
