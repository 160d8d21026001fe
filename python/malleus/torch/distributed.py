"""torch.distributed set-up for malleus.torch: the process group from the environment
(what ``python3 -m malleus.torch.run`` sets)."""

from typing import Optional

import torch
import torch.distributed as dist


def init_from_env(backend: Optional[str] = None):
    """torch.distributed.init_process_group from MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
    (what ``python3 -m malleus.torch.run`` sets); NCCL where CUDA is available, else gloo."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, init_method="env://")
