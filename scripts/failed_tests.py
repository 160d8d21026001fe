#!/usr/bin/python3
"""Prints the end of each failed test's output from a build folder's last CTest run.

    scripts/failed_tests.py BUILD_DIR [--lines N]

CTest's --output-on-failure prints a failed test's output where the test ended, in the middle of a
long log; a CI page that shows only the log's end then names the failed test without its reason.
The test scripts call this after a CTest run that failed (CTest leaves an older run's list of
failures in place after a run without any), and print what it wrote at their end: for each test in
BUILD_DIR/Testing/Temporary/LastTestsFailed.log, the last N lines (default 60) of its output in
LastTest.log of the same run.
"""
import argparse
import os
import sys


def outputs(log_path):
    """Test name -> its output lines, from a CTest LastTest.log."""
    found, name, lines = {}, None, None
    with open(log_path, errors="replace") as log:
        for line in log:
            line = line.rstrip("\n")
            if lines is None:
                if " Testing: " in line and line.split(" ", 1)[0].count("/") == 1:
                    name = line.split(" Testing: ", 1)[1]
                elif name is not None and line == "Output:":
                    lines = []
                    next(log, None)  # the dashes under "Output:"
                continue
            if line.endswith("<end of output>"):  # after the output's last line, or on it
                last = line[:-len("<end of output>")]
                found[name], name, lines = lines + ([last] if last else []), None, None
            else:
                lines.append(line)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("build_dir")
    parser.add_argument("--lines", type=int, default=60)
    args = parser.parse_args()
    temporary = os.path.join(args.build_dir, "Testing", "Temporary")
    failed_log = os.path.join(temporary, "LastTestsFailed.log")
    if not os.path.exists(failed_log):
        return 0
    with open(failed_log) as f:
        failed = [line.strip().split(":", 1)[1] for line in f if ":" in line]
    found = outputs(os.path.join(temporary, "LastTest.log"))
    for name in failed:
        lines = found.get(name)
        if lines is None:
            print(f"=== {name}: no output in {temporary}/LastTest.log")
            continue
        shown = lines[-args.lines:]
        print(f"=== {name}: the last {len(shown)} of its {len(lines)} lines of output")
        print("\n".join(shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
