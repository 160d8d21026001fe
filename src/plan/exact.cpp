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

namespace {

// A pipeline's stage costs: all that its layer assignment and times depend on.
struct PipelineCosts {
  std::vector<GroupCost> groups;
  std::vector<double> p2p;  // after each stage but the last
  bool gone = false;
};

PipelineCosts pipeline_costs(const CostModel& cost, const std::vector<Stage>& stages,
                             const Rates& rates) {
  PipelineCosts out;
  out.groups.reserve(stages.size());
  for (size_t j = 0; j < stages.size(); ++j) {
    out.groups.push_back(cost.group_cost(stages[j], rates));
    out.gone = out.gone || out.groups.back().gone;
    if (j + 1 < stages.size()) out.p2p.push_back(cost.p2p_time(stages[j], stages[j + 1]));
  }
  return out;
}

// Layers per stage and the pipeline's time coefficients from its stage costs (empty counts: no
// assignment fits).
PipelineTimes time_pipeline(const CostModel& cost, const PipelineCosts& pc, int pipelines) {
  PipelineTimes out;
  const int S = to_int(pc.groups.size());
  const int L = cost.model().num_layers;
  if (S == 0 || S > L || pc.gone) return out;
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
      const StageCost c = cost.stage_cost(pc.groups[static_cast<size_t>(j)], query(j, l));
      return c.fits ? c.forward + c.backward : kInf;
    });
  }
  out.layers = assign_layers(L, fns);
  if (out.layers.empty()) return out;
  std::vector<StagePrediction> preds;
  for (int j = 0; j < S; ++j) {
    StagePrediction p;
    p.cost = cost.stage_cost(pc.groups[static_cast<size_t>(j)],
                             query(j, out.layers[static_cast<size_t>(j)]));
    if (j + 1 < S) p.p2p_next = pc.p2p[static_cast<size_t>(j)];
    preds.push_back(p);
  }
  const PipelinePrediction pp = CostModel::pipeline_time(std::move(preds), 1);
  out.first = pp.first_micro_batch;
  out.period = pp.period;
  return out;
}

PipelineEval with_times(std::vector<Stage> stages, const PipelineTimes& times) {
  PipelineEval out;
  if (times.layers.empty()) return out;
  set_layers(stages, times.layers);
  out.feasible = true;
  out.first = times.first;
  out.period = times.period;
  out.stages = std::move(stages);
  return out;
}

void append(std::string& key, double x) {
  key.append(reinterpret_cast<const char*>(&x), sizeof x);
}

// Every number of the stage costs, as bytes: equal keys, equal evaluations.
std::string cost_key(const PipelineCosts& pc, int pipelines) {
  std::string key;
  key.reserve(pc.groups.size() * 64 * sizeof(double));
  append(key, pipelines);
  for (size_t j = 0; j < pc.groups.size(); ++j) {
    const GroupCost& g = pc.groups[j];
    for (double x :
         {double(g.tp), g.layer_forward, g.layer_backward, g.layer_comm, g.layer_comm_half,
          g.loss_comm, g.attention_share, g.o_proj_share, g.qkv_share, g.attention_core_forward,
          g.head_forward, g.head_backward, double(g.probes_links), double(g.gone),
          j < pc.p2p.size() ? pc.p2p[j] : -1.0}) {
      append(key, x);
    }
    const MemoryFootprint& f = g.memory;
    for (double x : {f.params_per_layer, f.embedding_params, f.head_params, f.largest_layer_tensor,
                     f.vocabulary_tensor, f.parameter_bytes, f.gradient_bytes, f.optimizer_bytes,
                     f.layer_kept[0], f.layer_kept[1], f.layer_kept[2], f.recompute_scratch[0],
                     f.recompute_scratch[1], f.recompute_scratch[2], f.stage_output,
                     f.embedding_inputs, f.head_kept, f.layer_workspace, f.head_workspace}) {
      append(key, x);
    }
  }
  return key;
}

}  // namespace

PipelineEval evaluate_pipeline(const CostModel& cost, std::vector<Stage> stages, const Rates& rates,
                               int pipelines) {
  const PipelineCosts pc = pipeline_costs(cost, stages, rates);
  return with_times(std::move(stages), time_pipeline(cost, pc, pipelines));
}

PipelineEval PipelineEvaluator::operator()(std::vector<Stage> stages, const Rates& rates,
                                           int pipelines) {
  const PipelineCosts pc = pipeline_costs(*cost_, stages, rates);
  const std::string key = cost_key(pc, pipelines);
  auto it = times_.find(key);
  if (it == times_.end()) {
    ++evaluations_;
    it = times_.emplace(key, time_pipeline(*cost_, pc, pipelines)).first;
  } else {
    ++reused_;
  }
  return with_times(std::move(stages), it->second);
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

namespace {

// The next finishing times of pipelines that have m_i micro-batches: pipeline i's k-th next one
// is T_i(m_i + k + 1) = first_i + (m_i + k)·period_i (first_i alone for the first).
class NextFinishTimes {
 public:
  NextFinishTimes(const std::vector<double>& first, const std::vector<double>& period,
                  const std::vector<int>& m, long long left)
      : first_(first), period_(period), m_(m), left_(left), order_(first.size()) {
    // Pipelines with the same coefficients count alike: most of a large cluster's are.
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) {
      return first[a] != first[b] ? first[a] < first[b] : period[a] < period[b];
    });
    for (size_t i : order_) {
      if (!kinds_.empty() && alike(kinds_.back().first, i)) {
        ++kinds_.back().second;
      } else {
        kinds_.emplace_back(i, 1);
      }
    }
  }

  // T_i(k + 1): finishing with k + 1 micro-batches.
  double value(size_t i, long long k) const {
    return k == 0 ? first_[i] : first_[i] + static_cast<double>(k) * period_[i];
  }

  // Gives every pipeline its next finishing times up to the largest bound (found by bisection)
  // below which there are at most `left` of them: all of them are among the `left` smallest.
  void take_below_bound(std::vector<int>& m) const {
    double lo = 0, hi = 0;
    bool any = false;
    for (size_t i = 0; i < first_.size(); ++i) {
      if (!std::isfinite(first_[i])) continue;
      lo = any ? std::min(lo, value(i, m_[i])) : value(i, m_[i]);
      any = true;
    }
    if (!any || left_ <= 0 || counted(lo) > left_) return;
    // hi: a bound with more than `left` values, or the largest finite value when none has.
    hi = lo;
    for (double step = std::max(1e-300, std::abs(lo)); counted(hi) <= left_ && std::isfinite(hi);
         step *= 2) {
      hi = lo + step;
    }
    for (int iter = 0; iter < 200 && std::isfinite(hi) && lo < hi; ++iter) {
      const double mid = lo + (hi - lo) / 2;
      if (mid <= lo || mid >= hi) break;
      (counted(mid) <= left_ ? lo : hi) = mid;
    }
    std::vector<int> add(kinds_.size());
    for (size_t k = 0; k < kinds_.size(); ++k) {
      add[k] = static_cast<int>(count(kinds_[k].first, lo));
    }
    size_t k = 0;
    for (size_t i : order_) {
      if (!alike(i, kinds_[k].first)) ++k;
      m[i] += add[k];
    }
  }

 private:
  bool alike(size_t a, size_t b) const {
    return first_[a] == first_[b] && period_[a] == period_[b];
  }

  // Pipeline i's next finishing times at most `bound`.
  long long count(size_t i, double bound) const {
    if (!(first_[i] <= bound)) return 0;
    const long long k0 = m_[i];
    if (!(period_[i] > 0) || !std::isfinite(period_[i])) return value(i, k0) <= bound ? 1 : 0;
    // Values k = 0..c−1, as the comparisons value(k) ≤ bound say (not the division's rounding).
    long long c = std::min(static_cast<long long>(std::floor((bound - first_[i]) / period_[i])) + 1,
                           left_ + k0 + 1);
    while (c > 0 && value(i, c - 1) > bound) --c;
    while (c <= left_ + k0 && value(i, c) <= bound) ++c;
    return std::max(0LL, c - k0);
  }

  // All pipelines' next finishing times at most `bound` (counting stops past `left`).
  long long counted(double bound) const {
    long long sum = 0;
    for (size_t k = 0; k < kinds_.size() && sum <= left_; ++k) {
      sum += kinds_[k].second * count(kinds_[k].first, bound);
    }
    return sum;
  }

  const std::vector<double>& first_;
  const std::vector<double>& period_;
  const std::vector<int>& m_;
  long long left_;
  std::vector<size_t> order_;
  std::vector<std::pair<size_t, long long>> kinds_;  // a pipeline of each kind, how many
};

}  // namespace

std::vector<int> assign_micro_batches(int total, const std::vector<double>& first,
                                      const std::vector<double>& period, bool allow_zero) {
  const size_t n = first.size();
  check(n == period.size() && n > 0, "assign_micro_batches: no pipelines");
  check(allow_zero || total >= to_int(n), "assign_micro_batches: " + std::to_string(total) +
                                              " micro-batches for " + std::to_string(n) +
                                              " pipelines");
  std::vector<int> m(n, allow_zero ? 0 : 1);
  // The optimum takes the `left` smallest of all next finishing times. Most of them at once
  // (NextFinishTimes::take_below_bound); the last few (ties at the bound; at most about one per
  // pipeline) one at a time, greedily on the next finishing time with a heap, as the exact rule
  // does for all of them.
  const NextFinishTimes times(first, period, m, total - (allow_zero ? 0 : to_int(n)));
  times.take_below_bound(m);
  long long rest = total;
  for (int x : m) rest -= x;
  using Item = std::pair<double, size_t>;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
  for (size_t i = 0; i < n; ++i) heap.emplace(times.value(i, m[i]), i);
  for (; rest > 0; --rest) {
    const size_t i = heap.top().second;
    heap.pop();
    ++m[i];
    heap.emplace(times.value(i, m[i]), i);
  }
  return m;
}

}  // namespace malleus::plan
