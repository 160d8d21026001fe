// Ours: a search over TP groupings around the stragglers, with layers and micro-batches assigned
// exactly for every trial (docs/planner.md, "Outer search"). One call is one MalleusSearch: its
// inputs and the candidates it collects, phase by phase.
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>

#include "common/error.h"
#include "plan/planner_parts.h"

namespace malleus::plan::detail {

namespace {

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

// One pipeline of a search: its regions' options in stage order, and, for a pipeline the search
// keeps as it is (the incremental re-plan's untouched ones), its evaluation with its layers.
struct PipelineSpace {
  std::vector<std::vector<RegionOption>> regions;
  std::vector<bool> healthy;  // per region: every device at rate 1 (its groups may move)
  std::optional<PipelineEval> fixed;
  bool straggling() const {
    return std::find(healthy.begin(), healthy.end(), false) != healthy.end();
  }
};

bool all_healthy(const std::vector<int>& devices, const Rates& rates) {
  for (int d : devices) {
    if (rates[static_cast<size_t>(d)] != 1.0) return false;
  }
  return true;
}

// Megatron's layout of t-rank groups, S per pipeline, as a search space: every pipeline's devices
// on one node form a region with region_options. `stage_major`: pipeline p's stage j is group
// j·P + p instead of p·S + j, so the stages of a pipeline spread over the nodes and the same stage
// of every pipeline shares a node: pipeline hand-offs (one activation) cross the inter-node links
// and the gradient sync (every parameter) stays inside nodes — the layout for slow links.
std::vector<PipelineSpace> megatron_space(const CostModel& cost, const Rates& rates, int t, int S,
                                          bool stage_major) {
  const ClusterSpec& c = cost.cluster();
  const int per_node = c.devices_per_node / t;
  const int G = c.nodes * per_node;
  const int P = G / S;
  std::vector<PipelineSpace> space(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    std::vector<std::vector<int>> regions;
    int last_node = -1;
    for (int j = 0; j < S; ++j) {
      const int g = stage_major ? j * P + p : p * S + j;
      const int node = g / per_node;
      if (node != last_node) regions.emplace_back(), last_node = node;
      for (int r = g * t; r < (g + 1) * t; ++r) regions.back().push_back(r);
    }
    for (const auto& devices : regions) {
      space[static_cast<size_t>(p)].regions.push_back(region_options(devices, t, rates));
      space[static_cast<size_t>(p)].healthy.push_back(all_healthy(devices, rates));
    }
  }
  return space;
}

// A coordinate descent over a search space on the predicted iteration time, with layers and
// micro-batches assigned exactly for every trial: region by region, the option that lowers the
// time most; then whole healthy TP groups moved from one pipeline to another (move_groups).
class BaseSearch {
 public:
  BaseSearch(const CostModel& cost, PipelineEvaluator& evaluate, const Rates& rates,
             std::vector<PipelineSpace> space)
      : cost_(cost), evaluate_(evaluate), rates_(rates), space_(std::move(space)) {
    const size_t P = space_.size();
    choice_.resize(P);
    moves_.resize(P);
    evals_.resize(P);
    cache_.resize(P);
    for (size_t p = 0; p < P; ++p) {
      choice_[p].assign(space_[p].regions.size(), 0);
      evals_[p] = &eval(p);
    }
  }

  // Runs the descent and appends its best `keep` states to `out`.
  void run(std::vector<Candidate>& out, int keep, bool move_groups = true) {
    double current = objective(nullptr);
    record(current);
    for (int pass = 0; pass < 2; ++pass) {
      if (!descend(current)) break;
    }
    if (move_groups) {
      for (int round = 0; round < 4 && move_group(current); ++round) {
        descend(current);
      }
    }
    std::sort(found_.begin(), found_.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (int i = 0; i < std::min(keep, to_int(found_.size())); ++i) {
      Candidate c;
      c.plan = std::move(found_[static_cast<size_t>(i)].second);
      out.push_back(std::move(c));
    }
  }

  // Healthy-cluster quality of this base: the objective of the initial state.
  double initial_objective() { return objective(nullptr); }

 private:
  // Whole healthy TP groups a pipeline gave away and received (appended after its stages or put
  // before them), by their ranks.
  struct Moves {
    std::vector<std::vector<int>> given;
    std::vector<std::vector<int>> front, back;
    bool empty() const { return given.empty() && front.empty() && back.empty(); }
    bool operator<(const Moves& o) const {
      return std::tie(given, front, back) < std::tie(o.given, o.front, o.back);
    }
  };

  // One pass over every region with a choice; whether the time fell.
  bool descend(double& current) {
    bool improved = false;
    for (size_t p = 0; p < space_.size(); ++p) {
      for (size_t r = 0; r < space_[p].regions.size(); ++r) {
        if (space_[p].regions[r].size() <= 1) continue;
        const int was = choice_[p][r];
        int best = was;
        for (int o = 0; o < to_int(space_[p].regions[r].size()); ++o) {
          if (o == was) continue;
          choice_[p][r] = o;
          evals_[p] = &eval(p);
          const double value = objective(nullptr);
          if (value < current * (1 - 1e-9)) {
            current = value;
            best = o;
            improved = true;
            record(value);
          }
        }
        choice_[p][r] = best;
        evals_[p] = &eval(p);
      }
    }
    return improved;
  }

  // Pipelines worth moving groups between: those with a straggler or with groups moved, and one
  // of the others (alike, as a rule).
  std::vector<size_t> movers() const {
    std::vector<size_t> out;
    bool untouched = false;
    for (size_t p = 0; p < space_.size(); ++p) {
      const bool touched = !moves_[p].empty() || space_[p].straggling();
      if (touched || !untouched) out.push_back(p);
      untouched = untouched || !touched;
    }
    return out;
  }

  // The groups of pipeline p that can move: in healthy regions, not given yet; the first and the
  // last such (the ends of its stage order).
  std::vector<std::vector<int>> movable(size_t p) const {
    std::vector<std::vector<int>> all;
    for (size_t r = 0; r < space_[p].regions.size(); ++r) {
      if (!space_[p].healthy[r]) continue;
      const RegionOption& o = space_[p].regions[r][static_cast<size_t>(choice_[p][r])];
      for (const auto& g : o.groups) {
        const auto& given = moves_[p].given;
        if (std::find(given.begin(), given.end(), g) == given.end()) all.push_back(g);
      }
    }
    if (all.size() <= 2) return all;
    return {all.front(), all.back()};
  }

  size_t stage_count(size_t p) const { return evals_[p]->stages.size(); }

  // The best single move of a whole healthy TP group from one pipeline to another (Malleus's
  // planner's: a pipeline that lost a device gives a healthy group to another, so that both run
  // as many stages); applied when it lowers the time. Returns whether one was.
  bool move_group(double& current) {
    const std::vector<size_t> pipes = movers();
    double best = current * (1 - 1e-9);
    size_t best_from = 0, best_to = 0;
    std::vector<int> best_group;
    bool best_front = false, found = false;
    for (size_t from : pipes) {
      if (stage_count(from) <= 1) continue;
      for (const auto& group : movable(from)) {
        for (size_t to : pipes) {
          if (to == from) continue;
          for (bool front : {false, true}) {
            apply_move(from, to, group, front);
            const double value = objective(nullptr);
            if (value < best) {
              best = value, found = true;
              best_from = from, best_to = to, best_group = group, best_front = front;
            }
            undo_move(from, to, front);
          }
        }
      }
    }
    if (!found) return false;
    apply_move(best_from, best_to, best_group, best_front);
    current = best;
    record(best);
    return true;
  }

  void apply_move(size_t from, size_t to, const std::vector<int>& group, bool front) {
    moves_[from].given.push_back(group);
    (front ? moves_[to].front : moves_[to].back).push_back(group);
    evals_[from] = &eval(from);
    evals_[to] = &eval(to);
  }

  void undo_move(size_t from, size_t to, bool front) {
    moves_[from].given.pop_back();
    (front ? moves_[to].front : moves_[to].back).pop_back();
    evals_[from] = &eval(from);
    evals_[to] = &eval(to);
  }

  const PipelineEval& eval(size_t p) {
    const std::vector<int>& choice = choice_[p];
    const Moves& moves = moves_[p];
    bool initial = moves.empty();
    for (int c : choice) initial = initial && c == 0;
    if (initial && space_[p].fixed) return *space_[p].fixed;
    auto& cache = cache_[p];
    const auto key = std::make_pair(choice, moves);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    std::vector<Stage> stages;
    for (auto it_front = moves.front.rbegin(); it_front != moves.front.rend(); ++it_front) {
      stages.push_back(make_group(cost_, *it_front, false, rates_));
    }
    for (size_t r = 0; r < choice.size(); ++r) {
      const RegionOption& o = space_[p].regions[r][static_cast<size_t>(choice[r])];
      for (const auto& g : o.groups) {
        if (std::find(moves.given.begin(), moves.given.end(), g) != moves.given.end()) continue;
        stages.push_back(make_group(cost_, g, o.balance, rates_));
      }
    }
    for (const auto& g : moves.back) stages.push_back(make_group(cost_, g, false, rates_));
    return cache.emplace(key, evaluate_(std::move(stages), rates_, to_int(space_.size())))
        .first->second;
  }

  double objective(std::vector<int>* micro_batches) {
    std::vector<double> first, period;
    first.reserve(evals_.size());
    period.reserve(evals_.size());
    for (const PipelineEval* e : evals_) {
      first.push_back(e->feasible ? e->first : kInf);
      period.push_back(e->feasible ? e->period : kInf);
    }
    auto m = assign_micro_batches(cost_.batch().micro_batches(), first, period, true);
    const double t = allocation_time(first, period, m);
    if (micro_batches) *micro_batches = std::move(m);
    return t;
  }

  void record(double value) {
    if (!std::isfinite(value)) return;
    std::vector<int> m;
    objective(&m);
    found_.emplace_back(value, assemble(cost_, evals_, m));
  }

  const CostModel& cost_;
  PipelineEvaluator& evaluate_;
  const Rates& rates_;
  std::vector<PipelineSpace> space_;
  std::vector<std::vector<int>> choice_;
  std::vector<Moves> moves_;
  std::vector<const PipelineEval*> evals_;
  std::vector<std::map<std::pair<std::vector<int>, Moves>, PipelineEval>> cache_;
  std::vector<std::pair<double, Plan>> found_;
};

// A base of the search: t-rank TP groups, S per pipeline, and how fast it is when healthy.
struct Base {
  int t, S;
  double healthy_time;
  bool stage_major = false;  // BaseSearch's layout for slow inter-node links
};

class MalleusSearch {
 public:
  MalleusSearch(const CostModel& cost, const PlanRequest& request, const PlannerOptions& options)
      : cost_(cost),
        request_(request),
        options_(options),
        rates_(full_rates(request.rates, cost.cluster().num_devices())),
        healthy_(static_cast<size_t>(cost.cluster().num_devices()), 1.0),
        evaluate_(cost),
        evaluate_healthy_(cost) {}

  PlanResult run() {
    const auto start = Clock::now();
    PhaseClock clock;
    const std::vector<Base> bases = enumerate_bases();
    clock.lap("bases");
    search(bases);
    clock.lap("search");
    add_baselines();
    add_current();
    clock.lap("baselines");
    check(!candidates_.empty(), "malleus: no plan fits the devices that are left");
    score();
    clock.lap("score");
    const std::vector<Candidate*> pool = refine();
    clock.lap("refine");
    PlanResult r = finish("malleus", cost_, choose(pool).plan, rates_, start);
    clock.lap("finish");
    r.phases = clock.phases();
    r.note = std::to_string(candidates_.size()) + " candidates from " +
             std::to_string(bases.size()) + " bases; " + std::to_string(evaluate_.evaluations()) +
             " pipelines evaluated, " + std::to_string(evaluate_.reused()) + " reused";
    return r;
  }

 private:
  // The fewest stages of t-rank groups for which a healthy pipeline fits in memory under `cost`;
  // 0 if none.
  int fewest_stages(const CostModel& cost, int t, int groups) const {
    for (int S = 1; S <= std::min(groups, cost.model().num_layers); ++S) {
      std::vector<Stage> stages;
      for (int g = 0; g < S; ++g) {
        std::vector<int> ranks;
        for (int r = g * t; r < (g + 1) * t; ++r) ranks.push_back(r);
        stages.push_back(make_group(cost, ranks, false, healthy_));
      }
      if (evaluate_pipeline(cost, stages, healthy_, std::max(1, groups / S)).feasible) return S;
    }
    return 0;
  }

  // Bases (t, S): for each TP degree the fewest stages that fit, a few more, the stage counts that
  // tile the cluster evenly, and the request's base shape.
  std::vector<Base> enumerate_bases() {
    const ClusterSpec& c = cost_.cluster();
    const int L = cost_.model().num_layers;
    bool slow_links = false;
    for (int n = 0; n < c.nodes; ++n) slow_links = slow_links || c.link_rate(n) > 1;
    std::vector<Base> bases;
    for (int t : tp_degrees(cost_)) {
      const int G = c.nodes * (c.devices_per_node / t);
      const int s_min = fewest_stages(cost_, t, G);
      if (s_min == 0) continue;
      // Recomputation lets fewer stages fit, but the deeper pipelines that fit without it
      // recompute nothing and are often faster: the counts start from both fewest.
      std::vector<int> fewest{s_min};
      if (cost_.recompute_allowed()) {
        CostModel plain = cost_;
        plain.allow_recompute(false);
        const int s_plain = fewest_stages(plain, t, G);
        if (s_plain > s_min) fewest.push_back(s_plain);
      }
      std::vector<int> counts;
      for (int low : fewest) {
        for (int S = low; S <= std::min({G, L, 2 * low + 2}); ++S) {
          const bool tiles =
              G % S == 0 || (S * t) % c.devices_per_node == 0 || c.devices_per_node % (S * t) == 0;
          if (S <= low + 2 || tiles) counts.push_back(S);
        }
      }
      const Shape& base = request_.base;
      if (base.tp == t && base.pp <= std::min(G, L) && base.pp >= 1) counts.push_back(base.pp);
      std::sort(counts.begin(), counts.end());
      counts.erase(std::unique(counts.begin(), counts.end()), counts.end());
      for (int S : counts) {
        BaseSearch probe(cost_, evaluate_healthy_, healthy_,
                         megatron_space(cost_, healthy_, t, S, false));
        bases.push_back({t, S, probe.initial_objective()});
        // With a slow inter-node link, also the layout that puts pipeline hand-offs rather than
        // the gradient sync on the links (only then: on healthy links Megatron's is never worse
        // by the cost model, and the search stays as fast).
        if (slow_links && S > 1 && G % S == 0 && G / S > 1) {
          BaseSearch across(cost_, evaluate_healthy_, healthy_,
                            megatron_space(cost_, healthy_, t, S, true));
          bases.push_back({t, S, across.initial_objective(), true});
        }
      }
    }
    return bases;
  }

  // Coordinate descent from every base worth searching: a base far slower when healthy rarely
  // wins under stragglers, but on small clusters (few bases) it can, so prune only where there
  // are many.
  void search(const std::vector<Base>& bases) {
    double best_healthy = kInf;
    for (const Base& b : bases) best_healthy = std::min(best_healthy, b.healthy_time);
    const double prune = bases.size() > 24 ? 1.5 : kInf;
    for (const Base& b : bases) {
      const bool is_base = b.t == request_.base.tp && b.S == request_.base.pp;
      if (!is_base && !(b.healthy_time <= prune * best_healthy)) continue;
      BaseSearch(cost_, evaluate_, rates_, megatron_space(cost_, rates_, b.t, b.S, b.stage_major))
          .run(candidates_, 3, options_.move_groups);
    }
  }

  void add_refined(Plan plan) {
    Candidate cand;
    cand.plan = std::move(plan);
    cand.must_refine = true;
    candidates_.push_back(std::move(cand));
  }

  // The baselines' plans are points of our search space too; they are always re-scored.
  void add_baselines() {
    const Shape shape = resolve_base(cost_, request_.base);
    try {
      const BaseLayout base = base_layout(cost_, shape, rates_);
      for (const UnevenAssignment uneven :
           {UnevenAssignment{.layers = true, .micro_batches = true},
            UnevenAssignment{.layers = true}, UnevenAssignment{.micro_batches = true},
            UnevenAssignment{}}) {
        add_refined(uneven_plan(cost_, base, rates_, uneven));
      }
    } catch (const Error&) {
      // every base pipeline holds a gone device
    }
    UniformChoice dropped = drop_slow_choice(cost_, rates_, options_.straggler_threshold);
    if (!dropped.plan.pipelines.empty()) add_refined(std::move(dropped.plan));
  }

  // The running plan, when it can still run here: keeping it is always an option.
  bool current_is_usable() const {
    if (!request_.current) return false;
    const Plan& current = *request_.current;
    bool ok = current.world_size == cost_.cluster().num_devices() &&
              current.global_batch() == cost_.batch().global_batch;
    for (const auto& p : current.pipelines) {
      for (const auto& s : p.stages) ok = ok && !uses_gone(s.ranks, rates_);
    }
    return ok;
  }

  void add_current() {
    if (current_is_usable()) add_refined(*request_.current);
  }

  // Scores every candidate with the cost model (score), then re-scores the best few (and the
  // baseline-shaped ones) with the evaluator when there is one (refine, which returns them).
  void score() {
    for (auto& cand : candidates_) {
      const Prediction pred = cost_.predict(cand.plan, rates_);
      cand.score = pred.fits ? pred.iteration_time : kInf;
    }
    std::stable_sort(candidates_.begin(), candidates_.end(),
                     [](const Candidate& a, const Candidate& b) { return a.score < b.score; });
  }

  std::vector<Candidate*> refine() {
    std::vector<Candidate*> pool;
    for (size_t i = 0; i < candidates_.size(); ++i) {
      Candidate& cand = candidates_[i];
      if (!std::isfinite(cand.score)) continue;
      if (to_int(i) < options_.refine_top || cand.must_refine) pool.push_back(&cand);
    }
    check(!pool.empty(), "malleus: no candidate plan fits in device memory");
    for (Candidate* cand : pool) {
      cand->refined = options_.refine ? options_.refine(cand->plan, rates_) : cand->score;
    }
    return pool;
  }

  // Bytes switching from the running plan to `plan` moves (0 without a running plan).
  double moved_bytes(const Plan& plan) const {
    if (!request_.current) return 0;
    if (options_.migration && request_.current->world_size == plan.world_size) {
      return options_.migration(*request_.current, plan);
    }
    return plan.to_json() == request_.current->to_json() ? 0.0 : 1.0;
  }

  // Among the candidates within the tie tolerance of the best, the one that moves least, then the
  // fastest.
  const Candidate& choose(const std::vector<Candidate*>& pool) const {
    double best = kInf;
    for (const Candidate* cand : pool) best = std::min(best, cand->refined);
    const Candidate* chosen = nullptr;
    double chosen_moved = kInf;
    for (const Candidate* cand : pool) {
      if (cand->refined > best * (1 + options_.tie_tolerance)) continue;
      const double moved = moved_bytes(cand->plan);
      if (!chosen || moved < chosen_moved ||
          (moved == chosen_moved && cand->refined < chosen->refined)) {
        chosen = cand;
        chosen_moved = moved;
      }
    }
    return *chosen;
  }

  const CostModel& cost_;
  const PlanRequest& request_;
  const PlannerOptions& options_;
  const Rates rates_, healthy_;
  PipelineEvaluator evaluate_, evaluate_healthy_;  // under the rates; on the healthy cluster
  std::vector<Candidate> candidates_;
};

class MalleusStrategy : public Strategy {
 public:
  explicit MalleusStrategy(PlannerOptions options) : options_(std::move(options)) {}
  std::string name() const override { return "malleus"; }
  PlanResult plan(const CostModel& cost, const PlanRequest& request) const override {
    return MalleusSearch(cost, request, options_).run();
  }

 private:
  PlannerOptions options_;
};

}  // namespace

std::unique_ptr<Strategy> make_malleus_strategy(PlannerOptions options) {
  return std::make_unique<MalleusStrategy>(std::move(options));
}

}  // namespace malleus::plan::detail
