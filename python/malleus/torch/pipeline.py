"""Pipeline parallelism that re-partitions itself around slow ranks, for a model handed over as
an ordered list of blocks.

``PipelineParallel`` runs any plan malleus's planner makes without tensor parallelism
(docs/plan-format.md): pipelines (data-parallel replicas) of unlike shape, each with its own
stages (a contiguous range of blocks on one rank each) and its own number of micro-batches, and
idle ranks. Each step:

1. every pipeline runs its micro-batches through its stages in 1F1B order over torch.distributed
   point-to-point (pipeline_schedule.py); each stage times its forwards and backwards alone, with
   no communication in the time;
2. each block's gradient is summed over the ranks that hold it (one per pipeline), the step's loss
   sum, loss units and every rank's compute time over the world, and the gradients are divided by
   the loss units of the whole global batch: the update of one process on the global batch;
3. each rank's optimizer steps on its own blocks;
4. the rates come from malleus's C++ monitor and the decision from its C++ controller with the
   planner's ``malleus`` strategy (layers per stage, stages per pipeline, micro-batches per
   pipeline; TP limited to 1 and no recomputation); when it switches, the blocks that change
   ranks move with their parameters, buffers and optimizer state, block by block
   (pipeline_blocks.py), before the next step.

See docs/python.md.
"""

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import malleus

from .distributed import broadcast_text, check_wrapper_args, comm_device, positive_int
from .pipeline_blocks import Blocks, Mover, migrate
from .pipeline_plan import BlockPlan, block_ends, even_plan
from .pipeline_schedule import Peers, one_f_one_b
from .timing import ComputeTimer, IdleProbe

__all__ = ["PipelineParallel", "PipelineStepResult"]


@dataclass
class PipelineStepResult:
    step: int
    loss: float                 # over the whole global batch: sum of losses / units
    units: int                  # loss units (tokens) in the global batch
    plan: str                   # the summary of the plan this step ran
    compute_s: List[float]      # per rank: its forwards and backwards (or probe), no waits
    rates: List[float]          # the monitor's, after this step
    step_s: float               # wall time of the whole step on this rank
    decision: Optional[malleus.Decision] = None  # set when the controller was asked
    switched: bool = False      # a new plan runs from the next step
    migrate_s: float = 0.0      # wall time of the switch (moving blocks, new groups)
    next_plan: str = ""         # the summary of the plan the next step runs


class PipelineParallel:
    """Pipeline (and data) parallelism over torch.distributed that re-partitions itself around
    slow ranks (module docstring; docs/python.md).

    Every rank builds the same ``blocks`` (an ordered list of modules, each taking the previous
    one's output tensor; rank 0's values are broadcast at the start) and passes the same
    arguments. ``optimizer(params)`` builds an optimizer over a list of parameters (called again
    for a rank's new blocks after a switch, whose state then carries over). ``loss_fn(output,
    targets)`` on the last block's output returns ``(loss_sum, units)``: the loss summed over the
    micro-batch's loss units (tokens) and their number.

    ``model_config``: the malleus model config the planner splits (its ``num_layers`` layers are
    the blocks, or the blocks between an embedding block and a head block) and whose FLOP count
    the loop divides times by; for a model that is not a LLaMA-style decoder give the nearest.
    None: ``demo``'s, with ``len(blocks) - 2`` layers (an embedding, the layers, a head).
    ``plan``: the plan to start from (``malleus.Plan``, its JSON form, or a ``malleus.plan``
    result); default, one pipeline over every rank, layers split evenly. ``replan=False`` keeps
    the plan (measured all the same); ``set_plan`` imposes one.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], optimizer: Callable,
                 loss_fn: Callable, *, global_batch: int, micro_batch: int = 1,
                 seq_len: Optional[int] = None, model_config=None, plan=None,
                 cluster="cpu-local", total_steps: Optional[int] = None, replan: bool = True,
                 monitor_window: int = 3, horizon_steps: int = 50, hysteresis: float = 0.3,
                 straggler_threshold: float = 1.2):
        self._check_arguments(blocks, optimizer, loss_fn, global_batch, micro_batch, total_steps)
        self.optimizer_factory, self.loss_fn = optimizer, loss_fn
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.global_batch, self.micro_batch = global_batch, micro_batch
        if model_config is None:
            model_config = dict(malleus.model_config("demo"), num_layers=max(1, len(blocks) - 2))
        self.config = malleus.model_config(model_config)
        self.seq_len = positive_int("seq_len", seq_len if seq_len is not None
                                    else self.config["max_seq_len"])
        block_ends(len(blocks), self.config["num_layers"])
        self.total_steps, self.horizon_steps = total_steps, horizon_steps
        self.device = comm_device()
        self.blocks = Blocks(blocks, self.device)
        self._check_devices()
        self._mover = Mover(self.blocks, self.device)
        self._groups: Dict[Tuple[int, ...], object] = {}
        self._plan: Optional[BlockPlan] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.steps = 0
        self._probe: Optional[IdleProbe] = None
        first = self._block_plan(plan if plan is not None else even_plan(
            self.config, self.world_size, global_batch, micro_batch))
        with torch.no_grad():  # replicas start equal: rank 0's values everywhere
            for tensors in self.blocks.tensors:
                for t in tensors:
                    dist.broadcast(t.data, 0)
        # malleus's straggler loop (the C++ trainer's): the "malleus" strategy re-plans layers per
        # stage, stages per pipeline and micro-batches per pipeline; one rank per stage, no
        # recomputation, each stage holding its blocks' whole optimizer state.
        self.loop = malleus.StragglerLoop(
            first.plan, self.config, cluster=cluster, seq_len=self.seq_len, strategy="malleus",
            replan=replan and self.world_size > 1, monitor_window=monitor_window,
            straggler_threshold=straggler_threshold, hysteresis=hysteresis,
            horizon_steps=horizon_steps, distributed_optimizer=False, recompute=False, max_tp=1)
        self._install(first)

    @staticmethod
    def _check_arguments(blocks, optimizer, loss_fn, global_batch, micro_batch, total_steps):
        if isinstance(blocks, torch.nn.Module) and not isinstance(blocks, (
                torch.nn.Sequential, torch.nn.ModuleList)):
            raise TypeError("malleus.torch: blocks must be a sequence of torch.nn.Module (the "
                            "model cut into blocks), got one module")
        blocks = list(blocks) if isinstance(blocks, (list, tuple, torch.nn.Sequential,
                                                     torch.nn.ModuleList)) else None
        if not blocks or not all(isinstance(b, torch.nn.Module) for b in blocks):
            raise TypeError("malleus.torch: blocks must be a non-empty sequence of "
                            "torch.nn.Module")
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("malleus.torch: optimizer must be a function params -> "
                            "torch.optim.Optimizer (called for each rank's blocks), got "
                            f"{type(optimizer).__name__}")
        if not callable(loss_fn):
            raise TypeError("malleus.torch: loss_fn must be a function (output, targets) -> "
                            "(loss_sum, units)")
        check_wrapper_args(global_batch, micro_batch, total_steps)

    def _check_devices(self):
        for b, tensors in enumerate(self.blocks.tensors):
            for t in tensors:
                if t.device != self.device:
                    raise ValueError(f"malleus.torch: block {b} has a tensor on {t.device}; "
                                     f"the {dist.get_backend()} backend runs on {self.device}: "
                                     "move the blocks there first")

    # ---- plans ------------------------------------------------------------------------------

    def _block_plan(self, plan) -> BlockPlan:
        return BlockPlan(plan, self.config, len(self.blocks), self.world_size, self.global_batch,
                         self.micro_batch)

    @property
    def plan(self) -> malleus.Plan:
        """The running plan (``to_dict()``: its JSON form)."""
        return self._plan.plan

    @property
    def held_blocks(self) -> range:
        """The blocks this rank holds (empty when idle)."""
        return self._plan.roles[self.rank].blocks

    @property
    def blocks_per_rank(self) -> List[range]:
        """The blocks every rank holds under the running plan (empty ranges: idle ranks)."""
        return [r.blocks for r in self._plan.roles]

    def set_plan(self, plan: dict) -> float:
        """Runs ``plan`` from the next step: the blocks that change ranks move now, with their
        optimizer state. Collective: every rank calls it with the same plan. Returns the
        switch's wall time."""
        t0 = time.perf_counter()
        new = self._block_plan(plan)
        self.loop.set_plan(new.plan)
        self._install(new)
        return time.perf_counter() - t0

    def _install(self, new: BlockPlan):
        """Moves to ``new``: blocks (with optimizer state), reduction groups, the optimizer, the
        gradient buckets, the links to the neighbouring stages."""
        state = {}
        if self.optimizer is not None:
            held = set(self.blocks.parameters(self.held_blocks))
            state = {p: s for p, s in self.optimizer.state.items() if p in held and s}
        if self._plan is None:
            for b in range(len(self.blocks)):
                if self.rank not in new.owners[b]:
                    self.blocks.release(b)
        else:
            migrate(self._mover, self.rank, self._plan.owners, new.owners, state)
        for key in new.reduction_groups():  # every rank, in the same order
            if key not in self._groups:
                self._groups[key] = dist.new_group(list(key))
        old_optimizer, self._plan = self.optimizer, new
        role = new.roles[self.rank]
        self.optimizer = self._make_optimizer(role.blocks, state, old_optimizer)
        self._make_buckets(new, role.blocks)
        self._peers = Peers(role.prev, role.next, self.device)

    def _make_optimizer(self, blocks: range, state: dict, old):
        params = self.blocks.parameters(blocks)
        if not params:
            return None
        opt = self.optimizer_factory(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError("malleus.torch: the optimizer factory must return a "
                            f"torch.optim.Optimizer, got {type(opt).__name__}")
        for p in params:
            if p in state:
                opt.state[p] = state[p]
        if old is not None and len(old.param_groups) == len(opt.param_groups):
            for new_group, old_group in zip(opt.param_groups, old.param_groups):
                new_group.update({k: v for k, v in old_group.items() if k != "params"})
        return opt

    def _make_buckets(self, plan: BlockPlan, blocks: range):
        """One flat gradient buffer per set of ranks holding the same blocks (and dtype): every
        parameter's gradient a view into one, each buffer one all-reduce over its set."""
        groups: Dict[tuple, List[torch.nn.Parameter]] = {}
        for b in blocks:
            key = tuple(sorted(plan.owners[b]))
            for p in self.blocks.params[b]:
                if p.requires_grad:
                    groups.setdefault((key, p.dtype), []).append(p)
        self._buckets, self._views = [], []
        for (key, dtype), params in sorted(groups.items(), key=lambda kv: (kv[0][0],
                                                                           str(kv[0][1]))):
            flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=self.device)
            offset = 0
            for p in params:
                view = flat[offset:offset + p.numel()].view_as(p)
                p.grad = view
                self._views.append((p, view))
                offset += p.numel()
            self._buckets.append((key, flat))

    # ---- one step ---------------------------------------------------------------------------

    def step(self, data) -> PipelineStepResult:
        """One optimizer step on the global batch. ``data``: a callable ``data(first, count)``
        returning ``(inputs, targets)`` of the global batch's samples ``first .. first + count -
        1``, or a tuple ``(inputs, targets)`` of tensors whose first dimension is the global batch
        (sliced). The first stage feeds ``inputs`` to the first block; the last stage gives the
        last block's output and ``targets`` to ``loss_fn``."""
        start = time.perf_counter()
        summary, role = self._plan.summary, self._plan.roles[self.rank]
        for _, flat in self._buckets:
            flat.zero_()
        for p, view in self._views:
            p.grad = view
        loss_sum, units, seconds = self._compute(role, data)
        total_loss, total_units, compute_s = self._reduce(loss_sum, units, seconds)
        for _, flat in self._buckets:
            flat.div_(total_units)
        if self.optimizer is not None:
            self.optimizer.step()
        self.steps += 1
        remaining = max(0, self.total_steps - self.steps) if self.total_steps else None
        decision = self.loop.observe(self.steps, compute_s, remaining_steps=remaining,
                                     root=self.rank == 0, broadcast=broadcast_text)
        rates = list(self.loop.rates)
        migrate_s, switched = 0.0, decision is not None and decision.plan is not None
        if switched:  # the loop runs the new plan already; the blocks follow it now
            t0 = time.perf_counter()
            self._install(self._block_plan(decision.plan))
            migrate_s = time.perf_counter() - t0
            self.loop.note_migration_seconds(migrate_s)
        return PipelineStepResult(
            step=self.steps, loss=total_loss / total_units, units=total_units, plan=summary,
            compute_s=compute_s, rates=rates, step_s=time.perf_counter() - start,
            decision=decision, switched=switched, migrate_s=migrate_s,
            next_plan=self._plan.summary)

    def _samples(self, data, first: int, count: int):
        if callable(data):
            out = data(first, count)
        elif isinstance(data, (tuple, list)) and len(data) == 2:
            out = tuple(t[first:first + count] for t in data)
        else:
            raise TypeError("malleus.torch: data must be a callable (first, count) -> (inputs, "
                            f"targets) or a tuple (inputs, targets), got {type(data).__name__}")
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("malleus.torch: data(first, count) must return (inputs, targets)")
        return out

    def _compute(self, role, data):
        """This rank's share of the step: its stage's micro-batches in 1F1B order, or the idle
        probe. Returns (loss sum, loss units, compute seconds)."""
        timer = ComputeTimer(self.device)
        if role.idle:
            with timer:
                self._run_probe()
            return 0.0, 0, timer.total()
        modules = [self.blocks.modules[b] for b in role.blocks]
        last = role.stage == role.num_stages - 1
        losses: List[torch.Tensor] = []
        counted = [0]

        def sample(k):
            return self._samples(data, role.first_sample + k * self.micro_batch, self.micro_batch)

        def inputs(k):
            x = sample(k)[0]
            return x.to(self.device) if isinstance(x, torch.Tensor) else x

        def forward(k, x):
            targets = sample(k)[1] if last else None
            with timer:
                for m in modules:
                    x = m(x)
                if not last:
                    return x
                out = self.loss_fn(x, targets)
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise TypeError("malleus.torch: loss_fn must return (loss_sum, units)")
                loss, n = out
                losses.append(loss.detach())
                counted[0] += int(n)
                return loss

        def backward(x, y, g):
            with timer:
                if last:
                    y.backward()
                elif g is not None:
                    torch.autograd.backward(y, g)
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    return x.grad if x.grad is not None else torch.zeros_like(x)
            return None

        one_f_one_b(self._peers, role.stage, role.num_stages, role.micro_batches, inputs,
                    forward, backward)
        loss_sum = float(torch.stack(losses).double().sum()) if losses else 0.0
        return loss_sum, counted[0], timer.total()

    def _run_probe(self):
        """What an idle rank times so that the loop sees it recover (the C++ engine's probe)."""
        if self._probe is None:
            self._probe = IdleProbe(self.device)
        self._probe.run()

    def _reduce(self, loss_sum: float, units: int, seconds: float):
        """Sums each block's gradient over its holders and the step's figures over the world.
        Returns (loss sum, loss units, every rank's compute seconds). Raises on every rank alike
        when the loss or a gradient is not finite on some rank (before the optimizer runs)."""
        stats = torch.zeros(3 + self.world_size, dtype=torch.float64, device=self.device)
        # Whether this rank's own gradients are finite, summed with the figures over the world,
        # so that every rank knows of a NaN in blocks it does not hold.
        local_bad = not all(bool(torch.isfinite(flat).all()) for _, flat in self._buckets)
        stats[0], stats[1], stats[2], stats[3 + self.rank] = loss_sum, units, local_bad, seconds
        works = [dist.all_reduce(stats, async_op=True)]
        for key, flat in self._buckets:
            if len(key) > 1:
                works.append(dist.all_reduce(flat, group=self._groups[key], async_op=True))
        for w in works:
            w.wait()
        figures = stats.cpu().tolist()
        total_units = int(round(figures[1]))
        if total_units <= 0:
            raise ValueError("malleus.torch: the global batch has no loss units (loss_fn "
                             "returned 0 units on every pipeline)")
        if figures[2] > 0 or not math.isfinite(figures[0]) or not all(
                bool(torch.isfinite(flat).all()) for _, flat in self._buckets):
            raise FloatingPointError(
                f"malleus.torch: step {self.steps + 1} is not finite (loss sum {figures[0]} over "
                f"{total_units} units; a gradient or the loss is NaN or infinite on some rank): "
                "the model was not updated")
        return figures[0], total_units, figures[3:]

    # ---- the model, gathered ------------------------------------------------------------------

    def gather(self, dst: int = 0) -> Optional[List[Dict[str, torch.Tensor]]]:
        """Every block's ``state_dict`` on rank ``dst`` (None elsewhere), from the block's holder
        in the first pipeline, one block at a time: to save the model or compare it. Collective."""
        out = [] if self.rank == dst else None
        for b in range(len(self.blocks)):
            src = self._plan.owners[b][0]
            module = self.blocks.modules[b]
            if self.rank == dst:
                if src == dst:
                    out.append({k: v.detach().clone() for k, v in module.state_dict().items()})
                    continue
                sd = {}
                for (name, v), shape in zip(self._named_tensors(b), self.blocks.shapes[b]):
                    t = torch.empty(shape, dtype=v.dtype, device=self.device)
                    dist.recv(t, src)
                    sd[name] = t
                out.append(sd)
            elif self.rank == src and src != dst:
                for _, v in self._named_tensors(b):
                    dist.send(v.detach().contiguous(), dst)
        return out

    def _named_tensors(self, b: int):
        m = self.blocks.modules[b]
        return list(m.named_parameters()) + list(m.named_buffers())
