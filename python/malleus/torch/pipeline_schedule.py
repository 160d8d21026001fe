"""One pipeline stage's step: the 1F1B schedule (malleus's runtime/schedule.h, Megatron-LM's
order) over torch.distributed point-to-point with the stages before and after.

Stage s of S first runs min(S - s - 1, m) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. A forward's output and the gradient coming back
for an earlier micro-batch cross in one batched exchange (``dist.batch_isend_irecv``), so that
NCCL, which runs a pair's transfers in the order posted, cannot deadlock, as in Megatron-LM. An
activation is sent after a fixed-size header (dtype, shape, whether it needs a gradient), so
blocks may return any shape; a gradient's shape is its activation's. Sends are waited for at the
end of the step, receives when their data is needed. Only ``isend``, ``irecv``, ``P2POp`` and
``batch_isend_irecv``: torch.distributed APIs of 1.13 and 2.x alike.
"""

from collections import deque
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # dtype, needs a gradient, number of dimensions, the dimensions


class Peers:
    """Point-to-point with the stage before (``prev``) and after (``next``) in one pipeline."""

    def __init__(self, prev: Optional[int], next: Optional[int], device: torch.device):
        self.prev, self.next, self.device = prev, next, device
        self._sends: List = []  # (work, tensor): kept alive until the end of the step

    def _header(self, t: torch.Tensor, needs_gradient: bool) -> torch.Tensor:
        if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
            raise TypeError(f"malleus.torch: a block returned a {t.dtype} tensor of {t.dim()} "
                            f"dimensions; stages exchange tensors of up to {_MAX_DIMS} dimensions "
                            f"of {', '.join(str(d) for d in _DTYPES)}")
        h = [_DTYPES.index(t.dtype), int(needs_gradient), t.dim()] + list(t.shape)
        h += [0] * (_HEADER - len(h))
        return torch.tensor(h, dtype=torch.int64, device=self.device)

    def _post(self, ops) -> List:
        if not ops:
            return []
        works = dist.batch_isend_irecv([dist.P2POp(op, t, peer) for op, t, peer in ops])
        receives = []
        for (op, t, _), w in zip(ops, works):
            (receives if op is dist.irecv else self._sends).append((w, t))
        return receives

    def exchange(self, send_next: Optional[torch.Tensor] = None, recv_prev: bool = False,
                 send_prev: Optional[torch.Tensor] = None,
                 recv_next: Optional[torch.Tensor] = None):
        """Sends an activation to the next stage and/or a gradient to the previous one, and
        receives an activation from the previous stage (``recv_prev``) and/or a gradient from the
        next one (into ``recv_next``, an empty tensor of its shape). The neighbour calls the
        mirror image. Returns (activation or None, gradient or None)."""
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        first = []
        if send_next is not None:
            header_out = self._header(send_next, send_next.requires_grad)
            send_next = send_next.detach().contiguous()
            first.append((dist.isend, header_out, self.next))
        if recv_next is not None:
            first.append((dist.irecv, recv_next, self.next))
        if send_prev is not None:
            first.append((dist.isend, send_prev.contiguous(), self.prev))
        if recv_prev:
            first.append((dist.irecv, header, self.prev))
        for w, _ in self._post(first):
            w.wait()
        second, activation = [], None
        if send_next is not None:
            second.append((dist.isend, send_next, self.next))
        if recv_prev:
            h = header.tolist()
            activation = torch.empty(h[3:3 + h[2]], dtype=_DTYPES[h[0]], device=self.device)
            second.append((dist.irecv, activation, self.prev))
        for w, _ in self._post(second):
            w.wait()
        if activation is not None and h[1]:
            activation.requires_grad_(True)
        return activation, recv_next

    def finish(self):
        """Waits for every send of the step."""
        for w, _ in self._sends:
            w.wait()
        self._sends = []


def _gradient_buffer(output: torch.Tensor, last: bool) -> Optional[torch.Tensor]:
    """Where the next stage's gradient for ``output`` lands (None: none comes)."""
    if last or not output.requires_grad:
        return None
    return torch.empty_like(output, memory_format=torch.contiguous_format)


def one_f_one_b(peers: Peers, stage: int, num_stages: int, micro_batches: int,
                inputs: Callable[[int], object], forward: Callable, backward: Callable):
    """Runs this stage's micro-batches in 1F1B order. ``inputs(k)``: the first stage's input of
    micro-batch k. ``forward(k, x)``: the stage's output (on the last stage, the loss to run the
    backward from). ``backward(x, y, g)``: runs the backward of output y with gradient g (None on
    the last stage) and returns the gradient to send back for input x, or None."""
    first, last = stage == 0, stage == num_stages - 1
    warmup = min(num_stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    held = deque()  # (input, output) of the micro-batches between their forward and backward

    def receive(k):
        return inputs(k) if first else peers.exchange(recv_prev=True)[0]

    for k in range(warmup):
        x = receive(k)
        y = forward(k, x)
        peers.exchange(send_next=y)
        held.append((x, y))
    x = receive(warmup) if steady > 0 else None
    for i in range(steady):
        k = warmup + i
        y = forward(k, x)
        held.append((x, y))
        x_old, y_old = held.popleft()
        g = None
        if not last:
            _, g = peers.exchange(send_next=y, recv_next=_gradient_buffer(y_old, last))
        dx = backward(x_old, y_old, g)
        if i == steady - 1:
            if not first:
                peers.exchange(send_prev=dx)
        elif first:
            x = inputs(k + 1)
        else:
            x, _ = peers.exchange(send_prev=dx, recv_prev=True)
    for _ in range(warmup):
        x_old, y_old = held.popleft()
        _, g = peers.exchange(recv_next=_gradient_buffer(y_old, last))
        dx = backward(x_old, y_old, g)
        if not first:
            peers.exchange(send_prev=dx)
    peers.finish()
