#include "plan/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <queue>

#include "common/error.h"

namespace malleus::plan {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

int to_int(size_t n) {
  return static_cast<int>(n);
}

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

// Layer ranges from per-stage counts.
void set_layers(std::vector<Stage>& stages, const std::vector<int>& counts) {
  int begin = 0;
  for (size_t j = 0; j < stages.size(); ++j) {
    stages[j].layer_begin = begin;
    begin += counts[j];
    stages[j].layer_end = begin;
  }
}

// A pipeline's stages (TP groups with shares) before and after its layers are assigned.
struct PipelineEval {
  bool feasible = false;
  std::vector<Stage> stages;
  double first = kInf, period = kInf;  // T(m) = first + (m − 1)·period
};

// Assigns layers to an ordered list of TP groups (exactly, for the closed form's bottleneck) and
// returns the pipeline's time coefficients, assuming it gets at least as many micro-batches as
// stages (in-flight activations are then S − j on stage j).
PipelineEval evaluate_pipeline(const CostModel& cost, std::vector<Stage> stages,
                               const Rates& rates) {
  PipelineEval out;
  const int S = to_int(stages.size());
  const int L = cost.model().num_layers;
  if (S == 0 || S > L) return out;
  std::vector<GroupCost> groups;
  groups.reserve(stages.size());
  for (const auto& s : stages) {
    groups.push_back(cost.group_cost(s, rates));
    if (groups.back().gone) return out;
  }
  std::vector<std::function<double(int)>> fns;
  for (int j = 0; j < S; ++j) {
    fns.emplace_back([&, j](int l) {
      const StageCost c =
          cost.stage_cost(groups[static_cast<size_t>(j)], l, j == 0, j == S - 1, S - j);
      return c.fits ? c.forward + c.backward : kInf;
    });
  }
  const auto counts = assign_layers(L, fns);
  if (counts.empty()) return out;
  set_layers(stages, counts);
  std::vector<StagePrediction> preds;
  for (int j = 0; j < S; ++j) {
    StagePrediction p;
    p.cost = cost.stage_cost(groups[static_cast<size_t>(j)], counts[static_cast<size_t>(j)], j == 0,
                             j == S - 1, S - j);
    if (j + 1 < S) {
      p.p2p_next =
          cost.p2p_time(stages[static_cast<size_t>(j)], stages[static_cast<size_t>(j + 1)]);
    }
    preds.push_back(p);
  }
  const PipelinePrediction pp = CostModel::pipeline_time(std::move(preds), 1);
  out.feasible = true;
  out.first = pp.first_micro_batch;
  out.period = pp.period;
  out.stages = std::move(stages);
  return out;
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

// Assembles a plan from evaluated pipelines and their micro-batch counts; pipelines given none
// are dropped (their ranks idle).
Plan assemble(const CostModel& cost, int world, const std::vector<const PipelineEval*>& pipes,
              const std::vector<int>& micro_batches) {
  Plan plan;
  plan.world_size = world;
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

// Max of T_i(m_i) after the exact micro-batch assignment.
double allocation_time(const std::vector<double>& first, const std::vector<double>& period,
                       const std::vector<int>& m) {
  double t = 0;
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i] > 0) t = std::max(t, first[i] + (m[i] - 1) * period[i]);
  }
  return t;
}

// ---- uniform layouts -------------------------------------------------------------------------

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

std::vector<int> tp_degrees(const CostModel& cost) {
  std::vector<int> out;
  const int D = cost.cluster().devices_per_node;
  for (int t = 1; t <= D && t <= cost.model().num_kv_heads; t *= 2) {
    if (D % t == 0) out.push_back(t);
  }
  return out;
}

struct UniformChoice {
  Plan plan;
  Shape shape;
  double time = kInf;
};

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

// The baselines' starting point: Megatron's layout of the base shape, with every pipeline that
// holds a gone device dropped (a data-parallel job can lose replicas, not parts of one).
struct BaseLayout {
  std::vector<std::vector<Stage>> pipelines;  // surviving pipelines, shares even, no layers yet
  bool dropped = false;
};

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

// Builds a plan from a base layout with layers either even or assigned by rates, and
// micro-batches even or assigned by rates.
Plan uneven_plan(const CostModel& cost, const BaseLayout& base, const Rates& rates,
                 bool uneven_layers, bool uneven_micro_batches) {
  const int L = cost.model().num_layers;
  const int M = cost.batch().micro_batches();
  std::vector<PipelineEval> evals;
  for (const auto& stages : base.pipelines) {
    if (uneven_layers) {
      PipelineEval e = evaluate_pipeline(cost, stages, rates);
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
  if (uneven_micro_batches) {
    std::vector<double> first, period;
    for (const auto& e : evals) first.push_back(e.first), period.push_back(e.period);
    m = assign_micro_batches(M, first, period, to_int(evals.size()) > M);
  } else {
    m = even_shares(M, to_int(evals.size()));
  }
  std::vector<const PipelineEval*> ptrs;
  for (const auto& e : evals) ptrs.push_back(&e);
  return assemble(cost, cost.cluster().num_devices(), ptrs, m);
}

PlanResult finish(std::string name, const CostModel& cost, Plan plan, const Rates& rates,
                  Clock::time_point start) {
  validate(plan, cost.model(), cost.cluster().num_devices(), cost.batch().global_batch,
           name + " plan");
  PlanResult r;
  r.strategy = std::move(name);
  r.prediction = cost.predict(plan, rates);
  r.plan = std::move(plan);
  r.planning_seconds = seconds_since(start);
  if (!r.prediction.fits) r.note = r.prediction.problem;
  return r;
}

// ---- baselines -------------------------------------------------------------------------------

class UniformStrategy : public Strategy {
 public:
  std::string name() const override { return "uniform"; }
  PlanResult plan(const CostModel& cost, const PlanRequest& req) const override {
    const auto start = Clock::now();
    const Rates rates = full_rates(req.rates, cost.cluster().num_devices());
    const Shape shape = resolve_base(cost, req.base);
    const BaseLayout base = base_layout(cost, shape, rates);
    PlanResult r = finish(name(), cost, uneven_plan(cost, base, rates, false, false), rates, start);
    r.restart = base.dropped;
    if (base.dropped) r.note = "pipelines with a gone device dropped (restart)";
    return r;
  }
};

class UnevenStrategy : public Strategy {
 public:
  UnevenStrategy(bool layers, bool micro_batches) : layers_(layers), micro_(micro_batches) {}
  std::string name() const override { return layers_ ? "uneven-layers" : "uneven-microbatches"; }
  PlanResult plan(const CostModel& cost, const PlanRequest& req) const override {
    const auto start = Clock::now();
    const Rates rates = full_rates(req.rates, cost.cluster().num_devices());
    const BaseLayout base = base_layout(cost, resolve_base(cost, req.base), rates);
    PlanResult r =
        finish(name(), cost, uneven_plan(cost, base, rates, layers_, micro_), rates, start);
    r.restart = base.dropped;
    return r;
  }

 private:
  bool layers_, micro_;
};

UniformChoice drop_slow_choice(const CostModel& cost, const Rates& rates, double threshold) {
  const auto kept = devices_by_node(cost.cluster(), [&](int d) {
    const double r = rates[static_cast<size_t>(d)];
    return !is_gone(r) && r < threshold;
  });
  return best_uniform(cost, kept, rates);
}

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

// ---- ours ------------------------------------------------------------------------------------

// One way to run a region's devices: TP groups in stage order, each with shares balanced to its
// members' rates or even.
struct RegionOption {
  std::vector<std::vector<int>> groups;
  bool balance = true;
  bool operator==(const RegionOption& o) const {
    return groups == o.groups && balance == o.balance;
  }
};

// Power-of-two groups of at most `t`, largest first, over `devices` in order.
std::vector<std::vector<int>> binary_groups(const std::vector<int>& devices, int t) {
  std::vector<std::vector<int>> out;
  size_t i = 0;
  while (i < devices.size()) {
    int size = t;
    while (static_cast<size_t>(size) > devices.size() - i) size /= 2;
    out.emplace_back(devices.begin() + static_cast<long>(i),
                     devices.begin() + static_cast<long>(i) + size);
    i += static_cast<size_t>(size);
  }
  return out;
}

// The choices for one region (the devices one pipeline has on one node): keep the TP groups
// (shares even or balanced to rates), or exclude the k slowest devices and regroup the rest into
// power-of-two groups, either in rate order or with the healthy devices grouped apart from the
// slow ones (Malleus's isolation). Devices are sorted by rate first, so slow devices share groups.
std::vector<RegionOption> region_options(std::vector<int> devices, int t, const Rates& rates) {
  std::stable_sort(devices.begin(), devices.end(), [&](int a, int b) {
    return rates[static_cast<size_t>(a)] < rates[static_cast<size_t>(b)];
  });
  const double best = rates[static_cast<size_t>(devices.front())];
  int gone = 0, slow = 0, healthy = 0;
  for (int d : devices) {
    const double r = rates[static_cast<size_t>(d)];
    gone += is_gone(r) ? 1 : 0;
    slow += r > 1.0 ? 1 : 0;
    healthy += r <= best ? 1 : 0;
  }
  std::vector<RegionOption> out;
  // Each grouping also in reverse stage order: slow groups first (where the embedding is cheap)
  // or last (fewer activations in flight) depends on the model and the memory.
  auto add = [&](RegionOption o) {
    for (int reversed = 0; reversed < 2; ++reversed) {
      if (std::find(out.begin(), out.end(), o) == out.end()) out.push_back(o);
      std::reverse(o.groups.begin(), o.groups.end());
    }
  };
  if (gone == 0) {
    add({binary_groups(devices, t), false});
    if (slow > 0) {
      add({binary_groups(devices, t), true});
      // HAP-style mixing: deal devices to the groups fast-to-slow in snake order so every group
      // has a similar total speed, with shares balanced inside each.
      const size_t groups = devices.size() / static_cast<size_t>(t);
      if (groups > 1 && devices.size() % static_cast<size_t>(t) == 0) {
        std::vector<std::vector<int>> mixed(groups);
        for (size_t i = 0; i < devices.size(); ++i) {
          const size_t round = i / groups, k = i % groups;
          mixed[round % 2 == 0 ? k : groups - 1 - k].push_back(devices[i]);
        }
        add({mixed, true});
      }
    }
  }
  const int n = to_int(devices.size());
  for (int k = gone; k <= slow && slow > 0; ++k) {
    const std::vector<int> kept(devices.begin(), devices.begin() + (n - k));
    add({binary_groups(kept, t), true});
    if (healthy > 0 && healthy < n - k) {
      const std::vector<int> fast(kept.begin(), kept.begin() + healthy);
      const std::vector<int> rest(kept.begin() + healthy, kept.end());
      auto groups = binary_groups(fast, t);
      for (auto& g : binary_groups(rest, t)) groups.push_back(std::move(g));
      add({std::move(groups), true});
    }
  }
  return out;
}

struct Candidate {
  Plan plan;
  double score = kInf;    // the cost model's iteration time (+inf when it does not fit)
  double refined = kInf;  // the evaluator's, when there is one
  bool must_refine = false;
};

// Searches one base (t, S): Megatron's layout of t-rank groups, S per pipeline, regrouped region
// by region around the stragglers by coordinate descent on the predicted iteration time, with
// layers and micro-batches assigned exactly for every trial.
class BaseSearch {
 public:
  BaseSearch(const CostModel& cost, const Rates& rates, int t, int S)
      : cost_(cost), rates_(rates), t_(t) {
    const ClusterSpec& c = cost.cluster();
    const int per_node = c.devices_per_node / t;
    const int G = c.nodes * per_node;
    const int P = G / S;
    for (int p = 0; p < P; ++p) {
      std::vector<std::vector<int>> regions;
      int last_node = -1;
      for (int g = p * S; g < (p + 1) * S; ++g) {
        const int node = g / per_node;
        if (node != last_node) regions.emplace_back(), last_node = node;
        for (int r = g * t; r < (g + 1) * t; ++r) regions.back().push_back(r);
      }
      std::vector<std::vector<RegionOption>> options;
      for (const auto& devices : regions) options.push_back(region_options(devices, t, rates));
      options_.push_back(std::move(options));
    }
    choice_.resize(options_.size());
    evals_.resize(options_.size());
    for (size_t p = 0; p < options_.size(); ++p) {
      choice_[p].assign(options_[p].size(), 0);
      evals_[p] = &eval(p, choice_[p]);
    }
  }

  int pipelines() const { return to_int(options_.size()); }

  // Runs the descent and appends its best states to `out`.
  void run(std::vector<Candidate>& out, int keep) {
    std::vector<std::pair<double, Plan>> found;
    double current = objective(nullptr);
    record(found, current);
    for (int pass = 0; pass < 2; ++pass) {
      bool improved = false;
      for (size_t p = 0; p < options_.size(); ++p) {
        for (size_t r = 0; r < options_[p].size(); ++r) {
          if (options_[p][r].size() <= 1) continue;
          const int was = choice_[p][r];
          int best = was;
          for (int o = 0; o < to_int(options_[p][r].size()); ++o) {
            if (o == was) continue;
            choice_[p][r] = o;
            evals_[p] = &eval(p, choice_[p]);
            const double value = objective(nullptr);
            if (value < current * (1 - 1e-9)) {
              current = value;
              best = o;
              improved = true;
              record(found, value);
            }
          }
          choice_[p][r] = best;
          evals_[p] = &eval(p, choice_[p]);
        }
      }
      if (!improved) break;
    }
    std::sort(found.begin(), found.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (int i = 0; i < std::min(keep, to_int(found.size())); ++i) {
      Candidate c;
      c.plan = std::move(found[static_cast<size_t>(i)].second);
      out.push_back(std::move(c));
    }
  }

  // Healthy-cluster quality of this base: the objective of the initial state.
  double initial_objective() { return objective(nullptr); }

 private:
  const PipelineEval& eval(size_t p, const std::vector<int>& choice) {
    auto& cache = cache_[p];
    auto it = cache.find(choice);
    if (it != cache.end()) return it->second;
    std::vector<Stage> stages;
    for (size_t r = 0; r < choice.size(); ++r) {
      const RegionOption& o = options_[p][r][static_cast<size_t>(choice[r])];
      for (const auto& g : o.groups) stages.push_back(make_group(cost_, g, o.balance, rates_));
    }
    return cache.emplace(choice, evaluate_pipeline(cost_, std::move(stages), rates_)).first->second;
  }

  double objective(std::vector<int>* micro_batches) {
    std::vector<double> first, period;
    for (const PipelineEval* e : evals_) {
      first.push_back(e->feasible ? e->first : kInf);
      period.push_back(e->feasible ? e->period : kInf);
    }
    auto m = assign_micro_batches(cost_.batch().micro_batches(), first, period, true);
    const double t = allocation_time(first, period, m);
    if (micro_batches) *micro_batches = std::move(m);
    return t;
  }

  void record(std::vector<std::pair<double, Plan>>& found, double value) {
    if (!std::isfinite(value)) return;
    std::vector<int> m;
    objective(&m);
    found.emplace_back(value, assemble(cost_, cost_.cluster().num_devices(), evals_, m));
  }

  const CostModel& cost_;
  const Rates& rates_;
  int t_;
  std::vector<std::vector<std::vector<RegionOption>>> options_;  // pipeline → region → options
  std::vector<std::vector<int>> choice_;
  std::vector<const PipelineEval*> evals_;
  std::map<size_t, std::map<std::vector<int>, PipelineEval>> cache_;
};

class MalleusStrategy : public Strategy {
 public:
  explicit MalleusStrategy(PlannerOptions options) : options_(std::move(options)) {}
  std::string name() const override { return "malleus"; }

  PlanResult plan(const CostModel& cost, const PlanRequest& req) const override {
    const auto start = Clock::now();
    const ClusterSpec& c = cost.cluster();
    const int N = c.num_devices();
    const Rates rates = full_rates(req.rates, N);
    const Rates healthy(static_cast<size_t>(N), 1.0);
    const int L = cost.model().num_layers;
    std::vector<Candidate> candidates;

    // Bases (t, S): for each TP degree the fewest stages that fit, a few more, and the stage
    // counts that tile the cluster evenly.
    struct Base {
      int t, S;
      double healthy_time;
    };
    std::vector<Base> bases;
    double best_healthy = kInf;
    for (int t : tp_degrees(cost)) {
      const int G = c.nodes * (c.devices_per_node / t);
      int s_min = 0;
      for (int S = 1; S <= std::min(G, L); ++S) {
        std::vector<Stage> stages;
        for (int g = 0; g < S; ++g) {
          std::vector<int> ranks;
          for (int r = g * t; r < (g + 1) * t; ++r) ranks.push_back(r);
          stages.push_back(make_group(cost, ranks, false, healthy));
        }
        if (evaluate_pipeline(cost, stages, healthy).feasible) {
          s_min = S;
          break;
        }
      }
      if (s_min == 0) continue;
      std::vector<int> counts;
      for (int S = s_min; S <= std::min({G, L, 2 * s_min + 2}); ++S) {
        const bool tiles =
            G % S == 0 || (S * t) % c.devices_per_node == 0 || c.devices_per_node % (S * t) == 0;
        if (S <= s_min + 2 || tiles) counts.push_back(S);
      }
      if (req.base.tp == t && req.base.pp <= std::min(G, L) && req.base.pp >= 1) {
        counts.push_back(req.base.pp);
      }
      std::sort(counts.begin(), counts.end());
      counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
      for (int S : counts) {
        BaseSearch probe(cost, healthy, t, S);
        const double time = probe.initial_objective();
        bases.push_back({t, S, time});
        best_healthy = std::min(best_healthy, time);
      }
    }
    // A base far slower when healthy rarely wins under stragglers, but on small clusters (few
    // bases) it can: prune only where there are many.
    const double prune = bases.size() > 24 ? 1.5 : kInf;
    for (const Base& b : bases) {
      const bool is_base = b.t == req.base.tp && b.S == req.base.pp;
      if (!is_base && !(b.healthy_time <= prune * best_healthy)) continue;
      BaseSearch search(cost, rates, b.t, b.S);
      search.run(candidates, 3);
    }

    // The baselines' plans are points of our search space too; they are always re-scored.
    const Shape shape = resolve_base(cost, req.base);
    try {
      const BaseLayout base = base_layout(cost, shape, rates);
      for (auto [layers, micro] :
           {std::pair{true, true}, {true, false}, {false, true}, {false, false}}) {
        Candidate cand;
        cand.plan = uneven_plan(cost, base, rates, layers, micro);
        cand.must_refine = true;
        candidates.push_back(std::move(cand));
      }
    } catch (const Error&) {
      // every base pipeline holds a gone device
    }
    UniformChoice dropped = drop_slow_choice(cost, rates, options_.straggler_threshold);
    if (!dropped.plan.pipelines.empty()) {
      Candidate cand;
      cand.plan = std::move(dropped.plan);
      cand.must_refine = true;
      candidates.push_back(std::move(cand));
    }
    if (req.current) {
      bool ok =
          req.current->world_size == N && req.current->global_batch() == cost.batch().global_batch;
      for (const auto& p : req.current->pipelines) {
        for (const auto& s : p.stages) ok = ok && !uses_gone(s.ranks, rates);
      }
      if (ok) {
        Candidate cand;
        cand.plan = *req.current;
        cand.must_refine = true;
        candidates.push_back(std::move(cand));
      }
    }
    check(!candidates.empty(), "malleus: no plan fits the devices that are left");

    for (auto& cand : candidates) {
      const Prediction pred = cost.predict(cand.plan, rates);
      cand.score = pred.fits ? pred.iteration_time : kInf;
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const Candidate& a, const Candidate& b) { return a.score < b.score; });
    // Re-score the best few (and the baseline-shaped ones) with the evaluator when there is one.
    std::vector<Candidate*> pool;
    for (size_t i = 0; i < candidates.size(); ++i) {
      Candidate& cand = candidates[i];
      if (!std::isfinite(cand.score)) continue;
      if (to_int(i) < options_.refine_top || cand.must_refine) pool.push_back(&cand);
    }
    check(!pool.empty(), "malleus: no candidate plan fits in device memory");
    for (Candidate* cand : pool) {
      cand->refined = options_.refine ? options_.refine(cand->plan, rates) : cand->score;
    }
    double best = kInf;
    for (Candidate* cand : pool) best = std::min(best, cand->refined);
    Candidate* chosen = nullptr;
    double chosen_moved = kInf;
    for (Candidate* cand : pool) {
      if (cand->refined > best * (1 + options_.tie_tolerance)) continue;
      const double moved =
          req.current ? migration_cost(*req.current, cand->plan, cost).total_bytes : 0.0;
      if (!chosen || moved < chosen_moved ||
          (moved == chosen_moved && cand->refined < chosen->refined)) {
        chosen = cand;
        chosen_moved = moved;
      }
    }
    PlanResult r = finish(name(), cost, chosen->plan, rates, start);
    r.note = std::to_string(candidates.size()) + " candidates from " +
             std::to_string(bases.size()) + " bases";
    return r;
  }

 private:
  PlannerOptions options_;
};

}  // namespace

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

std::vector<int> assign_layers(int layers,
                               const std::vector<std::function<double(int)>>& stage_time) {
  const int S = to_int(stage_time.size());
  if (S == 0 || S > layers) return {};
  const int max_per_stage = layers - (S - 1);
  std::vector<std::vector<double>> table(static_cast<size_t>(S));
  std::vector<double> values;
  for (int j = 0; j < S; ++j) {
    auto& row = table[static_cast<size_t>(j)];
    for (int l = 1; l <= max_per_stage; ++l) {
      const double t = stage_time[static_cast<size_t>(j)](l);
      row.push_back(t);
      if (std::isfinite(t)) values.push_back(t);
      if (!std::isfinite(t)) break;  // non-decreasing: more layers cannot fit either
    }
  }
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  auto capacity = [&](size_t j, double bound) {
    const auto& row = table[j];
    return to_int(std::upper_bound(row.begin(), row.end(), bound) - row.begin());
  };
  auto feasible = [&](double bound) {
    long long total = 0;
    for (size_t j = 0; j < table.size(); ++j) {
      const int c = capacity(j, bound);
      if (c < 1) return false;
      total += c;
    }
    return total >= layers;
  };
  // Smallest bottleneck among the stage times that admits an assignment.
  size_t lo = 0, hi = values.size();
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    if (feasible(values[mid])) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  if (lo == values.size()) return {};
  const double bound = values[lo];
  // Under that bottleneck, add layers where they cost least (minimises the sum of stage times
  // when stage times are convex in their layer count).
  std::vector<int> counts(static_cast<size_t>(S), 1);
  std::vector<int> caps(static_cast<size_t>(S));
  for (size_t j = 0; j < caps.size(); ++j) caps[j] = capacity(j, bound);
  for (int left = layers - S; left > 0; --left) {
    size_t best = caps.size();
    double best_step = kInf;
    for (size_t j = 0; j < caps.size(); ++j) {
      if (counts[j] >= caps[j]) continue;
      const double step =
          table[j][static_cast<size_t>(counts[j])] - table[j][static_cast<size_t>(counts[j] - 1)];
      if (step < best_step) best_step = step, best = j;
    }
    if (best == caps.size()) return {};
    ++counts[best];
  }
  return counts;
}

std::vector<int> assign_micro_batches(int total, const std::vector<double>& first,
                                      const std::vector<double>& period, bool allow_zero) {
  const size_t n = first.size();
  check(n == period.size() && n > 0, "assign_micro_batches: no pipelines");
  check(allow_zero || total >= to_int(n), "assign_micro_batches: " + std::to_string(total) +
                                              " micro-batches for " + std::to_string(n) +
                                              " pipelines");
  std::vector<int> m(n, allow_zero ? 0 : 1);
  int left = total - (allow_zero ? 0 : to_int(n));
  // Greedy on the next micro-batch's finishing time: the total'th smallest of all T_i(k) is the
  // optimum, and picking the smallest next value each time reaches exactly that.
  using Item = std::pair<double, size_t>;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
  auto next = [&](size_t i) { return m[i] == 0 ? first[i] : first[i] + m[i] * period[i]; };
  for (size_t i = 0; i < n; ++i) heap.emplace(next(i), i);
  for (; left > 0; --left) {
    const size_t i = heap.top().second;
    heap.pop();
    ++m[i];
    heap.emplace(next(i), i);
  }
  return m;
}

Shape best_uniform_shape(const CostModel& cost) {
  const Rates healthy(static_cast<size_t>(cost.cluster().num_devices()), 1.0);
  const auto all = devices_by_node(cost.cluster(), [](int) { return true; });
  const UniformChoice best = best_uniform(cost, all, healthy);
  check(!best.shape.empty(), "no uniform dp × tp × pp plan of " + cost.model().name +
                                 " fits in the memory of cluster " + cost.cluster().name);
  return best.shape;
}

Migration migration_cost(const Plan& from, const Plan& to, const CostModel& cost) {
  struct Held {
    int begin = 0, end = 0;
    int h0 = 0, h1 = 0, f0 = 0, f1 = 0, v0 = 0, v1 = 0;
    bool first = false, last = false, used = false;
  };
  auto holdings = [](const Plan& plan, int world) {
    std::vector<Held> held(static_cast<size_t>(world));
    for (const auto& p : plan.pipelines) {
      for (size_t j = 0; j < p.stages.size(); ++j) {
        const Stage& s = p.stages[j];
        int h = 0, f = 0, v = 0;
        for (size_t i = 0; i < s.ranks.size(); ++i) {
          const int r = s.ranks[i];
          if (r < 0 || r >= world) continue;
          Held& x = held[static_cast<size_t>(r)];
          x = Held{s.layer_begin,
                   s.layer_end,
                   h,
                   h + s.heads[i],
                   f,
                   f + s.ffn[i],
                   v,
                   v + s.vocab[i],
                   j == 0,
                   j + 1 == p.stages.size(),
                   true};
          h += s.heads[i], f += s.ffn[i], v += s.vocab[i];
        }
      }
    }
    return held;
  };
  const int world = std::max(from.world_size, to.world_size);
  const auto old_held = holdings(from, world), new_held = holdings(to, world);
  const auto& m = cost.model();
  const double h = m.hidden_size;
  const double attn = 2 * h * h + 2 * h * m.kv_dim(), ffn = 3 * h * m.ffn_hidden_size;
  const double vocab_row = h;
  auto overlap = [](int a0, int a1, int b0, int b1) {
    return std::max(0, std::min(a1, b1) - std::max(a0, b0));
  };
  Migration out;
  for (int r = 0; r < world; ++r) {
    const Held& n = new_held[static_cast<size_t>(r)];
    if (!n.used) continue;
    const Held& o = old_held[static_cast<size_t>(r)];
    const double per_layer =
        attn * (n.h1 - n.h0) / m.num_heads + ffn * (n.f1 - n.f0) / m.ffn_hidden_size + 2 * h;
    double params = (n.end - n.begin) * per_layer;
    if (o.used) {
      const int layers = overlap(n.begin, n.end, o.begin, o.end);
      params -= layers * (attn * overlap(n.h0, n.h1, o.h0, o.h1) / m.num_heads +
                          ffn * overlap(n.f0, n.f1, o.f0, o.f1) / m.ffn_hidden_size + 2 * h);
    }
    const int vocab_new = n.v1 - n.v0;
    const int vocab_kept = o.used ? overlap(n.v0, n.v1, o.v0, o.v1) : 0;
    if (n.first) params += vocab_row * (vocab_new - (o.used && o.first ? vocab_kept : 0));
    if (n.last) params += vocab_row * (vocab_new - (o.used && o.last ? vocab_kept : 0));
    const double bytes = std::max(0.0, params) * cost.cluster().state_bytes_per_param;
    out.total_bytes += bytes;
    out.max_rank_bytes = std::max(out.max_rank_bytes, bytes);
  }
  out.seconds = out.max_rank_bytes / cost.cluster().inter_node_bandwidth;
  return out;
}

std::unique_ptr<Strategy> make_strategy(const std::string& name, PlannerOptions options) {
  if (name == "malleus") return std::make_unique<MalleusStrategy>(std::move(options));
  if (name == "uniform") return std::make_unique<UniformStrategy>();
  if (name == "drop-slow") return std::make_unique<DropSlowStrategy>(options.straggler_threshold);
  if (name == "uneven-microbatches") return std::make_unique<UnevenStrategy>(false, true);
  if (name == "uneven-layers") return std::make_unique<UnevenStrategy>(true, false);
  std::string names;
  for (const auto& n : strategy_names()) {
    names += ' ';
    names += n;
  }
  throw Error("unknown strategy \"" + name + "\" (one of:" + names + ")");
}

std::vector<std::string> strategy_names() {
  return {"malleus", "uniform", "drop-slow", "uneven-microbatches", "uneven-layers"};
}

}  // namespace malleus::plan
