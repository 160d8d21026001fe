#include "elastic/monitor.h"

#include <algorithm>

#include "common/error.h"

namespace malleus::elastic {

namespace {

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(mid), values.end());
  if (values.size() % 2 == 1) return values[mid];
  const double upper = values[mid];
  return 0.5 * (upper + *std::max_element(values.begin(),
                                          values.begin() + static_cast<std::ptrdiff_t>(mid)));
}

}  // namespace

Monitor::Monitor(int world_size, int window)
    : world_size_(world_size),
      window_(static_cast<size_t>(window)),
      smoothed_(static_cast<size_t>(world_size), 1.0) {
  check(world_size > 0 && window > 0, "monitor: world size and window must be positive");
}

std::vector<double> Monitor::rates_of(const std::vector<double>& m) {
  const size_t n = m.size() / 4;
  std::vector<double> train(n, 0), probe(n, 0), active_train, all_probe;
  for (size_t r = 0; r < n; ++r) {
    const double compute = m[4 * r], work = m[4 * r + 1], probe_s = m[4 * r + 2],
                 probe_flops = m[4 * r + 3];
    if (work > 0 && compute > 0) {
      train[r] = compute / work;
      active_train.push_back(train[r]);
    }
    if (probe_flops > 0 && probe_s > 0) {
      probe[r] = probe_s / probe_flops;
      all_probe.push_back(probe[r]);
    }
  }
  const double train_reference = median(active_train), probe_reference = median(all_probe);
  std::vector<double> rates(n, 1.0);
  for (size_t r = 0; r < n; ++r) {
    if (train[r] > 0 && train_reference > 0) {
      rates[r] = train[r] / train_reference;
    } else if (probe[r] > 0 && probe_reference > 0) {
      rates[r] = probe[r] / probe_reference;
    }
  }
  return rates;
}

const std::vector<double>& Monitor::observe(const std::vector<double>& measurements) {
  check(measurements.size() == static_cast<size_t>(4 * world_size_),
        "monitor: expected 4 measurements per rank");
  history_.push_back(rates_of(measurements));
  if (history_.size() > window_) history_.pop_front();
  for (size_t r = 0; r < smoothed_.size(); ++r) {
    std::vector<double> samples;
    for (const auto& step : history_) samples.push_back(step[r]);
    smoothed_[r] = median(samples);
  }
  return smoothed_;
}

}  // namespace malleus::elastic
