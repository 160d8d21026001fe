#!/usr/bin/env bash
# What Open MPI's mpirun does to its ranks when mpirun itself gets a signal (docs/running.md,
# "Stopping a run"): starts 2 ranks of a small probe that logs every signal it receives with a
# timestamp, sends SIGTERM, SIGINT, then SIGUSR1 (followed by SIGTERM to end that job) to mpirun,
# and prints when each rank saw what, relative to the moment mpirun was signalled, and mpirun's
# exit status. Usage: scripts/mpirun_signals.sh [odls_base_sigkill_timeout seconds]
set -euo pipefail
timeout_s=${1:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/probe.py" <<'PY'
import os, signal, sys, time
rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
def note(sig, frame):
    print(f"{time.time():.3f} rank {rank} got {signal.Signals(sig).name}", flush=True)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCONT, signal.SIGUSR1, signal.SIGHUP):
    signal.signal(s, note)
print(f"{time.time():.3f} rank {rank} ready", flush=True)
while True:
    time.sleep(0.05)
    print(f"{time.time():.3f} rank {rank} alive", flush=True)
PY
for sig in TERM INT USR1; do
  mpirun --mca odls_base_sigkill_timeout "$timeout_s" --oversubscribe -np 2 \
    python3 "$work/probe.py" > "$work/out" 2>&1 &
  job=$!
  until [[ $(grep -c ready "$work/out" 2> /dev/null || true) -ge 2 ]]; do sleep 0.1; done
  t0=$(date +%s.%N)
  kill -"$sig" "$job"
  if [[ $sig == USR1 ]]; then sleep 2; kill -TERM "$job"; fi
  status=0
  wait "$job" || status=$?
  echo "== SIG$sig to mpirun (odls_base_sigkill_timeout $timeout_s): mpirun exit status $status"
  awk -v t0="$t0" '/ got /{printf "  +%.2f s  %s %s %s %s\n", $1 - t0, $2, $3, $4, $5}
                   / alive/{last[$3] = $1}
                   END {for (r in last) printf "  +%.2f s  rank %s last alive\n", last[r] - t0, r}' \
    "$work/out"
done
