#!/usr/bin/env bash
# What a lost host's memory costs at the restart (docs/recovery.md#memory-checkpoints): on the
# emulated test bed (scripts/hosts.sh) of 2 hosts × 2 ranks, the demo model (seq 128, global batch
# 8) trains with a memory checkpoint every step and no disk checkpoint. Once both hosts hold the
# copy of step 4, rank 1 (on host 0) is killed with SIGKILL and host 0's memory folder removed (the
# host lost); `malleus train --resume` on both hosts again then sends host 0 every file of the step
# from host 1 before it reads it. Prints each run's restart lines ("memory checkpoint of step N
# completed on every host: F files, X MiB sent between hosts in T s", T from the start of the
# gathering — host names, the hosts' listings, the plan — to the last file written; "resuming
# from ...") and the median T over the runs.
#
# Usage: bench/bench_host_restart.sh [runs (3)]. Exits 77 where namespaces cannot be made.
# Results go to runs/bench-host-restart/run<i>/ (BENCH_OUT overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/bench_common.sh
source bench/bench_common.sh
runs=${1:-3}
bench_ready_to_train
out=$(bench_output_dir runs/bench-host-restart)
export MALLEUS_HOSTS_PREFIX=mb MALLEUS_HOSTS_SUBNET=198.18.16 MALLEUS_HOSTS_SLOTS=2
shm=${MALLEUS_MEMORY_CHECKPOINT_DIR:-/dev/shm}
job=""
trap '[[ -z $job ]] || kill $job 2> /dev/null; scripts/hosts.sh down' EXIT
echo "load average before: $(bench_load_average)"
scripts/hosts.sh up 2 # exits 77 where namespaces cannot be made
flags=(--model demo --seq-len 128 --global-batch 8 --micro-batch 1 --threads 1 --val-data ""
       --eval-every 0 --no-replan --warmup-steps 2 --memory-checkpoint-every 1
       --checkpoint-every 100)

# Whether host $1 holds a complete memory copy of step 4 or later.
holds_step_4() {
  compgen -G "$shm/$MALLEUS_HOSTS_PREFIX-h$1/malleus-*/step_0000000[4-9]/manifest.json" > /dev/null
}

for ((i = 1; i <= runs; ++i)); do
  dir="$out/run$i"
  rm -rf "$dir"
  mkdir -p "$dir"
  timeout 600 scripts/hosts.sh mpirun -np 4 build/malleus train "${flags[@]}" --steps 12 \
    --train-data "data/fortunes/train_*.bin" --out "$dir/run" > "$dir/killed.log" 2>&1 &
  job=$!
  until holds_step_4 0 && holds_step_4 1; do
    kill -0 $job 2> /dev/null || { cat "$dir/killed.log"; echo "the job ended early" >&2; exit 1; }
    sleep 0.05
  done
  kill -9 "$(/usr/bin/python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["ranks"][1]["pid"])' \
    "$dir/run/ranks.json")"
  wait $job || true
  job=""
  rm -rf "${shm:?}/$MALLEUS_HOSTS_PREFIX-h0"
  timeout 600 scripts/hosts.sh mpirun -np 4 build/malleus train --resume "$dir/run" --steps 8 \
    > "$dir/resumed.log" 2>&1 || { cat "$dir/resumed.log"; exit 1; }
  grep -E "^(memory checkpoint of step .* on every host|resuming from|not resuming)" \
    "$dir/resumed.log" | sed "s/^/run $i: /"
done
echo "load average after: $(bench_load_average)"
cat "$out"/run*/resumed.log | /usr/bin/python3 -c '
import re, statistics, sys
t = [float(m.group(1)) for m in re.finditer(r"between hosts in ([0-9.]+) s", sys.stdin.read())]
print(f"median {statistics.median(t):.3f} s (min {min(t):.3f}, max {max(t):.3f}) over {len(t)} restarts" if t else "no copies moved")'
