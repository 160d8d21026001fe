#!/usr/bin/env bash
# The straggler benchmark (issue 5): the demo model on 4 ranks, one rank slowed 3x from step 20
# and healed at step 80, once with live re-planning and once with the uniform plan kept
# (Megatron-LM / DeepSpeed behaviour), in the same conditions; then the comparison.
# Usage: scripts/bench_straggler.sh [steps] [rate]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-100}
rate=${2:-3}
[[ -x build/malleus ]] || scripts/build.sh
compgen -G "data/fortunes/train_*.bin" > /dev/null || build/malleus prepare-data
out=${BENCH_OUT:-runs/bench-straggler}
rm -rf "$out"
mkdir -p "$out"
# The controller's cost model is calibrated with this machine's measured layer times.
build/malleus profile --model demo --micro-batch 1 --seq-len 128 --threads 1 --repeats 5 \
  --out "$out/profile.json" | sed -n 2,3p
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
common=(--model demo --seq-len 128 --micro-batch 1 --global-batch 16 --steps "$steps" --threads 1
        --lr 1e-3 --warmup-steps 10 --eval-every 0 --checkpoint-every 0 --val-data ""
        --straggler "1:$rate:20-80")
for mode in replan uniform; do
  flags=()
  [[ $mode == uniform ]] && flags=(--no-replan)
  echo "== $mode"
  mpirun --oversubscribe -np 4 build/malleus train "${common[@]}" "${flags[@]}" \
    --out "$out/$mode" | grep -E "^(re-plan|plan on)" || true
done
python3 bench/straggler_summary.py "$out/replan/metrics.jsonl" "$out/uniform/metrics.jsonl" \
  20 80 "$rate" 4
build/malleus report "$out/replan" --output "$out/replan-timeline.svg" > /dev/null
echo "timeline: $out/replan-timeline.svg"
