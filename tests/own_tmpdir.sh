#!/usr/bin/env bash
# Runs COMMAND... with a TMPDIR of its own (mode 1777, as /tmp: tests run commands as another user
# too), removes it when COMMAND ends, and exits with COMMAND's status. Open MPI 4 makes its session
# directory under TMPDIR, and two mpiruns that start at the same moment can both try to create the
# directory they share there: one of them fails (open-mpi/ompi#8510). The C++ test programs take
# a TMPDIR of their own themselves (tests/test_util.h, OwnTmpdir); CTest starts the tests that are
# an mpirun or a script through this. Under MALLEUS_KEEP_SCRATCH=1, which keeps a failed test's
# scratch directories (made under TMPDIR, by the ranks of an MPI test too), COMMAND runs with the
# caller's TMPDIR, as OwnTmpdir leaves it.
#
# Usage: tests/own_tmpdir.sh COMMAND [ARG...]
set -euo pipefail
(($# > 0)) || {
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}
[[ ${MALLEUS_KEEP_SCRATCH:-} != 1 ]] || exec "$@"
dir=$(mktemp -d "${TMPDIR:-/tmp}/mt.XXXXXX")
chmod 1777 "$dir"
trap 'rm -rf "$dir"' EXIT
status=0
TMPDIR=$dir "$@" || status=$?
exit "$status"
