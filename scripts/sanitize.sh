#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer build of the unit tests (the long training tests
# are left to the optimised build, where they take seconds rather than minutes). The Python
# package is not built here: its module, sanitized, would need the sanitizer runtime preloaded
# into Debian's interpreter; its tests run in scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMALLEUS_SANITIZE=ON "${launcher[@]}" \
  -DMALLEUS_WERROR=ON -DMALLEUS_BUILD_BENCH=OFF -DMALLEUS_BUILD_PYTHON=OFF > build-asan-configure.log ||
  { cat build-asan-configure.log; exit 1; }
cmake --build build-asan --parallel "$(nproc)"
# OpenMP's runtime keeps thread pools alive at exit; those are not our leaks. A failure's output
# is printed again at the end (scripts/failed_tests.py), where a CI page that shows only the log's
# end has it.
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$(nproc)" -E "${SANITIZE_EXCLUDE:-Slow}" || {
  status=$?
  echo "sanitize.sh: the failed tests' output again, the last lines of each"
  scripts/failed_tests.py build-asan
  exit "$status"
}
