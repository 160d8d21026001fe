#!/usr/bin/env bash
# Slow links benchmark on the multi-host test bed (scripts/hosts.sh): HOSTS emulated hosts × RANKS
# ranks (default 2 × 2), the demo model (seq 128, micro-batch 1, global batch 16; 12 with 3 ranks)
# from the uniform plan dp(HOSTS·RANKS), host 1's link throttled to a tenth of the bed's
# 0.335 GB/s (268mbit) once step SHAPE_AT is logged, to the end of the run. Three ways of running,
# interleaved, RUNS runs each:
#   uniform       --no-replan: the uniform plan kept
#   compute-only  --no-replan-links: re-planning on compute rates only (links measured, ignored)
#   link-aware    the default: re-planning on compute and link rates
# Throughput after the throttle = tokens of steps SHAPE_AT+1..STEPS / their wall time (detection,
# planning and migration included). Ideal = the healthy throughput of the uniform plan (steps
# 3..SHAPE_AT of every run, median) × the cost model's healthy step time for it / its best step
# time for the slowed cluster (`malleus plan` with --link-rates '{"1": 10}' on the bed's cluster
# file, configs/clusters/cpu-bed-HOSTSxRANKS.json): what the healthy run would do if it lost only
# what the best plan for the slow link must lose.
#   bench/bench_links.sh [runs] [steps] [shape-at]   (default 3 30 8; about 15 min on 2 cores)
# Environment: BENCH_HOSTS, BENCH_RANKS (hosts and ranks per host: 2 and 2, or 3 and 1 with the
# cpu-bed-3x1 cluster), BENCH_GLOBAL_BATCH (default 16, 12 with 3 ranks: whole micro-batches for
# every rank), MALLEUS_BINARY (the malleus to run; default build/malleus, built first).
# Needs root (network namespaces); exits 77 where they cannot be made. On a shared machine, run it
# when no other benchmark runs (its timings are the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
runs=${1:-3} steps=${2:-30} shape_at=${3:-8}
rate=268mbit slowdown=10
host_count=${BENCH_HOSTS:-2} ranks=${BENCH_RANKS:-2}
np=$((host_count * ranks))
global_batch=${BENCH_GLOBAL_BATCH:-$((np == 3 ? 12 : 16))}
((global_batch % np == 0)) || { echo "bench_links: global batch $global_batch is not a multiple of $np ranks" >&2; exit 2; }
cluster=configs/clusters/cpu-bed-${host_count}x${ranks}.json
[[ -f $cluster ]] || { echo "bench_links: no cluster file $cluster for $host_count hosts x $ranks ranks" >&2; exit 2; }
export MALLEUS_HOSTS_SLOTS=$ranks
malleus=${MALLEUS_BINARY:-build/malleus}
[[ -n ${MALLEUS_BINARY:-} ]] || bench_build_targets build malleus
bench_allow_mpirun
export MALLEUS_HOSTS_PREFIX=${MALLEUS_HOSTS_PREFIX:-mk} MALLEUS_HOSTS_SUBNET=${MALLEUS_HOSTS_SUBNET:-198.18.16}
scratch=$(mktemp -d /tmp/bench_links.XXXXXX)
job=""
cleanup() {
  [[ -z $job ]] || kill "$job" 2> /dev/null || true
  scripts/hosts.sh down || true
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

echo "# bench_links: $host_count hosts x $ranks ranks (dp$np, global batch $global_batch)," \
  "host 1's link to $rate after step $shape_at of $steps; $runs runs each;" \
  "load average $(bench_load_average)"
timeout 300 "$malleus" prepare-data --output "$scratch/data" > /dev/null

one_run() { # name flags...
  local name=$1
  shift
  local out="$scratch/$name"
  scripts/hosts.sh up "$host_count" > /dev/null
  timeout -k 10 600 scripts/hosts.sh mpirun -np "$np" "$malleus" train --model demo --seq-len 128 \
    --micro-batch 1 --global-batch "$global_batch" --threads 1 --steps "$steps" --warmup-steps 2 --lr 1e-3 \
    --eval-every 0 --checkpoint-every 0 --val-data '' --train-data "$scratch/data/train_*.bin" \
    --dp "$np" --cluster "$cluster" --out "$out" "$@" > "$scratch/$name.log" 2>&1 &
  job=$!
  local deadline=$((SECONDS + 500))
  until grep -q "\"step\":$shape_at," "$out/metrics.jsonl" 2> /dev/null; do
    if ! kill -0 "$job" 2> /dev/null || ((SECONDS > deadline)); then
      cat "$scratch/$name.log" >&2
      echo "bench_links: run $name ended or stalled before step $shape_at" >&2
      exit 1
    fi
    sleep 0.2
  done
  scripts/hosts.sh shape 1 "$rate"
  wait "$job" || { cat "$scratch/$name.log" >&2; exit 1; }
  job=""
  scripts/hosts.sh down
}

for ((i = 1; i <= runs; ++i)); do
  one_run "uniform-$i" --no-replan
  one_run "compute-only-$i" --no-replan-links
  one_run "link-aware-$i"
  echo "round $i done (load average $(bench_load_average))"
done

# The cost model's healthy uniform and best slowed step times.
"$malleus" plan --strategy uniform --base "dp$np,tp1,pp1" --cluster "$cluster" --model demo \
  --global-batch "$global_batch" --micro-batch 1 --seq-len 128 --out "$scratch/uniform.json" \
  > /dev/null
"$malleus" simulate --plan "$scratch/uniform.json" --cluster "$cluster" --model demo \
  --global-batch "$global_batch" --micro-batch 1 --seq-len 128 --json > "$scratch/uniform-healthy.json"
"$malleus" plan --strategy malleus --cluster "$cluster" --link-rates "{\"1\": $slowdown}" \
  --model demo --global-batch "$global_batch" --micro-batch 1 --seq-len 128 \
  --out "$scratch/best.json" > /dev/null
"$malleus" simulate --plan "$scratch/best.json" --cluster "$cluster" \
  --link-rates "{\"1\": $slowdown}" --model demo --global-batch "$global_batch" --micro-batch 1 \
  --seq-len 128 --json > "$scratch/best-slowed.json"

/usr/bin/python3 bench/links_summary.py "$scratch" "$runs" "$shape_at" "$scratch/uniform-healthy.json" \
  "$scratch/best-slowed.json" "$np"
echo "(load average $(bench_load_average))"
