// The baselines: what other systems do, behind the planner's interface so the simulator can hold
// them next to ours (docs/planner.md). Uniform Megatron-LM layouts, drop-slow (elastic
// frameworks), and the base layout with layers or micro-batches assigned from the rates.
#include <algorithm>
#include <functional>

#include "common/error.h"
#include "plan/planner_parts.h"

namespace malleus::plan {

namespace detail {

namespace {

// dp pipelines × pp stages × tp ranks from `groups` (each a list of tp ranks, in order), layers
// and micro-batches split evenly (the Megatron-LM layout when groups are consecutive ranks).
Plan uniform_from_groups(const CostModel& cost, const std::vector<std::vector<int>>& groups, int dp,
                         int pp, int world) {
  const auto& model = cost.model();
  Plan plan;
  plan.world_size = world;
  plan.micro_batch_size = cost.batch().micro_batch;
  const auto layers = even_shares(model.num_layers, pp);
  const auto batches = even_shares(cost.batch().micro_batches(), dp);
  for (int d = 0; d < dp; ++d) {
    Pipeline p;
    p.micro_batches = batches[static_cast<size_t>(d)];
    for (int s = 0; s < pp; ++s) {
      Stage stage;
      stage.ranks = groups[static_cast<size_t>(d * pp + s)];
      cost.even_shares_of(stage);
      p.stages.push_back(std::move(stage));
    }
    set_layers(p.stages, layers);
    plan.pipelines.push_back(std::move(p));
  }
  return plan;
}

// The fastest uniform plan over the devices `available` (per node, in rank order), TP inside
// nodes; used for the best healthy shape and for drop-slow's re-plan over the kept devices.
UniformChoice best_uniform(const CostModel& cost, const std::vector<std::vector<int>>& available,
                           const Rates& rates) {
  UniformChoice best;
  const int world = cost.cluster().num_devices();
  const int M = cost.batch().micro_batches();
  for (int t : tp_degrees(cost)) {
    std::vector<std::vector<int>> groups;
    for (const auto& node : available) {
      for (size_t i = 0; i + static_cast<size_t>(t) <= node.size(); i += static_cast<size_t>(t)) {
        groups.emplace_back(node.begin() + static_cast<long>(i),
                            node.begin() + static_cast<long>(i) + t);
      }
    }
    const int G = to_int(groups.size());
    for (int pp = 1; pp <= std::min(G, cost.model().num_layers); ++pp) {
      const int dp = std::min(G / pp, M);
      if (dp < 1) break;
      Plan plan = uniform_from_groups(cost, groups, dp, pp, world);
      const Prediction pred = cost.predict(plan, rates);
      const double time = pred.fits ? pred.iteration_time : kInf;
      if (time < best.time) {
        best.time = time;
        best.plan = std::move(plan);
        best.shape = Shape{dp, t, pp};
      }
    }
  }
  return best;
}

std::vector<std::vector<int>> devices_by_node(const ClusterSpec& c,
                                              const std::function<bool(int)>& keep) {
  std::vector<std::vector<int>> out(static_cast<size_t>(c.nodes));
  for (int d = 0; d < c.num_devices(); ++d) {
    if (keep(d)) out[static_cast<size_t>(c.node_of(d))].push_back(d);
  }
  return out;
}

}  // namespace

Shape resolve_base(const CostModel& cost, const Shape& base) {
  if (!base.empty()) {
    check(base.dp * base.tp * base.pp <= cost.cluster().num_devices(),
          "shape " + base.text() + " needs more devices than the cluster's " +
              std::to_string(cost.cluster().num_devices()));
    check(cost.cluster().devices_per_node % base.tp == 0,
          "shape " + base.text() + ": tp must divide the devices per node");
    return base;
  }
  return best_uniform_shape(cost);
}

BaseLayout base_layout(const CostModel& cost, const Shape& shape, const Rates& rates) {
  const Plan uniform =
      uniform_plan(cost.model(), shape.dp, shape.tp, shape.pp, cost.batch().global_batch,
                   cost.batch().micro_batch, cost.cluster().num_devices());
  BaseLayout out;
  for (const auto& p : uniform.pipelines) {
    bool gone = false;
    for (const auto& s : p.stages) gone = gone || uses_gone(s.ranks, rates);
    if (gone) {
      out.dropped = true;
    } else {
      out.pipelines.push_back(p.stages);
    }
  }
  check(!out.pipelines.empty(),
        "every pipeline of the " + shape.text() + " layout holds a gone device; nothing can run");
  return out;
}

Plan uneven_plan(const CostModel& cost, const BaseLayout& base, const Rates& rates,
                 UnevenAssignment uneven) {
  const int L = cost.model().num_layers;
  const int M = cost.batch().micro_batches();
  std::vector<PipelineEval> evals;
  for (const auto& stages : base.pipelines) {
    if (uneven.layers) {
      PipelineEval e = evaluate_pipeline(cost, stages, rates, to_int(base.pipelines.size()));
      if (e.feasible) {
        evals.push_back(std::move(e));
        continue;
      }
    }
    // Even layers (also the fallback when no assignment fits memory).
    std::vector<Stage> s = stages;
    set_layers(s, even_shares(L, to_int(s.size())));
    Plan one;
    one.world_size = cost.cluster().num_devices();
    one.micro_batch_size = cost.batch().micro_batch;
    one.pipelines.push_back(Pipeline{std::max(1, to_int(s.size())), s});
    const Prediction pred = cost.predict(one, rates);
    PipelineEval e;
    e.feasible = true;
    e.first = pred.pipelines[0].first_micro_batch;
    e.period = pred.pipelines[0].period;
    e.stages = std::move(s);
    evals.push_back(std::move(e));
  }
  std::vector<int> m;
  if (uneven.micro_batches) {
    std::vector<double> first, period;
    for (const auto& e : evals) first.push_back(e.first), period.push_back(e.period);
    m = assign_micro_batches(M, first, period,
                             uneven.allow_zero_micro_batches || to_int(evals.size()) > M);
  } else {
    m = even_shares(M, to_int(evals.size()));
  }
  std::vector<const PipelineEval*> ptrs;
  for (const auto& e : evals) ptrs.push_back(&e);
  return assemble(cost, ptrs, m);
}

UniformChoice drop_slow_choice(const CostModel& cost, const Rates& rates, double threshold) {
  const auto kept = devices_by_node(cost.cluster(), [&](int d) {
    const double r = rates[static_cast<size_t>(d)];
    return !is_gone(r) && r < threshold;
  });
  return best_uniform(cost, kept, rates);
}

namespace {

class UniformStrategy : public Strategy {
 public:
  std::string name() const override { return "uniform"; }
  PlanResult plan(const CostModel& cost, const PlanRequest& req) const override {
    const auto start = Clock::now();
    const Rates rates = full_rates(req.rates, cost.cluster().num_devices());
    const Shape shape = resolve_base(cost, req.base);
    const BaseLayout base = base_layout(cost, shape, rates);
    PlanResult r = finish(name(), cost, uneven_plan(cost, base, rates, {}), rates, start);
    r.restart = base.dropped;
    if (base.dropped) r.note = "pipelines with a gone device dropped (restart)";
    return r;
  }
};

class UnevenStrategy : public Strategy {
 public:
  explicit UnevenStrategy(UnevenAssignment uneven) : uneven_(uneven) {}
  std::string name() const override {
    return uneven_.layers ? "uneven-layers" : "uneven-microbatches";
  }
  PlanResult plan(const CostModel& cost, const PlanRequest& req) const override {
    const auto start = Clock::now();
    const Rates rates = full_rates(req.rates, cost.cluster().num_devices());
    const BaseLayout base = base_layout(cost, resolve_base(cost, req.base), rates);
    PlanResult r = finish(name(), cost, uneven_plan(cost, base, rates, uneven_), rates, start);
    r.restart = base.dropped;
    return r;
  }

 private:
  UnevenAssignment uneven_;
};

// Data parallelism alone: every device a replica of the whole model, micro-batches by rates, a
// replica too slow to help given none (it keeps its copy of the model, so it rejoins without a
// restart when it heals, and so does a replica of a gone device's peers).
class DataParallelStrategy : public Strategy {
 public:
  std::string name() const override { return "data-parallel"; }
  PlanResult plan(const CostModel& cost, const PlanRequest& req) const override {
    const auto start = Clock::now();
    const int devices = cost.cluster().num_devices();
    const Rates rates = full_rates(req.rates, devices);
    const BaseLayout base = base_layout(cost, Shape{devices, 1, 1}, rates);
    return finish(
        name(), cost,
        uneven_plan(cost, base, rates, {.micro_batches = true, .allow_zero_micro_batches = true}),
        rates, start);
  }
};

class DropSlowStrategy : public Strategy {
 public:
  explicit DropSlowStrategy(double threshold) : threshold_(threshold) {}
  std::string name() const override { return "drop-slow"; }
  PlanResult plan(const CostModel& cost, const PlanRequest& req) const override {
    const auto start = Clock::now();
    const Rates rates = full_rates(req.rates, cost.cluster().num_devices());
    UniformChoice choice = drop_slow_choice(cost, rates, threshold_);
    check(
        !choice.plan.pipelines.empty(),
        "drop-slow: no uniform plan fits on the devices below rate " + std::to_string(threshold_));
    PlanResult r = finish(name(), cost, std::move(choice.plan), rates, start);
    r.restart = true;
    r.note = "uniform " + choice.shape.text() + " over the devices below rate " +
             std::to_string(threshold_).substr(0, 4);
    return r;
  }

 private:
  double threshold_;
};

}  // namespace

std::unique_ptr<Strategy> make_uniform_strategy() {
  return std::make_unique<UniformStrategy>();
}
std::unique_ptr<Strategy> make_drop_slow_strategy(double threshold) {
  return std::make_unique<DropSlowStrategy>(threshold);
}
std::unique_ptr<Strategy> make_uneven_strategy(UnevenAssignment uneven) {
  return std::make_unique<UnevenStrategy>(uneven);
}
std::unique_ptr<Strategy> make_data_parallel_strategy() {
  return std::make_unique<DataParallelStrategy>();
}

}  // namespace detail

Shape best_uniform_shape(const CostModel& cost) {
  using namespace detail;
  const Rates healthy(static_cast<size_t>(cost.cluster().num_devices()), 1.0);
  const auto all = devices_by_node(cost.cluster(), [](int) { return true; });
  const UniformChoice best = best_uniform(cost, all, healthy);
  check(!best.shape.empty(), "no uniform dp × tp × pp plan of " + cost.model().name +
                                 " fits in the memory of cluster " + cost.cluster().name);
  return best.shape;
}

}  // namespace malleus::plan
