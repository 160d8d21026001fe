#!/usr/bin/env bash
# Calibration of the cost model on the multi-host test bed: 2 emulated hosts × 2 ranks
# (scripts/hosts.sh). Measures the links with bench_comm, then the step time of the uniform plans
# with bench_plans (interleaved rounds, median step), and prints next to each the cost model's
# prediction for the same plan on configs/clusters/cpu-bed-2x2.json and the error.
#   scripts/bench_bed.sh [rounds] [steps-per-round]   (default 5 × 4; about 5 minutes on 2 cores)
# Needs root (network namespaces); exits 77 where they cannot be made.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_common.sh
source scripts/bench_common.sh
rounds=${1:-5} steps=${2:-4}
bench_build_targets build malleus bench_comm bench_plans
bench_allow_mpirun
export MALLEUS_HOSTS_PREFIX=${MALLEUS_HOSTS_PREFIX:-mb} MALLEUS_HOSTS_SUBNET=${MALLEUS_HOSTS_SUBNET:-198.18.15}
cluster=configs/clusters/cpu-bed-2x2.json
scratch=$(mktemp -d /tmp/bench_bed.XXXXXX)
trap 'rm -rf "$scratch"' EXIT

echo "## Links (bench_comm, 2 hosts x 2 ranks)"
scripts/hosts.sh run 2 300 -np 4 build/bench/bench_comm | grep -v '^hosts.sh'
echo
echo "## Step times (bench_plans: demo model, seq 128, 16 sequences in micro-batches of 2)"
scripts/hosts.sh run 2 900 -np 4 build/bench/bench_plans "$rounds" "$steps" | tee "$scratch/table.md" |
  grep -v '^hosts.sh'
echo
echo "## Measured against the cost model ($cluster)"
echo "| plan | measured median step | predicted | error |"
echo "|---|---:|---:|---:|"
# bench_plans's rows: "| name | ... | median s [min-max] | ...": the uniform dp×tp×pp ones.
sed '/^Phases per rank/,$d' "$scratch/table.md" |
  grep -E '^\| (dp4|tp2 × dp2|pp2 × dp2|tp2 × pp2|pp4) \|' |
  while IFS='|' read -r _ name _ timing _; do
    name=$(echo "$name" | xargs)
    measured=$(echo "$timing" | awk '{print $1}')
    dp=1 tp=1 pp=1
    for part in ${name//×/ }; do
      case $part in dp*) dp=${part#dp} ;; tp*) tp=${part#tp} ;; pp*) pp=${part#pp} ;; esac
    done
    build/malleus plan --strategy uniform --base "dp$dp,tp$tp,pp$pp" --cluster "$cluster" \
      --model demo --global-batch 16 --micro-batch 2 --seq-len 128 --out "$scratch/plan.json" \
      > /dev/null
    predicted=$(build/malleus simulate --plan "$scratch/plan.json" --cluster "$cluster" \
      --model demo --global-batch 16 --micro-batch 2 --seq-len 128 --json |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["predicted_iteration_s"])')
    python3 -c "m, p = $measured, $predicted; print(f'| $name | {m:.3f} s | {p:.3f} s | {100 * (p - m) / m:+.0f} % |')"
  done
