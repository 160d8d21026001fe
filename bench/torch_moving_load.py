"""The moving-load benchmark for malleus.torch (bench/bench_moving_load.sh does it for malleus
train): the demo LLaMA in PyTorch on 2 processes over gloo, one per core, as
bench/torch_straggler.py runs it; after the warm-up one busy process moves between the two cores
every PERIOD ms. Each round trains once re-planning and once keeping the plan (replan=False)
under the same load, in alternating order (re-planning first in odd rounds), and compares the
time of the measured steps. Targets (issue 34, as issue 27's for malleus train): re-planning takes
at most 1.02x the time of keeping the plan in the median round and never more than 1.05x.

    build/malleus-python bench/torch_moving_load.py [--rounds 5] [--steps 60] [--period-ms 2500]

Exits 1 when a target is missed."""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_straggler import run_once  # noqa: E402

MEDIAN_TARGET, MAX_TARGET = 1.02, 1.05


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=8, help="steps before the load starts")
    p.add_argument("--period-ms", type=int, default=2500)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    a = p.parse_args()
    if a.rounds < 1 or a.steps < 1 or a.warmup < 1 or a.period_ms < 100:
        raise SystemExit("torch_moving_load: rounds, steps and warmup at least 1, period-ms at "
                         "least 100")
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    print(f"load average before: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    load = f"moving:{a.period_ms}"
    ratios = []
    for rnd in range(1, a.rounds + 1):
        order = ("malleus", "malleus-keep") if rnd % 2 else ("malleus-keep", "malleus")
        r = {mode: run_once(a, mode, load, cores) for mode in order}
        ratio = r["malleus-keep"]["tokens_per_s"] / r["malleus"]["tokens_per_s"]
        ratios.append(ratio)
        print(f"round {rnd}: re-planning {r['malleus']['tokens_per_s']:.0f} tok/s "
              f"({r['malleus']['switches']} switches), keeping the plan "
              f"{r['malleus-keep']['tokens_per_s']:.0f} tok/s: time re-planning / keeping "
              f"{ratio:.3f}", flush=True)
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")
    median, worst = statistics.median(ratios), max(ratios)
    print(f"median {median:.3f} (target <= {MEDIAN_TARGET}), largest {worst:.3f} "
          f"(target <= {MAX_TARGET})")
    return 0 if median <= MEDIAN_TARGET and worst <= MAX_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
