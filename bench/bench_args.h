// Positional arguments of the benchmark programs: `bench_x [ROUNDS [STEPS]]`, each a positive
// count with a default, and a clear error otherwise.
#pragma once

#include <cstdlib>
#include <string>

#include "common/error.h"

namespace malleus::bench {

// Takes `--name VALUE` (or `--name=VALUE`) out of argv, wherever it is, so the positional
// arguments keep their places; returns VALUE, or "" when the option is not given.
inline std::string take_option(int& argc, char** argv, const std::string& name) {
  std::string value;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == name) {
      check(i + 1 < argc, name + " needs a value");
      value = argv[++i];
    } else if (arg.rfind(name + "=", 0) == 0) {
      value = arg.substr(name.size() + 1);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  return value;
}

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
