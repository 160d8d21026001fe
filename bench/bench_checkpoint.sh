#!/usr/bin/env bash
# Checkpoint I/O of a 106M-parameter model against this machine's disk, measured in the same run
# (bench/bench_checkpoint.cpp): sharded save and load throughput next to the disk's sequential
# write and read, and the step stall of an asynchronous save next to a synchronous one. Prints a
# markdown table (docs/performance.md quotes it). Needs ~6 GB of memory and ~3 GB of disk in DIR.
#   bench/bench_checkpoint.sh [build-dir] [ranks] [rounds] [dir]
# (default: build, 2 ranks, 3 rounds, ./bench-checkpoint, removed afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
build="${1:-build}"
ranks="${2:-2}"
rounds="${3:-3}"
dir="${4:-bench-checkpoint}"
bench_build_targets "$build" bench_checkpoint
bench_allow_mpirun
exec timeout 1800 mpirun --oversubscribe --bind-to core -np "$ranks" "$build/bench/bench_checkpoint" "$rounds" "$dir"
