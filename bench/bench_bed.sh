#!/usr/bin/env bash
# Calibration of the cost model on the multi-host test bed: 2 emulated hosts × 2 ranks
# (scripts/hosts.sh), each host one CPU core that its 2 ranks take turns on (core lease).
#   1. bench_comm measures the links, also as the runtime waits for them while ranks take turns;
#      the cluster's link figures come from its pair all-reduces in turns;
#   2. bench_plans measures the step time of the uniform plans (interleaved rounds, median step)
#      and every rank's phases (compute, time inside TP collectives, GFLOP/s while computing);
#   3. a cluster file is written from this run alone: the turn-taking link figures of step 1 and
#      the compute rate of a rank alone on its core (dp1's rank 0) with cores_per_node 1;
#   4. (bench/bed_calibration.py, reading both programs' --json figures) next to each plan's
#      measured step: the cost model's prediction on that cluster file, and
#      its prediction with the compute rates the runtime measured for the plan's ranks (what the
#      straggler monitor hands the planner), so the rest of the error is communication and
#      schedule (bubbles, turns), not the speed of the machine's cores.
#   bench/bench_bed.sh [rounds] [steps-per-round]   (default 5 × 4; about 1.5 minutes on the quiet 2-core machine, 5 on a loaded one)
# Prints the cluster file; CALIBRATED_CLUSTER=path also keeps it. Needs root (network
# namespaces); exits 77 where they cannot be made.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
rounds=${1:-5} steps=${2:-4}
bench_build_targets build malleus bench_comm bench_plans
bench_allow_mpirun
export MALLEUS_HOSTS_PREFIX=${MALLEUS_HOSTS_PREFIX:-mb} MALLEUS_HOSTS_SUBNET=${MALLEUS_HOSTS_SUBNET:-198.18.15}
base_cluster=configs/clusters/cpu-bed-2x2.json
scratch=$(mktemp -d /tmp/bench_bed.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

echo "## Links (bench_comm, 2 hosts x 2 ranks)"
echo "load average: $(bench_load_average)"
scripts/hosts.sh run 2 300 -np 4 build/bench/bench_comm --json "$scratch/comm.json" | grep -v '^hosts.sh'
echo
echo "## Step times (bench_plans: demo model, seq 128, 16 sequences in micro-batches of 2)"
scripts/hosts.sh run 2 900 -np 4 build/bench/bench_plans "$rounds" "$steps" --json "$scratch/plans.json" |
  grep -v '^hosts.sh'
echo
/usr/bin/python3 bench/bed_calibration.py "$scratch/comm.json" "$scratch/plans.json" "$base_cluster" \
  "$scratch"
if [[ -n ${CALIBRATED_CLUSTER:-} ]]; then cp "$scratch/cluster.json" "$CALIBRATED_CLUSTER"; fi
