#!/usr/bin/env bash
# The recovery benchmark: a 2-rank job under `malleus launch` (one rank per core) loses rank 1 to
# SIGKILL in mid-run; the supervisor restarts it from the latest checkpoint on the one rank left.
# Measured per run:
#   recovery  from the kill to the first step line of the restarted job (what training lost in
#             wall time, besides the steps it does again)
#   ended     from the kill to the end of the failed job (mpirun noticing and ending the others)
#   restart   from the end of the failed job to the first step of the new one (mpirun start, the
#             checkpoint read, the job's setup, the first step)
#   steps lost  steps done again: those after the checkpoint the job restarted from
#   from      what the restart read: "memory" (the ranks' in-memory copies) or "disk"
# and the median (min–max) over the runs, for each model:
#   demo  3.5 M parameters, seq 128, global batch 8, a checkpoint every 4 steps, killed after step 6
#   100m  99 M parameters (hidden 768, 14 layers, 12 heads, FFN 2048, byte vocabulary), seq 64,
#         global batch 4, a checkpoint every 3 steps, killed after step 4
#
# Usage: bench/bench_recovery.sh [models, comma-separated (demo,100m)] [runs (3)] [train flags]
#   train flags: added to every run's, e.g. "--memory-checkpoint-every 1" or
#   "--no-memory-checkpoints" (disk checkpoints only)
# Results go to runs/bench-recovery/<model>/run<i>/ (BENCH_OUT overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
models=${1:-demo,100m}
runs=${2:-3}
read -r -a extra_flags <<< "${3:-}"
bench_ready_to_train
out=$(bench_output_dir runs/bench-recovery)
bench_write_model "$out/model-100m.json" m100 768 14 12 2048 256
echo "load average before: $(bench_load_average)"

job=""
trap '[[ -n $job ]] && kill $job 2> /dev/null; true' EXIT

# run MODEL DIR: one run; prints its figures as a JSON line (bench/recovery_summary.py run).
run() {
  local model=$1 dir=$2 flags kill_after
  case $model in
    demo) flags=(--model demo --seq-len 128 --global-batch 8 --steps 12 --checkpoint-every 4)
          kill_after=6 ;;
    100m) flags=(--model "$out/model-100m.json" --seq-len 64 --global-batch 4 --steps 8
                 --checkpoint-every 3)
          kill_after=4 ;;
    *) echo "unknown model $model (demo, 100m)" >&2; exit 2 ;;
  esac
  rm -rf "$dir"
  mkdir -p "$dir"
  # Every output line with the time it arrived.
  timeout 1200 build/malleus launch --np 2 --mpirun-args="--bind-to core --map-by core" -- \
    train "${flags[@]}" --micro-batch 1 --threads 1 --val-data "" --eval-every 0 --no-replan \
    --warmup-steps 2 "${extra_flags[@]}" --out "$dir/run" 2>&1 |
    /usr/bin/python3 -u bench/recovery_summary.py stamp > "$dir/out.log" &
  job=$!
  local step_line
  step_line=$(printf 'step %5d/' "$kill_after")
  until grep -q " $step_line" "$dir/out.log"; do
    kill -0 $job 2> /dev/null || { echo "the job ended before step $kill_after" >&2; exit 1; }
    sleep 0.05
  done
  local victim killed_at
  # Rank 1's pid, without starting an interpreter (seconds on a loaded machine).
  victim=$(grep -o '"pid": [0-9]*' "$dir/run/ranks.json" | sed -n 2p | grep -o '[0-9]*$')
  killed_at=$(date +%s.%N)
  kill -KILL "$victim"
  wait $job
  job=""
  /usr/bin/python3 bench/recovery_summary.py run "$dir" "$killed_at"
}

for model in ${models//,/ }; do
  results=()
  for ((i = 1; i <= runs; i++)); do
    result=$(run "$model" "$out/$model/run$i")
    echo "$model run $i: $result"
    results+=("$result")
  done
  printf '%s\n' "${results[@]}" | /usr/bin/python3 bench/recovery_summary.py summary "$model"
done
echo "load average after: $(bench_load_average)"
