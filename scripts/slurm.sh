#!/usr/bin/env bash
# A Slurm cluster on this machine, for the tests and for trying the batch scripts of
# examples/slurm/ as written: munged with a key and socket of its own, slurmctld, and N slurmd
# (nodes HOST, HOST-n2, HOST-n3, ... after this machine's short name; each slurmd its own port on
# 127.0.0.1), all in one directory (config, state, spools, logs); nothing is written to /etc.
# Needs root (slurmd runs jobs as their users) and Debian's slurm-wlm and munge (setup.sh).
#
#   scripts/slurm.sh up DIR [N] [CPUS]   start a cluster of N nodes (default 3) of CPUS each
#                                        (default: this machine's) in DIR (made; must be empty)
#   scripts/slurm.sh env DIR             the environment a shell needs to use it:
#                                        eval "$(scripts/slurm.sh env DIR)"
#   scripts/slurm.sh down DIR            cancel its jobs, end every process it started (daemons,
#                                        jobs' processes) and remove DIR (safe to repeat)
#   scripts/slurm.sh run N SECONDS CMD...
#                                        up N in a new temporary directory, CMD in its
#                                        environment under a time limit of SECONDS, down again
#                                        whatever happened
#
# The nodes share this machine, its CPUs and its /dev/shm, as the slots of one host do; Open
# MPI's shared-memory transport would take the ranks of two nodes for one node's, so `env` sets
# OMPI_MCA_btl=tcp,self (on a real cluster each node has its own memory and this is not needed).
# Exit codes: 77 where Slurm cannot run here (not root, packages missing, a daemon that does not
# come up: the reason is printed; tests skip on it), 2 for bad usage.
set -euo pipefail

die() {
  echo "slurm.sh: $*" >&2
  exit 2
}
skip() {
  echo "slurm.sh: cannot run Slurm here: $*" >&2
  exit 77
}

# Free TCP ports on 127.0.0.1, as many as asked (the kernel's choice; released at once).
free_ports() {
  /usr/bin/python3 - "$1" << 'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}

# Node 1 is named after this machine, so that its name resolves (as the first node of a job's
# list must for torch's MASTER_ADDR, malleus.torch.init_from_env); the others after it, HOST-n2,
# HOST-n3..., which Slurm sorts after it ("localhost" cannot be a node's name: Slurm takes it for
# every node's host).
node_name() { if (($1 == 1)); then hostname -s; else echo "$(hostname -s)-n$1"; fi; }

write_config() {
  local dir=$1 n=$2 cpus=$3 ctld_port=$4
  shift 4
  local host
  host=$(hostname -s)
  cat > "$dir/slurm.conf" << EOF
# Written by scripts/slurm.sh: a cluster of $n nodes on this machine.
ClusterName=malleus
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it may start again (Slurm's default 120 s),
# long enough here for a step's credential to reach a slurmd on the same machine.
AuthInfo=socket=$dir/munge/socket,cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# Per node: the PMIx plugin's directories would otherwise collide in /tmp.
TmpFS=$dir/tmp/%n
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# A pending job whose begin time passed (a requeued one) starts within seconds, not a minute.
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
# Configured CPUs count even where the nodes share fewer.
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=60
KillWait=15
MinJobAge=600
JobRequeue=1
EOF
  local i
  for ((i = 1; i <= n; ++i)); do
    echo "NodeName=$(node_name "$i") NodeAddr=127.0.0.1 Port=$1 CPUs=$cpus" \
      >> "$dir/slurm.conf"
    shift
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"
}

# Waits up to $2 seconds (wall time) for $1 (a command) to succeed; false if $3 (a pid file),
# when given, names a process that ended.
wait_for() {
  local what=$1 seconds=$2 alive=${3:-} end=$((SECONDS + $2))
  while ((SECONDS < end)); do
    if eval "$what" > /dev/null 2>&1; then return 0; fi
    if [[ -n $alive ]] && ! kill -0 "$(cat "$alive" 2> /dev/null || echo 0)" 2> /dev/null; then
      return 1
    fi
    sleep 0.2
  done
  return 1
}

cmd_up() {
  local dir=${1:-} n=${2:-3} cpus=${3:-$(nproc)}
  [[ -n $dir ]] || die "up: give a directory"
  [[ $n =~ ^[1-9][0-9]?$ ]] || die "up: expected a node count 1..99, got '$n'"
  [[ $cpus =~ ^[1-9][0-9]*$ ]] || die "up: expected a CPU count, got '$cpus'"
  (($(id -u) == 0)) || skip "slurmd needs root"
  local tool
  for tool in munged slurmctld slurmd sbatch scontrol; do
    command -v "$tool" > /dev/null || skip "$tool is not installed (scripts/setup.sh installs slurm-wlm and munge)"
  done
  if [[ -e $dir ]] && [[ -n $(ls -A "$dir") ]]; then die "up: $dir is not empty"; fi
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir"/{munge,state,run,log,tmp,spool}
  chmod 755 "$dir/munge"
  head -c 1024 /dev/urandom > "$dir/munge/key"
  chmod 400 "$dir/munge/key"
  # Half-made clusters are taken down again.
  trap 'cmd_down "$dir" > /dev/null 2>&1 || true' ERR
  setsid munged --foreground --force --socket="$dir/munge/socket" --key-file="$dir/munge/key" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" \
    --seed-file="$dir/munge/seed" > "$dir/log/munged.out" 2>&1 < /dev/null &
  echo $! > "$dir/run/munged.pid.own"
  wait_for "[[ -S '$dir/munge/socket' ]]" 20 "$dir/run/munged.pid.own" || {
    cat "$dir/log/munged.out" >&2
    cmd_down "$dir"
    skip "munged did not start"
  }
  local ports
  read -r -a ports <<< "$(free_ports $((n + 1)))"
  write_config "$dir" "$n" "$cpus" "${ports[@]}"
  local i name
  for ((i = 1; i <= n; ++i)); do mkdir -p "$dir/spool/$(node_name "$i")" "$dir/tmp/$(node_name "$i")"; done
  SLURM_CONF=$dir/slurm.conf setsid slurmctld -D -i -f "$dir/slurm.conf" \
    > "$dir/log/slurmctld.out" 2>&1 < /dev/null &
  echo $! > "$dir/run/slurmctld.pid.own"
  for ((i = 1; i <= n; ++i)); do
    name=$(node_name "$i")
    SLURM_CONF=$dir/slurm.conf setsid slurmd -D -N "$name" -f "$dir/slurm.conf" \
      > "$dir/log/slurmd-$name.out" 2>&1 < /dev/null &
  done
  # Every node idle: the cluster takes jobs.
  local idle="SLURM_CONF='$dir/slurm.conf' timeout 5 sinfo -h -N -t idle -o %N | sort -u | wc -l"
  if ! wait_for "[[ \$($idle) -eq $n ]]" 60 "$dir/run/slurmctld.pid.own"; then
    tail -n 5 "$dir"/log/*.out >&2 || true
    cmd_down "$dir"
    skip "the cluster's $n nodes did not all come up within 60 s (logs above)"
  fi
  trap - ERR
}

cmd_env() {
  local dir=${1:-}
  [[ -f $dir/slurm.conf ]] || die "env: $dir holds no cluster (scripts/slurm.sh up $dir)"
  dir=$(cd "$dir" && pwd)
  echo "export SLURM_CONF=$dir/slurm.conf OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=lo" \
    "OMPI_MCA_mpi_yield_when_idle=1"
}

# Every process whose environment names this cluster's config (its daemons, slurmstepd, the jobs'
# processes), but this script and its callers, and the munged it started.
own_processes() {
  local dir=$1 pid callers=" " p=$$
  while ((p > 1)); do
    callers+="$p "
    p=$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2> /dev/null || echo 1)
  done
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    [[ $callers == *" $pid "* ]] && continue
    ((pid == BASHPID)) && continue
    if grep -qxz "SLURM_CONF=$dir/slurm.conf" "/proc/$pid/environ" 2> /dev/null; then
      echo "$pid"
    fi
  done
  [[ ! -f $dir/run/munged.pid.own ]] || cat "$dir/run/munged.pid.own"
}

cmd_down() {
  local dir=${1:-}
  [[ -n $dir ]] || die "down: give a directory"
  [[ -d $dir ]] || return 0
  dir=$(cd "$dir" && pwd)
  [[ -f $dir/slurm.conf || -d $dir/munge ]] || die "down: $dir holds no cluster made by slurm.sh"
  if [[ -f $dir/slurm.conf ]]; then
    # Jobs first, so that their processes end the way Slurm ends them.
    SLURM_CONF=$dir/slurm.conf timeout 10 scancel --quiet --partition debug > /dev/null 2>&1 || true
    wait_for "[[ -z \$(SLURM_CONF='$dir/slurm.conf' timeout 5 squeue -h -t R,CG 2> /dev/null) ]]" 20 || true
  fi
  local pids
  pids=$(own_processes "$dir" | sort -u)
  if [[ -n $pids ]]; then
    # shellcheck disable=SC2086
    kill -TERM $pids 2> /dev/null || true
    local i
    for ((i = 0; i < 50; ++i)); do
      # shellcheck disable=SC2086
      kill -0 $pids 2> /dev/null || break
      sleep 0.1
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2> /dev/null || true
  fi
  rm -rf -- "$dir"
}

cmd_run() {
  local n=${1:-} seconds=${2:-}
  [[ $seconds =~ ^[1-9][0-9]*$ ]] || die "run: expected a time limit in seconds, got '$seconds'"
  shift 2
  (($# > 0)) || die "run: give a command"
  # Global: the EXIT trap runs after this function's locals are gone.
  run_dir=$(mktemp -d "${TMPDIR:-/tmp}/malleus-slurm-XXXXXX")
  trap 'cmd_down "$run_dir"' EXIT
  trap 'exit 143' TERM INT
  cmd_up "$run_dir" "$n"
  eval "$(cmd_env "$run_dir")"
  local rc=0
  timeout -k 10 "$seconds" "$@" || rc=$?
  ((rc != 124 && rc != 137)) || echo "slurm.sh: the command ran past $seconds s and was killed" >&2
  return "$rc"
}

case ${1:-} in
  up) cmd_up "${@:2}" ;;
  env) cmd_env "${@:2}" ;;
  down) cmd_down "${@:2}" ;;
  run) cmd_run "${@:2}" ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
