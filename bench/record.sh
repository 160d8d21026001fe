#!/usr/bin/env bash
# Runs a benchmark and appends the run to its log in bench/results/ (docs/performance.md keeps the
# current figure; the logs keep every run):
#   bench/record.sh LOG COMMAND [ARGS...]
#   e.g. bench/record.sh straggler bench/bench_straggler.sh injected 1 20
# LOG names an existing log, bench/results/LOG.md (bench/results/README.md lists them). The entry
# says when the run started (UTC), the commit (with "+changes" when the work tree differs from
# it), the load average before and after, the command, its exit status, and the last 60 lines of
# its output, which is also printed as it runs. The exit status is the command's.
# BENCH_RESULTS_DIR replaces bench/results (the tests use it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 2 ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2
  exit 2
fi
log=$1
shift
if [[ ! $log =~ ^[a-z0-9_]+$ ]]; then
  echo "record: LOG must be a log's name such as straggler (letters, digits, _), not \"$log\"" >&2
  exit 2
fi
file=${BENCH_RESULTS_DIR:-bench/results}/$log.md
if [[ ! -f $file ]]; then
  echo "record: no log $file; bench/results/README.md lists the logs (create one there first)" >&2
  exit 2
fi
output=$(mktemp)
entry=$(mktemp)
trap 'rm -f "$output" "$entry"' EXIT
started=$(date -u '+%Y-%m-%d %H:%M UTC')
commit=$(git rev-parse --short HEAD 2> /dev/null || echo unknown)
if [[ $commit != unknown ]] && ! git diff --quiet HEAD -- 2> /dev/null; then
  commit+="+changes"
fi
before=$(cut -d' ' -f1-3 /proc/loadavg)
set +e
"$@" 2>&1 | tee "$output"
status=${PIPESTATUS[0]}
set -e
after=$(cut -d' ' -f1-3 /proc/loadavg)
{
  printf '\n## %s, commit %s\n\n' "$started" "$commit"
  printf 'Recorded by bench/record.sh: load average %s before, %s after; exit status %d.\n\n' \
    "$before" "$after" "$status"
  printf '```bash\n%s\n```\n\n```\n' "$(printf '%q ' "$@" | sed 's/ $//')"
  tail -n 60 "$output" | sed 's/^```/ ```/'
  printf '```\n'
} > "$entry"
cat "$entry" >> "$file"
echo "record: appended the run to $file" >&2
exit "$status"
