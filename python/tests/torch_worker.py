"""One rank of the malleus.torch tests (started by malleus.torch.run's launcher).

    torch_worker.py exact OUT SCHEDULES_JSON   trains each schedule of splits with step(); rank 0
                                               saves the losses and final parameters per schedule
    torch_worker.py loop OUT SCHEDULES_JSON    the same in a DistributedDataParallel-shaped loop
                                               (mean losses weighted by tokens, global-norm
                                               clipping), with AdamW and with a
                                               ZeroRedundancyOptimizer over AdamW; rank 0 saves
                                               the clipped norms and final parameters
    torch_worker.py straggler OUT STEPS BUSY_FROM BUSY_TO CORE
                                               trains with re-planning on; rank 0 starts two busy
                                               processes pinned to CORE before step BUSY_FROM and
                                               stops them before step BUSY_TO; saves the step log
    torch_worker.py fault OUT exit|hang TIMEOUT_S
                                               rank 1 exits with status 3 (or hangs) in the
                                               compute of step 2; rank 0 writes the error its
                                               step raised to OUT and exits with status 1
"""

import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_common as tc  # noqa: E402
import malleus.torch as mt  # noqa: E402


def exact(out, schedules):
    results = []
    for schedule in schedules:  # a list of splits, one per step
        model = tc.make_model()
        dp = mt.DataParallel(model, tc.make_optimizer(model), global_batch=tc.GLOBAL_BATCH,
                             micro_batch=tc.MICRO_BATCH, seq_len=tc.SEQ, replan=False,
                             bucket_mb=0.004)  # several buckets even for this small model
        losses, splits = [], []
        for split, data in zip(schedule, tc.batches(len(schedule))):
            dp.set_split(split)
            r = dp.step(data, tc.loss_sum)
            losses.append(r.loss)
            splits.append(r.split)
        results.append({"losses": losses, "splits": splits,
                        "params": [p.detach().clone() for p in model.parameters()]})
    if dist.get_rank() == 0:
        torch.save(results, out)


def ddp_shaped(out, schedules):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    results = []
    for optimizer in ("adamw", "zero"):
        for schedule in schedules:
            torch.manual_seed(0)
            model = mt.DataParallel(tc.make_model(), global_batch=tc.GLOBAL_BATCH,
                                    micro_batch=tc.MICRO_BATCH, seq_len=tc.SEQ,
                                    units=tc.counted_tokens, replan=False, bucket_mb=0.004)
            if optimizer == "zero":
                opt = ZeroRedundancyOptimizer(model.parameters(),
                                              optimizer_class=torch.optim.AdamW, lr=1e-2,
                                              weight_decay=0.1)
            else:
                opt = tc.make_optimizer(model)
            norms, splits = [], []
            for split, batch in zip(schedule, tc.batches(len(schedule))):
                model.set_split(split)
                for micro_batch in model.micro_batches(batch):
                    loss = tc.mean_loss(model, micro_batch)
                    loss.backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.CLIP)))
                opt.step()
                opt.zero_grad()
                splits.append(model.last.split)
            results.append({"optimizer": optimizer, "schedule": schedule, "norms": norms,
                            "splits": splits,
                            "params": [p.detach().clone() for p in model.module.parameters()]})
    if dist.get_rank() == 0:
        torch.save(results, out)


def stop(processes):
    for p in processes:
        p.kill()
        p.wait()


def straggler(out, steps, busy_from, busy_to, core):
    torch.manual_seed(0)
    width, seq = 256, 64
    model = torch.nn.Sequential(torch.nn.Embedding(tc.VOCAB, width),
                                *[torch.nn.Sequential(torch.nn.Linear(width, 4 * width),
                                                      torch.nn.GELU(),
                                                      torch.nn.Linear(4 * width, width))
                                  for _ in range(4)],
                                torch.nn.Linear(width, tc.VOCAB))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dp = mt.DataParallel(model, opt, global_batch=16, micro_batch=1, seq_len=seq,
                         total_steps=steps)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, tc.VOCAB, (16, seq + 1), generator=g)

    def loss_fn(m, t):
        logits = m(t[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, tc.VOCAB),
                                                 t[:, 1:].reshape(-1), reduction="sum")
        return loss, t[:, 1:].numel()

    log, busy = [], None
    try:
        for step in range(1, steps + 1):
            if dist.get_rank() == 0 and step == busy_from:
                busy = [subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c",
                                          "while True: pass"]) for _ in range(2)]
            if dist.get_rank() == 0 and step == busy_to and busy:
                stop(busy)
                busy = None
            dist.barrier()  # the busy process starts and stops between steps
            r = dp.step(tokens, loss_fn)
            log.append({"step": r.step, "split": r.split, "next_split": r.next_split,
                        "rates": r.rates, "compute_s": r.compute_s,
                        "switched": bool(r.decision and r.decision.switched)})
            if dist.get_rank() == 0:
                print(f"step {r.step} split {r.split} rates "
                      f"{[round(x, 2) for x in r.rates]} compute "
                      f"{[round(x, 3) for x in r.compute_s]}", flush=True)
    finally:
        if busy:
            stop(busy)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(log, f)


def fault(out, how):
    model = tc.make_model()
    dp = mt.DataParallel(model, tc.make_optimizer(model), global_batch=tc.GLOBAL_BATCH,
                         micro_batch=tc.MICRO_BATCH, seq_len=tc.SEQ, replan=False)

    def loss_fn(m, samples):
        if dist.get_rank() == 1 and dp.steps == 1:  # in step 2, before its all-reduce
            if how == "exit":
                os._exit(3)
            time.sleep(3600)
        return tc.loss_sum(m, samples)
    try:
        for data in tc.batches(4):
            dp.step(data, loss_fn)
    except RuntimeError as e:
        with open(out, "w") as f:
            f.write(str(e))
        # Finalized as usual: the launcher must see rank 1's own status (3) first, and a rank
        # that ends at once could come to its poll in the same round as rank 1.
        sys.exit(1)


def main():
    torch.set_num_threads(1)
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "fault":
        mt.init_from_env("gloo", timeout_s=float(sys.argv[4]))
        fault(out, sys.argv[3])
        return
    mt.init_from_env("gloo")
    if mode == "exact":
        exact(out, json.loads(sys.argv[3]))
    elif mode == "loop":
        ddp_shaped(out, json.loads(sys.argv[3]))
    else:
        straggler(out, *(int(x) for x in sys.argv[3:7]))
    dist.destroy_process_group()
    tc.exit_without_finalizing(0)


if __name__ == "__main__":
    main()
