"""One rank of the malleus.torch pipeline tests (started by malleus.torch.run's launcher).

    pipeline_worker.py exact OUT RUNS_JSON
        trains each run (a list of plans, one per step: a switch wherever it changes); rank 0
        saves, per run, every step's loss and plan summary, every block's state after every step
        (gathered from the ranks), and per switch the most bytes of blocks a rank held during the
        switch against its old and new ranges' bytes
    pipeline_worker.py straggler OUT STEPS BUSY_FROM BUSY_TO CORE
        trains with re-planning on; rank 0 starts two busy processes pinned to CORE before step
        BUSY_FROM and stops them before step BUSY_TO; saves the step log
"""

import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import malleus  # noqa: E402
import pipeline_common as pc  # noqa: E402
import torch_common as tc  # noqa: E402
import malleus.torch as mt  # noqa: E402


def block_bytes(pp, blocks):
    return sum(s.numel() * t.element_size() for b in blocks
               for s, t in zip(pp.blocks.shapes[b], pp.blocks.tensors[b]))


def watch_peak(pp):
    """Records the most bytes of blocks this rank holds while blocks move."""
    allocate = pp.blocks.allocate
    pp.peak = 0

    def allocating(b):
        allocate(b)
        pp.peak = max(pp.peak, pp.blocks.bytes_held())
    pp.blocks.allocate = allocating


def exact(out, runs):
    results = []
    for plans in runs:
        pp = mt.PipelineParallel(pc.make_blocks(), pc.make_optimizer, pc.loss_fn,
                                 global_batch=pc.GLOBAL_BATCH, micro_batch=pc.MICRO_BATCH,
                                 seq_len=tc.SEQ, model_config=pc.config(), plan=plans[0],
                                 replan=False)
        watch_peak(pp)
        old_blocks = list(pp.held_blocks)
        losses, summaries, states, switches = [], [], [], []
        for step, data in enumerate(tc.batches(len(plans))):
            if step > 0 and plans[step] != plans[step - 1]:
                pp.peak = pp.blocks.bytes_held()
                pp.set_plan(plans[step])
                new = block_bytes(pp, pp.held_blocks)
                union = block_bytes(pp, set(old_blocks) | set(pp.held_blocks))
                stale = sum(p.grad is not None for b in range(len(pp.blocks))
                            if b not in pp.held_blocks for p in pp.blocks.params[b])
                switches.append({"rank": dist.get_rank(), "peak": pp.peak, "union": union,
                                 "after": pp.blocks.bytes_held(), "new": new,
                                 "stale_gradients": stale})
            old_blocks = list(pp.held_blocks)
            r = pp.step(data)
            losses.append(r.loss)
            summaries.append(r.plan)
            states.append(pp.gather(0))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, switches)
        results.append({"losses": losses, "plans": summaries, "states": states,
                        "switches": [s for per_rank in gathered for s in per_rank]})
    if dist.get_rank() == 0:
        torch.save(results, out)


def stop(processes):
    for p in processes:
        p.kill()
        p.wait()


def straggler(out, steps, busy_from, busy_to, core):
    # The demo LLaMA as blocks (the example's), whose compute the planner's FLOP count follows
    # block by block, so that a rank's rate does not move when its blocks change.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples"))
    from torch_llama_pipeline import llama_blocks, loss_fn
    seq, layers = 64, 8
    config = dict(malleus.model_config("demo"), num_layers=layers)
    torch.manual_seed(0)
    pp = mt.PipelineParallel(llama_blocks(config), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                             loss_fn, global_batch=16, micro_batch=1, seq_len=seq,
                             model_config=config,
                             cluster=pc.cluster_holding(config, 2, seq, layers - 2),
                             total_steps=steps)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config["vocab_size"], (16, seq + 1), generator=g)
    data = (tokens[:, :-1], tokens[:, 1:])
    log, busy = [], None
    try:
        for step in range(1, steps + 1):
            if dist.get_rank() == 0 and step == busy_from:
                busy = [subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c",
                                          "while True: pass"]) for _ in range(2)]
            if dist.get_rank() == 0 and step == busy_to and busy:
                stop(busy)
                busy = None
            dist.barrier()  # the busy processes start and stop between steps
            blocks_before = [list(b) for b in pp.blocks_per_rank]
            r = pp.step(data)
            log.append({"step": r.step, "plan": r.plan, "next_plan": r.next_plan,
                        "blocks": blocks_before, "rates": r.rates,
                        "next_blocks": [list(b) for b in pp.blocks_per_rank],
                        "compute_s": r.compute_s, "switched": r.switched,
                        "migrate_s": r.migrate_s})
            if dist.get_rank() == 0:
                print(f"step {r.step} blocks per rank {[len(b) for b in blocks_before]} rates "
                      f"{[round(x, 2) for x in r.rates]} "
                      f"compute {[round(x, 3) for x in r.compute_s]}"
                      + (f" -> {[len(b) for b in pp.blocks_per_rank]} (moved in "
                         f"{r.migrate_s:.3f} s)" if r.switched else "")
                      + (f" | asked: {r.decision.reason}" if r.decision else ""), flush=True)
    finally:
        if busy:
            stop(busy)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(log, f)


def main():
    torch.set_num_threads(1)
    mt.init_from_env("gloo")
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "exact":
        exact(out, json.loads(sys.argv[3]))
    else:
        straggler(out, *(int(x) for x in sys.argv[3:7]))
    dist.destroy_process_group()
    tc.exit_without_finalizing(0)


if __name__ == "__main__":
    main()
