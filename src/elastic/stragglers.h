// Injected stragglers for experiments and tests: which rank runs how many times slower at which
// step. From the command line ("RANK:RATE:FROM-TO", steps 1-based, TO inclusive; TO may be left
// out for "until the end") or a trace file:
//   {"events": [{"step": 20, "rates": {"2": 3.0}}, {"step": 80, "rates": {"2": 1.0}}]}
// where each event sets the listed ranks' rates from that step on.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace malleus::elastic {

class StragglerSchedule {
 public:
  // Throws Error naming the text if it is not RANK:RATE:FROM-TO with RATE ≥ 1.
  void add(const std::string& spec);
  // Throws Error naming the file and the problem.
  void add_trace(const std::string& path);

  // The injected rate of `rank` at 1-based step `step` (1 when none applies).
  double rate(int rank, int64_t step) const;
  std::vector<double> rates(int world_size, int64_t step) const;
  bool empty() const { return windows_.empty(); }
  // The highest rank any window names (-1 when empty): the trainer refuses one outside the job.
  int highest_rank() const;

  // Injected rates are at most this: a rank 100 times slower is as good as gone, and a rate of
  // 1e308 or inf would stall the job instead of slowing it.
  static constexpr double kMaxRate = 100;

 private:
  struct Window {
    int rank;
    double rate;
    int64_t from, to;  // inclusive
  };
  std::vector<Window> windows_;  // later windows win where they overlap
};

}  // namespace malleus::elastic
