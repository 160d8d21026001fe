#!/usr/bin/python3
"""Summary of bench/bench_tp.sh: per micro-batch size, the median step time (steps after the
first, over all runs) without and with sub-pipelined tensor parallelism, with min-max, the
median of the per-run ratios (runs alternate off / on, so each pair ran side by side), the
median per-rank compute time the runtime measured (its timed sections less the time inside TP
collectives), and the cost model's predicted iteration time for both. A run of one step has no
step after the first: its one step counts, warm-up included, and the table says so.

Usage: tp_summary.py OUT MB...   (OUT/mbMB/{off,on}/run*/metrics.jsonl, OUT/mbMB/{off,on}.predicted)
"""
import glob
import json
import statistics
import sys

if len(sys.argv) < 3:
    sys.exit(__doc__)
out, sizes = sys.argv[1], sys.argv[2:]
first_step_counted = []  # runs of one step, whose only step (warm-up included) counts


def runs(directory):
    """Per run: (step times after the first, per-step compute time of the slowest rank)."""
    result = []
    for path in sorted(glob.glob(f"{directory}/run*/metrics.jsonl"),
                       key=lambda p: int(p.split("/run")[-1].split("/")[0])):
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
        steps = [r for r in steps if "step_time_s" in r]
        if not steps:
            sys.exit(f"tp_summary: no steps in {path}")
        if len(steps) == 1:
            first_step_counted.append(path)
        else:
            steps = steps[1:]
        result.append(([r["step_time_s"] for r in steps], [max(r["compute_s"]) for r in steps]))
    if not result:
        sys.exit(f"tp_summary: no runs in {directory} (expected run*/metrics.jsonl there)")
    return result


def spread(values):
    return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f}, n={len(values)})"


print("| micro-batch (split) | sub-pipelined | step time, median (min-max) | compute, slowest rank | "
      "on / off, median of paired runs | predicted iteration |")
print("|---|---|---|---|---|---|")
for mb in sizes:
    base = f"{out}/mb{mb}"
    off, on = runs(f"{base}/off"), runs(f"{base}/on")
    ratios = [statistics.median(b[0]) / statistics.median(a[0]) for a, b in zip(off, on)]
    split = "token rows" if mb == "1" else "sequences"
    for mode, data in (("off", off), ("on", on)):
        try:
            with open(f"{base}/{mode}.predicted") as f:
                predicted = float(f.read())
        except (OSError, ValueError) as e:
            sys.exit(f"tp_summary: no predicted iteration time in {base}/{mode}.predicted ({e})")
        times = [t for r in data for t in r[0]]
        compute = [t for r in data for t in r[1]]
        ratio = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if mode == "on" else ""
        print(f"| {mb} ({split}) | {mode} | {spread(times)} | {statistics.median(compute):.3f} s | "
              f"{ratio} | {predicted:.3f} s |")
if first_step_counted:
    print(f"\n{len(first_step_counted)} runs of one step: their only step counts, warm-up included "
          "(run 2 or more steps for steady-state figures)")
