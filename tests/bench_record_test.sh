#!/usr/bin/env bash
# bench/record.sh appends a run to its log: the command, its output and exit status, the date,
# commit and load; it passes the command's exit status on and refuses a log that does not exist.
# Usage: tests/bench_record_test.sh REPO_ROOT
set -euo pipefail
root=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export BENCH_RESULTS_DIR=$dir
fail() { echo "bench_record_test: $*" >&2; exit 1; }

printf '# Run log: a test\n' > "$dir/demo.md"
"$root/bench/record.sh" demo printf 'first line\nfigure 42.5 s\n' > "$dir/out" 2> "$dir/err" ||
  fail "a command that succeeds made record.sh fail: $(cat "$dir/err")"
grep -qx 'figure 42.5 s' "$dir/out" || fail "the command's output was not printed as it ran"
grep -qE '^## [0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2} UTC, commit ' "$dir/demo.md" ||
  fail "no dated entry heading in the log: $(cat "$dir/demo.md")"
grep -q 'exit status 0' "$dir/demo.md" || fail "the entry does not give the exit status"
grep -q '^Recorded by bench/record.sh: load average [0-9.]* [0-9.]* [0-9.]* before' "$dir/demo.md" ||
  fail "the entry does not quote the load average"
grep -qx 'figure 42.5 s' "$dir/demo.md" || fail "the output is not in the entry"
grep -q "^printf" "$dir/demo.md" || fail "the command is not in the entry"
head -1 "$dir/demo.md" | grep -qx '# Run log: a test' || fail "the log's earlier text was not kept"

status=0
"$root/bench/record.sh" demo bash -c 'echo broken; exit 3' > /dev/null 2>&1 || status=$?
[[ $status -eq 3 ]] || fail "the command's exit status 3 came back as $status"
[[ $(grep -c '^## ' "$dir/demo.md") -eq 2 ]] || fail "a failed run was not recorded"
grep -q 'exit status 3' "$dir/demo.md" || fail "the failed run's status is not in the entry"

status=0
"$root/bench/record.sh" missing true > /dev/null 2> "$dir/err" || status=$?
[[ $status -eq 2 ]] || fail "a log that does not exist gave status $status, not 2"
grep -q 'no log' "$dir/err" || fail "no message naming the missing log: $(cat "$dir/err")"
[[ ! -e $dir/missing.md ]] || fail "a missing log was created"

status=0
"$root/bench/record.sh" '../x' true > /dev/null 2>&1 || status=$?
[[ $status -eq 2 ]] || fail "a log name with a path gave status $status, not 2"
echo "bench_record_test: passed"
