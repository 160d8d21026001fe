#!/usr/bin/env bash
# Activation recomputation on this machine: a 12-layer model (hidden 512, 8 heads, FFN 1376,
# vocabulary 257) on 2 ranks bound one per core, pp2 (6 layers per stage), 4 micro-batches of one
# sequence. For each of none / selective / full (every layer of both stages) and stage-aware (the
# plan `malleus plan` writes for a memory budget the plain run does not fit), RUNS trainings of
# STEPS steps: median step time (steps after the first, over all runs) with its spread, each
# rank's peak memory from its own allocations (metrics.jsonl), and the cost model's prediction
# for the same plan (`malleus simulate --plan --json`).
#
# Usage: scripts/bench_recompute.sh [runs (3)] [steps (3)] [seq_len (512)]
# (sequence 1024 works too: about 4x the step time of 512 here, as the attention scores grow
# with s².) Results go to runs/bench-recompute (BENCH_OUT overrides); the table to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
steps=${2:-3}
seq=${3:-512}
[[ -x build/malleus ]] || scripts/build.sh
compgen -G "data/fortunes/train_*.bin" > /dev/null || build/malleus prepare-data
out=${BENCH_OUT:-runs/bench-recompute}
rm -rf "$out"
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
cat > "$out/model.json" << JSON
{"name": "bench-12x512", "vocab_size": 257, "hidden_size": 512, "num_layers": 12,
 "num_heads": 8, "num_kv_heads": 8, "ffn_hidden_size": 1376, "max_seq_len": $seq}
JSON
shape=(--model "$out/model.json" --seq-len "$seq" --micro-batch 1 --global-batch 4)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

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
predicted() {  # predicted() PLAN: the cost model's bytes per rank, one line
  build/malleus simulate --cluster "$out/cluster.json" "${shape[@]}" --plan "$1" --json |
    python3 -c 'import json,sys; print(" ".join(str(d["memory_gib"] * 2**30) for d in json.load(sys.stdin)["devices"]))'
}
sed -e 's/"memory_gib": [0-9.]*/"memory_gib": 1000/' configs/clusters/cpu-core.json > "$out/cluster.json"
budget=$(python3 -c 'import sys; a = max(map(float, sys.argv[1].split())); b = max(map(float, sys.argv[2].split())); print((a + b) / 2 / 2**30)' \
  "$(predicted "$out/none.json")" "$(predicted "$out/full.json")")
sed -i -e "s/\"memory_gib\": [0-9.]*/\"memory_gib\": $budget/" -e 's/"usable_memory_fraction": [0-9.]*/"usable_memory_fraction": 1/' "$out/cluster.json"
build/malleus plan --cluster "$out/cluster.json" "${shape[@]}" --strategy uniform --base dp1,tp1,pp2 \
  --out "$out/stage-aware.json" | grep -v "^wrote"
echo "memory budget per rank: $budget GiB"

for mode in none selective full stage-aware; do
  predicted "$out/$mode.json" > "$out/$mode.predicted"
  mkdir -p "$out/$mode"
  for i in $(seq "$runs"); do
    echo "== $mode, run $i"
    timeout 1800 mpirun --bind-to core --map-by core -np 2 build/malleus train "${shape[@]}" \
      --steps "$steps" --threads 1 --no-replan --eval-every 0 --checkpoint-every 0 --val-data "" \
      --plan "$out/$mode.json" --out "$out/$mode/run$i" > "$out/$mode/run$i.log" 2>&1 ||
      { cat "$out/$mode/run$i.log"; exit 1; }
  done
done
python3 bench/recompute_summary.py "$out" none selective full stage-aware
