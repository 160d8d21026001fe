// Order statistics shared by the report, the planning commands and the monitor, so that every
// "median" in the project answers the same for the same numbers.
#pragma once

#include <vector>

namespace malleus {

// The median of `values` ignoring NaNs (missing numbers): the middle value, or the mean of the two
// middle ones for an even count. NaN when no value is left.
double median(std::vector<double> values);

// Repeated measurements as the benchmarks quote them: the median and the extremes (NaNs ignored;
// all NaN when no value is left).
struct Summary {
  double median, min, max;
};
Summary summarize(const std::vector<double>& values);

}  // namespace malleus
