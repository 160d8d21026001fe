#!/usr/bin/env bash
# A multi-host test bed on one machine: N Linux network namespaces ("hosts"), each with one veth
# link to a bridge in a switch namespace, addresses from the benchmarking range 198.18.0.0/15, and
# mpirun across them over OpenMPI's TCP transport (a launch agent that enters the namespace
# instead of ssh). Needs root (or CAP_NET_ADMIN) and iproute2; nothing is added to the machine's
# own network namespace.
#
#   scripts/hosts.sh up N             make hosts 0..N-1 (replaces a bed already up)
#   scripts/hosts.sh down             delete every namespace of the bed (safe to repeat)
#   scripts/hosts.sh status           hosts, addresses, and each link's shaping
#   scripts/hosts.sh shape HOST RATE  limit HOST's link to RATE (tc units: 100mbit, 1gbit,
#                                     12500kbps...) in both directions; repeat to change it
#                                     while a job runs
#   scripts/hosts.sh unshape HOST     remove the limit (and a loss)
#   scripts/hosts.sh loss HOST PCT    drop PCT % of the packets on HOST's link, at random, in both
#                                     directions (replaces a shaping; unshape removes it). This
#                                     kernel has no netem: a classic-BPF tc filter sorts each packet
#                                     by a random number into a class whose queue holds nothing
#   scripts/hosts.sh cut HOST         take HOST's link down (as a NIC, cable or switch port fails)
#   scripts/hosts.sh heal HOST        bring it up again
#   scripts/hosts.sh hostfile [SLOTS] print an OpenMPI hostfile, SLOTS (default 2) per host
#   scripts/hosts.sh mpirun ARGS...   mpirun from host 0 across every host (-np, --map-by and the
#                                     program come from ARGS); ranks fill host 0 first, then 1...;
#                                     a --hostfile in ARGS (of bed addresses) replaces the bed's
#                                     own: what `malleus launch --mpirun scripts/bed_mpirun.sh` gives
#   scripts/hosts.sh exec HOST CMD... run CMD inside HOST's namespace
#   scripts/hosts.sh run N SECONDS ARGS...
#                                     up N, mpirun ARGS with a time limit of SECONDS (then the
#                                     job is killed, exit 124), down again whatever happened:
#                                     what the tests use
#
# Environment: MALLEUS_HOSTS_PREFIX (default "mh"; namespaces PREFIX-sw, PREFIX-h0, ...),
# MALLEUS_HOSTS_SUBNET (default 198.18.12; host i is SUBNET.(i+1)/24), MALLEUS_HOSTS_SLOTS (slots
# per host for `mpirun`, default 2), MALLEUS_HOSTS_BTL (default tcp,self: every byte between ranks,
# also two ranks of one host, goes through TCP; vader,tcp,self puts ranks of one host on shared
# memory, as on a real cluster), MALLEUS_HOSTS_PIN (default 1: each host runs on its own share of
# the machine's CPUs, host i on CPUs [i·C/N, (i+1)·C/N) of C, as separate machines would, through
# a cpuset cgroup PREFIX-hI that OpenMPI's binding cannot leave; 0, more hosts than CPUs, or no
# cgroup-v1 cpuset controller: every host may use every CPU). Each host keeps its memory
# checkpoints (src/checkpoint/memory_checkpoint.h) in a folder of its own, as each machine has its
# own /dev/shm: its ranks get MALLEUS_MEMORY_CHECKPOINT_DIR=BASE/PREFIX-hI, BASE being
# $MALLEUS_MEMORY_CHECKPOINT_DIR where given, else /dev/shm; `down` removes these folders.
# Exit codes: 77 when namespaces cannot be made here (tests skip on it), 2 for bad usage.
set -euo pipefail

prefix=${MALLEUS_HOSTS_PREFIX:-mh}
subnet=${MALLEUS_HOSTS_SUBNET:-198.18.12}
switch_ns="$prefix-sw"
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
# Where the hosts' memory-checkpoint folders go; set once by the outermost call (mpirun's own
# environment, which the launch agent inherits, already names host 0's folder).
export MALLEUS_HOSTS_SHM=${MALLEUS_HOSTS_SHM:-${MALLEUS_MEMORY_CHECKPOINT_DIR:-/dev/shm}}

die() {
  echo "hosts.sh: $*" >&2
  exit 2
}

[[ $subnet =~ ^198\.(18|19)\.[0-9]{1,3}$ ]] ||
  die "MALLEUS_HOSTS_SUBNET=$subnet: must be the first three numbers of an address in 198.18.0.0/15"
[[ $prefix =~ ^[a-z][a-z0-9]{0,5}$ ]] ||
  die "MALLEUS_HOSTS_PREFIX=$prefix: 1-6 lower-case letters or digits, starting with a letter"

# Hosts of the bed, in index order.
hosts() {
  ip netns list 2> /dev/null | awk '{print $1}' | grep -E "^$prefix-h[0-9]+$" |
    sed "s/^$prefix-h//" | sort -n
}
host_count() { hosts | wc -l; }
address() { echo "$subnet.$(($1 + 1))"; }
require_host() {
  [[ $1 =~ ^[0-9]+$ ]] || die "host '$1': expected a host index (0, 1, ...)"
  ip netns list | awk '{print $1}' | grep -qx "$prefix-h$1" ||
    die "host $1: no such host (is the bed up? scripts/hosts.sh status)"
}

cmd_down() {
  local ns
  for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep -E "^$prefix-(sw|h[0-9]+)$"); do
    # Processes left in a namespace (a killed job's ranks) would keep its links alive.
    ip netns pids "$ns" 2> /dev/null | xargs -r kill -9 2> /dev/null || true
    ip netns delete "$ns"
  done
  local dir
  for dir in "$cpuset_root/$prefix"-h*; do
    [[ -d $dir ]] || continue
    xargs -r kill -9 < "$dir/cgroup.procs" 2> /dev/null || true
    rmdir "$dir" 2> /dev/null || { sleep 0.5; rmdir "$dir"; }
  done
  # Open MPI's session directories of the hosts (named after their host names), which a daemon
  # killed above leaves behind, and the hostfiles of jobs whose mpirun was killed (malleus launch
  # ends a job mpirun cannot end with SIGKILL: cmd_mpirun never reaches its rm).
  rm -rf -- "${TMPDIR:-/tmp}/ompi.$prefix-h"[0-9]*".$(id -u)"
  rm -f -- "${TMPDIR:-/tmp}/$prefix-hostfile."??????
  # The hosts' memory: lost with them.
  for dir in "$MALLEUS_HOSTS_SHM/$prefix"-h*; do
    [[ ! -d $dir ]] || [[ ! $dir =~ /$prefix-h[0-9]+$ ]] || rm -rf -- "$dir"
  done
}

cmd_up() {
  local n=${1:-}
  [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= 64)) || die "up: expected a host count 1..64, got '$n'"
  cmd_down
  if ! ip netns add "$switch_ns" 2> /dev/null; then
    echo "hosts.sh: cannot create network namespaces here (needs root / CAP_SYS_ADMIN and" \
      "iproute2); skipping" >&2
    exit 77
  fi
  # Half-made beds are deleted again.
  trap 'cmd_down' ERR
  ip -n "$switch_ns" link add br0 type bridge
  ip -n "$switch_ns" link set br0 up
  ip -n "$switch_ns" link set lo up
  local i ns
  for ((i = 0; i < n; ++i)); do
    ns="$prefix-h$i"
    ip netns add "$ns"
    # eth0 in the host, port$i on the bridge: one link per host, shaped on both ends.
    ip -n "$ns" link add eth0 type veth peer name "port$i" netns "$switch_ns"
    ip -n "$switch_ns" link set "port$i" master br0 up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$(address "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    # TCP as cluster hosts usually set it: loss-based congestion control (CUBIC) and no slow
    # start after idle. The machine's default here is BBR, whose paced bandwidth estimate stays at
    # a throttled link's rate long after the limit is removed (the job's short bursts never probe
    # above it); and with slow start after idle, every step's burst would start from the initial
    # window up to the ssthresh the throttled period left, so a recovered link would read 3-5
    # times slower for the rest of the run. No cached metrics of a throttled period either.
    # CUBIC on the link's route: a namespace may not make it its default where the machine's
    # net.ipv4.tcp_allowed_congestion_control leaves it out (here: reno bbr), a route may.
    ip -n "$ns" route replace "$subnet.0/24" dev eth0 src "$(address "$i")" congctl cubic
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0 \
      net.ipv4.tcp_no_metrics_save=1 2> /dev/null || true
    local cpus
    cpus=$(cpus_of "$i" "$n")
    if [[ $cpus != "0-$(($(nproc --all) - 1))" ]]; then
      mkdir "$cpuset_root/$ns"
      echo "$cpus" > "$cpuset_root/$ns/cpuset.cpus"
      cat "$cpuset_root/cpuset.mems" > "$cpuset_root/$ns/cpuset.mems"
    fi
  done
  trap - ERR
  echo "hosts.sh: $n hosts up: $(for ((i = 0; i < n; ++i)); do printf '%s ' "$(address "$i")"; done)"
}

cmd_status() {
  local i
  if [[ -z $(hosts) ]]; then
    echo "no hosts (prefix $prefix)"
    return
  fi
  for i in $(hosts); do
    local qdisc
    qdisc=$(ip netns exec "$prefix-h$i" tc qdisc show dev eth0 root | head -1)
    local cpus="all CPUs"
    [[ ! -d $cpuset_root/$prefix-h$i ]] || cpus="CPUs $(cat "$cpuset_root/$prefix-h$i/cpuset.cpus")"
    echo "host $i  $prefix-h$i  $(address "$i")  $cpus  link: $qdisc"
  done
}

# tbf on both ends of the host's link: eth0 limits what the host sends, port$i what it receives.
cmd_shape() {
  local host=${1:-} rate=${2:-}
  require_host "$host"
  [[ $rate =~ ^[0-9]+(\.[0-9]+)?([kmg]?bit|[kmg]?bps)$ ]] ||
    die "shape: rate '$rate': expected a number with a tc unit (kbit, mbit, gbit, kbps, mbps...)"
  # The bucket holds 1 ms at the rate (at least 64 KiB, so a TSO burst fits), so a slow link is
  # slow from its first bytes on as a slow NIC would be (a larger bucket lets the first part of
  # every transfer through at full speed); a 200 ms queue.
  local bits
  bits=$(tc_bits "$rate")
  local burst=$((bits / 8 / 1000))
  ((burst >= 65536)) || burst=65536
  local dev ns
  for dev in "eth0@$prefix-h$host" "port$host@$switch_ns"; do
    ns=${dev#*@}
    ip netns exec "$ns" tc qdisc replace dev "${dev%@*}" root tbf rate "$rate" burst "$burst" \
      latency 200ms
  done
}

# Bits per second of a tc rate.
tc_bits() {
  local r=$1 n unit
  n=${r%%[a-z]*}
  unit=${r#"$n"}
  local mult
  case $unit in
    bit) mult=1 ;; kbit) mult=1000 ;; mbit) mult=1000000 ;; gbit) mult=1000000000 ;;
    bps) mult=8 ;; kbps) mult=8000 ;; mbps) mult=8000000 ;; gbps) mult=8000000000 ;;
  esac
  awk -v n="$n" -v m="$mult" 'BEGIN { printf "%.0f", n * m }'
}

cmd_unshape() {
  local host=${1:-}
  require_host "$host"
  ip netns exec "$prefix-h$host" tc qdisc del dev eth0 root 2> /dev/null || true
  ip netns exec "$switch_ns" tc qdisc del dev "port$host" root 2> /dev/null || true
}

# Random loss without netem, on both ends of the host's link: an htb root whose filter, a classic
# BPF program, draws a random number per packet (ld rand) and sends PCT in 100 of them to class
# 1:20, whose pfifo holds no packet (every one enqueued there is dropped); the rest go to 1:10.
cmd_loss() {
  local host=${1:-} pct=${2:-}
  require_host "$host"
  [[ $pct =~ ^[0-9]+$ ]] && ((pct <= 100)) || die "loss: '$pct': expected a percentage 0..100"
  # A = random u32; A %= 100; A >= pct ? 1:10 (pass) : 1:20 (drop).
  local program="5,32 0 0 4294963256,148 0 0 100,53 1 0 $pct,6 0 0 65568,6 0 0 65552"
  local dev ns
  for dev in "eth0@$prefix-h$host" "port$host@$switch_ns"; do
    ns=${dev#*@}
    dev=${dev%@*}
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2> /dev/null || true
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: htb default 10 r2q 100000
    ip netns exec "$ns" tc class add dev "$dev" parent 1: classid 1:10 htb rate 100gbit
    ip netns exec "$ns" tc class add dev "$dev" parent 1: classid 1:20 htb rate 100gbit
    ip netns exec "$ns" tc qdisc add dev "$dev" parent 1:20 handle 20: pfifo limit 0
    ip netns exec "$ns" tc filter add dev "$dev" parent 1: protocol all bpf bytecode "$program"
  done
}

# The host's end of its link down or up: the host's routes over it go (and come back), its peers'
# packets to it are lost on the switch.
cmd_cut() {
  require_host "${1:-}"
  ip -n "$prefix-h$1" link set dev eth0 down
}
cmd_heal() {
  require_host "${1:-}"
  ip -n "$prefix-h$1" link set dev eth0 up
}

cmd_hostfile() {
  local slots=${1:-${MALLEUS_HOSTS_SLOTS:-2}} i
  [[ $slots =~ ^[1-9][0-9]*$ ]] || die "hostfile: slots '$slots': expected a positive count"
  [[ -n $(hosts) ]] || die "hostfile: no hosts are up (scripts/hosts.sh up N)"
  for i in $(hosts); do echo "$(address "$i") slots=$slots"; done
}

cpuset_root=/sys/fs/cgroup/cpuset
# The CPUs host $1 of $2 runs on (cpuset list form), or all of them.
cpus_of() {
  local cpus
  cpus=$(nproc --all)
  if [[ ${MALLEUS_HOSTS_PIN:-1} == 0 ]] || (($2 > cpus)) || [[ ! -w $cpuset_root/cgroup.procs ]]
  then
    echo "0-$((cpus - 1))"
  else
    echo "$(($1 * cpus / $2))-$(((($1 + 1) * cpus / $2) - 1))"
  fi
}
# Puts the calling shell into host $1's cpuset, if the bed made one.
enter_cpuset() {
  local dir="$cpuset_root/$prefix-h$1"
  if [[ -d $dir ]]; then echo $$ > "$dir/cgroup.procs"; fi
}

# OpenMPI's launch agent (plm_rsh_agent): called as `AGENT HOST COMMAND...` where ssh would be.
# It enters the host's cpuset and network namespace, with its own host name (a UTS namespace), and
# runs the command with sh as ssh's remote shell would. nsenter rather than `ip netns exec`: the
# latter mounts a fresh /sys, without /sys/fs/cgroup, so a job could not enter another cpuset.
cmd_agent() {
  local target=$1 i
  shift
  for i in $(hosts); do
    if [[ $target == "$(address "$i")" || $target == "$prefix-h$i" ]]; then
      enter_cpuset "$i"
      exec nsenter --net="/run/netns/$prefix-h$i" unshare --uts /bin/sh -c \
        "hostname $prefix-h$i; export MALLEUS_MEMORY_CHECKPOINT_DIR='$MALLEUS_HOSTS_SHM/$prefix-h$i'; $*"
    fi
  done
  echo "hosts.sh agent: unknown host '$target'" >&2
  exit 255
}

cmd_exec() {
  local host=${1:-}
  require_host "$host"
  shift
  exec ip netns exec "$prefix-h$host" "$@"
}

cmd_mpirun() {
  [[ -n $(hosts) ]] || die "mpirun: no hosts are up (scripts/hosts.sh up N)"
  local hostfile arg args=()
  hostfile=$(mktemp "${TMPDIR:-/tmp}/$prefix-hostfile.XXXXXX")
  cmd_hostfile > "$hostfile"
  # A hostfile of the caller's (malleus launch writes one per job) replaces the bed's.
  while (($# > 0)); do
    arg=$1
    shift
    case $arg in
      --hostfile | -hostfile | --machinefile | -machinefile)
        (($# > 0)) || die "mpirun: $arg needs a file"
        cp -- "$1" "$hostfile"
        shift ;;
      --hostfile=*) cp -- "${arg#*=}" "$hostfile" ;;
      *) args+=("$arg") ;;
    esac
  done
  set -- "${args[@]}"
  local btl=${MALLEUS_HOSTS_BTL:-tcp,self}
  # mpirun itself runs on host 0 (it lists host 0's address, so it starts host 0's ranks itself);
  # the agent starts an orted in each other host. OOB and BTL traffic stay on the veth subnet.
  local rc=0
  enter_cpuset 0
  MALLEUS_MEMORY_CHECKPOINT_DIR="$MALLEUS_HOSTS_SHM/$prefix-h0" \
    nsenter --net="/run/netns/$prefix-h0" unshare --uts /bin/sh -c 'hostname "$0-h0"; exec "$@"' \
    "$prefix" mpirun --hostfile "$hostfile" \
    --mca plm rsh --mca plm_rsh_agent "$self agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl "$btl" --mca btl_tcp_if_include "$subnet.0/24" \
    --mca oob_tcp_if_include "$subnet.0/24" "$@" || rc=$?
  rm -f "$hostfile"
  return "$rc"
}

cmd_run() {
  local n=${1:-} seconds=${2:-}
  [[ $seconds =~ ^[1-9][0-9]*$ ]] || die "run: expected a time limit in seconds, got '$seconds'"
  shift 2
  trap 'cmd_down' EXIT
  trap 'exit 143' TERM INT
  cmd_up "$n"
  local rc=0
  timeout -k 10 "$seconds" "$self" mpirun "$@" || rc=$?
  ((rc != 124 && rc != 137)) || echo "hosts.sh: the job ran past $seconds s and was killed" >&2
  return "$rc"
}

case ${1:-} in
  up) cmd_up "${@:2}" ;;
  down) cmd_down ;;
  status) cmd_status ;;
  shape) cmd_shape "${@:2}" ;;
  unshape) cmd_unshape "${@:2}" ;;
  loss) cmd_loss "${@:2}" ;;
  cut) cmd_cut "${@:2}" ;;
  heal) cmd_heal "${@:2}" ;;
  hostfile) cmd_hostfile "${@:2}" ;;
  agent) cmd_agent "${@:2}" ;;
  exec) cmd_exec "${@:2}" ;;
  mpirun) cmd_mpirun "${@:2}" ;;
  run) cmd_run "${@:2}" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
