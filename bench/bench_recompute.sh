#!/usr/bin/env bash
# Activation recomputation on this machine: a 12-layer model (hidden 512, 8 heads, FFN 1376,
# vocabulary 257) on 2 ranks bound one per core, pp2 (6 layers per stage), 4 micro-batches of one
# sequence. For each of none / selective / full (every layer of both stages), stage-aware (the
# plan `malleus plan` writes for a memory budget the plain run does not fit), and selective and
# full again under the shifted schedule (--shifted-recompute: stage 0 recomputes a micro-batch
# while its gradient is on its way), RUNS trainings of STEPS steps, the modes taking turns within
# each round of runs so that a change of load hits them all: median step time (steps after the
# first, over all runs; every step with STEPS = 1) with its spread, each rank's peak memory from its own allocations
# (metrics.jsonl), the cost model's prediction for the same plan (`malleus simulate --plan
# --json`, with --shifted-recompute for the shifted rows), and per round the shifted run's step
# time over the unshifted one's of the same mode.
#
# Usage: bench/bench_recompute.sh [runs (3)] [steps (1)] [seq_len (1024)]
# (one step per run: 24 minutes at sequence 1024 on the loaded 2-core machine, 30–60 s a step;
# a run's first step was not slower than the next ones there.)
# Results go to runs/bench-recompute (BENCH_OUT overrides); the table to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
runs=${1:-3}
steps=${2:-1}
seq=${3:-1024}
bench_ready_to_train
out=$(bench_output_dir runs/bench-recompute fresh)
bench_write_model "$out/model.json" bench-12x512 512 12 8 1376 "$seq"
shape=(--model "$out/model.json" --seq-len "$seq" --micro-batch 1 --global-batch 4)
echo "load average before: $(bench_load_average)"

# plan NAME MODE: pp2, 6 layers per stage, both stages recomputing MODE.
plan() {
  local extra=""
  [[ $2 != none ]] && extra=", \"recompute\": \"$2\""
  cat > "$out/$1.json" << JSON
{"world_size": 2, "micro_batch_size": 1, "pipelines": [{"micro_batches": 4, "stages": [
  {"layers": [0, 6], "ranks": [0]$extra}, {"layers": [6, 12], "ranks": [1]$extra}]}]}
JSON
}
plan none none
plan selective selective
plan full full

# The stage-aware plan: a cluster of two cores whose memory is halfway between what the plain
# run and the fully recomputing run need on their fullest rank, so the plain plan does not fit.
predicted() {  # predicted() PLAN [FLAGS]: the cost model's bytes per rank, one line
  build/malleus simulate --cluster "$out/cluster.json" "${shape[@]}" --plan "$@" --json |
    /usr/bin/python3 -c 'import json,sys; print(" ".join(str(d["memory_gib"] * 2**30) for d in json.load(sys.stdin)["devices"]))'
}
sed -e 's/"memory_gib": [0-9.]*/"memory_gib": 1000/' configs/clusters/cpu-core.json > "$out/cluster.json"
budget=$(/usr/bin/python3 -c 'import sys; a = max(map(float, sys.argv[1].split())); b = max(map(float, sys.argv[2].split())); print((a + b) / 2 / 2**30)' \
  "$(predicted "$out/none.json")" "$(predicted "$out/full.json")")
sed -i -e "s/\"memory_gib\": [0-9.]*/\"memory_gib\": $budget/" -e 's/"usable_memory_fraction": [0-9.]*/"usable_memory_fraction": 1/' "$out/cluster.json"
build/malleus plan --cluster "$out/cluster.json" "${shape[@]}" --strategy uniform --base dp1,tp1,pp2 \
  --out "$out/stage-aware.json" | grep -v "^wrote"
echo "memory budget per rank: $budget GiB"

modes=(none selective full stage-aware selective-shifted full-shifted)
for mode in "${modes[@]}"; do
  base=${mode%-shifted}
  flags=()
  [[ $mode == *-shifted ]] && flags=(--shifted-recompute)
  predicted "$out/$base.json" "${flags[@]}" > "$out/$mode.predicted"
  mkdir -p "$out/$mode"
done
scratch=$(mktemp -d /dev/shm/bench-recompute.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
for i in $(seq "$runs"); do
  for mode in "${modes[@]}"; do
    base=${mode%-shifted}
    flags=(--no-shifted-recompute)
    [[ $mode == *-shifted ]] && flags=(--shifted-recompute)
    echo "== $mode, run $i ($(bench_load_average))"
    # The run directory in memory: the checkpoint at the end (nothing to measure here) is written
    # fast and then dropped; metrics.jsonl is kept.
    timeout 1800 mpirun --bind-to core --map-by core -np 2 build/malleus train "${shape[@]}" \
      --steps "$steps" --threads 1 --no-replan --eval-every 0 --checkpoint-every 0 --val-data "" \
      --plan "$out/$base.json" "${flags[@]}" --out "$scratch/run" > "$out/$mode/run$i.log" 2>&1 ||
      { cat "$out/$mode/run$i.log"; exit 1; }
    mkdir -p "$out/$mode/run$i"
    mv "$scratch/run/metrics.jsonl" "$out/$mode/run$i/"
    rm -rf "$scratch/run"
  done
done
echo "load average after: $(bench_load_average)"
/usr/bin/python3 bench/recompute_summary.py "$out" "${modes[@]}"
