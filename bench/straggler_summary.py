#!/usr/bin/python3
"""Summarises the straggler benchmark (bench/bench_straggler.sh): for each run of a scenario, the
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
first re-plan, which takes effect on the next step); the cost of each switch in iterations of the
new plan; and each plan's measured step time against the cost model's prediction.

A switch's cost is the time training waited for it (planning and the migration's blocking part,
migration_s) plus what the new plan's first step took beyond the new plan's steady step time (the
median of the 5 steps after it; an overlapped switch's moments arrive during that first step, and
any switch's new buffers are touched first there), in iterations of that steady step time. A
switch whose first new-plan step is itself followed at once by another switch, or has no steady
steps after it, has no cost figure ("-").

Healthy figures come from steps 3 to FIRST - 1 (past 2 warm-up steps, which run slower). In a
short run, where the slowdown starts at step 3 or earlier, there are none: a line says so and the
figures that need them (healthy throughput, ideal, fractions of it, a measured rate, detection
against it) print "-"."""
import json
import statistics
import sys

WARMUP_STEPS = 2


def load(path):
    steps, replans = {}, []
    try:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("event") == "replan":
                    replans.append(record)
                elif "tokens_per_s" in record:
                    steps[record["step"]] = record
    except (OSError, ValueError) as e:
        sys.exit(f"straggler_summary: cannot read {path}: {e}")
    if not steps:
        sys.exit(f"straggler_summary: no training steps in {path}")
    return steps, replans


def throughput(steps, first, last):
    """Tokens per second over steps [first, last]: total tokens over total time; None when the
    window holds no step."""
    window = [steps[s] for s in range(first, last + 1) if s in steps]
    if not window:
        return None
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in window)
    return tokens / sum(r["step_time_s"] for r in window)


def healthy_window(first):
    """The steps before the slowdown at FIRST to take healthy figures from, past the warm-up
    steps: empty when the slowdown starts at step WARMUP_STEPS + 1 or earlier."""
    return WARMUP_STEPS + 1, first - 1


def median_step_time(steps, first, last):
    times = [steps[s]["step_time_s"] for s in range(first, last + 1) if s in steps]
    return statistics.median(times) if times else None


def ratio(numerator, denominator):
    return None if numerator is None or not denominator else numerator / denominator


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
    healthy_from, healthy_to = healthy_window(first)
    healthy = throughput(base, healthy_from, healthy_to)  # same plan in both runs before it
    rates = dict(slowed)
    for rank, rate in slowed.items():
        # Measured: the uniform run's slowdown, past the first 2 slowed steps where it lasts longer.
        if rate is None:
            slow_time = (median_step_time(base, first + 2, last) or
                         median_step_time(base, first, last))
            rates[rank] = ratio(slow_time, median_step_time(base, healthy_from, healthy_to))
    known = all(rate is not None for rate in rates.values())
    ideal_factor = (sum(1 / rates.get(r, 1.0) for r in range(world)) / world) if known else None
    ideal = healthy * ideal_factor if healthy is not None and known else None
    ours_during, base_during = throughput(ours, first, last), throughput(base, first, last)

    def detected(step):
        return all(abs(ours[step]["rates"][r] - rate) <= 0.25 * rate for r, rate in rates.items())

    detection = None
    if known:
        detection = next((s - first for s in range(first, last + 1) if s in ours and detected(s)),
                         None)
    first_replan = next((r["step"] - first for r in replans if r["step"] >= first), None)
    switches = []
    blocking = {r["step"]: r["migration_s"] + r["planning_s"] for r in replans}
    boundaries = [r["step"] for r in replans] + [end]
    for r, stop in zip(replans, boundaries[1:]):
        first_new = r["step"] + 1
        # A step that decides the next switch holds its blocking part: not a steady step.
        last_steady = stop if stop == end else stop - 1
        steady = median_step_time(ours, first_new + 1, min(first_new + 5, last_steady))
        cost = None
        if first_new in ours and steady is not None and first_new < stop:
            cost = blocking[r["step"]] + ours[first_new]["step_time_s"] - steady
        switches.append({"step": r["step"], "old": r["old_plan"], "new": r["new_plan"],
                         "planning_s": r["planning_s"], "migration_s": r["migration_s"],
                         "bytes": r["bytes_moved"],
                         "background_bytes": r.get("migration_background_bytes", 0),
                         "first_s": ours.get(first_new, {}).get("step_time_s"),
                         "steady_s": steady, "iterations": ratio(cost, steady)})
    predictions = []
    for r, stop in zip(replans, boundaries[1:]):
        segment = [ours[s]["step_time_s"] for s in range(r["step"] + 2, stop + 1) if s in ours]
        if len(segment) >= 3:
            measured = statistics.median(segment)
            predictions.append({"plan": r["new_plan"], "measured_s": measured,
                                "predicted_s": r["predicted_new_s"],
                                "error": r["predicted_new_s"] / measured - 1})
    return {"end": end, "rates": rates, "healthy": healthy,
            "healthy_steps": (healthy_from, healthy_to),
            "ours_before": throughput(ours, healthy_from, healthy_to), "ours_during": ours_during,
            "base_during": base_during, "ours_after": throughput(ours, last + 1, end),
            "base_after": throughput(base, last + 1, end), "ideal": ideal,
            "ideal_factor": ideal_factor, "fraction": ratio(ours_during, ideal),
            "base_fraction": ratio(base_during, ideal), "speedup": ratio(ours_during, base_during),
            "detection": detection, "first_replan": first_replan, "switches": switches,
            "predictions": predictions}


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def main():
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    try:
        first, last, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
        slowed = parse_slowed(sys.argv[4])
    except ValueError as e:
        sys.exit(f"straggler_summary: {e}\n{__doc__}")
    if not 1 <= first <= last or world < 1:
        sys.exit(f"straggler_summary: the slowdown's steps {first}-{last} must satisfy "
                 f"1 <= FIRST <= LAST, and WORLD ({world}) be positive")
    runs = [summarise(d, first, last, world, slowed) for d in sys.argv[5:]]
    rates = ", ".join(f"rank {r} at " + ("an unmeasured rate" if rate is None else f"{rate:.2f}x")
                      for r, rate in runs[0]["rates"].items())
    print(f"{world} ranks, slowed during steps {first}-{last} of {runs[0]['end']}: {rates}"
          + (" (measured, run 1)" if None in slowed.values()
             and None not in runs[0]["rates"].values() else ""))
    healthy_from, healthy_to = runs[0]["healthy_steps"]
    if healthy_to < healthy_from:
        print(f"no healthy step between the {WARMUP_STEPS} warm-up steps and the slowdown at step "
              f"{first}: no healthy throughput, ideal, fraction of it or measured rate (the "
              f"slowdown has to start at step {WARMUP_STEPS + 2} or later for them)")
    print("| run | tok/s healthy | tok/s slowed: re-planning / uniform | fraction of ideal "
          "(uniform) | speedup | detection, steps | re-plan, steps | switch cost, iterations |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for i, r in enumerate(runs, 1):
        costs = " / ".join(fmt(s["iterations"], ".2f") for s in r["switches"]) or "-"
        print(f"| {i} | {fmt(r['healthy'], '.0f')} | {fmt(r['ours_during'], '.0f')} / "
              f"{fmt(r['base_during'], '.0f')} | {fmt(r['fraction'], '.2f')} "
              f"({fmt(r['base_fraction'], '.2f')}) | {fmt(r['speedup'], '.2f')}x | "
              f"{fmt(r['detection'], 'd')} | {fmt(r['first_replan'], 'd')} | {costs} |")
    if len(runs) > 1:
        def med(key):
            values = [r[key] for r in runs if r[key] is not None]
            return statistics.median(values) if values else None
        costs = [s["iterations"] for r in runs for s in r["switches"]
                 if s["iterations"] is not None]
        print(f"| median | {fmt(med('healthy'), '.0f')} | {fmt(med('ours_during'), '.0f')} / "
              f"{fmt(med('base_during'), '.0f')} | {fmt(med('fraction'), '.2f')} "
              f"({fmt(med('base_fraction'), '.2f')}) | {fmt(med('speedup'), '.2f')}x | "
              f"{fmt(med('detection'), 'g')} | {fmt(med('first_replan'), 'g')} | "
              f"{statistics.median(costs) if costs else 0:.2f} "
              f"(max {max(costs) if costs else 0:.2f}) |")
    for i, r in enumerate(runs, 1):
        for s in r["switches"]:
            print(f"run {i}: re-plan at step {s['step']}: {s['old']} -> {s['new']}; planning "
                  f"{s['planning_s'] * 1e3:.1f} ms, migration {s['migration_s'] * 1e3:.0f} ms "
                  f"({s['bytes'] / 1e6:.1f} MB, {s['background_bytes'] / 1e6:.1f} MB in the "
                  f"background), first step {fmt(s['first_s'], '.3f')} s against "
                  f"{fmt(s['steady_s'], '.3f')} s = {fmt(s['iterations'], '.2f')} iterations")
        for p in r["predictions"]:
            print(f"run {i}: plan {p['plan']}: measured {p['measured_s']:.3f} s/step, predicted "
                  f"{p['predicted_s']:.3f} s, error {100 * p['error']:+.0f}%")


if __name__ == "__main__":
    main()
