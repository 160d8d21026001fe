#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"

namespace malleus::sim {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Op {
  bool backward;
  int micro_batch;
};

// 1F1B order of stage s of S with m micro-batches: S − s − 1 warm-up forwards, then one forward
// and one backward alternately, then the remaining backwards.
std::vector<Op> one_f_one_b(int s, int S, int m) {
  const int warmup = std::min(S - s - 1, m);
  std::vector<Op> ops;
  int f = 0, b = 0;
  for (; f < warmup; ++f) ops.push_back({false, f});
  while (f < m) {
    ops.push_back({false, f++});
    ops.push_back({true, b++});
  }
  while (b < m) ops.push_back({true, b++});
  return ops;
}

}  // namespace

double SimResult::mean_utilisation() const {
  double sum = 0;
  int n = 0;
  for (const auto& d : devices) {
    if (!d.used) continue;
    sum += iteration_time > 0 && std::isfinite(iteration_time) ? d.busy_s / iteration_time : 0;
    ++n;
  }
  return n > 0 ? sum / n : 0;
}

double simulate_pipeline(const std::vector<double>& forward, const std::vector<double>& backward,
                         const std::vector<double>& transfer, int m,
                         std::vector<int>* peak_in_flight, const std::vector<double>& ahead) {
  const int S = static_cast<int>(forward.size());
  if (S == 0 || m <= 0) return 0;
  for (int s = 0; s < S; ++s) {
    if (!std::isfinite(forward[static_cast<size_t>(s)]) ||
        !std::isfinite(backward[static_cast<size_t>(s)])) {
      return kInf;
    }
  }
  // done_f[s][j], done_b[s][j]: finish times; NaN until the operation has run.
  const double unset = std::numeric_limits<double>::quiet_NaN();
  std::vector<std::vector<double>> done_f(static_cast<size_t>(S),
                                          std::vector<double>(static_cast<size_t>(m), unset));
  auto done_b = done_f;
  std::vector<std::vector<Op>> order;
  for (int s = 0; s < S; ++s) order.push_back(one_f_one_b(s, S, m));
  std::vector<size_t> next(static_cast<size_t>(S), 0);
  std::vector<double> free_at(static_cast<size_t>(S), 0.0);
  std::vector<int> in_flight(static_cast<size_t>(S), 0), peak(static_cast<size_t>(S), 0);
  size_t remaining = 0;
  for (const auto& o : order) remaining += o.size();
  // Event loop: run, on every stage, each next operation whose inputs have arrived; each pass
  // advances at least one stage because 1F1B's orders are deadlock-free.
  while (remaining > 0) {
    bool progressed = false;
    for (int s = 0; s < S; ++s) {
      const size_t us = static_cast<size_t>(s);
      while (next[us] < order[us].size()) {
        const Op op = order[us][next[us]];
        const size_t j = static_cast<size_t>(op.micro_batch);
        double ready = 0;
        if (!op.backward) {
          if (s > 0) {
            const double prev = done_f[us - 1][j];
            if (std::isnan(prev)) break;
            ready = prev + transfer[us - 1];
          }
        } else if (s + 1 < S) {
          const double prev = done_b[us + 1][j];
          if (std::isnan(prev)) break;
          ready = prev + transfer[us];
        } else {
          ready = done_f[us][j];  // the last stage's own forward
        }
        // Recomputation ahead runs once the stage is free; the rest of the backward once the
        // gradient is there too.
        const double early = op.backward && us < ahead.size() ? ahead[us] : 0;
        const double start = std::max(free_at[us] + early, ready);
        const double end = start + (op.backward ? backward[us] - early : forward[us]);
        (op.backward ? done_b : done_f)[us][j] = end;
        free_at[us] = end;
        in_flight[us] += op.backward ? -1 : 1;
        peak[us] = std::max(peak[us], in_flight[us]);
        ++next[us];
        --remaining;
        progressed = true;
      }
    }
    check(progressed, "simulate_pipeline: the 1F1B schedule deadlocked (a bug)");
  }
  if (peak_in_flight) *peak_in_flight = peak;
  return done_b[0][static_cast<size_t>(m - 1)];
}

SimResult simulate(const plan::CostModel& cost, const plan::Plan& plan, const plan::Rates& rates,
                   bool choose_recompute) {
  SimResult out;
  // The cost model supplies durations, gradient sync, optimizer and memory.
  const plan::Prediction pred = cost.predict(plan, rates, choose_recompute);
  out.fits = pred.fits;
  out.problem = pred.problem;
  out.grad_sync_time = pred.grad_sync_time;
  out.optimizer_time = pred.optimizer_time;
  out.devices.assign(static_cast<size_t>(plan.world_size), DeviceStats{});
  for (size_t i = 0; i < plan.pipelines.size(); ++i) {
    const auto& pipe = plan.pipelines[i];
    const auto& stages = pred.pipelines[i].stages;
    std::vector<double> f, b, d, ahead;
    for (size_t j = 0; j < stages.size(); ++j) {
      const auto& s = stages[j];
      f.push_back(s.cost.forward);
      b.push_back(s.cost.backward);
      d.push_back(s.p2p_next);
      ahead.push_back(s.cost.recompute_ahead && j + 1 < stages.size() ? s.cost.recompute_time : 0);
    }
    std::vector<int> peak;
    const double t = simulate_pipeline(f, b, d, pipe.micro_batches, &peak, ahead);
    out.pipeline_times.push_back(t);
    out.pipeline_time = std::max(out.pipeline_time, t);
    for (size_t j = 0; j < pipe.stages.size(); ++j) {
      const plan::Stage& st = pipe.stages[j];
      const auto load = cost.member_load(st, rates);
      const auto& c = stages[j].cost;
      for (size_t k = 0; k < st.ranks.size(); ++k) {
        const int r = st.ranks[k];
        if (r < 0 || r >= plan.world_size) continue;
        DeviceStats& dev = out.devices[static_cast<size_t>(r)];
        dev.used = true;
        dev.busy_s = pipe.micro_batches * ((c.forward + c.backward - c.comm) * load[k] + c.comm);
        dev.memory_bytes = pred.memory_bytes[static_cast<size_t>(r)];
        dev.peak_in_flight = peak.empty() ? 0 : peak[j];
      }
    }
  }
  if (cost.cluster().cores_shared()) {
    // Not simulated yet: ranks taking turns on shared cores (ClusterSpec::cores_per_node). The
    // schedule above lets them compute at once; the cost model's closed form knows they do not
    // (merged stages, the busiest core's compute), so its time bounds the pipelines from below.
    out.pipeline_time = std::max(out.pipeline_time, pred.pipeline_time);
  }
  out.iteration_time = out.pipeline_time + out.grad_sync_time + out.optimizer_time;
  for (auto& dev : out.devices) {
    if (!dev.used) continue;
    dev.busy_s += out.grad_sync_time + out.optimizer_time;
    dev.idle_s = std::isfinite(out.iteration_time) ? out.iteration_time - dev.busy_s : kInf;
  }
  return out;
}

}  // namespace malleus::sim
