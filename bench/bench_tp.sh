#!/usr/bin/env bash
# Sub-pipelined tensor parallelism on this machine: a 6-layer model (hidden 512, 8 heads, FFN
# 1376, vocabulary 257) as one tp2 stage on 2 ranks bound one per core, a global batch of 4
# sequences, with micro-batches of one sequence (split along token rows) and of two (split
# along sequences). For each, RUNS pairs of trainings of STEPS steps, without and with
# --tp-subpipeline, alternating so that each pair runs side by side: median step time (steps
# after the first), the median of the paired ratios, and the cost model's prediction for the
# same plan (`malleus simulate --plan [--tp-subpipeline]` on the cpu-core cluster).
#
# Usage: bench/bench_tp.sh [runs (5)] [steps (4)] [seq_len (512)]
# (With 1 step the summary counts that step, warm-up included, and says so.)
# Run it when no other benchmark runs (its timings are the figures). Results go to
# runs/bench-tp (BENCH_OUT overrides); the table to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
runs=${1:-5}
steps=${2:-4}
seq=${3:-512}
bench_require_count runs "$runs"
bench_require_count steps "$steps"
bench_require_count seq_len "$seq"
bench_ready_to_train
out=$(bench_output_dir runs/bench-tp fresh)
bench_write_model "$out/model.json" bench-6x512 512 6 8 1376 "$seq"
echo "load average before: $(bench_load_average)"

for mb in 1 2; do
  dir="$out/mb$mb"
  mkdir -p "$dir"
  cat > "$dir/plan.json" << JSON
{"world_size": 2, "micro_batch_size": $mb, "pipelines": [{"micro_batches": $((4 / mb)), "stages": [
  {"layers": [0, 6], "ranks": [0, 1]}]}]}
JSON
  shape=(--model "$out/model.json" --seq-len "$seq" --micro-batch "$mb" --global-batch 4)
  for mode in off on; do
    sim_flag=()
    [[ $mode == on ]] && sim_flag=(--tp-subpipeline)
    build/malleus simulate --cluster configs/clusters/cpu-core.json "${shape[@]}" \
      --plan "$dir/plan.json" --json "${sim_flag[@]}" |
      /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["predicted_iteration_s"])' \
        > "$dir/$mode.predicted"
    mkdir -p "$dir/$mode"
  done
  for i in $(seq "$runs"); do
    for mode in off on; do
      flag=--no-tp-subpipeline
      [[ $mode == on ]] && flag=--tp-subpipeline
      echo "== micro-batch $mb, sub-pipelining $mode, run $i"
      timeout 1800 mpirun --bind-to core --map-by core -np 2 build/malleus train "${shape[@]}" \
        --steps "$steps" --threads 1 --no-replan --eval-every 0 --checkpoint-every 0 \
        --val-data "" --plan "$dir/plan.json" "$flag" --out "$dir/$mode/run$i" \
        > "$dir/$mode/run$i.log" 2>&1 || { cat "$dir/$mode/run$i.log"; exit 1; }
    done
  done
done
echo "load average after: $(bench_load_average)"
/usr/bin/python3 bench/tp_summary.py "$out" 1 2
