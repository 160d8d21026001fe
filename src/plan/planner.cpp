// The planner's interface and the helpers its strategies share. The strategies live by job:
// exact.cpp (exact sub-solvers), baselines.cpp (other systems), search.cpp (ours).
#include "plan/planner.h"

#include <algorithm>

#include "common/error.h"
#include "plan/planner_parts.h"

namespace malleus::plan {

namespace detail {

Rates full_rates(const Rates& rates, int devices) {
  Rates out(static_cast<size_t>(devices), 1.0);
  for (size_t i = 0; i < rates.size() && i < out.size(); ++i) out[i] = rates[i];
  return out;
}

bool uses_gone(const std::vector<int>& ranks, const Rates& rates) {
  for (int r : ranks) {
    if (is_gone(rates[static_cast<size_t>(r)])) return true;
  }
  return false;
}

std::vector<int> tp_degrees(const CostModel& cost) {
  std::vector<int> out;
  const int D = cost.cluster().devices_per_node;
  const int limit = cost.max_tensor_parallel();
  for (int t = 1; t <= D && t <= cost.model().num_kv_heads && (limit <= 0 || t <= limit); t *= 2) {
    if (D % t == 0) out.push_back(t);
  }
  return out;
}

void set_layers(std::vector<Stage>& stages, const std::vector<int>& counts) {
  int begin = 0;
  for (size_t j = 0; j < stages.size(); ++j) {
    stages[j].layer_begin = begin;
    begin += counts[j];
    stages[j].layer_end = begin;
  }
}

Stage make_group(const CostModel& cost, std::vector<int> ranks, bool balance, const Rates& rates) {
  Stage s;
  s.ranks = std::move(ranks);
  if (balance) {
    cost.balance_shares(s, rates);
  } else {
    cost.even_shares_of(s);
  }
  return s;
}

Plan assemble(const CostModel& cost, const std::vector<const PipelineEval*>& pipes,
              const std::vector<int>& micro_batches) {
  Plan plan;
  plan.world_size = cost.cluster().num_devices();
  plan.micro_batch_size = cost.batch().micro_batch;
  for (size_t i = 0; i < pipes.size(); ++i) {
    if (micro_batches[i] <= 0) continue;
    Pipeline p;
    p.micro_batches = micro_batches[i];
    p.stages = pipes[i]->stages;
    plan.pipelines.push_back(std::move(p));
  }
  return plan;
}

PlanResult finish(std::string name, const CostModel& cost, Plan plan, const Rates& rates,
                  Clock::time_point start) {
  validate(plan, cost.model(), cost.cluster().num_devices(), cost.batch().global_batch,
           name + " plan");
  PlanResult r;
  r.strategy = std::move(name);
  r.prediction = cost.predict(plan, rates);
  // The recomputation each stage needs to fit, chosen by the cost model, travels with the plan
  // to the runtime.
  CostModel::write_recompute(plan, r.prediction);
  // And, where the memory allows, recomputation ahead of the gradient (the shifted schedule),
  // which the prediction then includes.
  if (cost.choose_recompute_ahead(plan)) r.prediction = cost.predict(plan, rates, false);
  r.plan = std::move(plan);
  r.planning_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (!r.prediction.fits) r.note = r.prediction.problem;
  return r;
}

}  // namespace detail

std::string Shape::text() const {
  std::string s = "dp";
  s += std::to_string(dp);
  s += " tp";
  s += std::to_string(tp);
  s += " pp";
  s += std::to_string(pp);
  return s;
}

Shape Shape::parse(const std::string& text) {
  Shape s;
  std::string t = text;
  for (char& ch : t) {
    if (ch == ',' || ch == 'x' || ch == ' ') ch = ' ';
  }
  int values[3] = {0, 0, 0};
  char names[3][3] = {"dp", "tp", "pp"};
  size_t pos = 0;
  for (int i = 0; i < 3; ++i) {
    while (pos < t.size() && t[pos] == ' ') ++pos;
    if (t.compare(pos, 2, names[i]) == 0) pos += 2;
    size_t used = 0;
    try {
      values[i] = std::stoi(t.substr(pos), &used);
    } catch (const std::exception&) {
      throw Error("shape \"" + text + "\" is not dpD,tpT,ppP (e.g. dp2,tp8,pp4)");
    }
    pos += used;
  }
  while (pos < t.size() && t[pos] == ' ') ++pos;
  check(pos == t.size() && values[0] > 0 && values[1] > 0 && values[2] > 0,
        "shape \"" + text + "\" is not dpD,tpT,ppP (e.g. dp2,tp8,pp4)");
  s.dp = values[0], s.tp = values[1], s.pp = values[2];
  return s;
}

std::unique_ptr<Strategy> make_strategy(const std::string& name, PlannerOptions options) {
  if (name == "malleus") return detail::make_malleus_strategy(std::move(options));
  if (name == "uniform") return detail::make_uniform_strategy();
  if (name == "drop-slow") return detail::make_drop_slow_strategy(options.straggler_threshold);
  if (name == "uneven-microbatches") return detail::make_uneven_strategy({.micro_batches = true});
  if (name == "uneven-layers") return detail::make_uneven_strategy({.layers = true});
  if (name == "data-parallel") return detail::make_data_parallel_strategy();
  std::string names;
  for (const auto& n : strategy_names()) {
    names += ' ';
    names += n;
  }
  throw Error("unknown strategy \"" + name + "\" (one of:" + names + " data-parallel)");
}

std::vector<std::string> strategy_names() {
  return {"malleus", "uniform", "drop-slow", "uneven-microbatches", "uneven-layers"};
}

}  // namespace malleus::plan
