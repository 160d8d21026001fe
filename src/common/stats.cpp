#include "common/stats.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace malleus {

double median(std::vector<double> values) {
  std::erase_if(values, [](double v) { return std::isnan(v); });
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  const auto mid = static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  const double upper = values[static_cast<size_t>(mid)];
  if (values.size() % 2 == 1) return upper;
  // nth_element leaves the lower half before `mid`: its largest is the other middle value.
  return 0.5 * (upper + *std::max_element(values.begin(), values.begin() + mid));
}

Summary summarize(const std::vector<double>& values) {
  Summary s{median(values), std::numeric_limits<double>::quiet_NaN(),
            std::numeric_limits<double>::quiet_NaN()};
  for (double v : values) {
    if (std::isnan(v)) continue;
    if (!(v >= s.min)) s.min = v;  // also takes the first value (NaN compares false)
    if (!(v <= s.max)) s.max = v;
  }
  return s;
}

}  // namespace malleus
