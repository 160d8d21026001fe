#!/usr/bin/env bash
# The main job on its built-in default: set up, build, prepare the fortunes corpus, then train the
# demo model on 4 MPI ranks while rank 1 runs 3x slower from step 100 to step 200. Watch the
# monitor notice it, the controller re-plan around it and migrate the state, and re-plan again
# once it heals. Extra arguments go to `malleus train` (e.g. --steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
if ! compgen -G "data/fortunes/train_*.bin" > /dev/null; then
  build/malleus prepare-data
fi
# Running as root and more ranks than cores need OpenMPI's consent; idle ranks yield the CPU.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
# Each demo starts afresh: `train` refuses a run directory that already holds a run.
rm -rf runs/demo
mpirun --oversubscribe -np 4 build/malleus train --straggler 1:3:100-200 "$@"
build/malleus report runs/demo
