#!/usr/bin/python3
"""The recovery benchmark's measurements (bench/bench_recovery.sh), three commands:

    bench/recovery_summary.py stamp            stdin to stdout, each line prefixed with the Unix
                                               time it arrived
    bench/recovery_summary.py run DIR KILLED_AT  one run's figures as a JSON line, from
                                               DIR/run/metrics.jsonl (the restart record) and
                                               DIR/out.log (stamped output); KILLED_AT: Unix time
                                               of the kill
    bench/recovery_summary.py summary MODEL    the runs' JSON lines on stdin: median (min-max)
                                               of each figure

A run's figures: recovery_s, from the kill to the first step line of the restarted job;
ended_s, from the kill to the end of the failed job; restart_s, from then to that first step;
steps_lost, the steps done again; source, what the restart read: "memory" (a memory checkpoint)
or "disk".
"""
import json
import statistics
import sys
import time

FIGURES = [("recovery_s", "recovery (s)"), ("ended_s", "ended (s)"),
           ("restart_s", "restart (s)"), ("steps_lost", "steps lost")]


def stamp():
    for line in sys.stdin:
        print(f"{time.time():.3f} {line}", end="", flush=True)


def run(directory, killed_at):
    restart = None
    with open(f"{directory}/run/metrics.jsonl") as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "restart":
                restart = record
    if restart is None:
        sys.exit(f"recovery_summary: no restart recorded in {directory}/run/metrics.jsonl")
    first = None
    seen_restart = False
    source = "disk"
    with open(f"{directory}/out.log") as f:
        for line in f:
            at, _, text = line.partition(" ")
            seen_restart |= text.startswith("restart 1 ")
            if seen_restart and text.startswith("resuming from ") and "(a memory checkpoint)" in text:
                source = "memory"
            if seen_restart and text.startswith("memory checkpoint refused"):
                source = "disk"
            if seen_restart and text.startswith("step "):
                first = float(at)
                break
    if first is None:
        sys.exit(f"recovery_summary: no step after the restart in {directory}/out.log")
    print(json.dumps({"recovery_s": round(first - killed_at, 2),
                      "ended_s": round(restart["failed_at"] - killed_at, 2),
                      "restart_s": round(first - restart["failed_at"], 2),
                      "steps_lost": restart["steps_lost"], "source": source}))


def summary(model):
    rows = [json.loads(line) for line in sys.stdin if line.strip()]
    print(model + ": " + "; ".join(
        f"{label} {statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f})"
        for label, c in ((label, [r[key] for r in rows]) for key, label in FIGURES))
        + f" over {len(rows)} runs; restarts read "
        + ", ".join(sorted(set(r.get("source", "disk") for r in rows))))


def main():
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "stamp" and len(sys.argv) == 2:
        stamp()
    elif command == "run" and len(sys.argv) == 4:
        run(sys.argv[2], float(sys.argv[3]))
    elif command == "summary" and len(sys.argv) == 3:
        summary(sys.argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
