"""malleus.torch.DataParallel: data parallelism shaped like DistributedDataParallel, that moves
micro-batches off slow ranks.

Wrap the module; keep the loop: every rank takes the same global batch, iterates over
``model.micro_batches(batch)`` (this rank's micro-batches of it, consecutive in the global batch's
order), calls ``loss.backward()`` on each, then ``optimizer.step()``. Per step:

1. the gradients accumulate in flat buckets; during the last micro-batch's backward each bucket
   starts its all-reduce as soon as its gradients are in (buckets.py), overlapping the backward;
2. the rank's compute is timed from its first micro-batch to the end of its last, with no wait in
   it (a rank given no micro-batch times the C++ engine's idle probe instead);
3. at the end of the iteration the sums are in: divided by the loss units (tokens) of the whole
   global batch, so the update is that of one process on the global batch whatever the split,
   and every ``.grad`` holds it for the optimizer, gradient clipping or a ZeroRedundancyOptimizer;
4. every rank's time goes into malleus's straggler loop (malleus.StragglerLoop, the C++
   trainer's: each rank against its own healthy speed, the planner's "data-parallel" strategy
   and the shared switch rule); when it switches, the next step runs the new split, down to no
   micro-batch for a hopeless rank and back.

See docs/python.md.
"""

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

import malleus

from .buckets import GradientBuckets
from .distributed import broadcast_text, check_wrapper_args, comm_device, positive_int
from .plans import plan_of_split, split_of_plan
from .timing import ComputeTimer, IdleProbe

__all__ = ["DataParallel", "StepResult"]


@dataclass
class StepResult:
    step: int
    loss: float                 # over the whole global batch (sum / units); NaN when not known
    units: int                  # loss units (tokens) in the global batch
    split: List[int]            # micro-batches per rank this step ran
    compute_s: List[float]      # per rank: its micro-batches' forward and backward (or probe)
    rates: List[float]          # the straggler loop's, after this step
    step_s: float               # wall time of the step on this rank, from its first micro-batch
    decision: Optional[malleus.Decision] = None  # when the controller was asked
    next_split: List[int] = field(default_factory=list)  # what the next step runs


# The step's figures summed over the ranks: the loss sum, the units, the ranks that counted their
# loss (note_loss, step), then every rank's seconds.
_LOSS, _UNITS, _NOTED, _SECONDS = 0, 1, 2, 3


class DataParallel(torch.nn.Module):
    """Data parallelism that re-plans around slow ranks (module docstring; docs/python.md).

    ``global_batch`` samples per optimizer step in ``global_batch // micro_batch`` micro-batches.
    ``units(micro_batch) -> int``: the loss units (tokens) a micro-batch's loss averages over;
    None: every micro-batch counts the same. ``loss_reduction``: "mean" (the loss is a mean over
    its micro-batch's units: ``F.cross_entropy``'s default) or "sum". ``model_config``: the
    malleus model config the cost model plans with and whose FLOP count the loop divides times
    by; for a module that is not a LLaMA-style decoder give the nearest one (the split follows
    the measured rates; the predicted times follow this config and ``cluster``).
    ``total_steps``: the run's length (the controller's horizon is min(remaining steps,
    ``horizon_steps``)). ``replan=False`` keeps the split (measured all the same).
    ``overlap=False`` starts every bucket after the backward. ``optimizer``: only for ``step``.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 *, global_batch: int, micro_batch: int = 1, seq_len: Optional[int] = None,
                 units: Optional[Callable] = None, loss_reduction: str = "mean",
                 model_config="demo", cluster="cpu-local", total_steps: Optional[int] = None,
                 replan: bool = True, monitor_window: int = 3, horizon_steps: int = 50,
                 hysteresis: float = 0.3, straggler_threshold: float = 1.2,
                 bucket_mb: float = 25.0, overlap: bool = True, process_group=None):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"malleus.torch: module must be a torch.nn.Module, got "
                            f"{type(module).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"malleus.torch: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        check_wrapper_args(global_batch, micro_batch, total_steps)
        if not bucket_mb > 0:
            raise ValueError(f"malleus.torch: bucket_mb must be positive, got {bucket_mb!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"malleus.torch: loss_reduction is \"mean\" or \"sum\", got "
                             f"{loss_reduction!r}")
        if units is not None and not callable(units):
            raise TypeError("malleus.torch: units must be a callable (micro_batch) -> int")
        self.module, self.optimizer = module, optimizer
        self.group = process_group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.micro_batch_count = global_batch // micro_batch
        if self.micro_batch_count < self.world_size:
            raise ValueError(f"malleus.torch: {self.micro_batch_count} micro-batches cannot start "
                             f"on {self.world_size} ranks (give each at least one)")
        self.units_fn, self.loss_reduction = units, loss_reduction
        self.config = malleus.model_config(model_config)
        self.seq_len = seq_len if seq_len is not None else self.config["max_seq_len"]
        positive_int("seq_len", self.seq_len)
        self.total_steps, self.horizon_steps = total_steps, horizon_steps
        self.comm_device = comm_device(self.group)
        # Where the module computes, whatever the group's backend: its compute is timed there
        # (CUDA events on a GPU) and an idle rank's probe runs there.
        first = next(module.parameters(), None)
        self.device = first.device if first is not None else self.comm_device
        # Every replica holds the whole model and optimizer state (no distributed optimizer).
        self.loop = malleus.StragglerLoop(
            plan_of_split(self._even_split(), micro_batch, self.config["num_layers"]),
            self.config, cluster=cluster, seq_len=self.seq_len, strategy="data-parallel",
            replan=replan, monitor_window=monitor_window,
            straggler_threshold=straggler_threshold, hysteresis=hysteresis,
            horizon_steps=horizon_steps, distributed_optimizer=False)
        self.steps = 0
        self.last: Optional[StepResult] = None   # the last step's figures
        self._split = split_of_plan(self.loop.plan, self.world_size)
        self._probe: Optional[IdleProbe] = None
        self._in_step = False
        self._buckets = GradientBuckets(list(module.parameters()), int(bucket_mb * 1024 * 1024),
                                        _SECONDS + self.world_size, self.group, self.comm_device,
                                        overlap)
        # Replicas start equal: rank 0's parameters and buffers everywhere.
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, dist.get_global_rank(self.group, 0)
                               if self.group is not None else 0, group=self.group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """DistributedDataParallel's, for loops written for it: nothing to do here (gradients
        are reduced during the last micro-batch's backward only)."""
        yield

    # ---- the split ------------------------------------------------------------------------

    def _even_split(self):
        base, extra = divmod(self.micro_batch_count, self.world_size)
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
        if sum(split) != self.micro_batch_count:
            raise ValueError(f"malleus.torch: the split {split} has {sum(split)} micro-batches, "
                             f"the global batch {self.micro_batch_count}")
        self.loop.set_plan(plan_of_split(split, self.micro_batch, self.config["num_layers"]))
        self._split = split

    # ---- one step ---------------------------------------------------------------------------

    def micro_batches(self, data) -> Iterator:
        """One optimizer step's micro-batches for this rank: iterate, run forward and
        ``loss.backward()`` on each; when the iteration ends every ``.grad`` holds the global
        batch's gradient. ``data``: the global batch (the same on every rank) as a tensor or a
        tuple/list of tensors whose first dimension is the sample, or a callable
        ``data(first, count)`` returning samples ``first .. first + count - 1`` of it (so a rank
        loads only its own)."""
        return self._micro_batches(data, None)

    def _micro_batches(self, data, tally):
        if self._in_step:
            raise RuntimeError("malleus.torch: a step's micro_batches() began before the last "
                               "one ended (iterate each to its end)")
        self._in_step = True
        try:
            split = list(self._split)
            first = sum(split[:self.rank]) * self.micro_batch
            mine = split[self.rank]
            start = time.perf_counter()
            timer = ComputeTimer(self.device)
            self._buckets.begin()
            timer.start()
            units, previous = 0, None
            self._losses = {"loss": 0.0, "known": False}
            for k in range(mine):
                samples = self._samples(data, first + k * self.micro_batch, self.micro_batch)
                u = self._units_of(samples) if tally is None else 1
                weight = u if self.loss_reduction == "mean" and tally is None else 1
                if previous is not None and previous != weight:
                    self._buckets.rescale(previous / weight)
                previous = weight
                if k == mine - 1:
                    self._buckets.arm(weight)
                units += u
                self._loss_weight = u if self.loss_reduction == "mean" else 1
                yield samples
            if mine == 0:
                self._run_probe()
            seconds = timer.stop()
            stats = [0.0] * (_SECONDS + self.world_size)
            if tally is not None:
                stats[_LOSS], units = tally["loss"], tally["units"]
            else:
                stats[_LOSS] = self._losses["loss"]
            stats[_UNITS] = units
            stats[_SECONDS + self.rank] = seconds
            stats[_NOTED] = 1.0 if tally is not None or self._losses["known"] else 0.0
            try:
                summed = self._buckets.finish(stats, _UNITS)
            except RuntimeError as e:
                # A peer that exited (its connection closed) or stopped answering (past the
                # process group's timeout): this rank stops too, saying so, rather than waiting.
                raise RuntimeError(
                    f"malleus.torch: step {self.steps + 1}: the all-reduce of the gradients failed "
                    f"on rank {self.rank} of {self.world_size}: another rank exited or did not "
                    f"answer within the process group's timeout ({e})") from e
            self._end_step(split, summed, start)
        finally:
            self._in_step = False

    def note_loss(self, loss):
        """Optional, inside ``micro_batches``: counts this micro-batch's loss into the step's loss
        over the whole global batch (``last.loss``), weighted as its gradient is."""
        if not self._in_step:
            raise RuntimeError("malleus.torch: note_loss() belongs inside a step's micro_batches()")
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._losses["loss"] += value * self._loss_weight
        self._losses["known"] = True

    def _units_of(self, samples) -> int:
        if self.units_fn is None:
            return 1
        u = self.units_fn(samples)
        u = int(u.item()) if isinstance(u, torch.Tensor) else u
        if isinstance(u, bool) or not isinstance(u, int) or u < 0:
            raise ValueError(f"malleus.torch: units(micro_batch) must be a non-negative int, got "
                             f"{u!r}")
        return u

    def _end_step(self, split, summed, start):
        total_units = int(round(summed[_UNITS]))
        if total_units <= 0:
            raise ValueError("malleus.torch: the global batch has no loss units (units() "
                             "returned 0 for every micro-batch)")
        # Summed over every rank, so every rank finds the same and raises together, before the
        # optimizer steps: the model is left as it was (the C++ trainer's rule for such a step).
        if (summed[_NOTED] > 0 and not math.isfinite(summed[_LOSS])) or \
                not self._buckets.finite():
            raise FloatingPointError(
                f"malleus.torch: step {self.steps + 1} is not finite (loss sum {summed[_LOSS]} "
                f"over {total_units} units; a gradient or the loss is NaN or infinite on some "
                "rank): the model was not updated")
        self.steps += 1
        compute_s = summed[_SECONDS:]
        remaining = (self.total_steps - self.steps) if self.total_steps else None
        decision = self.loop.observe(self.steps, compute_s, remaining_steps=max(0, remaining)
                                     if remaining is not None else None, root=self.rank == 0,
                                     broadcast=lambda text: broadcast_text(text, self.group))
        if decision is not None and decision.plan is not None:
            self._split = split_of_plan(decision.plan, self.world_size)
        loss = summed[_LOSS] / total_units if summed[_NOTED] > 0 else math.nan
        self.last = StepResult(step=self.steps, loss=loss, units=total_units, split=split,
                               compute_s=compute_s, rates=list(self.loop.rates),
                               step_s=time.perf_counter() - start, decision=decision,
                               next_split=list(self._split))

    def step(self, data, loss_fn: Callable) -> StepResult:
        """One optimizer step on the global batch, the loop written for you: ``loss_fn(module,
        samples)`` returns ``(loss_sum, units)``, the loss summed over the micro-batch's loss
        units (tokens) and their number; then the optimizer given at construction steps."""
        if self.optimizer is None:
            raise RuntimeError("malleus.torch: step() needs the optimizer given to DataParallel")
        tally = {"loss": 0.0, "units": 0}
        for samples in self._micro_batches(data, tally):
            out = loss_fn(self.module, samples)
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError("malleus.torch: loss_fn must return (loss_sum, units)")
            loss, n = out
            loss.backward()
            tally["loss"] += float(loss.detach())
            tally["units"] += int(n)
        self.optimizer.step()
        return self.last

    def _samples(self, data, first, count):
        if callable(data):
            return data(first, count)
        if isinstance(data, torch.Tensor):
            return data[first:first + count]
        if isinstance(data, (tuple, list)):
            return type(data)(t[first:first + count] for t in data)
        raise TypeError("malleus.torch: data must be a callable (first, count) -> samples, a "
                        f"tensor or a tuple of tensors, got {type(data).__name__}")

    def _run_probe(self):
        """What an idle rank times so that the loop sees it recover (the engine's probe)."""
        if self._probe is None:
            self._probe = IdleProbe(self.device)
        self._probe.run()
