#!/usr/bin/env bash
# Checkpoint I/O of a 106M-parameter model against this machine's disk, measured in the same run
# (bench/bench_checkpoint.cpp): sharded save and load throughput next to the disk's sequential
# write and read, and the step stall of an asynchronous save next to a synchronous one. Prints a
# markdown table (docs/performance.md quotes it). Needs ~6 GB of memory and ~3 GB of disk in DIR.
#   scripts/bench_checkpoint.sh [build-dir] [ranks] [rounds] [dir]
# (default: build, 2 ranks, 3 rounds, ./bench-checkpoint, removed afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}"
ranks="${2:-2}"
rounds="${3:-3}"
dir="${4:-bench-checkpoint}"
[[ -f "$build/build.ninja" || -f "$build/Makefile" ]] || cmake -S . -B "$build" -G Ninja >/dev/null
cmake --build "$build" --target bench_checkpoint >/dev/null
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
exec timeout 1800 mpirun --oversubscribe --bind-to core -np "$ranks" "$build/bench/bench_checkpoint" "$rounds" "$dir"
