#!/usr/bin/env bash
# The straggler benchmark. Each scenario trains the demo model (seq 128, micro-batch 1, global
# batch 16) once with live re-planning and once keeping the uniform plan (--no-replan: Megatron-LM
# / DeepSpeed behaviour) under the same slowdown, RUNS times; bench/straggler_summary.py then
# compares them, per run and as medians.
#
# Scenarios (steps are for the default 100; the slowdown lasts from 20% to 80% of the run):
#   injected  4 ranks on 2 cores (bound and taking turns), rank 1 injected 3x slower
#   external  2 ranks bound one per core, two busy processes pinned to rank 1's core
#             (scripts/slow_rank.sh busy:2): a slowdown malleus knows nothing about
#   two       4 ranks on 2 cores, rank 0 injected 2x and rank 1 5x slower (one on each core)
#   two-shared  the same with rank 2 instead of rank 1: both stragglers on core 0. The planner
#             treats ranks as independent devices; ranks sharing a core are not, and here its
#             plan loads core 1 (two healthy ranks with large shares) far more than core 0
#   pipelined like injected, but starting from 2 pipelines of 2 stages (--dp 2 --pp 2), so that
#             a switch moves state between ranks (from data-parallel plans the controller
#             rebalances micro-batches, which moves nothing)
#
# Usage: bench/bench_straggler.sh [scenarios, comma-separated (injected,external,two,two-shared;
#                                   pipelined also runs when named)]
#                                   [runs (3)] [steps (100)] [switch (overlapped)]
# switch: how the re-planning run switches plans: overlapped (the Adam moments move during the new
# plan's first step, the default), synchronous (--no-overlap-switch: everything moves first), or
# both: each run then trains both ways, one after the other, and the summary is printed for each
# (switch costs measured side by side, under the same load).
# At least 5 steps (the slowdown starts at step steps / 5, and steps count from 1); the healthy
# throughput, the ideal and its fractions need 20 or more (the summary takes healthy figures past
# 2 warm-up steps, before the slowdown) and print "-" below that.
# Results go to runs/bench-straggler/<scenario>/run<i>/{replan,uniform} (BENCH_OUT overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
scenarios=${1:-injected,external,two,two-shared}
runs=${2:-3}
steps=${3:-100}
bench_require_count runs "$runs"
bench_require_count steps "$steps" 5
switch=${4:-overlapped}
case $switch in
  overlapped) modes=(replan uniform) ;;
  synchronous) modes=(replan-sync uniform) ;;
  both) modes=(replan replan-sync uniform) ;;
  *) echo "bench_straggler: unknown switch \"$switch\" (overlapped, synchronous, both)" >&2
     exit 2 ;;
esac
from=$((steps / 5)) to=$((steps * 4 / 5))
bench_ready_to_train
out=$(bench_output_dir runs/bench-straggler)
common=(--model demo --seq-len 128 --micro-batch 1 --global-batch 16 --steps "$steps" --threads 1
        --lr 1e-3 --warmup-steps 10 --eval-every 0 --checkpoint-every 0 --val-data "")
echo "load average before: $(bench_load_average)"

slower=""
trap '[[ -n $slower ]] && kill $slower 2> /dev/null; true' EXIT

# train SCENARIO DIR MODE: one training run of a scenario, re-planning or uniform.
train() {
  local scenario=$1 dir=$2 mode=$3 flags=()
  [[ $mode == uniform ]] && flags=(--no-replan)
  [[ $mode == replan-sync ]] && flags=(--no-overlap-switch)
  rm -rf "$dir"
  case $scenario in
    injected)
      mpirun --oversubscribe -np 4 build/malleus train "${common[@]}" "${flags[@]}" \
        --straggler "1:3:$from-$to" --out "$dir" ;;
    two)
      mpirun --oversubscribe -np 4 build/malleus train "${common[@]}" "${flags[@]}" \
        --straggler "0:2:$from-$to" --straggler "1:5:$from-$to" --out "$dir" ;;
    two-shared)
      mpirun --oversubscribe -np 4 build/malleus train "${common[@]}" "${flags[@]}" \
        --straggler "0:2:$from-$to" --straggler "2:5:$from-$to" --out "$dir" ;;
    pipelined)
      mpirun --oversubscribe -np 4 build/malleus train "${common[@]}" "${flags[@]}" --dp 2 --pp 2 \
        --straggler "1:3:$from-$to" --out "$dir" ;;
    external)
      scripts/slow_rank.sh "$dir" 1 "$from" "$to" busy:2 & slower=$!
      mpirun --bind-to core --map-by core -np 2 build/malleus train "${common[@]}" "${flags[@]}" \
        --cluster cpu-core --out "$dir"
      wait "$slower" || true
      slower="" ;;
    *) echo "bench_straggler: unknown scenario \"$scenario\" (injected, external, two, two-shared," \
            "pipelined)" >&2
       exit 2 ;;
  esac
}

IFS=, read -r -a chosen <<< "$scenarios"
for scenario in "${chosen[@]}"; do
  dirs=()
  for i in $(seq "$runs"); do
    dir=$out/$scenario/run$i
    for mode in "${modes[@]}"; do
      echo "== $scenario, run $i, $mode"
      train "$scenario" "$dir/$mode" "$mode" | grep -E "^(re-plan|switch|cores|slow_rank)" || true
    done
    dirs+=("$dir")
  done
  case $scenario in
    injected|pipelined) world=4 slowed=1:3 ;;
    two) world=4 slowed=0:2,1:5 ;;
    two-shared) world=4 slowed=0:2,2:5 ;;
    external) world=2 slowed=1:busy ;;
  esac
  # The summary reads <run>/replan and <run>/uniform: a synchronous run's is linked there.
  for kind in "${modes[@]}"; do
    [[ $kind == uniform ]] && continue
    summarised=()
    for dir in "${dirs[@]}"; do
      if [[ $kind == replan ]]; then summarised+=("$dir"); continue; fi
      mkdir -p "$dir/sync"
      ln -sfn ../replan-sync "$dir/sync/replan"
      ln -sfn ../uniform "$dir/sync/uniform"
      summarised+=("$dir/sync")
    done
    switching=overlapped
    [[ $kind == replan-sync ]] && switching=synchronous
    echo "== $scenario: summary, $switching switch"
    /usr/bin/python3 bench/straggler_summary.py "$from" "$to" "$world" "$slowed" "${summarised[@]}"
  done
  build/malleus report "${dirs[0]}/${modes[0]}" --output "$out/$scenario-timeline.svg" > /dev/null
  echo "timeline of run 1: $out/$scenario-timeline.svg"
done
echo "load average after: $(bench_load_average)"
