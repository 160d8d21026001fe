// The planner's exact sub-solvers: layers to the stages of one pipeline (binary search on the
// bottleneck, then greedy filling) and micro-batches to pipelines (the M smallest finishing
// times); both checked against brute force in test_planner.
#include <algorithm>
#include <cmath>
#include <queue>

#include "common/error.h"
#include "plan/planner_parts.h"

namespace malleus::plan {

namespace detail {

PipelineEval evaluate_pipeline(const CostModel& cost, std::vector<Stage> stages, const Rates& rates,
                               int pipelines) {
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
  // Stage j of S with l layers, S − j micro-batches in flight, recomputation chosen to fit.
  auto query = [&](int j, int l) {
    CostModel::StageQuery q;
    q.layers = l;
    q.first = j == 0;
    q.last = j == S - 1;
    q.in_flight = S - j;
    q.pipelines = pipelines;
    return q;
  };
  std::vector<std::function<double(int)>> fns;
  for (int j = 0; j < S; ++j) {
    fns.emplace_back([&, j](int l) {
      const StageCost c = cost.stage_cost(groups[static_cast<size_t>(j)], query(j, l));
      return c.fits ? c.forward + c.backward : kInf;
    });
  }
  const auto counts = assign_layers(L, fns);
  if (counts.empty()) return out;
  set_layers(stages, counts);
  std::vector<StagePrediction> preds;
  for (int j = 0; j < S; ++j) {
    StagePrediction p;
    p.cost =
        cost.stage_cost(groups[static_cast<size_t>(j)], query(j, counts[static_cast<size_t>(j)]));
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

double allocation_time(const std::vector<double>& first, const std::vector<double>& period,
                       const std::vector<int>& m) {
  double t = 0;
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i] > 0) t = std::max(t, first[i] + (m[i] - 1) * period[i]);
  }
  return t;
}

}  // namespace detail

using detail::kInf;
using detail::to_int;

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

}  // namespace malleus::plan
