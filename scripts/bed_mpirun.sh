#!/usr/bin/env bash
# mpirun across the emulated hosts of scripts/hosts.sh, as one word for `malleus launch --mpirun`
# (which passes the hostfile of each job; the bed's environment, MALLEUS_HOSTS_PREFIX and the
# rest, comes from the caller's):
#
#   scripts/hosts.sh up 2
#   malleus launch --hostfile <(scripts/hosts.sh hostfile) --mpirun scripts/bed_mpirun.sh -- train ...
exec "$(dirname "${BASH_SOURCE[0]}")/hosts.sh" mpirun "$@"
