#!/usr/bin/env bash
# Configures and builds into build/ (Release). Extra arguments go to CMake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
# ccache, where installed, makes rebuilds across clones and worktrees cheap.
launcher=()
if command -v ccache > /dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "$@" > build-configure.log ||
  { cat build-configure.log; exit 1; }
# What the configure step chose or left out (the Python package, where pybind11-dev is missing).
grep '^-- malleus:' build-configure.log || true
cmake --build build --parallel "$(nproc)"
