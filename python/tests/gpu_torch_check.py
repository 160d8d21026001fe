"""malleus.torch on one GPU (issue 35): DataParallel over NCCL with a world of one process, and
over gloo with two processes sharing the GPU; PipelineParallel over NCCL with a world of one (the
blocks on the GPU; two processes cannot share one GPU under NCCL, and gloo's point-to-point takes
CPU tensors). In each, every step's loss and the parameters after the last step equal one process
training on the whole global batch in one forward (on the same device), and each rank's compute
is timed with CUDA events.

    PYTHONPATH=build/python /usr/bin/python3 python/tests/gpu_torch_check.py [--device cpu]

Exit status 0 when every check passed or none could run (no CUDA device: it says "skipped"), 1
when one failed. One line per check, then "gpu_torch_check: N passed, M failed" last.
``--device cpu`` runs the same checks on the CPU over gloo, the pipeline on two processes (the
launcher, the workers, the comparison and the report; what the CPU test suite runs,
python_gpu_torch_check_cpu).

Tolerance on a GPU: the sums run in another order (per micro-batch, then across ranks) and cuBLAS
may pick other kernels for other shapes, so losses agree to a relative 2e-5 and parameters to an
absolute 1e-4 after the AdamW steps at lr 1e-2 (on the CPU: 1e-6 and 2e-6, as
test_torch_exact.py; a gradient weighted per rank instead of per token is off by 1e-3 and more).
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import pipeline_common as pc  # noqa: E402
import torch_common as tc  # noqa: E402

STEPS = 4
TOLERANCE = {"cuda": (2e-5, 1e-4), "cpu": (1e-6, 2e-6)}  # (loss rtol, parameter atol)


def reference(kind, device, steps):
    """One process, the whole global batch in one forward, on `device`: (losses, parameters on
    the CPU) of the test model (`kind` "data") or of its blocks run in order ("pipeline")."""
    if kind == "pipeline":
        losses, states = pc.reference_run(steps, device)
        return losses, [v for block in states[-1] for v in block.values()]
    model = tc.make_model().to(device)
    opt = tc.make_optimizer(model)
    losses = []
    for inputs, targets in tc.batches(steps):
        opt.zero_grad()
        logits = model(inputs.to(device))
        loss = F.cross_entropy(logits.reshape(-1, tc.VOCAB), targets.to(device).reshape(-1),
                               ignore_index=tc.IGNORE)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


TIMING_EVENTS = 0  # CUDA events made with enable_timing, in this worker


def count_timing_events():
    """Makes torch.cuda.Event count the timing events made (DataParallel's compute timing)."""
    base = torch.cuda.Event

    class CountingEvent(base):
        def __new__(cls, *args, **kwargs):
            global TIMING_EVENTS
            if kwargs.get("enable_timing") or (args and args[0]):
                TIMING_EVENTS += 1
            return super().__new__(cls, *args, **kwargs)

    torch.cuda.Event = CountingEvent


def worker(kind, device, backend, out, steps):
    """One rank (started by malleus.torch.run's launcher): DataParallel (`kind` "data") or
    PipelineParallel ("pipeline") on `device` over `backend`; rank 0 saves the losses, the final
    parameters and the timing events made."""
    import malleus.torch as mt
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        count_timing_events()  # the wrappers make their timing events with torch.cuda.Event
    mt.init_from_env(backend)
    losses, compute_s = [], []
    if kind == "pipeline":
        pp = mt.PipelineParallel([b.to(device) for b in pc.make_blocks()], pc.make_optimizer,
                                 pc.loss_fn, global_batch=pc.GLOBAL_BATCH,
                                 micro_batch=pc.MICRO_BATCH, seq_len=tc.SEQ,
                                 model_config=pc.config(), replan=False)
        for data in tc.batches(steps):
            r = pp.step(data)
            losses.append(r.loss)
            compute_s.append(r.compute_s)
        state = pp.gather(0)
        params = [v.cpu() for block in state for v in block.values()] if state else []
    else:
        model = tc.make_model().to(device)
        dp = mt.DataParallel(model, tc.make_optimizer(model), global_batch=tc.GLOBAL_BATCH,
                             micro_batch=tc.MICRO_BATCH, seq_len=tc.SEQ, replan=False,
                             bucket_mb=0.004)  # several buckets even for this small model
        for inputs, targets in tc.batches(steps):
            r = dp.step((inputs.to(device), targets.to(device)), tc.loss_sum)
            losses.append(r.loss)
            compute_s.append(r.compute_s)
        params = [p.detach().cpu().clone() for p in model.parameters()]
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "compute_s": compute_s, "events": TIMING_EVENTS,
                    "params": params, "backend": dist.get_backend()}, out)
    dist.destroy_process_group()


def check(name, kind, device, backend, nproc, steps):
    """Runs one configuration; returns the failures (empty: passed) and prints its line."""
    from malleus.torch import run
    loss_rtol, param_atol = TOLERANCE[device]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        status = run.launch([sys.executable, os.path.abspath(__file__), "--worker", kind,
                             device, backend, out, str(steps)], nproc, timeout=300)
        if status != 0:
            print(f"FAIL {name}: a rank exited with status {status}", flush=True)
            return [f"{name}: exit status {status}"]
        result = torch.load(out)
    failures = []
    losses, params = reference(kind, device, steps)
    loss_err = max(abs(g - w) / abs(w) for g, w in zip(result["losses"], losses))
    param_err = max(float((a - b).abs().max()) for a, b in zip(result["params"], params))
    if len(result["losses"]) != steps or loss_err > loss_rtol:
        failures.append(f"losses {result['losses']} against one process's {losses} (relative "
                        f"error {loss_err:.1e} > {loss_rtol:.0e})")
    if param_err > param_atol:
        failures.append(f"parameters differ from one process's by {param_err:.1e} > "
                        f"{param_atol:.0e}")
    if device == "cuda" and result["events"] < 2 * steps:
        failures.append(f"{result['events']} CUDA timing events for {steps} steps: the compute "
                        "was not timed with CUDA events")
    if any(s <= 0 for step in result["compute_s"] for s in step):
        failures.append(f"a rank's compute time is not positive: {result['compute_s']}")
    state = "PASS" if not failures else "FAIL"
    print(f"{state} {name}: {nproc} process{'es' if nproc > 1 else ''} over "
          f"{result['backend']}, worst relative loss error {loss_err:.1e}, worst parameter error "
          f"{param_err:.1e}, timing events {result['events']}, compute s per step "
          f"{[[round(s, 4) for s in step] for step in result['compute_s']]}", flush=True)
    for f in failures:
        print(f"  {f}", flush=True)
    return failures


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, device, backend, out, steps = sys.argv[2:7]
        worker(kind, device, backend, out, int(steps))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_torch_check: skipped: no CUDA device (torch.cuda.is_available() is False); "
              "--device cpu runs the same checks on the CPU", flush=True)
        return 0
    print(f"gpu_torch_check: torch {torch.__version__} on "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'the CPU'}", flush=True)
    one = "nccl" if args.device == "cuda" else "gloo"
    results = [check(f"world of one over {one}", "data", args.device, one, 1, args.steps),
               check("two processes on one device over gloo", "data", args.device, "gloo", 2,
                     args.steps)]
    if args.device == "cuda":
        results.append(check("pipeline, world of one over nccl", "pipeline", "cuda", "nccl", 1,
                             args.steps))
    else:
        results.append(check("pipeline of two stages over gloo", "pipeline", "cpu", "gloo", 2,
                             args.steps))
    failed = sum(1 for failures in results if failures)
    print(f"gpu_torch_check: {len(results) - failed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
