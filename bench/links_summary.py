#!/usr/bin/python3
"""The slow-links benchmark's summary (bench/bench_links.sh).

    bench/links_summary.py SCRATCH RUNS SHAPE_AT HEALTHY_JSON SLOWED_JSON NP

SCRATCH holds each run's run directory (<arm>-<i>/metrics.jsonl, arms uniform, compute-only,
link-aware); HEALTHY_JSON and SLOWED_JSON are `malleus simulate --json` of the healthy uniform
plan and of the best plan for the slowed link. Prints the healthy throughput, the ideal after
the throttle, each arm's throughput after it (median and runs) as a fraction of the ideal, and
each run's final link rates and plan switches.
"""
import json, statistics, sys
scratch, runs, shape_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
healthy_uniform, best_slowed = (json.load(open(path))["predicted_iteration_s"]
                                for path in sys.argv[4:6])
np = int(sys.argv[6])
def read(name):
    steps, decisions = {}, []
    for line in open(f"{scratch}/{name}/metrics.jsonl"):
        r = json.loads(line)
        if r.get("event") in ("replan", "replan_declined"):
            decisions.append(r)
        elif "step_time_s" in r:
            steps[r["step"]] = r
    return steps, decisions
def tokens_per_s(steps, first, last):
    chosen = [steps[s] for s in range(first, last + 1)]
    return sum(s["tokens_per_s"] * s["step_time_s"] for s in chosen) / sum(
        s["step_time_s"] for s in chosen)
arms = ["uniform", "compute-only", "link-aware"]
healthy, after, notes = [], {a: [] for a in arms}, {a: [] for a in arms}
for arm in arms:
    for i in range(1, runs + 1):
        steps, decisions = read(f"{arm}-{i}")
        last = max(steps)
        healthy.append(tokens_per_s(steps, 3, shape_at))
        after[arm].append(tokens_per_s(steps, shape_at + 1, last))
        switched = [d for d in decisions if d["event"] == "replan" and d["step"] > shape_at]
        links = steps[last].get("link_rates", [])
        notes[arm].append(f"links at the end {[round(x, 1) for x in links]}; " + (
            "; ".join(f"step {d['step']}: {d['new_plan']}" for d in switched) or "no switch"))
ideal = statistics.median(healthy) * healthy_uniform / best_slowed
print(f"healthy dp{np} (steps 3-{shape_at}, median of {len(healthy)} runs): "
      f"{statistics.median(healthy):.0f} tokens/s")
print(f"cost model: healthy dp{np} {healthy_uniform:.3f} s/step, best plan with host 1's link 10x "
      f"slower {best_slowed:.3f} s/step -> ideal {ideal:.0f} tokens/s")
print()
print("| running | tokens/s after the throttle (median of %d) | runs | fraction of ideal |" % runs)
print("|---|---:|---|---:|")
for arm in arms:
    m = statistics.median(after[arm])
    print(f"| {arm} | {m:.0f} | {', '.join(f'{x:.0f}' for x in after[arm])} | {m / ideal:.2f} |")
print()
for arm in arms:
    for i, n in enumerate(notes[arm], 1):
        print(f"{arm} {i}: {n}")
