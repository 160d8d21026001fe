#!/usr/bin/env bash
# The main job on its built-in default: set up, build, prepare the fortunes corpus, then train the
# demo model on 2 MPI ranks bound one per core while, from step 100 to step 200, two ordinary busy
# processes (`bash -c 'while :; do :; done'`, nothing to do with malleus) share rank 1's core
# (scripts/slow_rank.sh). Watch the monitor measure the slowdown, the controller re-plan around
# it, and re-plan again once the processes are gone. Ends with the timeline (malleus report) and a
# few samples of the model before and after training (scripts/demo_samples.sh).
#
#   scripts/demo.sh [--injected] [malleus train arguments...]
#
# --injected: the slowdown made by malleus itself instead, on 4 ranks sharing the 2 cores (they
# take turns on them): rank 1 computes 3x longer from step 100 to 200 (--straggler 1:3:100-200).
# Other arguments go to `malleus train` (e.g. --steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
injected=false
if [[ ${1:-} == --injected ]]; then
  injected=true
  shift
fi
scripts/setup.sh
scripts/build.sh
if ! compgen -G "data/fortunes/train_*.bin" > /dev/null; then
  build/malleus prepare-data
fi
# Running as root needs OpenMPI's consent; ranks waiting in MPI yield the CPU.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
out=runs/demo
for ((i = 1; i <= $#; ++i)); do
  [[ ${!i} == --out ]] && { j=$((i + 1)); out=${!j}; }
done
# Each demo starts afresh: `train` refuses a run directory that already holds a run.
rm -rf "$out"
if $injected; then
  mpirun --oversubscribe -np 4 build/malleus train --straggler 1:3:100-200 "$@"
else
  scripts/slow_rank.sh "$out" 1 100 200 busy:2 &
  slower=$!
  trap 'kill $slower 2> /dev/null || true' EXIT
  mpirun --bind-to core --map-by core -np 2 build/malleus train --cluster cpu-core "$@"
  wait $slower || true
fi
build/malleus report "$out"
# What the model writes before and after training.
scripts/demo_samples.sh "$out"
