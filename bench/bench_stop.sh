#!/usr/bin/env bash
# The window a stop needs: a 2-rank job (one rank per core, mpirun) gets SIGTERM on both ranks,
# as Slurm's scancel sends it, in mid-run; the ranks finish the step they are in, save a
# checkpoint of it and exit (docs/running.md, "Stopping a run"). Measured per run, from the
# signal:
#   saved  until checkpoints/latest names the stop's checkpoint (the commit): the kill window
#          must be longer than this
#   ended  until mpirun exited
#   step   the median step time before the signal (the stop waits for the step in flight)
# and the median (min-max) over the runs, for each model:
#   demo  3.5 M parameters, seq 128, global batch 8
#   100m  99 M parameters (hidden 768, 14 layers, 12 heads, FFN 2048, byte vocabulary), seq 64,
#         global batch 4
# The checkpoint holds the parameters and both Adam moments: 12 bytes a parameter.
#
# Usage: bench/bench_stop.sh [models, comma-separated (demo,100m)] [runs (3)]
# Results go to runs/bench-stop/<model>/run<i>/ (BENCH_OUT overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
models=${1:-demo,100m}
runs=${2:-3}
bench_require_count runs "$runs"
bench_ready_to_train
out=$(bench_output_dir runs/bench-stop)
bench_write_model "$out/model-100m.json" m100 768 14 12 2048 256
echo "load average before: $(bench_load_average)"

job=""
trap '[[ -n $job ]] && kill $job 2> /dev/null; true' EXIT

# run MODEL DIR: one run; prints "saved ended step bytes" (seconds, seconds, seconds, bytes).
run() {
  local model=$1 dir=$2 flags
  case $model in
    demo) flags=(--model demo --seq-len 128 --global-batch 8) ;;
    100m) flags=(--model "$out/model-100m.json" --seq-len 64 --global-batch 4) ;;
    *) echo "unknown model $model (demo, 100m)" >&2; exit 2 ;;
  esac
  rm -rf "$dir"
  mkdir -p "$dir"
  : > "$dir/out.log"  # before the job's shell opens it: the wait below reads it at once
  timeout 1200 mpirun -np 2 --bind-to core --map-by core build/malleus train "${flags[@]}" \
    --steps 100000 --checkpoint-every 0 --micro-batch 1 --threads 1 --val-data "" \
    --eval-every 0 --no-replan --no-memory-checkpoints --warmup-steps 2 --out "$dir/run" \
    > "$dir/out.log" 2>&1 &
  job=$!
  until grep -q "^step     4/" "$dir/out.log"; do
    kill -0 $job 2> /dev/null || { echo "the job ended before step 4" >&2; exit 1; }
    sleep 0.05
  done
  local pids signalled saved ended
  pids=$(grep -o '"pid": [0-9]*' "$dir/run/ranks.json" | grep -o '[0-9]*$')
  signalled=$(date +%s.%N)
  # shellcheck disable=SC2086
  kill -TERM $pids
  until [[ -f $dir/run/checkpoints/latest ]]; do
    kill -0 $job 2> /dev/null || break
    sleep 0.01
  done
  saved=$(date +%s.%N)
  wait $job || true
  ended=$(date +%s.%N)
  job=""
  local step bytes
  step=$(grep -o '| [0-9.]* s |' "$dir/out.log" | tr -d '| s' | sort -n |
    awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  bytes=$(du -sb "$dir/run/checkpoints" | cut -f1)
  [[ -f $dir/run/checkpoints/latest ]] || { echo "no checkpoint was saved" >&2; exit 1; }
  awk -v a="$signalled" -v s="$saved" -v e="$ended" -v st="$step" -v b="$bytes" \
    'BEGIN {printf "%.3f %.3f %s %s\n", s - a, e - a, st, b}'
}

# median_range VALUES...: "median (min-max)".
median_range() {
  printf '%s\n' "$@" | sort -g | awk '{a[NR] = $1} END {printf "%.2f (%.2f-%.2f)", a[int((NR + 1) / 2)], a[1], a[NR]}'
}

for model in ${models//,/ }; do
  saved=() ended=() steps=()
  for ((i = 1; i <= runs; i++)); do
    read -r s e st bytes <<< "$(run "$model" "$out/$model/run$i")"
    echo "$model run $i: saved ${s} s, ended ${e} s after the signal; step ${st} s; checkpoint $bytes bytes"
    saved+=("$s") ended+=("$e") steps+=("$st")
  done
  echo "$model: saved $(median_range "${saved[@]}") s, ended $(median_range "${ended[@]}") s after SIGTERM; step $(median_range "${steps[@]}") s; checkpoint $((bytes / 1048576)) MiB"
done
echo "load average after: $(bench_load_average)"
