#!/usr/bin/env bash
# Regenerates docs/experiments.md and the charts under docs/figures: every straggler scenario in
# configs/scenarios run through the simulator against every strategy, then the planning-time
# benchmark. Takes well under a minute.
#   scripts/experiments.sh [build-dir]   (default: build; configured and built if needed)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
if [[ ! -x "$build/malleus" || ! -x "$build/bench/bench_planner" ]]; then
  [[ -f "$build/build.ninja" || -f "$build/Makefile" ]] || cmake -S . -B "$build" -G Ninja >/dev/null
  cmake --build "$build" --target malleus bench_planner
fi
"$build/malleus" experiments --scenarios configs/scenarios/*.json \
  --out docs/experiments.md --svg-dir docs/figures
{
  echo
  echo "## Planning time"
  echo
  echo "\`$build/bench/bench_planner 5\` on $(nproc) cores (median, min, max of 5 runs; the malleus"
  echo "planner with the simulator re-ranking its best candidates, llama-70b, A800 nodes of 8):"
  echo
  echo '```'
  "$build/bench/bench_planner" 5
  echo '```'
} > docs/.planning_time.md
cat docs/.planning_time.md >> docs/experiments.md
rm docs/.planning_time.md
