#!/usr/bin/env python3
"""Summary of scripts/bench_recompute.sh: per mode, the median step time (steps after the first,
over all runs) with min-max, and per rank the peak memory the runtime measured (largest over the
steps and runs) against the cost model's prediction.

Usage: recompute_summary.py OUT MODE...   (OUT/MODE/run*/metrics.jsonl, OUT/MODE.predicted)
"""
import glob
import json
import statistics
import sys

out, modes = sys.argv[1], sys.argv[2:]
MiB = 2**20
print("| mode | step time, median (min-max) | rank | peak memory measured | predicted | predicted / measured |")
print("|---|---|---|---|---|---|")
for mode in modes:
    times, peaks = [], {}
    for path in sorted(glob.glob(f"{out}/{mode}/run*/metrics.jsonl")):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        steps = [r for r in records if "step_time_s" in r]
        times += [r["step_time_s"] for r in steps[1:]]
        for r in steps:
            for rank, bytes_ in enumerate(r.get("peak_memory_bytes", [])):
                peaks[rank] = max(peaks.get(rank, 0), bytes_)
    with open(f"{out}/{mode}.predicted") as f:
        predicted = [float(x) for x in f.read().split()]
    if not times:
        sys.exit(f"recompute_summary: no steps for {mode} in {out}")
    time = f"{statistics.median(times):.2f} s ({min(times):.2f}-{max(times):.2f}, n={len(times)})"
    for rank in sorted(peaks):
        measured = peaks[rank]
        p = predicted[rank]
        print(f"| {mode if rank == 0 else ''} | {time if rank == 0 else ''} | {rank} | "
              f"{measured / MiB:.1f} MiB | {p / MiB:.1f} MiB | {p / measured:.3f} |")
