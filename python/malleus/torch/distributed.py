"""torch.distributed set-up for malleus.torch: the process group from the environment
(what ``python3 -m malleus.torch.run`` sets)."""

import datetime
import math
import os
from typing import Optional

import torch
import torch.distributed as dist

# How long a collective waits for a rank that stopped answering before it fails on the others
# (the process group's timeout: its watchdog). A rank that exits fails them at once.
DEFAULT_TIMEOUT_S = 300.0


def init_from_env(backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S):
    """torch.distributed.init_process_group from MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
    (what ``python3 -m malleus.torch.run`` sets); NCCL where CUDA is available, else gloo.
    ``timeout_s``: a collective that a rank does not join within it fails on the others with an
    error instead of waiting forever (docs/python.md)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"malleus.torch: timeout_s must be a positive number of seconds, got "
                         f"{timeout_s!r}")
    for name, integer in (("MASTER_ADDR", False), ("MASTER_PORT", True), ("RANK", True),
                          ("WORLD_SIZE", True)):
        value = os.environ.get(name)
        if not value:
            raise RuntimeError(f"malleus.torch: ${name} is not set (start the ranks with "
                               "python3 -m malleus.torch.run, or set MASTER_ADDR, MASTER_PORT, "
                               "RANK and WORLD_SIZE)")
        if integer and not value.isdigit():
            raise ValueError(f"malleus.torch: ${name} must be a non-negative integer, got "
                             f"{value!r}")
    if int(os.environ["RANK"]) >= int(os.environ["WORLD_SIZE"]):
        raise ValueError(f"malleus.torch: $RANK {os.environ['RANK']} is not below $WORLD_SIZE "
                         f"{os.environ['WORLD_SIZE']}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s))
