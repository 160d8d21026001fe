#!/usr/bin/python3
"""Summary of bench/bench_recompute.sh: per mode, the median step time (steps after the first,
over all runs; all of them when runs have one step) with min-max, and per rank the peak memory the runtime measured (largest over the
steps and runs) against the cost model's prediction. For modes "X-shifted", a second table: per
round of runs, the shifted run's median step time over mode X's of the same round (side by side),
and on each rank the recomputation done ahead of the gradient and its part done while the
gradient was still on its way (medians per step).

A third table ranks the modes side by side: per round, each mode's median step time over the
first mode's (none) of the same round, with the median of those ratios.

Usage: recompute_summary.py OUT MODE...   (OUT/MODE/run*/metrics.jsonl, OUT/MODE.predicted)
"""
import glob
import json
import re
import statistics
import sys

out, modes = sys.argv[1], sys.argv[2:]
MiB = 2**20


def steps_of(path):
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "step_time_s" in r]


def timed(steps):
    """The steps whose time counts: after the first, or the only one."""
    return steps[1:] if len(steps) > 1 else steps


def runs_of(mode):
    """{run number: step records} of a mode."""
    runs = {}
    for path in glob.glob(f"{out}/{mode}/run*/metrics.jsonl"):
        runs[int(re.search(r"/run(\d+)/", path).group(1))] = steps_of(path)
    return runs


print("| mode | step time, median (min-max, n) | rank | peak memory measured | predicted | predicted / measured |")
print("|---|---|---|---|---|---|")
for mode in modes:
    times, peaks = [], {}
    for steps in runs_of(mode).values():
        times += [r["step_time_s"] for r in timed(steps)]
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

shifted_modes = [m for m in modes if m.endswith("-shifted") and m[: -len("-shifted")] in modes]
if shifted_modes:
    print()
    print("| mode | shifted / unshifted step time, per round | median | rank | recomputed ahead per step | of it while the gradient was on its way |")
    print("|---|---|---|---|---|---|")
for mode in shifted_modes:
    shifted, unshifted = runs_of(mode), runs_of(mode[: -len("-shifted")])
    ratios = []
    for run in sorted(set(shifted) & set(unshifted)):
        a = [r["step_time_s"] for r in timed(shifted[run])]
        b = [r["step_time_s"] for r in timed(unshifted[run])]
        if a and b:
            ratios.append(statistics.median(a) / statistics.median(b))
    ahead, overlapped = {}, {}
    for steps in shifted.values():
        for r in timed(steps):
            for rank, (x, y) in enumerate(zip(r.get("recompute_ahead_s", []),
                                              r.get("recompute_overlapped_s", []))):
                ahead.setdefault(rank, []).append(x)
                overlapped.setdefault(rank, []).append(y)
    per_round = ", ".join(f"{x:.3f}" for x in ratios)
    median = f"{statistics.median(ratios):.3f}" if ratios else "-"
    for i, rank in enumerate(sorted(ahead) or [0]):
        a = f"{statistics.median(ahead[rank]):.2f} s" if rank in ahead else "-"
        o = f"{statistics.median(overlapped[rank]):.2f} s" if rank in overlapped else "-"
        print(f"| {mode if i == 0 else ''} | {per_round if i == 0 else ''} | "
              f"{median if i == 0 else ''} | {rank} | {a} | {o} |")


def round_medians(mode):
    """{run number: median step time} of a mode."""
    out = {}
    for run, steps in runs_of(mode).items():
        times = [r["step_time_s"] for r in timed(steps)]
        if times:
            out[run] = statistics.median(times)
    return out


if len(modes) > 1:
    reference = round_medians(modes[0])
    print()
    print(f"| mode | step time over {modes[0]}'s, per round | median | min-max |")
    print("|---|---|---|---|")
    for mode in modes[1:]:
        this = round_medians(mode)
        ratios = [this[run] / reference[run] for run in sorted(set(this) & set(reference))]
        if not ratios:
            continue
        print(f"| {mode} | {', '.join(f'{x:.3f}' for x in ratios)} | "
              f"{statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")
