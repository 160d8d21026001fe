// Ours: a search over TP groupings around the stragglers, with layers and micro-batches assigned
// exactly for every trial (docs/planner.md, "Outer search"). One call is one MalleusSearch: its
// inputs and the candidates it collects, phase by phase.
#include <algorithm>
#include <cmath>
#include <cstdio>
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

// Whether two plans are the same: pipelines, micro-batches, stages (layers, ranks, shares,
// recomputation).
bool same_plan(const Plan& a, const Plan& b) {
  if (a.world_size != b.world_size || a.micro_batch_size != b.micro_batch_size ||
      a.pipelines.size() != b.pipelines.size()) {
    return false;
  }
  for (size_t p = 0; p < a.pipelines.size(); ++p) {
    const Pipeline &x = a.pipelines[p], &y = b.pipelines[p];
    if (x.micro_batches != y.micro_batches || x.stages.size() != y.stages.size()) return false;
    for (size_t j = 0; j < x.stages.size(); ++j) {
      const Stage &s = x.stages[j], &t = y.stages[j];
      if (s.layer_begin != t.layer_begin || s.layer_end != t.layer_end || s.ranks != t.ranks ||
          s.heads != t.heads || s.ffn != t.ffn || s.vocab != t.vocab ||
          s.recompute.mode != t.recompute.mode || s.recompute.layers != t.recompute.layers ||
          s.recompute_ahead != t.recompute_ahead) {
        return false;
      }
    }
  }
  return true;
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

  static constexpr int kMoveRounds = 8;  // group moves (each followed by a descent), at most

  // Runs the descent and appends its best `keep` states to `out`.
  void run(std::vector<Candidate>& out, int keep, bool move_groups = true) {
    double current = objective(nullptr);
    record(current);
    for (int pass = 0; pass < 2; ++pass) {
      if (!descend(current)) break;
    }
    if (move_groups) {
      for (int round = 0; round < kMoveRounds && move_group(current); ++round) {
        descend(current);
      }
      if (dissolve(current)) descend(current);
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

  // Pipelines worth moving groups between: those searched with a straggler or with groups moved
  // (at most kMovers: the slowest and the fastest per micro-batch), and one of the others (alike,
  // as a rule).
  std::vector<size_t> movers() const {
    constexpr size_t kMovers = 16;
    std::vector<size_t> touched;
    std::optional<size_t> untouched;
    for (size_t p = 0; p < space_.size(); ++p) {
      if (!moves_[p].empty() || (!space_[p].fixed && space_[p].straggling())) {
        touched.push_back(p);
      } else if (!untouched) {
        untouched = p;
      }
    }
    if (touched.size() > kMovers) {
      std::stable_sort(touched.begin(), touched.end(),
                       [&](size_t a, size_t b) { return evals_[a]->period > evals_[b]->period; });
      touched.erase(touched.begin() + kMovers / 2, touched.end() - kMovers / 2);
    }
    if (untouched) touched.push_back(*untouched);
    return touched;
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

  // The compound move no single one reaches: a pipeline with a straggler gives every healthy
  // group it has to the others, one each (those with the fewest stages first), and runs no more.
  // Tried for each such pipeline; the best is kept when it lowers the time.
  bool dissolve(double& current) {
    std::vector<size_t> order(space_.size());
    for (size_t p = 0; p < order.size(); ++p) order[p] = p;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return stage_count(a) != stage_count(b) ? stage_count(a) < stage_count(b)
                                              : evals_[a]->period < evals_[b]->period;
    });
    double best = current * (1 - 1e-9);
    std::optional<size_t> best_from;
    for (size_t from = 0; from < space_.size(); ++from) {
      if (space_[from].fixed || !space_[from].straggling()) continue;
      const auto applied = give_away(from, order);
      const double value = objective(nullptr);
      if (value < best) best = value, best_from = from;
      for (auto it = applied.rbegin(); it != applied.rend(); ++it) undo_move(from, *it, false);
    }
    if (!best_from) return false;
    give_away(*best_from, order);
    current = best;
    record(best);
    return true;
  }

  // Moves every healthy group of `from` to the next pipeline of `order`; returns the receivers.
  std::vector<size_t> give_away(size_t from, const std::vector<size_t>& order) {
    std::vector<size_t> receivers;
    size_t next = 0;
    for (size_t r = 0; r < space_[from].regions.size(); ++r) {
      if (!space_[from].healthy[r]) continue;
      const RegionOption& o = space_[from].regions[r][static_cast<size_t>(choice_[from][r])];
      for (const auto& g : o.groups) {
        const auto& given = moves_[from].given;
        if (std::find(given.begin(), given.end(), g) != given.end()) continue;
        while (next < order.size() && order[next] == from) ++next;
        if (next == order.size()) return receivers;
        apply_move(from, order[next], g, false);
        receivers.push_back(order[next++]);
      }
    }
    return receivers;
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
    std::optional<std::vector<int>> changed = changed_devices();
    std::string checked;  // why the incremental plan was checked against the full search
    if (changed) {
      BaseSearch(cost_, evaluate_, rates_, incremental_space(*changed))
          .run(candidates_, 3, options_.move_groups);
      clock.lap("incremental");
      if (candidates_.empty()) changed.reset();  // nothing fits near the running plan
      if (changed) checked = short_of_capacity();
      if (!checked.empty()) changed.reset();  // the full search's candidates join the pool
    }
    size_t bases = 0;
    if (!changed) {
      const std::vector<Base> all = enumerate_bases();
      bases = all.size();
      clock.lap("bases");
      search(all);
      clock.lap("search");
      add_baselines();
      clock.lap("baselines");
    }
    add_current();
    check(!candidates_.empty(), "malleus: no plan fits the devices that are left");
    score();
    clock.lap("score");
    const std::vector<Candidate*> pool = refine();
    clock.lap("refine");
    PlanResult r = finish("malleus", cost_, choose(pool).plan, rates_, start);
    clock.lap("finish");
    r.phases = clock.phases();
    r.incremental = changed.has_value();
    r.note = (changed ? "incremental from the running plan (" + std::to_string(changed->size()) +
                            " devices changed): "
                      : checked) +
             std::to_string(candidates_.size()) + " candidates from " + std::to_string(bases) +
             " bases; " + std::to_string(evaluate_.evaluations()) + " pipelines evaluated, " +
             std::to_string(evaluate_.reused()) + " reused";
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

  // ---- the incremental re-plan ----------------------------------------------------------------

  // The devices whose rate differs from the rates the running plan was made for, when the request
  // gives those and at most kIncrementalDevices changed; nullopt: the full search.
  std::optional<std::vector<int>> changed_devices() const {
    if (!request_.current || !request_.previous_rates) return std::nullopt;
    const Plan& current = *request_.current;
    const int N = cost_.cluster().num_devices();
    if (current.world_size != N || current.global_batch() != cost_.batch().global_batch) {
      return std::nullopt;
    }
    const Rates before = full_rates(*request_.previous_rates, N);
    std::vector<int> changed;
    for (size_t d = 0; d < before.size(); ++d) {
      if (before[d] != rates_[d]) changed.push_back(to_int(d));
    }
    if (to_int(changed.size()) > kIncrementalDevices) return std::nullopt;
    return changed;
  }

  // Non-empty (the reason) when the cluster is small enough for the full search to be cheap and
  // the best incremental candidate is predicted more than kIncrementalSlack slower than the
  // running plan scaled by the capacity the change took (kIncrementalCheckDevices).
  std::string short_of_capacity() const {
    const int N = cost_.cluster().num_devices();
    if (N > kIncrementalCheckDevices) return "";
    const Rates before = full_rates(*request_.previous_rates, N);
    const double after_capacity = remaining_capacity(rates_);
    const Prediction was = cost_.predict(*request_.current, before);
    if (!was.fits || !std::isfinite(was.iteration_time) || after_capacity <= 0) return "";
    const double bound = was.iteration_time * remaining_capacity(before) / after_capacity;
    double best = kInf;
    for (const Candidate& cand : candidates_) {
      const Prediction pred = cost_.predict(cand.plan, rates_);
      if (pred.fits) best = std::min(best, pred.iteration_time);
    }
    if (best <= bound * (1 + kIncrementalSlack)) return "";
    char why[160];
    std::snprintf(why, sizeof why,
                  "incremental plan %.2f %% above the running plan scaled to the capacity left, "
                  "checked against the full search: ",
                  100 * (best / bound - 1));
    return why;
  }

  // The running plan's pipelines as a search space: the ones that hold a changed device (or, for
  // a changed idle device, the pipeline with most ranks on its node, which may take it in) are
  // searched region by region from their current groups; the rest stay as they are, layers
  // included, and only their micro-batches (which move no state) and group moves can change.
  std::vector<PipelineSpace> incremental_space(const std::vector<int>& changed) const {
    const Plan& current = *request_.current;
    const ClusterSpec& c = cost_.cluster();
    const int P = to_int(current.pipelines.size());
    std::vector<int> owner(static_cast<size_t>(c.num_devices()), -1);
    for (int p = 0; p < P; ++p) {
      for (const auto& s : current.pipelines[static_cast<size_t>(p)].stages) {
        for (int r : s.ranks) owner[static_cast<size_t>(r)] = p;
      }
    }
    std::vector<bool> searched(static_cast<size_t>(P), false);
    std::map<std::pair<int, int>, std::vector<int>> taken_in;  // (pipeline, node) → idle devices
    for (int d : changed) {
      if (owner[static_cast<size_t>(d)] >= 0) {
        searched[static_cast<size_t>(owner[static_cast<size_t>(d)])] = true;
        continue;
      }
      const int node = c.node_of(d);
      std::map<int, int> on_node;
      for (int r = node * c.devices_per_node; r < (node + 1) * c.devices_per_node; ++r) {
        if (owner[static_cast<size_t>(r)] >= 0) ++on_node[owner[static_cast<size_t>(r)]];
      }
      if (on_node.empty()) continue;  // a whole idle node stays idle
      const auto most = std::max_element(on_node.begin(), on_node.end(),
                                         [](auto a, auto b) { return a.second < b.second; });
      searched[static_cast<size_t>(most->first)] = true;
      taken_in[{most->first, node}].push_back(d);
    }
    std::vector<PipelineSpace> space;
    for (int p = 0; p < P; ++p) {
      const Pipeline& pipe = current.pipelines[static_cast<size_t>(p)];
      space.push_back(searched[static_cast<size_t>(p)] ? searched_pipeline(pipe, p, taken_in)
                                                       : kept_pipeline(pipe, P));
    }
    return space;
  }

  // Stages of a pipeline in runs on one node: its regions.
  std::vector<std::vector<const Stage*>> node_runs(const Pipeline& pipe) const {
    std::vector<std::vector<const Stage*>> runs;
    int last = -1;
    for (const auto& s : pipe.stages) {
      const int node = cost_.cluster().node_of(s.ranks[0]);
      if (runs.empty() || node != last) runs.emplace_back();
      runs.back().push_back(&s);
      last = node;
    }
    return runs;
  }

  // A pipeline searched near its current groups: per region, its groups as they are (shares
  // balanced where a member straggles), then region_options over its devices and the idle
  // devices it takes in.
  PipelineSpace searched_pipeline(
      const Pipeline& pipe, int p,
      const std::map<std::pair<int, int>, std::vector<int>>& taken_in) const {
    PipelineSpace out;
    for (const auto& run : node_runs(pipe)) {
      std::vector<int> devices;
      RegionOption now;
      int widest = 1;
      bool usable = true;
      for (const Stage* s : run) {
        devices.insert(devices.end(), s->ranks.begin(), s->ranks.end());
        now.groups.push_back(s->ranks);
        widest = std::max(widest, s->tp());
        usable = usable && !uses_gone(s->ranks, rates_);
      }
      const auto in = taken_in.find({p, cost_.cluster().node_of(run[0]->ranks[0])});
      if (in != taken_in.end()) devices.insert(devices.end(), in->second.begin(), in->second.end());
      int t = 1;
      while (t * 2 <= widest) t *= 2;
      now.balance = !all_healthy(devices, rates_);
      std::vector<RegionOption> options;
      if (usable) options.push_back(now);
      for (auto& o : region_options(devices, t, rates_)) {
        if (std::find(options.begin(), options.end(), o) == options.end()) options.push_back(o);
      }
      out.regions.push_back(std::move(options));
      out.healthy.push_back(all_healthy(devices, rates_));
    }
    return out;
  }

  // A pipeline kept as it is: its regions' only option is its groups (should a group move), and
  // its evaluation keeps its layers.
  PipelineSpace kept_pipeline(const Pipeline& pipe, int pipelines) const {
    PipelineSpace out;
    for (const auto& run : node_runs(pipe)) {
      RegionOption o;
      o.balance = false;
      std::vector<int> devices;
      for (const Stage* s : run) {
        o.groups.push_back(s->ranks);
        devices.insert(devices.end(), s->ranks.begin(), s->ranks.end());
      }
      out.regions.push_back({o});
      out.healthy.push_back(all_healthy(devices, rates_));
    }
    out.fixed = kept_eval(pipe, pipelines);
    return out;
  }

  // The time coefficients of a pipeline with its stages and layers as they are.
  PipelineEval kept_eval(const Pipeline& pipe, int pipelines) const {
    PipelineEval e;
    const int S = to_int(pipe.stages.size());
    std::vector<StagePrediction> preds;
    for (int j = 0; j < S; ++j) {
      const Stage& s = pipe.stages[static_cast<size_t>(j)];
      const GroupCost g = cost_.group_cost(s, rates_);
      if (g.gone) return e;
      CostModel::StageQuery q;
      q.layers = s.num_layers();
      q.first = j == 0;
      q.last = j == S - 1;
      q.in_flight = S - j;
      q.planned = s.recompute;
      q.pipelines = pipelines;
      q.timing = s.recompute_ahead ? RecomputeTiming::kAhead : RecomputeTiming::kInBackward;
      StagePrediction sp;
      sp.cost = cost_.stage_cost(g, q);
      if (!sp.cost.fits) return e;
      if (j + 1 < S) sp.p2p_next = cost_.p2p_time(s, pipe.stages[static_cast<size_t>(j + 1)]);
      preds.push_back(sp);
    }
    const PipelinePrediction pp = CostModel::pipeline_time(std::move(preds), 1);
    e.feasible = true;
    e.first = pp.first_micro_batch;
    e.period = pp.period;
    e.stages = pipe.stages;
    return e;
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
    if (same_plan(plan, *request_.current)) return 0;
    if (options_.migration && request_.current->world_size == plan.world_size) {
      return options_.migration(*request_.current, plan);
    }
    return 1.0;
  }

  // Among the candidates within the tie tolerance of the best, the one that moves least, then the
  // fastest. The running plan moves nothing and wins a tie outright; a single distinct plan needs
  // no comparison. Otherwise the migration estimate (the layout algebra's, a second or more per
  // plan at 4,096 devices) is asked for the kMigrationEstimates best-scored distinct plans.
  static constexpr size_t kMigrationEstimates = 2;
  const Candidate& choose(const std::vector<Candidate*>& pool) const {
    double best = kInf;
    for (const Candidate* cand : pool) best = std::min(best, cand->refined);
    std::vector<const Candidate*> tied;  // distinct plans, the fastest of equal ones
    for (const Candidate* cand : pool) {
      if (cand->refined > best * (1 + options_.tie_tolerance)) continue;
      auto same = std::find_if(tied.begin(), tied.end(),
                               [&](const Candidate* t) { return same_plan(t->plan, cand->plan); });
      if (same == tied.end()) {
        tied.push_back(cand);
      } else if (cand->refined < (*same)->refined) {
        *same = cand;
      }
    }
    for (const Candidate* cand : tied) {
      if (request_.current && same_plan(cand->plan, *request_.current)) return *cand;
    }
    const Candidate* chosen = tied.front();
    double chosen_moved = kInf;
    for (size_t i = 0; i < tied.size() && tied.size() > 1 && i < kMigrationEstimates; ++i) {
      const double moved = moved_bytes(tied[i]->plan);
      if (moved < chosen_moved || (moved == chosen_moved && tied[i]->refined < chosen->refined)) {
        chosen = tied[i];
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
