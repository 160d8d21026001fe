#!/usr/bin/env bash
# Training throughput of several parallel plans side by side on 4 MPI ranks of this machine
# (bench/bench_plans.cpp): prints a markdown table of step time and tokens/s per plan. About two
# minutes on 2 cores.
#   bench/bench_plans.sh [build-dir] [rounds] [steps-per-round] [model] [threads-per-rank]
# (default: build, 5 rounds × 4 timed steps, the demo model, 1 thread per rank; the build dir is
# configured and bench_plans built or brought up to date first).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
build="${1:-build}"
shift || true
bench_build_targets "$build" bench_plans
bench_allow_mpirun
exec mpirun --oversubscribe -np 4 "$build/bench/bench_plans" "$@"
