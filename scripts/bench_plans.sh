#!/usr/bin/env bash
# Training throughput of several parallel plans side by side on 4 MPI ranks of this machine
# (bench/bench_plans.cpp): prints a markdown table of step time and tokens/s per plan. About two
# minutes on 2 cores.
#   scripts/bench_plans.sh [build-dir] [rounds] [steps-per-round] [model] [threads-per-rank]
# (default: build, 5 rounds × 4 timed steps, the demo model, 1 thread per rank; the build dir is
# configured and bench_plans built or brought up to date first).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
shift || true
[[ -f "$build/build.ninja" || -f "$build/Makefile" ]] || cmake -S . -B "$build" -G Ninja >/dev/null
cmake --build "$build" --target bench_plans >/dev/null
# More ranks than cores needs --oversubscribe, and then ranks waiting in MPI must yield the CPU
# to the ones computing instead of busy-polling; root (containers) needs explicit permission.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
exec mpirun --oversubscribe -np 4 "$build/bench/bench_plans" "$@"
