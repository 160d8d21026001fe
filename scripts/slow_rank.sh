#!/usr/bin/env bash
# Slows one rank of a running `malleus train` from outside malleus, during a span of its steps:
# the monitor must see it like any real straggler. Used by scripts/demo.sh, the straggler
# benchmark and the tests.
#
# Usage: scripts/slow_rank.sh RUN_DIR RANK FROM TO METHOD
#   RUN_DIR  the run's output directory: ranks.json says where each rank runs (pid, CPUs), and
#            metrics.jsonl how far training is. Start this script before the run (or while it
#            runs): it waits for a ranks.json written after it started, and reads only the
#            metrics appended after that (a run directory may hold earlier runs' metrics).
#   FROM-TO  the slowdown starts once step FROM-1 is logged and ends once step TO is logged
#            (steps 1-based, like --straggler).
#   METHOD   busy:N     N busy processes pinned to the rank's CPUs with taskset: the rank gets
#                       about 1/(N+1) of its core (Linux shares a core fairly), so N+1 times slower
#            cpulimit:P Debian's cpulimit lets the rank run P % of the time (SIGSTOP/SIGCONT;
#                       its control is coarse)
#            quota:P    a cgroup CPU quota of P % of one CPU per 10 ms for the rank (cgroup v2
#                       cpu.max, or v1 cpu.cfs_quota_us); exits with status 3 and a message where
#                       the machine has no writable cpu controller
#            moving:MS  one busy process that starts on RANK's CPUs and moves to the next rank's
#                       (in ranks.json's order, round) every MS milliseconds: load that moves
#                       between the ranks (the moving-load benchmark, bench/bench_moving_load.sh)
# Prints one line when the slowdown starts and one when it ends. Whatever it started is stopped
# when it ends, is interrupted, or the run goes away; every busy process also carries its own
# time limit, so nothing outlives a killed script for long.
set -euo pipefail
[[ $# -eq 5 ]] || { sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2; }
run=$1 rank=$2 from=$3 to=$4 method=$5
kind=${method%%:*} amount=${method#*:}
[[ $kind == busy || $kind == cpulimit || $kind == quota || $kind == moving ]] &&
  [[ $amount =~ ^[0-9]+$ ]] ||
  { echo "slow_rank: METHOD must be busy:N, cpulimit:P, quota:P or moving:MS, not \"$method\"" >&2
    exit 2; }
[[ $from =~ ^[0-9]+$ && $to =~ ^[0-9]+$ && $from -ge 1 && $to -ge $from ]] ||
  { echo "slow_rank: FROM-TO must be steps with 1 <= FROM <= TO, not \"$from-$to\"" >&2; exit 2; }
limit_s=${SLOW_RANK_LIMIT_S:-1800}  # the longest any busy process may live

pids=() cgroup="" home_cgroup="" rank_pid=""
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2> /dev/null || true; done
  pids=()
  # A rank left stopped by a killed cpulimit would hang the job.
  [[ $kind == cpulimit && -n $rank_pid ]] && kill -CONT "$rank_pid" 2> /dev/null || true
  if [[ -n $cgroup ]]; then
    [[ -d /proc/$rank_pid ]] && echo "$rank_pid" > "$home_cgroup/cgroup.procs" 2> /dev/null || true
    rmdir "$cgroup" 2> /dev/null || true
    cgroup=""
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=$(date +%s)
offset=$(stat -c %s "$run/metrics.jsonl" 2> /dev/null || echo 0)
# The run's latest logged step (0 before the first), from what was appended since we started.
latest_step() {
  local last
  last=$(tail -c +$((offset + 1)) "$run/metrics.jsonl" 2> /dev/null | tail -c 8192 |
    grep -o '"step":[0-9]*' | tail -n 1) || true
  last=${last#\"step\":}
  echo "${last:-0}"
}
# Waits until step $1 is logged; returns 1 if the rank's process ends first.
wait_for_step() {
  while (($(latest_step) < $1)); do
    [[ -d /proc/$rank_pid ]] || return 1
    sleep 0.05
  done
}

fresh_ranks() { [[ -s $run/ranks.json ]] && (($(stat -c %Y "$run/ranks.json") >= started)); }
for _ in $(seq 1200); do fresh_ranks && break; sleep 0.1; done
fresh_ranks || { echo "slow_rank: no new $run/ranks.json within 120 s" >&2; exit 1; }
read -r rank_pid rank_cpus all_cpus < <(python3 - "$run/ranks.json" "$rank" << 'EOF'
import json, sys
ranks = json.load(open(sys.argv[1]))["ranks"]
rank = int(sys.argv[2])
if not 0 <= rank < len(ranks):
    sys.exit(f"slow_rank: {sys.argv[1]} has no rank {rank} (ranks 0-{len(ranks) - 1})")
# Every rank's CPUs from RANK on, round (moving:MS visits them in turn), separated by '/'.
print(ranks[rank]["pid"], ranks[rank]["cpus"],
      "/".join(ranks[(rank + i) % len(ranks)]["cpus"] for i in range(len(ranks))))
EOF
)

if [[ $kind == quota ]]; then
  # cgroup v2 where the cpu controller is enabled, else v1's cpu hierarchy.
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers; then
    base=/sys/fs/cgroup
  elif [[ -f /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]]; then
    base=/sys/fs/cgroup/cpu
  else
    echo "slow_rank: no cgroup cpu controller on this machine; quota:P cannot be used here" >&2
    exit 3
  fi
  if ! mkdir "$base/malleus-slow-$$" 2> /dev/null; then
    echo "slow_rank: cannot create a cgroup under $base (not root, or read-only); quota:P cannot be used here" >&2
    exit 3
  fi
  rmdir "$base/malleus-slow-$$"
fi

wait_for_step $((from - 1)) || exit 0
case $kind in
  busy)
    for _ in $(seq "$amount"); do
      timeout "$limit_s" taskset -c "$rank_cpus" bash -c 'while :; do :; done' &
      pids+=($!)
    done
    ;;
  moving)
    # One busy process, its affinity moved from rank to rank by a loop that ends with it.
    IFS=/ read -r -a visits <<< "$all_cpus"
    # (taskset execs bash: $! is the busy process itself; it carries its own time limit.)
    taskset -c "${visits[0]}" bash -c "while ((SECONDS < $limit_s)); do :; done" &
    busy=$!
    pids+=("$busy")
    (
      i=1
      while sleep "$(printf '%d.%03d' $((amount / 1000)) $((amount % 1000)))" &&
        taskset -apc "${visits[i % ${#visits[@]}]}" "$busy" > /dev/null 2>&1; do
        i=$((i + 1))
      done
    ) &
    pids+=($!)
    ;;
  cpulimit)
    command -v cpulimit > /dev/null || { echo "slow_rank: cpulimit is not installed (apt-get install cpulimit)" >&2; exit 1; }
    timeout "$limit_s" cpulimit --pid "$rank_pid" --limit "$amount" --lazy --quiet > /dev/null &
    pids+=($!)
    ;;
  quota)
    # The rank's own group now, to go back to afterwards (v2: "0::PATH"; v1: "N:...cpu...:PATH").
    if [[ $base == /sys/fs/cgroup ]]; then
      home_cgroup=$base$(sed -n 's/^0:://p' "/proc/$rank_pid/cgroup")
    else
      home_cgroup=$base$(awk -F: '$2 ~ /(^|,)cpu(,|$)/ {print $3}' "/proc/$rank_pid/cgroup")
    fi
    cgroup=$base/malleus-slow-$$
    mkdir "$cgroup"
    if [[ $base == /sys/fs/cgroup ]]; then
      echo "$((amount * 100)) 10000" > "$cgroup/cpu.max"
    else
      echo 10000 > "$cgroup/cpu.cfs_period_us"
      echo $((amount * 100)) > "$cgroup/cpu.cfs_quota_us"
    fi
    echo "$rank_pid" > "$cgroup/cgroup.procs"  # the whole process, every thread
    ;;
esac
echo "slow_rank: rank $rank (pid $rank_pid, CPU $rank_cpus) slowed by $method after step $(latest_step)"
wait_for_step "$to" || true
cleanup
echo "slow_rank: rank $rank released after step $(latest_step)"
