#!/usr/bin/env python3
"""Summarises two metrics files of the straggler benchmark (scripts/bench_straggler.sh): the
run with re-planning and the uniform baseline, both with the same injected straggler.

Prints throughput before, during and after the straggler for both, the speedup while it is
present, its fraction of the ideal (healthy throughput x sum(1/r) / N, the throughput of the same
devices if work could be split in proportion to speed), the cost of each switch, and how the
measured step time of each plan used compares with the cost model's prediction."""
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


def main():
    ours_path, base_path, first, last, rate, world = sys.argv[1:7]
    first, last, rate, world = int(first), int(last), float(rate), int(world)
    ours, replans = load(ours_path)
    base, _ = load(base_path)
    end = max(ours)
    healthy = throughput(base, 3, first - 1)  # same plan in both runs before the straggler
    ideal = healthy * ((world - 1) + 1 / rate) / world
    ours_during, base_during = throughput(ours, first, last), throughput(base, first, last)
    print(f"{world} ranks, rank slowed {rate:g}x during steps {first}-{last} of {end}")
    print(f"{'':28}{'re-planning':>14}{'uniform':>14}")
    for name, a, b in [("healthy, before (tok/s)", throughput(ours, 3, first - 1), healthy),
                       ("straggler present (tok/s)", ours_during, base_during),
                       ("healed, after (tok/s)", throughput(ours, last + 1, end),
                        throughput(base, last + 1, end))]:
        print(f"{name:28}{a:14.0f}{b:14.0f}")
    print(f"ideal while the straggler is present: {ideal:.0f} tok/s "
          f"(healthy x {(world - 1 + 1 / rate) / world:.3f})")
    print(f"speedup over uniform while present: {ours_during / base_during:.2f}x; "
          f"fraction of ideal: {ours_during / ideal:.2f} (uniform: {base_during / ideal:.2f})")
    for r in replans:
        step_time = statistics.median(ours[s]["step_time_s"] for s in
                                      range(max(1, r["step"] - 5), r["step"]) if s in ours)
        cost = r["migration_s"] + r["planning_s"]
        print(f"re-plan at step {r['step']}: {r['old_plan']} -> {r['new_plan']}; planning "
              f"{r['planning_s'] * 1e3:.1f} ms, migration {r['migration_s'] * 1e3:.0f} ms "
              f"({r['bytes_moved'] / 1e6:.1f} MB) = {cost / step_time:.2f} iterations")
    # Measured step time of each plan against the cost model's prediction for it.
    boundaries = [r["step"] for r in replans] + [end]
    start = 1
    for r, stop in zip(replans, boundaries[1:]):
        segment = [ours[s]["step_time_s"] for s in range(r["step"] + 2, stop + 1) if s in ours]
        if len(segment) >= 3:
            measured = statistics.median(segment)
            predicted = r["predicted_new_s"]
            print(f"plan {r['new_plan']}: measured {measured:.3f} s/step (median of "
                  f"{len(segment)}), predicted {predicted:.3f} s, error "
                  f"{100 * (predicted / measured - 1):+.0f}%")


if __name__ == "__main__":
    main()
