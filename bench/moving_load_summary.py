#!/usr/bin/python3
"""Summarises the moving-load benchmark (bench/bench_moving_load.sh): in each round, the time
of training with live re-planning against keeping the plan (--no-replan) under the same load
moving between the ranks.

Usage: moving_load_summary.py FIRST LAST ROUND_DIR [ROUND_DIR...]
  FIRST-LAST  the steps whose times are summed (the load runs through them)
  ROUND_DIR   holds replan/metrics.jsonl and keep/metrics.jsonl

Prints, per round: both times, their ratio (re-planning / keeping), the re-plans switched and the
questions declined (held still or not paying); then the median and the largest ratio against the
targets of issue 27 (median <= 1.02, none above 1.05). Exits 1 when a target is missed."""
import json
import statistics
import sys

MEDIAN_TARGET, MAX_TARGET = 1.02, 1.05


def load(path, first, last):
    seconds, switched, declined, held = 0.0, 0, 0, 0
    seen = set()
    try:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                event = record.get("event")
                if event == "replan":
                    switched += 1
                elif event == "replan_declined":
                    declined += 1
                    held += record.get("reason", "").startswith("holding still")
                elif "step_time_s" in record and first <= record["step"] <= last:
                    seconds += record["step_time_s"]
                    seen.add(record["step"])
    except (OSError, ValueError) as e:
        sys.exit(f"moving_load_summary: cannot read {path}: {e}")
    missing = set(range(first, last + 1)) - seen
    if missing:
        sys.exit(f"moving_load_summary: {path} lacks steps {sorted(missing)[:5]}...")
    return seconds, switched, declined, held


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    first, last = int(sys.argv[1]), int(sys.argv[2])
    ratios = []
    print(f"steps {first}-{last}   re-planning   keeping   ratio   switches  declined (held)")
    for i, directory in enumerate(sys.argv[3:], 1):
        replan, switched, declined, held = load(f"{directory}/replan/metrics.jsonl", first, last)
        keep, _, _, _ = load(f"{directory}/keep/metrics.jsonl", first, last)
        ratios.append(replan / keep)
        print(f"round {i:2d}      {replan:9.1f} s {keep:7.1f} s  {ratios[-1]:6.3f}   {switched:8d}"
              f"  {declined:8d} ({held})")
    median, largest = statistics.median(ratios), max(ratios)
    ok = median <= MEDIAN_TARGET and largest <= MAX_TARGET
    print(f"median ratio {median:.3f} (target <= {MEDIAN_TARGET}), largest {largest:.3f} "
          f"(target <= {MAX_TARGET}): {'met' if ok else 'MISSED'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
