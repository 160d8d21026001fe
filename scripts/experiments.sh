#!/usr/bin/env bash
# Regenerates bench/results/experiments.md and the charts under bench/results/figures: every
# straggler scenario in configs/scenarios run through the simulator against every strategy (the
# summary and what it means: docs/experiments.md). Takes well under a minute.
#   scripts/experiments.sh [--scale] [build-dir]   (default: build; configured and built if needed)
# --scale also runs configs/scenarios/scale (llama-405b on 4,096-16,384 devices; tens of minutes
# on two cores) into the section "At scale"; without it that section of the current
# bench/results/experiments.md is kept as it is. MALLEUS_EXPERIMENT_JOBS: scenarios run at once (1).
set -euo pipefail
cd "$(dirname "$0")/.."
scale=()
if [[ "${1:-}" == "--scale" ]]; then
  # Smallest cluster first: 4k, 8k, 16k.
  mapfile -t files < <(printf "%s\n" configs/scenarios/scale/*.json | sort -V)
  scale=(--scale-scenarios "${files[@]}")
  shift
fi
build="${1:-build}"
if [[ ! -x "$build/malleus" ]]; then
  [[ -f "$build/build.ninja" || -f "$build/Makefile" ]] || cmake -S . -B "$build" -G Ninja >/dev/null
  cmake --build "$build" --target malleus
fi
kept=""
out=bench/results/experiments.md
if [[ ${#scale[@]} -eq 0 && -f "$out" ]]; then
  kept="$(sed -n '/^<!-- scale: begin -->$/,/^<!-- scale: end -->$/p' "$out")"
fi
"$build/malleus" experiments --scenarios configs/scenarios/*.json "${scale[@]}" \
  --jobs "${MALLEUS_EXPERIMENT_JOBS:-1}" --out "$out" --svg-dir bench/results/figures
if [[ -n "$kept" ]]; then
  printf '\n%s\n' "$kept" >> "$out"
fi
# Planning time lives in docs/performance.md ("Planning time at scale", from
# build/bench/bench_planner): one place per figure.
{
  echo
  echo "## Planning time"
  echo
  echo "See docs/performance.md, \"Planning time at scale\" (\`build/bench/bench_planner\`: full and"
  echo "incremental planning time and memory, 64 … 16,384 devices, and where the time goes)."
} >> "$out"
