#!/usr/bin/env python3
"""Summarises the straggler benchmark (scripts/bench_straggler.sh): for each run of a scenario, the
metrics of training with live re-planning and of the uniform baseline (--no-replan) under the
same slowdown.

Usage: straggler_summary.py FIRST LAST WORLD SLOWED RUN_DIR [RUN_DIR...]
  FIRST-LAST  the steps during which the ranks are slowed
  SLOWED      the slowed ranks and their true rates, "1:3" or "0:2,2:5"; a rate of "busy" means
              "measure it": the uniform run's step time while slowed over its healthy step time
              (the slowed rank paces every step of the uniform plan)
  RUN_DIR     holds replan/metrics.jsonl and uniform/metrics.jsonl

Prints, per run and as the median over the runs: throughput while slowed with and without
re-planning; its fraction of the ideal (healthy throughput x sum(1/r) / N: the same devices with
the work split in proportion to their speed); the detection delay (steps from FIRST until every
slowed rank's rate is within 25 % of its true rate) and the re-plan delay (steps from FIRST to the
first re-plan, which takes effect on the next step); the cost of each switch in iterations; and
each plan's measured step time against the cost model's prediction."""
import json
import statistics
import sys


def load(path):
    steps, replans = {}, []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "replan":
                replans.append(record)
            elif "tokens_per_s" in record:
                steps[record["step"]] = record
    return steps, replans


def throughput(steps, first, last):
    """Tokens per second over steps [first, last]: total tokens over total time."""
    window = [steps[s] for s in range(first, last + 1) if s in steps]
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in window)
    return tokens / sum(r["step_time_s"] for r in window)


def parse_slowed(text):
    slowed = {}
    for part in text.split(","):
        rank, rate = part.split(":")
        slowed[int(rank)] = None if rate == "busy" else float(rate)
    return slowed


def summarise(run_dir, first, last, world, slowed):
    ours, replans = load(f"{run_dir}/replan/metrics.jsonl")
    base, _ = load(f"{run_dir}/uniform/metrics.jsonl")
    end = max(ours)
    healthy = throughput(base, 3, first - 1)  # same plan in both runs before the slowdown
    rates = dict(slowed)
    for rank, rate in slowed.items():
        if rate is None:  # measured: the uniform run's slowdown, past the first 2 slowed steps
            slow_time = statistics.median(base[s]["step_time_s"] for s in range(first + 2, last + 1))
            healthy_time = statistics.median(base[s]["step_time_s"] for s in range(3, first))
            rates[rank] = slow_time / healthy_time
    ideal_factor = sum(1 / rates.get(r, 1.0) for r in range(world)) / world
    ideal = healthy * ideal_factor
    ours_during, base_during = throughput(ours, first, last), throughput(base, first, last)

    def detected(step):
        return all(abs(ours[step]["rates"][r] - rate) <= 0.25 * rate for r, rate in rates.items())

    detection = next((s - first for s in range(first, last + 1) if s in ours and detected(s)), None)
    first_replan = next((r["step"] - first for r in replans if r["step"] >= first), None)
    switches = []
    for r in replans:
        step_time = statistics.median(
            ours[s]["step_time_s"] for s in range(max(1, r["step"] - 5), r["step"]) if s in ours)
        switches.append({"step": r["step"], "old": r["old_plan"], "new": r["new_plan"],
                         "planning_s": r["planning_s"], "migration_s": r["migration_s"],
                         "bytes": r["bytes_moved"],
                         "iterations": (r["migration_s"] + r["planning_s"]) / step_time})
    predictions = []
    boundaries = [r["step"] for r in replans] + [end]
    for r, stop in zip(replans, boundaries[1:]):
        segment = [ours[s]["step_time_s"] for s in range(r["step"] + 2, stop + 1) if s in ours]
        if len(segment) >= 3:
            measured = statistics.median(segment)
            predictions.append({"plan": r["new_plan"], "measured_s": measured,
                                "predicted_s": r["predicted_new_s"],
                                "error": r["predicted_new_s"] / measured - 1})
    return {"end": end, "rates": rates, "healthy": healthy,
            "ours_before": throughput(ours, 3, first - 1), "ours_during": ours_during,
            "base_during": base_during, "ours_after": throughput(ours, last + 1, end),
            "base_after": throughput(base, last + 1, end), "ideal": ideal,
            "ideal_factor": ideal_factor, "fraction": ours_during / ideal,
            "base_fraction": base_during / ideal, "speedup": ours_during / base_during,
            "detection": detection, "first_replan": first_replan, "switches": switches,
            "predictions": predictions}


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def main():
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    first, last, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    slowed = parse_slowed(sys.argv[4])
    runs = [summarise(d, first, last, world, slowed) for d in sys.argv[5:]]
    rates = ", ".join(f"rank {r} at {rate:.2f}x" for r, rate in runs[0]["rates"].items())
    print(f"{world} ranks, slowed during steps {first}-{last} of {runs[0]['end']}: {rates}"
          + (" (measured, run 1)" if None in slowed.values() else ""))
    print("| run | tok/s healthy | tok/s slowed: re-planning / uniform | fraction of ideal "
          "(uniform) | speedup | detection, steps | re-plan, steps | switch cost, iterations |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(runs, 1):
        costs = " / ".join(f"{s['iterations']:.2f}" for s in r["switches"]) or "-"
        print(f"| {i} | {r['healthy']:.0f} | {r['ours_during']:.0f} / {r['base_during']:.0f} | "
              f"{r['fraction']:.2f} ({r['base_fraction']:.2f}) | {r['speedup']:.2f}x | "
              f"{fmt(r['detection'], 'd')} | {fmt(r['first_replan'], 'd')} | {costs} |")
    if len(runs) > 1:
        def med(key):
            values = [r[key] for r in runs if r[key] is not None]
            return statistics.median(values) if values else None
        costs = [s["iterations"] for r in runs for s in r["switches"]]
        print(f"| median | {med('healthy'):.0f} | {med('ours_during'):.0f} / "
              f"{med('base_during'):.0f} | {med('fraction'):.2f} ({med('base_fraction'):.2f}) | "
              f"{med('speedup'):.2f}x | {fmt(med('detection'), 'g')} | "
              f"{fmt(med('first_replan'), 'g')} | {statistics.median(costs) if costs else 0:.2f} "
              f"(max {max(costs) if costs else 0:.2f}) |")
    for i, r in enumerate(runs, 1):
        for s in r["switches"]:
            print(f"run {i}: re-plan at step {s['step']}: {s['old']} -> {s['new']}; planning "
                  f"{s['planning_s'] * 1e3:.1f} ms, migration {s['migration_s'] * 1e3:.0f} ms "
                  f"({s['bytes'] / 1e6:.1f} MB) = {s['iterations']:.2f} iterations")
        for p in r["predictions"]:
            print(f"run {i}: plan {p['plan']}: measured {p['measured_s']:.3f} s/step, predicted "
                  f"{p['predicted_s']:.3f} s, error {100 * p['error']:+.0f}%")


if __name__ == "__main__":
    main()
