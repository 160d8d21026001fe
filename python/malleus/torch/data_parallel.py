"""malleus.torch.DataParallel: straggler-resilient data parallelism over torch.distributed.

``DataParallel`` trains a plain ``torch.nn.Module`` with its optimizer on every rank of a process
group (gloo on CPU, NCCL on GPU). Each step:

1. every rank runs forward and backward on its share of the global batch (its micro-batches,
   consecutive in the global batch's order), timed without communication;
2. the gradients are summed across ranks in buckets (one all-reduce per bucket, after the
   backward) and divided by the number of loss units (tokens) in the whole global batch, so the
   update is that of one process on the global batch whatever the split;
3. the optimizer steps;
4. the rates and the decision come from malleus's C++ straggler loop (malleus.StragglerLoop:
   each rank against its own healthy speed; the planner's "data-parallel" strategy and the
   shared switch rule): when it switches, the next step runs the new split (down to no micro-batch for a
   hopeless rank, which then times a probe so that its recovery is seen, and back).

See docs/python.md.
"""

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

import malleus

from .plans import plan_of_split, split_of_plan

__all__ = ["DataParallel", "StepResult"]

# The C++ engine's idle probe: PROBE_REPEATS products of PROBE_SIZE x PROBE_SIZE fp32 matrices.
_PROBE_SIZE = malleus.PROBE_SIZE
_PROBE_REPEATS = malleus.PROBE_REPEATS


@dataclass
class StepResult:
    step: int
    loss: float                 # over the whole global batch: sum of losses / units
    units: int                  # loss units (tokens) in the global batch
    split: List[int]            # micro-batches per rank this step ran
    compute_s: List[float]      # per rank: forward + backward (or probe), no communication
    rates: List[float]          # the monitor's, after this step
    step_s: float               # wall time of the whole step on this rank
    decision: Optional[malleus.Decision] = None  # set when the controller was asked
    next_split: List[int] = field(default_factory=list)  # what the next step runs


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"malleus.torch: {name} must be a positive int, got {value!r}")
    return value


class DataParallel:
    """Data parallelism that re-plans around slow ranks (module docstring; docs/python.md).

    Every rank builds the same module and optimizer and calls ``step`` with the same arguments.

    ``global_batch`` samples per optimizer step in ``global_batch // micro_batch`` micro-batches;
    ``model_config``: the malleus model config (preset name, JSON file or dict) the cost model
    plans with and whose FLOP count the monitor divides times by; for a module that is not a
    LLaMA-style decoder give the nearest one: the split depends on the measured rates, the
    predicted times on this config and ``cluster``. ``total_steps``: the run's length (the
    controller's horizon is min(remaining steps, ``horizon_steps``)). ``replan=False`` keeps the
    split (measured all the same).
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 global_batch: int, micro_batch: int = 1, seq_len: Optional[int] = None,
                 model_config="demo", cluster="cpu-local", total_steps: Optional[int] = None,
                 replan: bool = True, monitor_window: int = 3, horizon_steps: int = 50,
                 hysteresis: float = 0.3, straggler_threshold: float = 1.2,
                 bucket_mb: float = 25.0, process_group=None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"malleus.torch: module must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"malleus.torch: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("malleus.torch: torch.distributed is not initialized (call "
                               "torch.distributed.init_process_group or "
                               "malleus.torch.init_from_env first)")
        _positive_int("global_batch", global_batch)
        _positive_int("micro_batch", micro_batch)
        if global_batch % micro_batch:
            raise ValueError(f"malleus.torch: global_batch {global_batch} is not a multiple of "
                             f"micro_batch {micro_batch}")
        if not bucket_mb > 0:
            raise ValueError(f"malleus.torch: bucket_mb must be positive, got {bucket_mb!r}")
        if total_steps is not None:
            _positive_int("total_steps", total_steps)
        self.module, self.optimizer = module, optimizer
        self.group = process_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.micro_batches = global_batch // micro_batch
        if self.micro_batches < self.world_size:
            raise ValueError(f"malleus.torch: {self.micro_batches} micro-batches cannot start "
                             f"on {self.world_size} ranks (give each at least one)")
        self.config = malleus.model_config(model_config)
        self.seq_len = seq_len if seq_len is not None else self.config["max_seq_len"]
        _positive_int("seq_len", self.seq_len)
        self.total_steps, self.horizon_steps = total_steps, horizon_steps
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.cuda = dist.get_backend(self.group) == "nccl"
        self.comm_device = torch.device("cuda", torch.cuda.current_device()) if self.cuda \
            else torch.device("cpu")
        # Every replica holds the whole model and optimizer state (no distributed optimizer).
        self.loop = malleus.StragglerLoop(
            plan_of_split(self._even_split(), micro_batch, self.config["num_layers"]),
            self.config, cluster=cluster, seq_len=self.seq_len, strategy="data-parallel",
            replan=replan, monitor_window=monitor_window,
            straggler_threshold=straggler_threshold, hysteresis=hysteresis,
            horizon_steps=horizon_steps, distributed_optimizer=False)
        self.steps = 0
        self._split = split_of_plan(self.loop.plan, self.world_size)
        self._probe = None
        self._make_buckets()
        # Replicas start equal: rank 0's parameters and buffers everywhere.
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, 0, group=self.group)

    # ---- the split ------------------------------------------------------------------------

    def _even_split(self):
        base, extra = divmod(self.micro_batches, self.world_size)
        return [base + (1 if r < extra else 0) for r in range(self.world_size)]

    @property
    def split(self) -> List[int]:
        """Micro-batches per rank of the next step."""
        return list(self._split)

    @property
    def plan(self) -> malleus.Plan:
        """The running split as a malleus plan (what the straggler loop runs)."""
        return self.loop.plan

    def set_split(self, split: Sequence[int]):
        """Runs ``split`` (micro-batches per rank) from the next step on. Every rank must call it
        with the same split. The controller may change it again when the rates move."""
        split = list(split)
        if len(split) != self.world_size or any(isinstance(m, bool) or not isinstance(m, int)
                                                or m < 0 for m in split):
            raise ValueError(f"malleus.torch: a split is {self.world_size} non-negative ints "
                             f"(micro-batches per rank), got {split!r}")
        if sum(split) != self.micro_batches:
            raise ValueError(f"malleus.torch: the split {split} has {sum(split)} micro-batches, "
                             f"the global batch {self.micro_batches}")
        self.loop.set_plan(plan_of_split(split, self.micro_batch, self.config["num_layers"]))
        self._split = split

    # ---- one step ---------------------------------------------------------------------------

    def step(self, data, loss_fn: Callable) -> StepResult:
        """One optimizer step on the global batch.

        ``data``: a callable ``data(first, count)`` returning the global batch's samples
        ``first .. first + count - 1``, or a tensor / tuple of tensors whose first dimension is
        the global batch (sliced). ``loss_fn(module, samples)`` returns ``(loss_sum, units)``:
        the loss summed over the micro-batch's loss units (tokens) and their number.
        """
        start = time.perf_counter()
        split = list(self._split)
        first = sum(split[:self.rank]) * self.micro_batch
        mine = split[self.rank]
        self._zero_gradients()
        loss_sum, units, seconds = self._compute(data, loss_fn, first, mine)
        # Every rank's seconds, the loss sum and the units travel with the gradients.
        stats = [0.0] * self._stats_len
        stats[0], stats[1] = loss_sum, units
        stats[2 + self.rank] = seconds
        stats = self._reduce(stats)
        total_units = int(round(stats[1]))
        if total_units <= 0:
            raise ValueError("malleus.torch: the global batch has no loss units (loss_fn "
                             "returned 0 units on every rank)")
        # Summed over every rank, so every rank finds the same and stops together; the model is
        # left as it was (the trainer's rule for a step that is not finite).
        finite = math.isfinite(stats[0]) and all(
            bool(torch.isfinite(flat[:n]).all()) for _, flat, n in self._buckets)
        if not finite:
            raise FloatingPointError(
                f"malleus.torch: step {self.steps + 1} is not finite (loss sum {stats[0]} over "
                f"{total_units} units; a gradient or the loss is NaN or infinite on some rank): "
                "the model was not updated")
        for _, flat, n in self._buckets:
            flat[:n].div_(total_units)
        self.optimizer.step()
        self.steps += 1
        compute_s = stats[2:]
        decision = self._observe(compute_s)
        rates = list(self.loop.rates)
        return StepResult(step=self.steps, loss=stats[0] / total_units, units=total_units,
                          split=split, compute_s=compute_s, rates=rates,
                          step_s=time.perf_counter() - start, decision=decision,
                          next_split=list(self._split))

    def _samples(self, data, first, count):
        if callable(data):
            return data(first, count)
        if isinstance(data, torch.Tensor):
            return data[first:first + count]
        if isinstance(data, (tuple, list)):
            return type(data)(t[first:first + count] for t in data)
        raise TypeError("malleus.torch: data must be a callable (first, count) -> samples, a "
                        f"tensor or a tuple of tensors, got {type(data).__name__}")

    def _compute(self, data, loss_fn, first, count):
        """Forward and backward of this rank's micro-batches, timed alone (no communication)."""
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        else:
            t0 = time.perf_counter()
        loss_sum, units = 0.0, 0
        for k in range(count):
            samples = self._samples(data, first + k * self.micro_batch, self.micro_batch)
            out = loss_fn(self.module, samples)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError("malleus.torch: loss_fn must return (loss_sum, units)")
            loss, n = out
            loss.backward()
            loss_sum += float(loss.detach())
            units += int(n)
        if count == 0:
            self._run_probe()
        if self.cuda:
            end.record()
            end.synchronize()
            seconds = begin.elapsed_time(end) / 1000.0
        else:
            seconds = time.perf_counter() - t0
        return loss_sum, units, seconds

    def _run_probe(self):
        """What an idle rank times so that the monitor sees it recover (the engine's probe)."""
        if self._probe is None:
            g = torch.Generator().manual_seed(0)
            a = torch.rand(_PROBE_SIZE, _PROBE_SIZE, generator=g).to(self.comm_device)
            self._probe = (a, a.clone(), torch.empty_like(a))
        a, b, c = self._probe
        for _ in range(_PROBE_REPEATS):
            torch.mm(a, b, out=c)

    def _make_buckets(self):
        """Flat gradient buckets of at most ``bucket_mb`` (one dtype and device each), every
        parameter's gradient a view into one, so that the reduction neither gathers nor scatters;
        the step's figures (loss, units, each rank's time and FLOPs) ride at the end of the last
        fp32 bucket, or in a small fp64 one of their own."""
        self._stats_len = 2 + self.world_size
        groups, current, size, key = [], [], 0, None
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            k = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            if current and (k != key or size + nbytes > self.bucket_bytes):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
            key = k
        if current:
            groups.append(current)
        last_fp32 = max((i for i, g in enumerate(groups) if g[0].dtype == torch.float32),
                        default=None)
        self._buckets, self._views = [], []
        for i, params in enumerate(groups):
            n = sum(p.numel() for p in params)
            extra = self._stats_len if i == last_fp32 else 0
            flat = torch.zeros(n + extra, dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for p in params:
                view = flat[offset:offset + p.numel()].view_as(p)
                p.grad = view
                self._views.append((p, view))
                offset += p.numel()
            self._buckets.append((params, flat, n))
        self._stats_bucket = self._buckets[last_fp32][1] if last_fp32 is not None else None

    def _zero_gradients(self):
        for _, flat, _ in self._buckets:
            flat.zero_()
        for p, view in self._views:
            p.grad = view  # what the caller or the optimizer may have replaced or dropped

    def _reduce(self, stats):
        """Sums every gradient and the step's figures over the ranks: one all-reduce per bucket,
        all in flight at once. Returns the summed figures."""
        for p, view in self._views:  # autograd accumulates into the views; a replaced gradient
            if p.grad is None:        # is copied back
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        separate = None
        if self._stats_bucket is not None:
            self._stats_bucket[-self._stats_len:] = torch.tensor(stats, dtype=torch.float32)
        else:
            separate = torch.tensor(stats, dtype=torch.float64, device=self.comm_device)
        try:
            works = [dist.all_reduce(flat, group=self.group, async_op=True)
                     for _, flat, _ in self._buckets]
            if separate is not None:
                works.append(dist.all_reduce(separate, group=self.group, async_op=True))
            for w in works:
                w.wait()
        except RuntimeError as e:
            # A peer that exited (its connection closed) or stopped answering (past the process
            # group's timeout): this rank stops too, saying so, rather than waiting.
            raise RuntimeError(
                f"malleus.torch: step {self.steps + 1}: the all-reduce of the gradients failed on "
                f"rank {self.rank} of {self.world_size}: another rank exited or did not answer "
                f"within the process group's timeout ({e})") from e
        summed = separate if separate is not None else self._stats_bucket[-self._stats_len:]
        return summed.double().cpu().tolist()

    def _broadcast_text(self, text: str) -> str:
        data = text.encode()
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.comm_device)
        dist.broadcast(length, 0, group=self.group)
        n = int(length.item())
        buf = torch.tensor(list(data), dtype=torch.uint8, device=self.comm_device) \
            if self.rank == 0 else torch.empty(n, dtype=torch.uint8, device=self.comm_device)
        if n:
            dist.broadcast(buf, 0, group=self.group)
        return bytes(buf.cpu().tolist()).decode()

    def _observe(self, compute_s):
        """The step into the straggler loop (malleus.StragglerLoop); a switch runs from the next
        step."""
        remaining = (self.total_steps - self.steps) if self.total_steps else None
        decision = self.loop.observe(self.steps, compute_s, remaining_steps=remaining,
                                     root=self.rank == 0, broadcast=self._broadcast_text)
        if decision is not None and decision.plan is not None:
            self._split = split_of_plan(decision.plan, self.world_size)
        return decision
