"""A hang and partition watchdog for a PyTorch training loop: malleus's own (the C++ class the
trainer runs, watchdog/watchdog.h), so that a rank that stops answering (stopped, a hung device or
driver) or a host whose link went down ends the job within the watchdog's limit, with an error
that names the rank and its host, instead of leaving the others inside a gloo or NCCL collective
until the process group's timeout (30 minutes by default)::

    dist.init_process_group(...)                 # or malleus.torch.init_from_env()
    with malleus.torch.Watchdog("runs/r", floor_s=60) as watchdog:   # on every rank
        for step in range(steps):
            watchdog.step(step + 1)
            ...                                   # forward, backward, all-reduce, update

When a step outlasts max(floor_s, multiple x the median of this rank's earlier steps), the
watchdog thread of each waiting rank reads every rank's heartbeat (in <run_dir>/heartbeats: the
directory must be shared by the hosts), names the ranks that did not arrive (or, from its probes
between hosts, the hosts cut off), writes <run_dir>/hang.json and ends its process with status
``HANG_EXIT_CODE`` (87), after one line on stderr::

    error: [rank 0] watchdog: step 7 has taken 3.1 s, over its limit of 3.0 s; did not arrive:
    rank 2: no heartbeat for 3.2 s (pid 4242 on node1 is not running), last in step 7

``lost_ranks(run_dir)`` reads who was named, so a launcher can start the job again without them
(docs/python.md shows a loop).
"""

import json
import os
from typing import List, Optional

import torch.distributed as dist

from .. import _malleus

HANG_EXIT_CODE = _malleus.HANG_EXIT_CODE


class Watchdog:
    """Watches this rank's steps (see the module's documentation). One rank alone waits for nobody:
    then it does nothing. Construct it on every rank at the same point (rank 0 clears the previous
    job's heartbeats and report, and a barrier keeps the others' first heartbeats after that)."""

    def __init__(self, run_dir, floor_s: float = 120.0, multiple: float = 10.0,
                 cut_after_s: float = 3.0, network: str = "", rank: Optional[int] = None,
                 world_size: Optional[int] = None, group=None):
        if not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"malleus.torch.Watchdog: run_dir must be a path, got {run_dir!r}")
        if rank is None or world_size is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("malleus.torch.Watchdog: torch.distributed is not initialized "
                                   "(call init_process_group first, or give rank and world_size)")
            rank = dist.get_rank(group) if rank is None else rank
            world_size = dist.get_world_size(group) if world_size is None else world_size
        self.run_dir = os.fspath(run_dir)
        self.rank, self.world_size = int(rank), int(world_size)
        self._watchdog = None
        if self.world_size < 2:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        if self.rank == 0:
            _malleus.Watchdog.clear(self.run_dir)
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group)
        self._watchdog = _malleus.Watchdog(self.run_dir, self.rank, self.world_size,
                                           floor_s=float(floor_s), multiple=float(multiple),
                                           cut_after_s=float(cut_after_s), network=network)

    def step(self, step: int):
        """This rank begins step ``step``; the previous phase ended now."""
        self.enter("step", step)

    def enter(self, phase: str, step: int):
        """This rank begins ``phase`` ("step", "eval", "checkpoint", ...) of step ``step``: each
        phase has its own limit, from its own durations."""
        if self._watchdog is not None:
            self._watchdog.enter(str(phase), int(step))

    def limit_s(self, phase: str = "step") -> float:
        """The limit ``phase`` runs under now (0 when the watchdog does nothing)."""
        return self._watchdog.limit_s(phase) if self._watchdog is not None else 0.0

    def close(self):
        """Stops the watchdog's thread (before the process group goes)."""
        self._watchdog = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def hang_report(run_dir) -> Optional[dict]:
    """The watchdog's <run_dir>/hang.json, or None when no watchdog wrote one."""
    path = os.path.join(os.fspath(run_dir), "hang.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def lost_ranks(run_dir) -> List[int]:
    """The ranks the watchdog named (did not arrive, or on a host cut off); [] when none."""
    report = hang_report(run_dir)
    return list(report.get("lost_ranks", [])) if report else []
