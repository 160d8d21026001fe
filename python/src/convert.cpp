#include "convert.h"

#include <cmath>

#include "common/error.h"
#include "common/files.h"

namespace malleus::python {

Json to_json(const py::handle& value, const std::string& what) {
  const py::module_ json = py::module_::import("json");
  std::string text;
  try {
    // allow_nan: rates may be float('inf'); the strict parser below names what it rejects.
    text = py::cast<std::string>(json.attr("dumps")(value));
  } catch (const py::error_already_set& e) {
    throw Error(what + ": not a JSON-shaped value (dict, list, str, number, bool, None): " +
                std::string(e.what()));
  }
  try {
    return Json::parse(text);
  } catch (const std::exception&) {
    throw Error(what + ": not a JSON value (infinity and NaN are written \"inf\" in rates): " +
                text.substr(0, 200));
  }
}

py::object from_json(const Json& json) {
  // nlohmann writes non-finite numbers as null; the callers write "inf" where it can occur.
  return py::module_::import("json").attr("loads")(json.dump());
}

model::ModelConfig model_config(const py::handle& model) {
  if (py::isinstance<py::str>(model)) return model::load_model_config(py::cast<std::string>(model));
  check(py::isinstance<py::dict>(model),
        "model: expected a preset name, a JSON file or a dict, got " +
            py::cast<std::string>(py::str(py::type::of(model))));
  model::ModelConfig m = model::ModelConfig::from_json(to_json(model, "model"), "model dict");
  m.validate("model dict");
  return m;
}

plan::ClusterSpec cluster_spec(const py::handle& cluster) {
  if (py::isinstance<py::str>(cluster)) return plan::load_cluster(py::cast<std::string>(cluster));
  check(py::isinstance<py::dict>(cluster),
        "cluster: expected a preset name, a JSON file or a dict, got " +
            py::cast<std::string>(py::str(py::type::of(cluster))));
  return plan::ClusterSpec::from_json(to_json(cluster, "cluster"), "cluster dict");
}

std::optional<plan::Profile> profile(const py::handle& profile) {
  if (profile.is_none()) return std::nullopt;
  if (py::isinstance<py::str>(profile)) {
    const std::string path = py::cast<std::string>(profile);
    return plan::Profile::from_json(read_json_file(path), path);
  }
  return plan::Profile::from_json(to_json(profile, "profile"), "profile dict");
}

plan::Rates rates(const py::handle& value, int devices, const std::string& what) {
  if (value.is_none()) return plan::Rates(static_cast<size_t>(devices), 1.0);
  if (py::isinstance<py::dict>(value)) {
    // Keys may be ints; the JSON form names devices by strings.
    py::dict by_name;
    for (const auto& [key, rate] : py::cast<py::dict>(value)) {
      py::object r = py::reinterpret_borrow<py::object>(rate);
      if (py::isinstance<py::float_>(rate) && std::isinf(py::cast<double>(rate)))
        r = py::str("inf");
      by_name[py::str(key)] = r;
    }
    return plan::rates_from_json(to_json(by_name, what), devices, what);
  }
  check(py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value),
        what + ": expected None, a dict {device: rate} or a list of rates");
  plan::Rates r;
  for (const auto& x : value) {
    check(py::isinstance<py::int_>(x) || py::isinstance<py::float_>(x),
          what + ": a rate must be a number, got " + py::cast<std::string>(py::repr(x)));
    r.push_back(py::cast<double>(x));
  }
  check(static_cast<int>(r.size()) == devices, what + ": expected " + std::to_string(devices) +
                                                   " rates (one per device), got " +
                                                   std::to_string(r.size()));
  for (size_t d = 0; d < r.size(); ++d) {
    check(r[d] >= 1, what + ": device " + std::to_string(d) + "'s rate must be >= 1, got " +
                         std::to_string(r[d]));
  }
  return r;
}

plan::Plan plan_of(const py::handle& value, const model::ModelConfig& model) {
  if (py::isinstance<plan::Plan>(value)) {
    plan::Plan p = py::cast<plan::Plan>(value);
    plan::validate(p, model, "plan");
    return p;
  }
  if (py::isinstance<py::str>(value)) {
    const std::string path = py::cast<std::string>(value);
    plan::Plan p = plan::Plan::from_json(read_json_file(path), model, path);
    plan::validate(p, model, path);
    return p;
  }
  check(py::isinstance<py::dict>(value),
        "plan: expected a malleus.Plan, a dict (the JSON form) or a file path");
  plan::Plan p = plan::Plan::from_json(to_json(value, "plan"), model, "plan dict");
  plan::validate(p, model, "plan dict");
  return p;
}

}  // namespace malleus::python
