#!/usr/bin/env bash
# Regenerates docs/experiments.md and the charts under docs/figures: every straggler scenario in
# configs/scenarios run through the simulator against every strategy. Takes well under a minute.
#   scripts/experiments.sh [build-dir]   (default: build; configured and built if needed)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
if [[ ! -x "$build/malleus" ]]; then
  [[ -f "$build/build.ninja" || -f "$build/Makefile" ]] || cmake -S . -B "$build" -G Ninja >/dev/null
  cmake --build "$build" --target malleus
fi
"$build/malleus" experiments --scenarios configs/scenarios/*.json \
  --out docs/experiments.md --svg-dir docs/figures
# Planning time lives in docs/performance.md ("Planning time at scale", from
# build/bench/bench_planner): one place per figure.
{
  echo
  echo "## Planning time"
  echo
  echo "See docs/performance.md, \"Planning time at scale\" (\`build/bench/bench_planner\`: full and"
  echo "incremental planning time and memory, 64 … 16,384 devices, and where the time goes)."
} >> docs/experiments.md
