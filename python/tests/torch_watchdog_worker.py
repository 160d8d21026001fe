"""One rank of test_torch_watchdog.py (started by malleus.torch.run's launcher):

    torch_watchdog_worker.py RUN_DIR STEPS STOP_RANK STOP_AT

trains the tests' model (torch_common) for STEPS steps under malleus.torch.Watchdog (floor 3 s),
resuming from RUN_DIR/checkpoint.pt when there is one (rank 0 saves it after every step: model,
optimizer, step, the losses so far). Rank STOP_RANK (-1: none) stops itself with SIGSTOP at the
start of step STOP_AT, after writing the time to RUN_DIR/stopped. Each rank's stderr goes to
RUN_DIR/stderr_<rank>.txt (the watchdog's line); rank 0 writes the losses to RUN_DIR/losses.json.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_common as tc  # noqa: E402
import malleus.torch as mt  # noqa: E402

FLOOR_S = 3.0


def main():
    run_dir, steps, stop_rank, stop_at = sys.argv[1], *map(int, sys.argv[2:5])
    rank = int(os.environ["RANK"])
    err = os.open(os.path.join(run_dir, f"stderr_{rank}.txt"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 2)
    torch.set_num_threads(1)
    mt.init_from_env("gloo")
    model = tc.make_model()
    opt = tc.make_optimizer(model)
    start, losses = 0, []
    checkpoint = os.path.join(run_dir, "checkpoint.pt")
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, losses = state["step"], state["losses"]
    dp = mt.DataParallel(model, opt, global_batch=tc.GLOBAL_BATCH, micro_batch=tc.MICRO_BATCH,
                         seq_len=tc.SEQ, replan=False)
    data = tc.batches(steps)
    with mt.Watchdog(run_dir, floor_s=FLOOR_S) as watchdog:
        for step in range(start, steps):
            watchdog.step(step + 1)
            if rank == stop_rank and step + 1 == stop_at:
                with open(os.path.join(run_dir, "stopped"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            losses.append(dp.step(data[step], tc.loss_sum).loss)
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                            "step": step + 1, "losses": losses}, checkpoint + ".tmp")
                os.replace(checkpoint + ".tmp", checkpoint)
    if rank == 0:
        with open(os.path.join(run_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
