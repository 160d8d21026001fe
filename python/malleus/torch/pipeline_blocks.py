"""The blocks a rank holds, and how a block moves between ranks with its state.

Every rank builds the whole list of blocks (the same way), so it knows every tensor's shape; it
keeps storage only for the blocks its plan gives it: a block it does not hold has its parameters
and buffers pointed at empty tensors (the Parameter objects stay, so hooks and names do too).

A switch of plans moves, block by block in model order, each block a rank newly holds from one
rank that held it: its parameters, its buffers, and every entry of ``optimizer.state`` of each of
its parameters (AdamW's moments and step, or whatever the optimizer keeps per parameter), after a
small header that describes that state. A rank that no longer holds a block frees it as soon as
the block's transfers are done, so at no point does a rank hold more than the blocks of its old
and its new range; nothing is packed into a buffer larger than one tensor.
"""

import pickle
from typing import Dict, Iterable, List, Sequence

import torch
import torch.distributed as dist


class Blocks:
    """The model's blocks on this rank: every block's tensors, storage for the held ones."""

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device):
        self.modules = list(blocks)
        self.device = device
        seen: Dict[int, int] = {}
        self.tensors: List[List[torch.Tensor]] = []  # per block: parameters, then buffers
        self.params: List[List[torch.nn.Parameter]] = []
        self.shapes: List[List[torch.Size]] = []
        for b, m in enumerate(self.modules):
            params = list(m.parameters())
            for p in params:
                if id(p) in seen:
                    raise ValueError(f"malleus.torch: blocks {seen[id(p)]} and {b} share a "
                                     "parameter (tied weights); each block must own its "
                                     "parameters, as each may live on another rank")
                seen[id(p)] = b
            self.params.append(params)
            self.tensors.append(params + list(m.buffers()))
            self.shapes.append([t.shape for t in self.tensors[-1]])
        self.held = set(range(len(self.modules)))

    def __len__(self):
        return len(self.modules)

    def release(self, b: int):
        """Frees block b's storage (and its gradients, views into a gradient buffer)."""
        for t in self.tensors[b]:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            t.grad = None
        self.held.discard(b)

    def allocate(self, b: int):
        """Gives block b storage of its shapes (uninitialised: to be received)."""
        for t, shape in zip(self.tensors[b], self.shapes[b]):
            t.data = torch.empty(shape, dtype=t.dtype, device=t.device)
        self.held.add(b)

    def bytes_held(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.held for t in self.tensors[b])

    def parameters(self, blocks: Iterable[int]) -> List[torch.nn.Parameter]:
        return [p for b in blocks for p in self.params[b]]


def _describe(state: dict):
    """The header of one parameter's optimizer state: per entry, a tensor's shape, dtype and
    device kind, or a plain value."""
    out = []
    for key, v in state.items():
        if isinstance(v, torch.Tensor):
            out.append((key, "tensor", tuple(v.shape), str(v.dtype).replace("torch.", ""),
                        v.device.type))
        else:
            out.append((key, "value", v))
    return out


class Mover:
    """Moves blocks with their optimizer state between ranks over point-to-point."""

    def __init__(self, blocks: Blocks, comm_device: torch.device):
        self.blocks = blocks
        self.comm_device = comm_device

    def _send(self, tensor: torch.Tensor, dst: int, works: list):
        t = tensor.detach().to(self.comm_device).contiguous()
        works.append((dist.isend(t, dst), t))

    def _recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        t = torch.empty(like.shape, dtype=like.dtype, device=self.comm_device)
        dist.irecv(t, src).wait()
        return t

    def send(self, b: int, dst: int, state: Dict, works: list):
        """Posts block b's tensors and its parameters' optimizer state to ``dst``."""
        header = pickle.dumps([_describe(state.get(p, {})) for p in self.blocks.params[b]])
        payload = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._send(torch.tensor([len(header)], dtype=torch.int64), dst, works)
        self._send(payload, dst, works)
        for t in self.blocks.tensors[b]:
            self._send(t, dst, works)
        for p in self.blocks.params[b]:
            for v in state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    self._send(v, dst, works)

    def receive(self, b: int, src: int, state: Dict):
        """Receives block b from ``src`` into fresh storage, and its optimizer state into
        ``state`` (parameter -> dict)."""
        n = int(self._recv(torch.empty(1, dtype=torch.int64), src).item())
        header = pickle.loads(bytes(self._recv(torch.empty(n, dtype=torch.uint8), src)
                                    .cpu().tolist()))
        self.blocks.allocate(b)
        for t in self.blocks.tensors[b]:
            if t.device == self.comm_device:
                dist.irecv(t.data, src).wait()
            else:
                got = self._recv(t, src)
                with torch.no_grad():
                    t.copy_(got)
        for p, entries in zip(self.blocks.params[b], header):
            s = {}
            for entry in entries:
                if entry[1] == "value":
                    s[entry[0]] = entry[2]
                    continue
                key, _, shape, dtype, kind = entry
                like = torch.empty(shape, dtype=getattr(torch, dtype))
                device = p.device if kind == p.device.type else torch.device(kind)
                s[key] = self._recv(like, src).to(device)
            if s:
                state[p] = s


def transfers(old_owners: List[List[int]], new_owners: List[List[int]]):
    """Per block, (source, destination) pairs: each new holder that did not hold the block gets
    it from one of its old holders, spread over them in turn. The same on every rank."""
    plan = []
    for b, (old, new) in enumerate(zip(old_owners, new_owners)):
        sources = sorted(old)
        receivers = [r for r in new if r not in old]
        plan.append([(sources[i % len(sources)], r) for i, r in enumerate(receivers)])
    return plan


def migrate(mover: Mover, rank: int, old_owners, new_owners, state: Dict) -> None:
    """Moves every block to its new holders, in model order, one block at a time; frees the
    blocks this rank no longer holds as soon as their transfers are done. ``state``: this rank's
    optimizer state (parameter -> dict), updated in place (entries of freed blocks dropped,
    received ones added). Collective over the ranks that send or receive."""
    new_mine = {b for b, owners in enumerate(new_owners) if rank in owners}
    for b, pairs in enumerate(transfers(old_owners, new_owners)):
        works: list = []
        for src, dst in pairs:
            if src == rank:
                mover.send(b, dst, state, works)
            elif dst == rank:
                mover.receive(b, src, state)
        for w, _ in works:
            w.wait()
        if b in mover.blocks.held and b not in new_mine:
            for p in mover.blocks.params[b]:
                state.pop(p, None)
            mover.blocks.release(b)
