#!/usr/bin/env bash
# Set up, build (warnings are errors) and run the whole test suite.
#
# The tests that judge elapsed time (the straggler timing tests, the watchdog's stopped-rank test,
# the slow-link tests on the multi-host bed, malleus.torch's straggler test) run alone, after the
# others (the `timing` tier; CTest's RUN_SERIAL where CTest runs them with the rest), so the
# suite's own load never reaches them, and what they start runs in a session
# of its own (tests/own_session.sh) against other sessions' load; each runs once and must pass.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh -DMALLEUS_WERROR=ON
# Two CTest runs: every tier but `timing`, twice as many tests at a time as there are cores (many
# of its tests wait on Slurm's timers, mpirun's start or a child; 2 cores: 124 s with -j 4 against
# 141-143 s with -j 3, the machine idle 12 % and 17 % of the run), then the `timing` tier alone.
# In one run, CTest holds the other cores idle while a RUN_SERIAL test waits for the tests before
# it to end.
status=0
ctest --test-dir build --output-on-failure --timeout 900 -j "$((2 * $(nproc)))" -LE timing ||
  status=$?
ctest --test-dir build --output-on-failure --timeout 900 -L timing || status=$?
exit "$status"
