#!/usr/bin/env bash
# malleus under a real Slurm: a cluster of slurmctld and 2 or 3 slurmd on this machine
# (scripts/slurm.sh), the batch scripts of examples/slurm/ submitted as written, with the tiny
# model's arguments after them. One case per call:
#
#   batch    examples/slurm/demo.sbatch trains to the end (srun starts its 2 ranks); the job is
#            COMPLETED and its losses are those of the same run under mpirun.
#   scancel  the job is cancelled mid-run (SIGTERM to every rank, SIGKILL after KillWait): the
#            run's newest checkpoint is the last step it logged (no periodic checkpoint is due,
#            so the stop saved it) and the job is CANCELLED.
#   requeue  `scontrol requeue` mid-run: the job runs its script again, `malleus train` continues
#            the run from the checkpoint the stop saved, with no argument changed, and every
#            step's loss equals the uninterrupted run's.
#   timelimit  examples/slurm/multinode.sbatch on 2 nodes with a 1-minute time limit: Slurm's
#            --signal=USR1 ahead of the limit stops the ranks with a checkpoint, the script requeues
#            the job, and the requeued job continues the run with the losses of an uninterrupted
#            run; a scancel then stops it through malleus launch, which reports the stop.
#   drain    examples/slurm/multinode.sbatch on 3 nodes x 1 task; mid-run the third node is
#            drained and its rank killed: `malleus launch` restarts on the other 2 nodes, says the
#            drained node was left out and why, and the losses equal the uninterrupted run's.
#   torch    malleus.torch.init_from_env in 2 ranks that srun starts (no torch variables): the
#            ranks, world size, rank 0's address and port come from Slurm, and an all-reduce works.
#
# Usage: tests/slurm_test.sh CASE MALLEUS_BINARY SOURCE_DIR
# Exits 77 (CTest: skipped) with the reason where Slurm cannot run here (scripts/slurm.sh: not
# root, slurm-wlm or munge missing, a daemon that does not come up). Every wait has a limit; the
# cluster, its jobs' processes, the runs' memory copies and the scratch directory go whatever
# happens.
set -euo pipefail
case_name=${1:-} malleus=${2:-} source_dir=${3:-}
[[ $case_name =~ ^(batch|scancel|requeue|timelimit|drain|torch)$ && -x $malleus && -d $source_dir ]] || {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
malleus=$(realpath "$malleus") source_dir=$(realpath "$source_dir")
slurm="$source_dir/scripts/slurm.sh"
scratch=$(mktemp -d /tmp/malleus-slurm-test.XXXXXX)
cluster=$scratch/cluster
cleanup() {
  "$slurm" down "$cluster" > /dev/null 2>&1 || true
  local run
  for run in "$scratch"/runs/* "$scratch"/straight; do
    [[ ! -d $run ]] || "$malleus" clean-memory "$run" > /dev/null 2>&1 || true
  done
  rm -rf "$scratch"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

fail() {
  echo "FAIL ($case_name): $*"
  if [[ -f $scratch/job.out ]]; then
    echo "--- the job's output (last 80 lines)"
    tail -n 80 "$scratch/job.out"
  fi
  exit 1
}

nodes=2
[[ $case_name != drain ]] || nodes=3
status=0
"$slurm" up "$cluster" "$nodes" 2 || status=$?
((status != 77)) || exit 77
((status == 0)) || fail "scripts/slurm.sh up exited with $status"
eval "$("$slurm" env "$cluster")"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
first_node=$(sinfo -h -N -o %N | head -n 1)
last_node=$(sinfo -h -N -o %N | tail -n 1)

# The tiny model, a constant learning rate, the plan the job starts with (--no-replan): the losses
# of a run do not depend on its rank count or on a restart (docs/design.md, the invariant).
timeout 300 "$malleus" prepare-data --output "$scratch/data" > /dev/null
tiny=(--model tiny --seq-len 16 --micro-batch 1 --global-batch 12 --threads 1 --warmup-steps 1
  --min-lr-ratio 1 --val-data '' --no-replan --train-data "$scratch/data/train_*.bin")
# Rank 0 computes 100 times longer than it would (timing only: the numerics are untouched), so
# that a step takes a good part of a second and the test acts mid-run.
slowed=(--straggler 0:100:1-)

# `submit [SBATCH OPTIONS] SCRIPT [ARGUMENTS]`: a script of examples/slurm/ submitted from the
# scratch directory (as from a repository's root: its run goes to runs/), its output in job.out;
# prints the job id.
submit() {
  MALLEUS=$malleus timeout 30 sbatch --parsable --chdir="$scratch" --output="$scratch/job.out" \
    "$@"
}

# Waits up to $2 seconds for job $1 to leave the queue (finished, cancelled, failed).
wait_job() {
  local end=$((SECONDS + $2))
  while [[ -n $(timeout 10 squeue -h -j "$1" -o %T 2> /dev/null) ]]; do
    ((SECONDS < end)) || fail "job $1 still in the queue after $2 s"
    sleep 1
  done
}

# Waits up to $3 seconds until job $1's output logs step $2.
wait_step() {
  local end=$((SECONDS + $3)) pattern
  pattern=$(printf 'step %5d/' "$2")
  until grep -qF "$pattern" "$scratch/job.out" 2> /dev/null; do
    ((SECONDS < end)) || fail "step $2 not logged within $3 s"
    [[ -n $(timeout 10 squeue -h -j "$1" -o %T 2> /dev/null) ]] || fail "job $1 ended before step $2"
    sleep 0.3
  done
}

job_field() { timeout 10 scontrol show job -o "$1" | grep -o "\b$2=[^ ]*" | head -n 1 | cut -d= -f2; }

# The uninterrupted run on $1 ranks under mpirun, $2 steps, in $scratch/straight.
uninterrupted() {
  timeout 300 mpirun --oversubscribe -np "$1" "$malleus" train "${tiny[@]}" --steps "$2" \
    --out "$scratch/straight" > "$scratch/straight.out" 2>&1 ||
    fail "the uninterrupted run failed: $(tail -n 5 "$scratch/straight.out")"
}

# Every step of run $1 (the last loss logged for it: a resumed run logs some steps again) equals
# the uninterrupted run's within 2e-4, and both ran $2 steps (with $3 = first: run $1 may have
# run more, and its first $2 are compared).
same_losses() {
  /usr/bin/python3 - "$1/metrics.jsonl" "$scratch/straight/metrics.jsonl" "$2" "${3:-}" << 'PY' ||
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if "event" not in record and "loss" in record:
            out[record["step"]] = record["loss"]
    return out
run, straight, steps = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
if sys.argv[4] == "first":
    run = {s: loss for s, loss in run.items() if s <= steps}
assert sorted(run) == list(range(1, steps + 1)), f"run logged steps {sorted(run)}"
assert sorted(straight) == sorted(run), f"uninterrupted run logged steps {sorted(straight)}"
bad = [(s, run[s], straight[s]) for s in run if abs(run[s] - straight[s]) > 2e-4]
assert not bad, f"losses differ (step, run, uninterrupted): {bad}"
print(f"steps 1-{steps}: every loss equals the uninterrupted run's (within 2e-4)")
PY
    fail "losses of $1"
}

# The step of run $1's newest checkpoint (its `latest`).
latest_step() { sed -n 's/^step_0*\([0-9][0-9]*\)$/\1/p' "$1/checkpoints/latest"; }
# The last step run $1 logged.
last_logged_step() {
  /usr/bin/python3 -c 'import json,sys; print(max(json.loads(l)["step"] for l in open(sys.argv[1]) if "\"loss\"" in l))' "$1/metrics.jsonl"
}

demo=$source_dir/examples/slurm/demo.sbatch
multinode=$source_dir/examples/slurm/multinode.sbatch
case $case_name in
  batch)
    jid=$(submit "$demo" "${tiny[@]}" --steps 8 --checkpoint-every 4)
    wait_job "$jid" 240
    state=$(job_field "$jid" JobState) code=$(job_field "$jid" ExitCode)
    [[ $state == COMPLETED && $code == 0:0 ]] || fail "job $jid ended $state, exit code $code"
    grep -q "plan on 2 ranks" "$scratch/job.out" || fail "the job did not train on 2 ranks"
    uninterrupted 2 8
    same_losses "$scratch/runs/slurm-demo-$jid" 8
    [[ $(latest_step "$scratch/runs/slurm-demo-$jid") == 8 ]] || fail "no checkpoint of step 8"
    echo "batch job $jid: COMPLETED, 2 ranks under srun"
    ;;
  scancel)
    # No periodic checkpoint within the run, no memory copies: a checkpoint is the stop's save.
    jid=$(submit "$demo" "${tiny[@]}" "${slowed[@]}" --steps 200 --checkpoint-every 1000 \
      --no-memory-checkpoints)
    wait_step "$jid" 5 240
    timeout 30 scancel "$jid"
    wait_job "$jid" 120
    state=$(job_field "$jid" JobState)
    [[ $state == CANCELLED ]] || fail "job $jid ended $state, not CANCELLED"
    run=$scratch/runs/slurm-demo-$jid
    [[ -f $run/checkpoints/latest ]] || fail "scancel left no checkpoint in $run"
    saved=$(latest_step "$run") logged=$(last_logged_step "$run")
    ((saved == logged && saved >= 5)) ||
      fail "the newest checkpoint is of step $saved, the last logged step $logged"
    echo "scancel of job $jid at step $logged: the stop saved step $saved ($state)"
    ;;
  requeue)
    steps=24
    jid=$(submit "$demo" "${tiny[@]}" "${slowed[@]}" --steps $steps --checkpoint-every 1000)
    wait_step "$jid" 5 240
    timeout 30 scontrol requeue "$jid"
    wait_job "$jid" 300
    state=$(job_field "$jid" JobState) restarts=$(job_field "$jid" Restarts)
    [[ $state == COMPLETED && $restarts == 1 ]] || fail "job $jid ended $state after $restarts restarts"
    run=$scratch/runs/slurm-demo-$jid
    line=$(grep -m 1 "^requeued Slurm job $jid (restart 1): continuing runs/slurm-demo-$jid from its newest checkpoint" "$scratch/job.out") ||
      fail "the requeued job did not say it continues the run"
    resumed=$(grep -m 1 "^resuming from " "$scratch/job.out") || fail "the requeued job did not resume"
    [[ $resumed =~ at\ step\ ([0-9]+)$ ]] && ((BASH_REMATCH[1] >= 5)) ||
      fail "resumed from before the requeue: $resumed"
    uninterrupted 2 $steps
    same_losses "$run" $steps
    echo "requeue of job $jid: $line; $resumed"
    ;;
  drain)
    steps=20
    jid=$(submit --nodes=3 --ntasks-per-node=1 "$multinode" "${tiny[@]}" \
      "${slowed[@]}" --steps $steps --checkpoint-every 4)
    wait_step "$jid" 5 240
    reason="malleus test: node drained"
    timeout 30 scontrol update NodeName="$last_node" State=DRAIN Reason="$reason"
    # The rank on the drained node: a process of this cluster's job step on that node.
    victim=""
    for pid in $(pgrep -x malleus); do
      environ=$(tr '\0' '\n' < "/proc/$pid/environ" 2> /dev/null) || continue
      grep -qx "SLURM_CONF=$SLURM_CONF" <<< "$environ" &&
        grep -qx "SLURMD_NODENAME=$last_node" <<< "$environ" &&
        grep -q "^SLURM_STEP_ID=" <<< "$environ" && victim=$pid
    done
    [[ -n $victim ]] || fail "no rank of job $jid on $last_node"
    kill -KILL "$victim"
    wait_job "$jid" 300
    state=$(job_field "$jid" JobState)
    [[ $state == COMPLETED ]] || fail "job $jid ended $state"
    out=$scratch/job.out
    left="launch: node $last_node left out: drained (Slurm state "
    grep -F "$left" "$out" | grep -qF "+DRAIN, reason \"$reason\")" ||
      fail "launch did not say that $last_node was left out as drained"
    grep -q "^restart 1 at step [0-9]*: rank 2 killed; resuming from the checkpoint of step [0-9]* on 2 ranks" "$out" ||
      fail "no restart on 2 ranks"
    grep -q -- "--nodes=2 --ntasks=2 --nodelist=$first_node,[^ ]* " "$out" ||
      fail "the restart's srun did not name 2 nodes"
    ! grep -q -- "--nodes=2 --ntasks=2 --nodelist=[^ ]*$last_node" "$out" ||
      fail "the restart ran on the drained node"
    grep -q "launch: the run finished after 1 restart" "$out" || fail "the run did not finish"
    uninterrupted 3 $steps
    same_losses "$scratch/runs/slurm-multinode-$jid" $steps
    echo "drain: $(grep -F "$left" "$out" | head -n 1)"
    ;;
  timelimit)
    # multinode.sbatch's --signal, with a 1-minute limit (Slurm's least): SIGUSR1 to every rank
    # 20 to 50 s before it (Slurm checks limits every 30 s and signals up to 30 s early), 10 to
    # 40 s into the job, which leaves the ranks at least 30 s to save and exit 138 and the script
    # to requeue the job before a check finds the limit passed. Once requeued, the limit is
    # lifted; the test follows the requeued job 3 steps past its resume, then cancels it (a run
    # long enough to outlast the signal on any machine would take minutes to finish).
    jid=$(submit --nodes=2 --ntasks-per-node=1 --time=1 --signal=USR1@20 "$multinode" \
      "${tiny[@]}" "${slowed[@]}" --steps 100000 --checkpoint-every 100000)
    end=$((SECONDS + 240))
    until (($(job_field "$jid" Restarts) >= 1)); do
      ((SECONDS < end)) || fail "job $jid not requeued within 240 s"
      [[ -n $(timeout 10 squeue -h -j "$jid" -o %T) ]] || fail "job $jid ended without a requeue"
      sleep 1
    done
    timeout 30 scontrol update JobId="$jid" TimeLimit=UNLIMITED
    out=$scratch/job.out
    end=$((SECONDS + 240))
    until resumed=$(grep -m 1 "^resuming from " "$out"); do
      ((SECONDS < end)) || fail "the requeued job did not resume within 240 s"
      sleep 1
    done
    [[ $resumed =~ at\ step\ ([0-9]+)$ ]] || fail "$resumed"
    from=${BASH_REMATCH[1]}
    wait_step "$jid" $((from + 3)) 240
    timeout 30 scancel "$jid"
    wait_job "$jid" 120
    # 138 whether srun ended the rank exiting last (it then reports 143) or not.
    grep -Eq "^launch: the job was stopped \(exit status 138[;)]" "$out" || fail "no stop by SIGUSR1"
    grep -q "^stopped ahead of the time limit: requeueing job $jid" "$out" || fail "no requeue"
    line=$(grep -m 1 "^requeued Slurm job $jid (restart 1): continuing runs/slurm-multinode-$jid from its newest checkpoint" "$out") ||
      fail "the requeued job did not continue the run"
    # The batch shell waits for malleus launch, which saw the scancel and stopped the ranks.
    grep -q "^launch: the job stopped by SIGTERM after step [0-9]*; its checkpoint is " "$out" ||
      fail "malleus launch did not report the scancel's stop"
    uninterrupted 2 $((from + 3))
    same_losses "$scratch/runs/slurm-multinode-$jid" $((from + 3)) first
    echo "time limit of job $jid: $line; $resumed"
    ;;
  torch)
    cat > "$scratch/ranks.py" << 'PY'
import os, torch, torch.distributed as dist, malleus.torch as mt
mt.init_from_env("gloo", timeout_s=120)
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
env = os.environ
print(f"rank {dist.get_rank()} of {dist.get_world_size()} local {env['LOCAL_RANK']} "
      f"at {env['MASTER_ADDR']}:{env['MASTER_PORT']} sum {total.item():.0f}")
dist.destroy_process_group()
PY
    out=$(PYTHONPATH=$(dirname "$malleus")/python timeout 240 srun --nodes=2 --ntasks=2 \
      --kill-on-bad-exit=1 /usr/bin/python3 "$scratch/ranks.py" 2>&1) || fail "srun: $out"
    echo "$out"
    for rank in 0 1; do
      grep -qE "^rank $rank of 2 local 0 at $first_node:[0-9]+ sum 3$" <<< "$out" ||
        fail "rank $rank did not join the group from Slurm's variables"
    done
    ;;
esac
echo "PASS ($case_name)"
