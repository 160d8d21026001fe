// Positional arguments of the benchmark programs: `bench_x [ROUNDS [STEPS]]`, each a positive
// count with a default, and a clear error otherwise.
#pragma once

#include <cstdlib>
#include <string>

#include "common/error.h"

namespace malleus::bench {

// argv[index] as a positive integer, or `fallback` when it is not given.
inline int positive_arg(int argc, char** argv, int index, int fallback) {
  if (argc <= index) return fallback;
  char* end = nullptr;
  const long value = std::strtol(argv[index], &end, 10);
  check(*end == '\0' && value > 0 && value <= 1'000'000,
        "argument " + std::to_string(index) + " must be a positive whole number, not \"" +
            argv[index] + "\"");
  return static_cast<int>(value);
}

}  // namespace malleus::bench
