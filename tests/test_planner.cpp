// The planner: its exact sub-problems against brute force, every strategy's plans valid, ours
// optimal against an exhaustive search on small clusters and never worse than a baseline, and
// the tie-break toward the running plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "common/error.h"
#include "common/json.h"
#include "model/config.h"
#include "plan/cost_model.h"
#include "plan/planner.h"
#include "replan/replan.h"
#include "test_models.h"

using namespace malleus;
using malleus::testing::planner_model;
using plan::CostModel;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// All compositions of `total` into `parts` parts of at least `least`.
void compositions(int total, int parts, int least, std::vector<int>& cur,
                  const std::function<void(const std::vector<int>&)>& f) {
  if (parts == 0) {
    if (total == 0) f(cur);
    return;
  }
  for (int x = least; x <= total - least * (parts - 1); ++x) {
    cur.push_back(x);
    compositions(total - x, parts - 1, least, cur, f);
    cur.pop_back();
  }
}

plan::ClusterSpec small_cluster(int nodes, int per_node) {
  auto c = plan::load_cluster("a800-8x8");
  c.nodes = nodes;
  c.devices_per_node = per_node;
  c.memory_bytes = 2e9;  // small enough that memory shapes the plans
  return c;
}

std::vector<plan::Rates> rate_patterns(int devices) {
  std::vector<plan::Rates> out;
  plan::Rates r(static_cast<size_t>(devices), 1.0);
  out.push_back(r);
  r[1] = 2;
  out.push_back(r);
  r[1] = 1, r[2] = 5;
  out.push_back(r);
  r[2] = 1, r[0] = kInf;
  out.push_back(r);
  r[0] = 1, r[1] = 3, r[3] = 1.5;
  out.push_back(r);
  if (devices > 4) {
    plan::Rates node(static_cast<size_t>(devices), 1.0);
    for (int d = 4; d < 8; ++d) node[static_cast<size_t>(d)] = 2;
    out.push_back(node);
  }
  return out;
}

}  // namespace

TEST(Planner, AssignLayersIsOptimalAgainstBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.2, 3.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int S = 1 + static_cast<int>(rng() % 4);
    const int L = S + static_cast<int>(rng() % 8);
    std::vector<std::function<double(int)>> fns;
    for (int j = 0; j < S; ++j) {
      const double a = u(rng), c = u(rng), kink = u(rng);
      const int knee = 1 + static_cast<int>(rng() % 4);
      const int cap = trial % 3 == 0 ? 1 + static_cast<int>(rng() % L) : L;
      // Linear with a steeper part past `knee` (recomputation) and a memory cap.
      fns.emplace_back([=](int l) {
        if (l > cap) return kInf;
        return c + a * l + kink * std::max(0, l - knee);
      });
    }
    double brute = kInf;
    std::vector<int> cur;
    compositions(L, S, 1, cur, [&](const std::vector<int>& ls) {
      double worst = 0;
      for (int j = 0; j < S; ++j)
        worst = std::max(worst, fns[static_cast<size_t>(j)](ls[static_cast<size_t>(j)]));
      brute = std::min(brute, worst);
    });
    const auto got = plan::assign_layers(L, fns);
    if (!std::isfinite(brute)) {
      EXPECT_TRUE(got.empty()) << "trial " << trial;
      continue;
    }
    ASSERT_EQ(static_cast<int>(got.size()), S) << "trial " << trial;
    int sum = 0;
    double worst = 0;
    for (int j = 0; j < S; ++j) {
      EXPECT_GE(got[static_cast<size_t>(j)], 1);
      sum += got[static_cast<size_t>(j)];
      worst = std::max(worst, fns[static_cast<size_t>(j)](got[static_cast<size_t>(j)]));
    }
    EXPECT_EQ(sum, L);
    EXPECT_DOUBLE_EQ(worst, brute) << "trial " << trial;
  }
}

TEST(Planner, AssignMicroBatchesIsOptimalAgainstBruteForce) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.5, 4.0);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 4);
    const int total = n + static_cast<int>(rng() % 8);
    const bool allow_zero = trial % 2 == 0;
    std::vector<double> first, period;
    for (int i = 0; i < n; ++i) {
      period.push_back(u(rng));
      first.push_back(period.back() * (1 + static_cast<int>(rng() % 4)) + u(rng));
    }
    auto value = [&](const std::vector<int>& m) {
      double t = 0;
      for (int i = 0; i < n; ++i) {
        const auto k = static_cast<size_t>(i);
        if (m[k] > 0) t = std::max(t, first[k] + (m[k] - 1) * period[k]);
      }
      return t;
    };
    double brute = kInf;
    std::vector<int> cur;
    compositions(total, n, allow_zero ? 0 : 1, cur,
                 [&](const std::vector<int>& m) { brute = std::min(brute, value(m)); });
    const auto got = plan::assign_micro_batches(total, first, period, allow_zero);
    int sum = 0;
    for (int x : got) {
      EXPECT_GE(x, allow_zero ? 0 : 1);
      sum += x;
    }
    EXPECT_EQ(sum, total);
    EXPECT_NEAR(value(got), brute, 1e-12) << "trial " << trial;
  }
}

// The plain greedy the fast assignment replaces: one micro-batch at a time to the pipeline that
// would finish it first.
std::vector<int> greedy_micro_batches(int total, const std::vector<double>& first,
                                      const std::vector<double>& period, bool allow_zero) {
  std::vector<int> m(first.size(), allow_zero ? 0 : 1);
  int left = total - (allow_zero ? 0 : static_cast<int>(first.size()));
  auto next = [&](size_t i) { return m[i] == 0 ? first[i] : first[i] + m[i] * period[i]; };
  for (; left > 0; --left) {
    size_t best = 0;
    for (size_t i = 1; i < m.size(); ++i) {
      if (next(i) < next(best)) best = i;
    }
    ++m[best];
  }
  return m;
}

TEST(Planner, AssignMicroBatchesMatchesTheGreedyOnLargeInstances) {
  // Many pipelines, most of them alike (as in a large healthy cluster), some infeasible, totals
  // from below the pipeline count to many per pipeline.
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(0.5, 4.0);
  for (int trial = 0; trial < 60; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    const int total = 1 + static_cast<int>(rng() % (40 * n));
    const bool allow_zero = trial % 2 == 0 || total < n;
    const double healthy_first = 3 + u(rng), healthy_period = u(rng) / 4;
    std::vector<double> first, period;
    for (int i = 0; i < n; ++i) {
      const int kind = static_cast<int>(rng() % 10);
      if (kind < 7) {
        first.push_back(healthy_first), period.push_back(healthy_period);
      } else if (kind < 9) {
        period.push_back(u(rng));
        first.push_back(period.back() * 4 + u(rng));
      } else {
        first.push_back(kInf), period.push_back(kInf);
      }
    }
    const auto got = plan::assign_micro_batches(total, first, period, allow_zero);
    const auto want = greedy_micro_batches(total, first, period, allow_zero);
    int sum = 0;
    for (int x : got) sum += x;
    EXPECT_EQ(sum, total) << "trial " << trial;
    auto value = [&](const std::vector<int>& m) {
      double time = 0;
      for (size_t i = 0; i < m.size(); ++i) {
        if (m[i] > 0) time = std::max(time, first[i] + (m[i] - 1) * period[i]);
      }
      return time;
    };
    EXPECT_EQ(value(got), value(want)) << "trial " << trial << ", " << n << " pipelines";
  }
}

TEST(Planner, EveryStrategyGivesValidPlans) {
  const auto model = planner_model();
  const CostModel cost(model, small_cluster(2, 4), plan::BatchConfig{16, 1, 1024});
  const int N = 8;
  for (const auto& rates : rate_patterns(N)) {
    const std::string label = plan::rates_to_json(rates).dump();
    std::map<std::string, double> times;
    for (const auto& name : plan::strategy_names()) {
      const auto strategy = plan::make_strategy(name);
      const plan::PlanResult r = strategy->plan(cost, {rates, plan::Shape{2, 2, 2}, std::nullopt});
      EXPECT_NO_THROW(plan::validate(r.plan, model, N, 16, name)) << name << " " << label;
      for (const auto& p : r.plan.pipelines) {
        for (const auto& s : p.stages) {
          for (int rank : s.ranks) {
            EXPECT_FALSE(plan::is_gone(rates[static_cast<size_t>(rank)])) << name << " " << label;
            if (name == "drop-slow") {
              EXPECT_LT(rates[static_cast<size_t>(rank)], 1.2);
            }
          }
        }
      }
      EXPECT_EQ(r.strategy, name);
      times[name] = r.prediction.iteration_time;
      if (name == "uniform" && plan::is_gone(rates[0])) {
        EXPECT_TRUE(r.restart);
      }
    }
    for (const auto& [name, t] : times) {
      EXPECT_LE(times["malleus"], t * (1 + 1e-9)) << name << " " << label;
    }
  }
}

TEST(Planner, UnknownStrategyAndImpossibleRequestsAreErrors) {
  EXPECT_THROW(plan::make_strategy("fastest"), Error);
  const CostModel cost(planner_model(), small_cluster(1, 4), plan::BatchConfig{8, 1, 1024});
  plan::Rates all_gone(4, kInf);
  for (const auto& name : plan::strategy_names()) {
    EXPECT_THROW(plan::make_strategy(name)->plan(cost, {all_gone, plan::Shape{}, std::nullopt}),
                 Error)
        << name;
  }
}

// Exhaustive search over every plan of a 4-device node: which devices run, how they form TP
// groups (any subsets of size 1, 2 or 4), how groups form pipelines and in which order, layers
// per stage, micro-batches per pipeline, even or rate-balanced shares.
double brute_force(const CostModel& cost, const plan::Rates& rates) {
  const int N = 4, L = cost.model().num_layers, M = cost.batch().micro_batches();
  double best = kInf;
  std::vector<std::vector<int>> groups;
  std::function<void(int, std::vector<int>)> form_groups;
  std::function<void(size_t, std::vector<std::vector<int>>&)> form_pipelines;
  auto evaluate = [&](const std::vector<std::vector<int>>& pipes) {
    // pipes: lists of group indices in stage order.
    for (int balance = 0; balance < 2; ++balance) {
      std::vector<std::vector<plan::Stage>> stages(pipes.size());
      for (size_t p = 0; p < pipes.size(); ++p) {
        for (int g : pipes[p]) {
          plan::Stage s;
          s.ranks = groups[static_cast<size_t>(g)];
          if (balance) {
            cost.balance_shares(s, rates);
          } else {
            cost.even_shares_of(s);
          }
          stages[p].push_back(s);
        }
      }
      // Layers per pipeline, then micro-batches.
      std::function<void(size_t, plan::Plan&)> layers_of = [&](size_t p, plan::Plan& plan) {
        if (p == pipes.size()) {
          std::vector<int> cur;
          compositions(M, static_cast<int>(pipes.size()), 1, cur, [&](const std::vector<int>& m) {
            for (size_t i = 0; i < m.size(); ++i) plan.pipelines[i].micro_batches = m[i];
            plan::validate(plan, cost.model(), "brute force");
            const auto pred = cost.predict(plan, rates);
            if (pred.fits) best = std::min(best, pred.iteration_time);
          });
          return;
        }
        std::vector<int> cur;
        compositions(L, static_cast<int>(stages[p].size()), 1, cur,
                     [&](const std::vector<int>& ls) {
                       int begin = 0;
                       for (size_t j = 0; j < ls.size(); ++j) {
                         plan.pipelines[p].stages[j].layer_begin = begin;
                         begin += ls[j];
                         plan.pipelines[p].stages[j].layer_end = begin;
                       }
                       layers_of(p + 1, plan);
                     });
      };
      plan::Plan plan;
      plan.world_size = N;
      plan.micro_batch_size = cost.batch().micro_batch;
      for (auto& s : stages) plan.pipelines.push_back({1, s});
      if (static_cast<int>(pipes.size()) <= M) layers_of(0, plan);
    }
  };
  // Ordered partitions of the groups into pipelines.
  form_pipelines = [&](size_t next, std::vector<std::vector<int>>& pipes) {
    if (next == groups.size()) {
      std::vector<std::vector<int>> ordered = pipes;
      std::function<void(size_t)> permute = [&](size_t p) {
        if (p == ordered.size()) {
          evaluate(ordered);
          return;
        }
        std::sort(ordered[p].begin(), ordered[p].end());
        do {
          permute(p + 1);
        } while (std::next_permutation(ordered[p].begin(), ordered[p].end()));
      };
      permute(0);
      return;
    }
    for (size_t p = 0; p < pipes.size(); ++p) {  // by index: the recursion grows `pipes`
      pipes[p].push_back(static_cast<int>(next));
      form_pipelines(next + 1, pipes);
      pipes[p].pop_back();
    }
    pipes.push_back({static_cast<int>(next)});
    form_pipelines(next + 1, pipes);
    pipes.pop_back();
  };
  // Groups over the devices in `left` (bitmask), each device used or left idle.
  form_groups = [&](int left, std::vector<int>) {
    if (left == 0) {
      if (groups.empty()) return;
      std::vector<std::vector<int>> pipes;
      form_pipelines(0, pipes);
      return;
    }
    int first = 0;
    while (!(left & (1 << first))) ++first;
    // `first` stays idle.
    form_groups(left & ~(1 << first), {});
    if (plan::is_gone(rates[static_cast<size_t>(first)])) return;
    for (int subset = 0; subset < (1 << N); ++subset) {
      if (!(subset & (1 << first)) || (subset & ~left)) continue;
      const int size = __builtin_popcount(static_cast<unsigned>(subset));
      if (size != 1 && size != 2 && size != 4) continue;
      std::vector<int> g;
      bool gone = false;
      for (int d = 0; d < N; ++d) {
        if (subset & (1 << d))
          g.push_back(d), gone = gone || plan::is_gone(rates[static_cast<size_t>(d)]);
      }
      if (gone) continue;
      groups.push_back(g);
      form_groups(left & ~subset, {});
      groups.pop_back();
    }
  };
  form_groups((1 << N) - 1, {});
  return best;
}

TEST(Planner, MalleusMatchesBruteForceOnASmallCluster) {
  auto m = planner_model();
  m.num_layers = 4;
  const CostModel cost(m, small_cluster(1, 4), plan::BatchConfig{4, 1, 1024});
  const auto planner = plan::make_strategy("malleus");
  for (const auto& rates : rate_patterns(4)) {
    const double best = brute_force(cost, rates);
    const auto r = planner->plan(cost, {rates, plan::Shape{}, std::nullopt});
    const std::string label = plan::rates_to_json(rates).dump();
    EXPECT_GE(r.prediction.iteration_time, best * (1 - 1e-9)) << label;
    EXPECT_LE(r.prediction.iteration_time, best * (1 + 1e-6))
        << label << ": planner " << r.prediction.iteration_time << " s (" << r.plan.summary()
        << "), brute force " << best << " s";
  }
}

TEST(Planner, TiesAreBrokenTowardTheCurrentPlan) {
  const auto model = planner_model();
  const CostModel cost(model, small_cluster(2, 4), plan::BatchConfig{16, 1, 1024});
  const plan::Rates healthy(8, 1.0);
  const auto current = plan::uniform_plan(model, 2, 2, 2, 16, 1, 8);
  // With a wide tolerance the running plan counts as good as the best: nothing moves, whether the
  // tie-break knows the migration's size or only that keeping the plan moves nothing.
  plan::PlannerOptions lenient;
  lenient.tie_tolerance = 1.0;
  for (const auto& options : {lenient, replan::with_migration_tie_break(lenient, cost)}) {
    const auto kept = plan::make_strategy("malleus", options)->plan(cost, {healthy, {}, current});
    EXPECT_EQ(kept.plan.to_json(), current.to_json());
    EXPECT_EQ(replan::estimate_migration(cost, current, kept.plan).total_bytes, 0);
  }
  // With exact ties only, the faster plan wins.
  const auto best = plan::make_strategy("malleus")->plan(cost, {healthy, {}, current});
  EXPECT_LE(best.prediction.iteration_time, cost.predict(current, healthy).iteration_time);
  // Planning the same situation again from the chosen plan keeps it.
  const auto again = plan::make_strategy("malleus")->plan(cost, {healthy, {}, best.plan});
  EXPECT_EQ(again.plan.to_json(), best.plan.to_json());

  // When the running plan cannot be kept (it holds a gone device), the tie-break among the other
  // near-best plans asks the migration estimate and takes one that moves no more than the fastest.
  plan::Rates lost = healthy;
  lost[5] = kInf;
  int asked = 0;
  plan::PlannerOptions counting = replan::with_migration_tie_break(lenient, cost);
  const plan::MigrationBytes estimate = counting.migration;
  counting.migration = [&](const plan::Plan& from, const plan::Plan& to) {
    ++asked;
    return estimate(from, to);
  };
  const auto near = plan::make_strategy("malleus", counting)->plan(cost, {lost, {}, current});
  const auto fastest = plan::make_strategy("malleus")->plan(cost, {lost, {}, current});
  EXPECT_GT(asked, 0);
  EXPECT_LE(replan::estimate_migration(cost, current, near.plan).total_bytes,
            replan::estimate_migration(cost, current, fastest.plan).total_bytes);
  EXPECT_LE(near.prediction.iteration_time, 2 * fastest.prediction.iteration_time);
}

TEST(Planner, BaselinesBehaveAsDocumented) {
  const auto model = planner_model();
  const CostModel cost(model, small_cluster(2, 4), plan::BatchConfig{16, 1, 1024});
  plan::Rates rates(8, 1.0);
  rates[5] = kInf;
  const plan::Shape base{2, 2, 2};
  const auto uniform = plan::make_strategy("uniform")->plan(cost, {rates, base, std::nullopt});
  ASSERT_EQ(uniform.plan.pipelines.size(), 1u);  // the pipeline holding device 5 is dropped
  EXPECT_EQ(uniform.plan.pipelines[0].micro_batches, 16);
  EXPECT_TRUE(uniform.restart);
  rates[5] = 4;
  const auto layers = plan::make_strategy("uneven-layers")->plan(cost, {rates, base, std::nullopt});
  // Device 5 is in pipeline 1, stage 0 (ranks 4, 5): that stage gets fewer layers.
  EXPECT_LT(layers.plan.pipelines[1].stages[0].num_layers(),
            layers.plan.pipelines[0].stages[0].num_layers());
  EXPECT_EQ(layers.plan.pipelines[0].micro_batches, layers.plan.pipelines[1].micro_batches);
  const auto micro =
      plan::make_strategy("uneven-microbatches")->plan(cost, {rates, base, std::nullopt});
  EXPECT_LT(micro.plan.pipelines[1].micro_batches, micro.plan.pipelines[0].micro_batches);
  const auto drop = plan::make_strategy("drop-slow")->plan(cost, {rates, base, std::nullopt});
  for (int r : drop.plan.idle_ranks()) EXPECT_NE(r, 0);
  const auto idle = drop.plan.idle_ranks();
  EXPECT_NE(std::find(idle.begin(), idle.end(), 5), idle.end());
}

// data-parallel (malleus.torch's): a replica per device, micro-batches by rates, down to none for a
// replica too slow to help, even again when healthy; never a restart.
TEST(Planner, DataParallelSplitsMicroBatchesByRatesDownToNone) {
  const auto model = model::load_model_config("demo");
  const CostModel cost(model, small_cluster(1, 3), plan::BatchConfig{12, 1, 128});
  const auto strategy = plan::make_strategy("data-parallel");
  auto split = [&](const plan::Rates& rates) {
    const plan::PlanResult r = strategy->plan(cost, {rates, {}, std::nullopt});
    EXPECT_FALSE(r.restart);
    std::vector<int> m(3, 0);
    for (const auto& p : r.plan.pipelines) {
      EXPECT_EQ(p.stages.size(), 1u);
      EXPECT_EQ(p.stages[0].tp(), 1);
      m[static_cast<size_t>(p.stages[0].ranks[0])] = p.micro_batches;
    }
    return m;
  };
  EXPECT_EQ(split({1, 1, 1}), (std::vector<int>{4, 4, 4}));
  const auto slow = split({1, 1, 3});
  EXPECT_LT(slow[2], slow[0]);
  EXPECT_EQ(slow[0] + slow[1] + slow[2], 12);
  EXPECT_EQ(split({1, 1, 100}), (std::vector<int>{6, 6, 0}));
  EXPECT_EQ(split({1, 1, kInf}), (std::vector<int>{6, 6, 0}));
  // Not among the strategies the simulator holds side by side.
  const auto names = plan::strategy_names();
  EXPECT_EQ(std::find(names.begin(), names.end(), "data-parallel"), names.end());
}

// A runtime without tensor parallelism (malleus.torch's pipelines) limits the planner to TP groups
// of one rank (CostModel::limit_tensor_parallel): on 8 devices of one node with little memory,
// where the unlimited search forms TP groups, every stage of every strategy's plan then has one
// rank, under every rate pattern, and the plans stay valid (with a device slow or gone a strategy
// may find none that fits, its documented error).
TEST(Planner, KeepsTensorParallelGroupsWithinTheCostModelsLimit) {
  const auto model = planner_model();
  auto cluster = small_cluster(1, 8);
  cluster.memory_bytes = 0.6e9;  // tight: the search forms TP groups to fit
  CostModel cost(model, cluster, plan::BatchConfig{16, 1, 1024});
  auto widest = [](const plan::Plan& p) {
    int w = 0;
    for (const auto& pipe : p.pipelines) {
      for (const auto& s : pipe.stages) w = std::max(w, s.tp());
    }
    return w;
  };
  auto widest_of_all = [&](int limit) {
    int w = 0;
    for (const auto& rates : rate_patterns(8)) {
      const std::string label = plan::rates_to_json(rates).dump();
      for (const auto& name : plan::strategy_names()) {
        plan::PlanResult r;
        try {
          r = plan::make_strategy(name)->plan(cost, {rates, {}, std::nullopt});
        } catch (const Error& e) {
          // Under the limit a strategy may find nothing that fits in so little memory (the
          // planners' documented error), but not on the healthy cluster.
          EXPECT_TRUE(limit > 0 && rates != rate_patterns(8)[0])
              << name << " " << label << ": " << e.what();
          continue;
        }
        EXPECT_NO_THROW(plan::validate(r.plan, model, 8, 16, name)) << name << " " << label;
        if (limit > 0) {
          EXPECT_LE(widest(r.plan), limit) << name << " " << label << ": " << r.plan.summary();
        }
        w = std::max(w, widest(r.plan));
      }
    }
    return w;
  };
  ASSERT_GT(widest_of_all(0), 1) << "the unlimited search should form TP groups here, or this "
                                    "test checks nothing";
  cost.limit_tensor_parallel(1);
  EXPECT_EQ(widest_of_all(1), 1);
}

// With one node's link ten times slower, the planner moves the gradient sync (every parameter)
// off the link and puts pipeline hand-offs (one activation) on it: pipelines whose stages span
// the nodes, the same stage of every pipeline on one node. Tensor parallelism stays inside nodes.
TEST(Planner, SlowLinksCarryPipelineHandOffsNotGradientSync) {
  const auto model = model::load_model_config("demo");
  plan::ClusterSpec cluster = plan::load_cluster("cpu-local");
  cluster.nodes = 2;  // links as fast across nodes as inside them: data parallelism when healthy
  cluster.devices_per_node = 2;
  const CostModel healthy(model, cluster, plan::BatchConfig{16, 1, 128});
  const CostModel slowed = healthy.with_link_rates({1.0, 10.0});
  const auto strategy = plan::make_strategy("malleus");
  plan::PlanRequest request;
  request.rates = plan::Rates(4, 1.0);
  const plan::PlanResult on_healthy = strategy->plan(healthy, request);
  const plan::PlanResult on_slowed = strategy->plan(slowed, request);
  const plan::Prediction chosen = slowed.predict(on_slowed.plan, request.rates);
  // Better on the slow link than the healthy cluster's plan, by the cost model.
  EXPECT_LT(chosen.iteration_time,
            slowed.predict(on_healthy.plan, request.rates).iteration_time * 0.95)
      << on_healthy.plan.summary() << " vs " << on_slowed.plan.summary();
  // No tensor-parallel group spans the nodes, and the gradient sync stays inside them: every
  // stage's ranks of one layer range sit on one node across all pipelines.
  std::map<std::pair<int, int>, std::set<int>> nodes_of_layers;
  for (const auto& p : on_slowed.plan.pipelines) {
    for (const auto& s : p.stages) {
      std::set<int> group_nodes;
      for (int r : s.ranks) group_nodes.insert(cluster.node_of(r));
      EXPECT_EQ(group_nodes.size(), 1u) << on_slowed.plan.summary();
      nodes_of_layers[{s.layer_begin, s.layer_end}].insert(group_nodes.begin(), group_nodes.end());
    }
  }
  for (const auto& [layers, nodes] : nodes_of_layers) {
    EXPECT_EQ(nodes.size(), 1u) << "layers " << layers.first << "-" << layers.second
                                << " sync across nodes in " << on_slowed.plan.summary();
  }
  EXPECT_EQ(on_healthy.plan.pipelines.size(), 4u) << on_healthy.plan.summary();
  EXPECT_LT(chosen.grad_sync_time, slowed.predict(on_healthy.plan, request.rates).grad_sync_time);
  // Pipelines cross the slow link (hand-offs on it), rather than data parallelism.
  ASSERT_GT(on_slowed.plan.pipelines.size(), 0u);
  EXPECT_GT(on_slowed.plan.pipelines[0].stages.size(), 1u) << on_slowed.plan.summary();
}

// At Malleus's scale, where memory binds: llama-110b on 8 nodes of 8 A800s with 40 GiB each
// (A100 40GB's memory), one device gone. The model state (16 bytes per parameter, 27 GB a device
// when spread over all 64) leaves too little room for the first stages' activations under 1F1B
// on the 63 devices left, whatever the shape, so without recomputation no plan fits; with it the
// planner recomputes on the stages that need it and not on all of them, every device's predicted
// memory fits, and so does the plan as written (its recomputation, which the runtime runs).
TEST(Planner, StageAwareRecomputationMakesA110bPlanFitOn40GiBDevices) {
  auto cluster = plan::load_cluster("a800-8x8");
  cluster.memory_bytes = 40.0 * 1024 * 1024 * 1024;
  CostModel cost(model::load_model_config("llama-110b"), cluster, plan::BatchConfig{64, 1, 4096});
  plan::Rates rates(64, 1.0);
  rates[3] = kInf;
  const plan::PlanRequest request{rates, plan::Shape::parse("dp2,tp8,pp4"), std::nullopt};

  cost.allow_recompute(false);
  bool fits_without = false;
  try {
    fits_without = plan::make_strategy("malleus")->plan(cost, request).prediction.fits;
  } catch (const Error&) {
  }
  EXPECT_FALSE(fits_without);

  cost.allow_recompute(true);
  const plan::PlanResult r = plan::make_strategy("malleus")->plan(cost, request);
  ASSERT_TRUE(r.prediction.fits) << r.prediction.problem;
  EXPECT_TRUE(std::isfinite(r.prediction.iteration_time));
  int stages = 0, recomputing = 0;
  for (const auto& pipe : r.plan.pipelines) {
    for (const auto& s : pipe.stages) {
      ++stages;
      if (s.recompute.mode != model::RecomputeMode::kNone && s.recompute.layers > 0) ++recomputing;
    }
  }
  EXPECT_GT(recomputing, 0) << r.plan.summary();
  // Recomputation ahead of the gradient only where a stage recomputes, never on the last.
  for (const auto& pipe : r.plan.pipelines) {
    for (size_t j = 0; j < pipe.stages.size(); ++j) {
      if (!pipe.stages[j].recompute_ahead) continue;
      EXPECT_GT(pipe.stages[j].recompute.layers, 0) << r.plan.summary();
      EXPECT_LT(j + 1, pipe.stages.size()) << r.plan.summary();
    }
  }
  EXPECT_LT(recomputing, stages) << r.plan.summary();
  for (double bytes : r.prediction.memory_bytes) EXPECT_LE(bytes, cluster.usable_memory());
  const plan::Prediction as_written = cost.predict(r.plan, rates, /*choose_recompute=*/false);
  EXPECT_TRUE(as_written.fits) << as_written.problem;
  EXPECT_NEAR(as_written.iteration_time, r.prediction.iteration_time,
              1e-9 * r.prediction.iteration_time);
}

// Allowing recomputation lets shallower pipelines fit, but the deeper ones that fit without it
// recompute nothing and can be faster: the search starts from both (llama-32b on 4 nodes of 8
// A800s with 40 GiB, node 1 at 2×, where it once settled on a plan 3 % slower with recomputation
// allowed than without).
TEST(Planner, AllowingRecomputationNeverGivesASlowerPlan) {
  auto cluster = plan::load_cluster("a800-4x8");
  cluster.memory_bytes = 40.0 * 1024 * 1024 * 1024;
  CostModel cost(model::load_model_config("llama-32b"), cluster, plan::BatchConfig{64, 1, 4096});
  plan::Rates rates(32, 1.0);
  for (size_t d = 8; d < 16; ++d) rates[d] = 2;
  const plan::PlanRequest request{rates, plan::Shape::parse("dp4,tp2,pp4"), std::nullopt};
  cost.allow_recompute(false);
  const plan::PlanResult without = plan::make_strategy("malleus")->plan(cost, request);
  cost.allow_recompute(true);
  const plan::PlanResult with = plan::make_strategy("malleus")->plan(cost, request);
  ASSERT_TRUE(without.prediction.fits);
  ASSERT_TRUE(with.prediction.fits);
  EXPECT_LE(with.prediction.iteration_time, without.prediction.iteration_time * (1 + 1e-9))
      << "with: " << with.plan.summary() << "\nwithout: " << without.plan.summary();
}

// On several nodes only each node's leader holds the link probe's buffer (CostModel::probes_links),
// and the planner's fit test agrees: on the 2 x 2 bed, with the tiny model (every tensor far
// smaller than the probe, so the probe sets a leader's packing buffer) and devices with room for a
// non-leader's shard but not a leader's, ranks 1 and 3 train without recomputation (charged the
// probe, they would have to recompute) and the leaders recompute. Every stage's predicted memory is
// its ranks' per-device figure, and that is what the cost model says each device holds.
TEST(Planner, OnlyNodeLeadersAreChargedTheLinkProbeWhenStagesAreFitted) {
  const auto model = model::load_model_config("tiny");
  auto cluster = plan::load_cluster("cpu-bed-2x2");
  const plan::BatchConfig batch{16, 1, 128};
  const auto strategy = plan::make_strategy("malleus");
  plan::PlanRequest request;
  request.rates = plan::Rates(4, 1.0);
  // Each device's need in the plan chosen with room to spare: data parallelism, one rank a
  // pipeline.
  const auto roomy = strategy->plan(CostModel(model, cluster, batch), request);
  ASSERT_EQ(roomy.plan.pipelines.size(), 4u) << roomy.plan.summary();
  const auto& need = roomy.prediction.memory_bytes;
  ASSERT_LT(need[1], need[0]);
  cluster.memory_bytes = (need[0] + need[1]) / 2;
  cluster.usable_memory_fraction = 1;
  const CostModel tight(model, cluster, batch);
  const auto result = strategy->plan(tight, request);
  ASSERT_TRUE(result.prediction.fits) << result.prediction.problem;
  const auto by_kind = tight.memory_by_kind(result.plan);
  int without_leader = 0;
  for (size_t p = 0; p < result.plan.pipelines.size(); ++p) {
    const auto& stages = result.plan.pipelines[p].stages;
    for (size_t j = 0; j < stages.size(); ++j) {
      double fullest = 0, fullest_by_kind = 0;
      bool leader = false;
      for (int r : stages[j].ranks) {
        fullest = std::max(fullest, result.prediction.memory_bytes[size_t(r)]);
        fullest_by_kind = std::max(fullest_by_kind, by_kind[size_t(r)].total());
        leader = leader || tight.probes_links(r);
      }
      const auto& cost = result.prediction.pipelines[p].stages[j].cost;
      EXPECT_DOUBLE_EQ(cost.memory_bytes, fullest) << result.plan.summary();
      EXPECT_DOUBLE_EQ(cost.memory_bytes, fullest_by_kind) << result.plan.summary();
      EXPECT_LE(cost.memory_bytes, cluster.memory_bytes);
      if (leader) {
        EXPECT_NE(cost.recompute.mode, model::RecomputeMode::kNone) << result.plan.summary();
      } else {
        ++without_leader;
        EXPECT_EQ(cost.recompute, model::Recompute{}) << result.plan.summary();
      }
    }
  }
  EXPECT_GT(without_leader, 0) << result.plan.summary();
}

// The planner's quality against the oracle recorded from the planner of issue 25's start
// (tests/data/planner_oracle.json, written by build/bench/planner_oracle; its header says how):
// on every situation, llama-70b on 64 to 4,096 A800 devices and 32b / 110b on 64, the predicted
// iteration time of the plan chosen now is at most 1 % above the one chosen then.
TEST(Planner, MatchesTheRecordedOracle) {
  const Json oracle =
      read_json_file(std::string(MALLEUS_SOURCE_DIR) + "/tests/data/planner_oracle.json");
  ASSERT_GE(oracle.at("situations").size(), 20u);
  double worst = 0;
  for (const Json& s : oracle.at("situations")) {
    plan::ClusterSpec cluster = plan::load_cluster(s.at("cluster").get<std::string>());
    cluster.nodes = s.at("nodes").get<int>();
    const plan::CostModel cost(model::load_model_config(s.at("model").get<std::string>()), cluster,
                               {s.at("global_batch").get<int>(), s.at("micro_batch").get<int>(),
                                s.at("seq_len").get<int>()});
    const plan::Rates rates = plan::rates_from_json(s.at("rates"), cluster.num_devices(), "oracle");
    const plan::PlanResult r =
        plan::make_strategy("malleus")->plan(cost, {rates, plan::Shape{}, std::nullopt});
    const double then = s.at("iteration_s").get<double>();
    const double ratio = r.prediction.iteration_time / then;
    worst = std::max(worst, ratio);
    EXPECT_LE(ratio, 1.01) << s.at("model").get<std::string>() << " on " << cluster.num_devices()
                           << " devices, " << s.at("pattern").get<std::string>() << ": "
                           << r.plan.summary() << " vs " << s.at("summary").get<std::string>();
    std::printf(
        "%-10s %5d %-22s then %.4f s now %.4f s (%+.2f %%) planned in %.2f s (then %.2f s)\n",
        s.at("model").get<std::string>().c_str(), cluster.num_devices(),
        s.at("pattern").get<std::string>().c_str(), then, r.prediction.iteration_time,
        100 * (ratio - 1), r.planning_seconds, s.at("planning_s").get<double>());
  }
  std::printf("worst ratio to the oracle: %.4f\n", worst);
}

// Issue 25's missing move: where a device is gone, Malleus's planner moves a whole healthy TP
// group from the pipeline that lost it to another, where a search that only regroups inside each
// pipeline keeps an uneven split. Ours makes that move when its cost model says it pays: here
// llama-110b on 64 devices with device 5 gone, the pipeline that lost it gives a healthy TP group
// to the other, and the plan is faster than the best one without the move. (On the 70b
// case, 5 + 5 stages instead of 6 + 4, our cost model scores the move 1.3 % slower, so the search
// tries it and keeps 6 + 4.)
TEST(Planner, MovesAWholeHealthyTpGroupToAnotherPipeline) {
  plan::ClusterSpec cluster = plan::load_cluster("a800-8x8");
  const CostModel cost(model::load_model_config("llama-110b"), cluster, {128, 1, 4096});
  plan::Rates rates(64, 1.0);
  rates[5] = kInf;
  plan::PlannerOptions without;
  without.move_groups = false;
  const plan::PlanRequest request{rates, plan::Shape::parse("dp2,tp8,pp4"), std::nullopt};
  const plan::PlanResult moved = plan::make_strategy("malleus")->plan(cost, request);
  const plan::PlanResult kept = plan::make_strategy("malleus", without)->plan(cost, request);
  std::printf("with the move: %s (%.4f s)\nwithout: %s (%.4f s)\n", moved.plan.summary().c_str(),
              moved.prediction.iteration_time, kept.plan.summary().c_str(),
              kept.prediction.iteration_time);
  EXPECT_LT(moved.prediction.iteration_time, kept.prediction.iteration_time * (1 - 5e-3));
  // Some pipeline runs a healthy TP group that the layout it was searched from gives to another
  // pipeline (of 2, each holds 32 consecutive ranks there).
  bool crossed = false;
  for (const auto& p : moved.plan.pipelines) {
    std::set<int> homes;
    for (const auto& s : p.stages) homes.insert(s.ranks[0] / 32);
    crossed = crossed || homes.size() > 1;
  }
  EXPECT_TRUE(crossed) << moved.plan.summary();
}

// The incremental re-plan (PlanRequest::previous_rates) against the full search on small
// clusters: llama-70b and llama-32b on 64, 128 and 256 A800s, the running plan the full search's
// for the healthy cluster, then one to three devices slowed or gone. The incremental plan's
// predicted iteration must be within 1 % of the full re-plan's (issue 25).
TEST(Planner, IncrementalReplanIsWithinOnePercentOfTheFullSearch) {
  struct Change {
    std::string name;
    std::vector<std::pair<int, double>> rates;  // device (as a fraction of N, ×1000) → rate
  };
  const std::vector<Change> changes = {
      {"one 2x", {{3, 2.0}}},
      {"one 5x", {{3, 5.0}}},
      {"one gone", {{9, kInf}}},
      {"one gone late", {{-3, kInf}}},
      {"two slow", {{3, 2.0}, {-7, 5.0}}},
      {"gone and slow", {{9, kInf}, {-7, 3.0}}},
      {"half a node 3x", {{8, 3.0}, {9, 3.0}, {10, 3.0}, {11, 3.0}}},
  };
  double worst = 0;
  int situations = 0, stayed = 0;
  for (const std::string model : {"llama-70b", "llama-32b"}) {
    for (int nodes : {8, 16, 32}) {
      plan::ClusterSpec cluster = plan::load_cluster("a800-8x8");
      cluster.nodes = nodes;
      const int N = cluster.num_devices();
      const CostModel cost(model::load_model_config(model), cluster, {16 * nodes, 1, 4096});
      const auto planner = plan::make_strategy("malleus");
      const plan::Rates healthy(static_cast<size_t>(N), 1.0);
      const plan::Plan current = planner->plan(cost, {healthy, {}, std::nullopt}).plan;
      for (const Change& change : changes) {
        plan::Rates rates = healthy;
        for (auto [device, rate] : change.rates) {
          rates[static_cast<size_t>(device >= 0 ? device : N + device)] = rate;
        }
        const plan::PlanResult inc = planner->plan(cost, {rates, {}, current, healthy});
        const plan::PlanResult full = planner->plan(cost, {rates, {}, std::nullopt});
        const double ratio = inc.prediction.iteration_time / full.prediction.iteration_time;
        worst = std::max(worst, ratio);
        // Incremental, or checked against the full search (plan::kIncrementalSlack).
        if (inc.incremental) {
          ++stayed;
        } else {
          EXPECT_NE(inc.note.find("checked against the full search"), std::string::npos)
              << model << " " << N << " " << change.name << ": " << inc.note;
        }
        ++situations;
        EXPECT_LE(ratio, 1.01) << model << " on " << N << " devices, " << change.name
                               << ": incremental " << inc.plan.summary() << " vs full "
                               << full.plan.summary();
        std::printf("%-10s %4d %-15s %-11s %.4f s (%.3f s) full %.4f s (%.3f s) %+.2f %%\n",
                    model.c_str(), N, change.name.c_str(),
                    inc.incremental ? "incremental" : "checked", inc.prediction.iteration_time,
                    inc.planning_seconds, full.prediction.iteration_time, full.planning_seconds,
                    100 * (ratio - 1));
      }
    }
  }
  std::printf("worst incremental / full: %.4f; %d of %d stayed incremental\n", worst, stayed,
              situations);
  EXPECT_GE(stayed, situations / 4);  // the check is the exception, not the rule
}
