"""Gradient buckets reduced while the backward runs, for malleus.torch's data parallelism.

Every parameter's ``.grad`` is a view into a flat bucket of at most ``bucket_bytes`` (one dtype
and device each), so autograd accumulates the micro-batches of a step in place and a bucket is
one ``all_reduce`` with nothing gathered or scattered. Buckets follow the parameters in reverse
(about the order the backward produces their gradients). During the last micro-batch's backward
a hook on every parameter's gradient accumulator counts it in; a bucket whose parameters are all
in starts its all-reduce at once (asynchronously, so the backward goes on), and buckets start in
their order only, so every rank issues the same collectives in the same order whatever its
backward does, a rank without micro-batches included. The last bucket waits for the end of the
step and carries the step's figures (loss, units, every rank's compute seconds) at its end, so a
step needs no collective beyond the buckets; where it is not fp32 the figures go alone.

Weighting: the gradient of one process on the global batch is sum over micro-batches of
``u_k * grad(loss_k)`` / sum of ``u_k`` for losses that are means over their micro-batch's ``u_k``
units (tokens), or sum of ``grad(loss_k)`` / sum of ``u_k`` for summed losses. The buckets hold
sum_j u_j g_j / u_k while micro-batch k accumulates (rescaled by u_{k-1} / u_k between
micro-batches, not at all where the units are equal), are multiplied by the last u as they start
their all-reduce, and are divided by the global batch's units once summed."""

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

__all__ = ["GradientBuckets"]


class GradientBuckets:
    def __init__(self, parameters: List[torch.nn.Parameter], bucket_bytes: int, stats_len: int,
                 group, comm_device: torch.device, overlap: bool = True):
        self.group, self.comm_device, self.overlap = group, comm_device, overlap
        self.stats_len = stats_len
        params = [p for p in parameters if p.requires_grad]
        groups, current, size, key = [], [], 0, None
        for p in reversed(params):
            k = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            if current and (k != key or size + nbytes > bucket_bytes):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
            key = k
        if current:
            groups.append(current)
        self.carries_stats = bool(groups) and groups[-1][0].dtype == torch.float32
        self.flats, self.sizes, self.views = [], [], []   # per bucket; views: (param, view)
        self.bucket_of = []                                # per entry of self.views
        for b, members in enumerate(groups):
            n = sum(p.numel() for p in members)
            extra = stats_len if b == len(groups) - 1 and self.carries_stats else 0
            flat = torch.zeros(n + extra, dtype=members[0].dtype, device=members[0].device)
            offset = 0
            for p in members:
                self.views.append((p, flat[offset:offset + p.numel()].view_as(p)))
                self.bucket_of.append(b)
                offset += p.numel()
            self.flats.append(flat)
            self.sizes.append(n)
        self._accumulators = []  # autograd's gradient accumulators, kept alive with their hooks
        with torch.enable_grad():
            for i, (p, _) in enumerate(self.views):
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._hook(i))
                self._accumulators.append(acc)
        self._armed = False
        self._active = False  # between begin() and finish(): the hooks look after the grads
        self._works: List = []
        self._separate: Optional[torch.Tensor] = None

    # ---- a step ----------------------------------------------------------------------------

    def begin(self):
        """Zeroes the buckets and points every ``.grad`` at its view (what the caller or the
        optimizer may have replaced or dropped since)."""
        self._armed = False
        self._active = True
        self._works, self._separate = [], None
        self._pending = [0] * len(self.flats)
        for b in self.bucket_of:
            self._pending[b] += 1
        self._next = 0          # the next bucket to start
        self._seen = [False] * len(self.views)  # gradients in, in the last micro-batch
        self._last_units = 1.0
        for flat in self.flats:
            flat.zero_()
        for p, view in self.views:
            p.grad = view

    def rescale(self, factor: float):
        """Multiplies what the buckets hold (between micro-batches)."""
        for flat, n in zip(self.flats, self.sizes):
            flat[:n].mul_(factor)

    def arm(self, last_units: float):
        """The next backward is the step's last: its buckets start as they complete, multiplied
        by ``last_units`` first."""
        self._armed = True
        self._last_units = last_units

    def _hook(self, index: int) -> Callable:
        def on_accumulated(*_):
            if not self._active:  # a backward outside a step: not ours
                return
            p, view = self.views[index]
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                # The gradient was replaced (zero_grad(set_to_none=True) inside the step, say):
                # back into the bucket.
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
            if not self._armed:
                return
            if self._seen[index]:
                raise RuntimeError("malleus.torch: a second backward through the same parameters "
                                   "in a step's last micro-batch; its gradients are being reduced "
                                   "already (one backward per micro-batch)")
            self._seen[index] = True
            self._pending[self.bucket_of[index]] -= 1
            if self.overlap:
                self._start_ready()
        return on_accumulated

    def _start_ready(self):
        # In order, and never the last bucket (it carries the step's figures at the end).
        while self._next < len(self.flats) - 1 and self._pending[self._next] == 0:
            self._start(self._next)

    def _start(self, b: int):
        flat, n = self.flats[b], self.sizes[b]
        if self._last_units != 1.0:
            flat[:n].mul_(self._last_units)
        self._works.append(dist.all_reduce(flat, group=self.group, async_op=True))
        self._next = b + 1

    def finite(self) -> bool:
        """Whether every reduced gradient is finite (the same answer on every rank)."""
        return all(bool(torch.isfinite(flat[:n]).all()) for flat, n in zip(self.flats, self.sizes))

    def finish(self, stats: List[float], units_total_index: int) -> List[float]:
        """Starts what has not started (in order; the figures with the last bucket), waits for
        every bucket, divides the gradients by the global batch's units (``stats`` summed at
        ``units_total_index``) and returns the summed figures."""
        self._armed = self._active = False
        if self.carries_stats:
            self.flats[-1][-self.stats_len:] = torch.tensor(stats, dtype=torch.float32)
        else:
            self._separate = torch.tensor(stats, dtype=torch.float64, device=self.comm_device)
        while self._next < len(self.flats):
            self._start(self._next)
        if self._separate is not None:
            self._works.append(dist.all_reduce(self._separate, group=self.group, async_op=True))
        for w in self._works:
            w.wait()
        # Done with: a finished gloo work kept to the interpreter's exit outlives its process
        # group, and its destruction then can abort the process.
        self._works = []
        summed = self._separate if self._separate is not None else \
            self.flats[-1][-self.stats_len:]
        summed = summed.double().cpu().tolist()
        units = summed[units_total_index]
        if units > 0:
            for flat, n in zip(self.flats, self.sizes):
                flat[:n].div_(units)
        return summed
