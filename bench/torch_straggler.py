"""Plain DistributedDataParallel against malleus.torch: the demo LLaMA (examples/torch_llama.py)
in PyTorch on 2 processes over gloo, one per core, the same model, data and global batch, healthy
and with an external 3x straggler on rank 1's core (two busy processes pinned there, started by
this benchmark after the warm-up, so rank 1 gets a third of its core).

    build/malleus-python bench/torch_straggler.py [--rounds 3]

Both run the same training loop (gradient accumulation, loss.backward(), optimizer.step()),
differing only in the lines of docs/python.md's diff. Prints tokens/s over the measured steps per
run, then medians over the paired rounds (the modes alternate within a round) and the ratios the
targets are stated in (issue 34): healthy, malleus.torch / DDP (>= 1.0); under the straggler
malleus.torch / DDP (>= 1.5) and malleus.torch / ideal (>= 0.85, ideal = healthy malleus.torch x
(1 + 1/3) / 2). --modes ddp,malleus,malleus-serial adds malleus.torch without the overlap of the
bucket all-reduces with the backward.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import malleus
    import malleus.torch as mt
    from torch_llama import Llama

    torch.set_num_threads(1)
    mt.init_from_env("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = malleus.model_config("demo")
    torch.manual_seed(0)
    model = Llama(config)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, config["vocab_size"], (a.global_batch, a.seq_len + 1), generator=g)
    steps = a.warmup + a.steps
    busy = []

    def loss(m, w):  # the mean over the micro-batch's tokens
        logits = m(w[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))

    # The same loop for both, as docs/python.md's diff has it: only the wrapper and where this
    # rank's micro-batches come from differ.
    if a.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        share = a.global_batch // world

        def micro_batches(batch):  # this rank's share, in micro-batches of 1
            return batch[rank * share:(rank + 1) * share].split(1)
        scale = 1.0 / share  # accumulation: the mean over this rank's micro-batches
    else:
        model = mt.DataParallel(model, global_batch=a.global_batch, micro_batch=1,
                                seq_len=a.seq_len, model_config=config, total_steps=steps,
                                overlap=a.mode != "malleus-serial", bucket_mb=a.bucket_mb,
                                replan=a.mode != "malleus-keep")
        micro_batches = model.micro_batches
        scale = 1.0  # malleus.torch weights the micro-batches itself
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        batches = micro_batches(data)
        for k, w in enumerate(batches):
            last = a.mode != "ddp" or k == share - 1
            with contextlib.nullcontext() if last else model.no_sync():
                (loss(model, w) * scale).backward()
        opt.step()
        opt.zero_grad()
        return getattr(model, "last", None)
    times, splits, rates, switches = [], [], [], 0
    try:
        for s in range(steps):
            if a.load == "straggler" and s == a.warmup and rank == 0:
                busy = [subprocess.Popen(["taskset", "-c", str(a.cores[1]), sys.executable,
                                          "-c", "while True: pass"]) for _ in range(2)]
            if a.load.startswith("moving:") and s == a.warmup and rank == 0:
                busy = [subprocess.Popen([sys.executable, "-c", MOVER, ",".join(map(str, a.cores)),
                                          a.load.split(":")[1]])]
            dist.barrier()
            t0 = time.perf_counter()
            r = step()
            times.append(time.perf_counter() - t0)
            if r is not None:
                splits.append(r.split)
                rates.append(r.rates)
                switches += bool(r.decision and r.decision.switched)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if rank == 0:
        measured = times[a.warmup:]
        with open(a.out, "w") as f:
            json.dump({"tokens_per_s": a.global_batch * a.seq_len * len(measured) / sum(measured),
                       "last_split": splits[-1] if splits else None,
                       "last_rates": rates[-1] if rates else None, "switches": switches}, f)
    dist.destroy_process_group()


# One busy process that moves between the cores (argv[1], comma-separated) every argv[2] ms: load
# that moves between the ranks (scripts/slow_rank.sh moving:MS does the same to malleus train).
MOVER = """
import os, sys, time
cores, period = [int(c) for c in sys.argv[1].split(",")], int(sys.argv[2]) / 1000
i, end = 0, time.time() + 3600
while time.time() < end:
    os.sched_setaffinity(0, {cores[i % len(cores)]})
    until = time.time() + period
    while time.time() < until:
        pass
    i += 1
"""


def launch_worker(script, a, mode, load, cores, extra=()):
    """Runs `script --worker` on 2 ranks pinned to `cores` for one `mode` under `load`, with
    the common arguments from `a` and `extra`: the figures its rank 0 wrote. Shared with
    torch_pipeline.py."""
    from malleus.torch import run
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.abspath(script), "--worker", "--mode", mode,
                "--out", out, "--steps", str(a.steps), "--warmup", str(a.warmup),
                "--global-batch", str(a.global_batch), "--seq-len", str(a.seq_len),
                "--cores", ",".join(map(str, cores)), "--load", load, *extra]
        status = run.launch(argv, 2, cores=cores, timeout=900)
        if status:
            raise SystemExit(f"{mode} run failed with status {status}")
        with open(out) as f:
            return json.load(f)


def measure_rounds(a, modes, run, line, loads=(False, True)):
    """`a.rounds` rounds of every mode, healthy and then under the straggler (`loads`: which of
    the two), the modes side by side; their order alternates between rounds (ABBA), so a machine
    drifting faster or slower favours none. `run(mode, load)` gives a run's figures, printed by
    `line(round, straggler, mode, figures)`. Returns {(mode, straggler): [tokens/s of each
    round]}. Shared with torch_pipeline.py."""
    results = {(m, s): [] for m in modes for s in loads}
    for rnd in range(a.rounds):
        order = list(modes) if rnd % 2 == 0 else list(reversed(modes))
        for straggler in loads:
            for mode in order:
                r = run(mode, "straggler" if straggler else "none")
                results[(mode, straggler)].append(r["tokens_per_s"])
                line(rnd + 1, straggler, mode, r)
    return results


def side_by_side(results, mode, base, straggler):
    """The median over rounds of `mode`'s tokens/s over `base`'s in the same round."""
    return statistics.median(x / y for x, y in zip(results[(mode, straggler)],
                                                   results[(base, straggler)]))


def run_once(a, mode, load, cores):
    """One run of `mode` under `load` ("none", "straggler" or "moving:MS"): its figures."""
    return launch_worker(__file__, a, mode, load, cores, ["--bucket-mb", str(a.bucket_mb)])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--modes", default="ddp,malleus",
                   help="what to run, of ddp, malleus, malleus-serial (malleus.torch without "
                        "the overlap) and malleus-keep (without re-planning); default "
                        "%(default)s")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="malleus.torch's bucket_mb")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--load", default="none", help=argparse.SUPPRESS)
    p.add_argument("--cores", type=lambda x: [int(c) for c in x.split(",")],
                   help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    print(f"load average before: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    modes = a.modes.split(",")
    if not set(modes) <= {"ddp", "malleus", "malleus-serial", "malleus-keep"}:
        raise SystemExit(f"--modes: of ddp, malleus, malleus-serial and malleus-keep, got "
                         f"{a.modes}")
    def line(rnd, straggler, mode, r):
        print(f"round {rnd} {'straggler' if straggler else 'healthy  '} {mode:14s} "
              f"{r['tokens_per_s']:8.0f} tok/s  split {r['last_split']} rates "
              f"{[round(x, 2) for x in r['last_rates']] if r['last_rates'] else '-'}", flush=True)

    results = measure_rounds(a, modes, lambda mode, load: run_once(a, mode, load, cores), line)
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")
    for mode in modes:
        print(f"medians of {a.rounds} (tok/s): {mode} healthy {med[(mode, False)]:.0f}, "
              f"3x straggler {med[(mode, True)]:.0f}")
    if "ddp" in modes and "malleus" in modes:
        ideal = med[("malleus", False)] * (1 + 1 / 3) / 2
        print(f"healthy malleus.torch / DDP: {side_by_side(results, 'malleus', 'ddp', False):.3f} "
              f"(median of the rounds' ratios; target >= 1.0)")
        print(f"straggler malleus.torch / DDP: {side_by_side(results, 'malleus', 'ddp', True):.2f} "
              f"(target >= 1.5)")
        print(f"straggler malleus.torch / ideal ({ideal:.0f}): "
              f"{med[('malleus', True)] / ideal:.2f} (target >= 0.85)")
    if "malleus-serial" in modes and "malleus" in modes:
        print(f"healthy overlap / serial: "
              f"{side_by_side(results, 'malleus', 'malleus-serial', False):.3f}")


if __name__ == "__main__":
    main()
