#!/usr/bin/env bash
# The moving-load benchmark (issue 27): load that moves between the ranks faster than a re-plan
# pays back. 2 ranks bound one per core train the demo model (seq 128, micro-batch 1, global batch
# 16, as the straggler benchmark); from step FROM, one busy process moves between the two cores
# every PERIOD ms (scripts/slow_rank.sh moving:PERIOD). Each round trains once re-planning and once
# keeping the plan (--no-replan) under the same load, in alternating order (re-planning first in
# odd rounds); bench/moving_load_summary.py then compares the time of steps FROM+2 to STEPS-2.
# Target: re-planning takes at most 1.02x the time of keeping the plan in the median round and
# never more than 1.05x.
#
# Usage: bench/bench_moving_load.sh [rounds (5)] [steps (72)] [period ms (2500)] [from (8)]
# Results go to runs/bench-moving-load/round<i>/{replan,keep} (BENCH_OUT overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
rounds=${1:-5}
steps=${2:-72}
period=${3:-2500}
from=${4:-8}
bench_require_count rounds "$rounds"
bench_require_count steps "$steps" 12
bench_require_count period "$period" 100
bench_require_count from "$from" 2
((from + 2 <= steps - 2)) || { echo "bench_moving_load: from must be at most steps - 4" >&2; exit 2; }
bench_ready_to_train
out=$(bench_output_dir runs/bench-moving-load fresh)
common=(--model demo --seq-len 128 --micro-batch 1 --global-batch 16 --steps "$steps" --threads 1
        --lr 1e-3 --warmup-steps 10 --eval-every 0 --checkpoint-every 0 --val-data ""
        --cluster cpu-core)
echo "load average before: $(bench_load_average)"

mover=""
trap '[[ -n $mover ]] && kill $mover 2> /dev/null; true' EXIT

# train DIR MODE: one run under the moving load, re-planning or keeping the plan.
train() {
  local dir=$1 mode=$2 flags=()
  [[ $mode == keep ]] && flags=(--no-replan)
  rm -rf "$dir"
  scripts/slow_rank.sh "$dir" 0 "$from" "$steps" "moving:$period" & mover=$!
  mpirun --bind-to core --map-by core -np 2 build/malleus train "${common[@]}" "${flags[@]}" \
    --out "$dir" | grep -E "^(re-plan at|slow_rank)" || true
  wait "$mover" || true
  mover=""
}

dirs=()
for i in $(seq "$rounds"); do
  dir=$out/round$i
  modes=(replan keep)
  ((i % 2 == 0)) && modes=(keep replan)
  for mode in "${modes[@]}"; do
    echo "== round $i, $mode (load average $(bench_load_average))"
    train "$dir/$mode" "$mode"
  done
  dirs+=("$dir")
done
echo "load average after: $(bench_load_average)"
/usr/bin/python3 bench/moving_load_summary.py $((from + 2)) $((steps - 2)) "${dirs[@]}"
