"""Plain DistributedDataParallel against malleus.torch: the demo LLaMA (examples/torch_llama.py)
in PyTorch on 2 processes over gloo, one per core, the same model, data and global batch, healthy
and with an external 3x straggler on rank 1's core (two busy processes pinned there, started by
this benchmark after the warm-up, so rank 1 gets a third of its core).

    PYTHONPATH=build/python /usr/bin/python3 bench/torch_straggler.py [--rounds 3]

Prints tokens/s over the measured steps per run, then medians over the paired rounds (DDP and
malleus.torch alternate within a round) and the ratios the targets are stated in:
under the straggler malleus.torch / DDP (target >= 1.3) and malleus.torch / ideal (>= 0.85,
ideal = healthy malleus.torch x (1 + 1/3) / 2); healthy, malleus.torch / DDP (>= 0.98).
"""

import argparse
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

    def loss_sum(m, w):
        logits = m(w[:, :-1])
        return (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                reduction="sum"), w[:, 1:].numel())

    if a.mode == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        share = a.global_batch // world
        mine = data[rank * share:(rank + 1) * share]

        def step():
            opt.zero_grad()
            for k in range(share):  # micro-batches of 1; gradients synced on the last only
                w = mine[k:k + 1]
                if k < share - 1:
                    with ddp.no_sync():
                        (loss_sum(ddp, w)[0] / (share * a.seq_len)).backward()
                else:
                    (loss_sum(ddp, w)[0] / (share * a.seq_len)).backward()
            opt.step()
            return None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        dp = mt.DataParallel(model, opt, global_batch=a.global_batch, micro_batch=1,
                             seq_len=a.seq_len, model_config=config, total_steps=steps)

        def step():
            return dp.step(data, loss_sum)
    times, splits, rates = [], [], []
    try:
        for s in range(steps):
            if a.straggler and s == a.warmup and rank == 0:
                busy = [subprocess.Popen(["taskset", "-c", str(a.slow_core), sys.executable,
                                          "-c", "while True: pass"]) for _ in range(2)]
            dist.barrier()
            t0 = time.perf_counter()
            r = step()
            times.append(time.perf_counter() - t0)
            if r is not None:
                splits.append(r.split)
                rates.append(r.rates)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if rank == 0:
        measured = times[a.warmup:]
        with open(a.out, "w") as f:
            json.dump({"tokens_per_s": a.global_batch * a.seq_len * len(measured) / sum(measured),
                       "last_split": splits[-1] if splits else None,
                       "last_rates": rates[-1] if rates else None}, f)
    dist.destroy_process_group()


def run_once(a, mode, straggler, cores):
    from malleus.torch import run
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--mode", mode,
                "--out", out, "--steps", str(a.steps), "--warmup", str(a.warmup),
                "--global-batch", str(a.global_batch), "--seq-len", str(a.seq_len),
                "--slow-core", str(cores[1])] + (["--straggler"] if straggler else [])
        status = run.launch(argv, 2, cores=cores, timeout=900)
        if status:
            raise SystemExit(f"{mode} run failed with status {status}")
        with open(out) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["ddp", "malleus"], help=argparse.SUPPRESS)
    p.add_argument("--straggler", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--slow-core", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("needs 2 cores")
    print(f"load average before: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    results = {(m, s): [] for m in ("ddp", "malleus") for s in (False, True)}
    for rnd in range(a.rounds):
        for straggler in (False, True):
            for mode in ("ddp", "malleus"):
                r = run_once(a, mode, straggler, cores)
                results[(mode, straggler)].append(r["tokens_per_s"])
                print(f"round {rnd + 1} {'straggler' if straggler else 'healthy  '} {mode:8s} "
                      f"{r['tokens_per_s']:8.0f} tok/s  split {r['last_split']} rates "
                      f"{[round(x, 2) for x in r['last_rates']] if r['last_rates'] else '-'}",
                      flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    ideal = med[("malleus", False)] * (1 + 1 / 3) / 2
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")
    print(f"medians of {a.rounds} (tok/s): healthy DDP {med[('ddp', False)]:.0f}, malleus.torch "
          f"{med[('malleus', False)]:.0f}; 3x straggler DDP {med[('ddp', True)]:.0f}, "
          f"malleus.torch {med[('malleus', True)]:.0f}, ideal {ideal:.0f}")
    print(f"healthy malleus.torch / DDP: {med[('malleus', False)] / med[('ddp', False)]:.3f} "
          f"(target >= 0.98)")
    print(f"straggler malleus.torch / DDP: {med[('malleus', True)] / med[('ddp', True)]:.2f} "
          f"(target >= 1.3)")
    print(f"straggler malleus.torch / ideal: {med[('malleus', True)] / ideal:.2f} "
          f"(target >= 0.85)")


if __name__ == "__main__":
    main()
