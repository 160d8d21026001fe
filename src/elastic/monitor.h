// The straggler monitor: every step, every rank's own compute time per FLOP of assigned work is
// shared, and each rank's rate is its time per FLOP over the median of the ranks (so a rate of 3
// means three times slower than the typical rank). Ranks idle under the current plan are rated
// by the small probe all ranks run, so a recovered device is noticed and can rejoin. Rates are
// smoothed by a per-rank median over a sliding window, so a single noisy step moves nothing.
#pragma once

#include <cstddef>
#include <deque>
#include <vector>

namespace malleus::elastic {

class Monitor {
 public:
  explicit Monitor(int world_size, int window = 3);

  // Adds one step's measurements of all ranks (runtime::StepResult::measurements, the same on
  // every rank); returns the smoothed rates.
  const std::vector<double>& observe(const std::vector<double>& measurements);
  const std::vector<double>& rates() const { return smoothed_; }
  // Steps seen since the last reset (measurements from before a re-plan are dropped).
  int samples() const { return static_cast<int>(history_.size()); }
  void reset() { history_.clear(); }

  // One step's rates from every rank's (compute s, work FLOPs, probe s, probe FLOPs); exposed
  // for tests.
  static std::vector<double> rates_of(const std::vector<double>& measurements);

 private:
  int world_size_;
  std::size_t window_;
  std::deque<std::vector<double>> history_;
  std::vector<double> smoothed_;
};

}  // namespace malleus::elastic
