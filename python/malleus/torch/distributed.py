"""torch.distributed set-up for malleus.torch: the process group from the environment (what
``python3 -m malleus.torch.run`` sets, or Slurm's variables under ``srun``), the device its
collectives use, and the broadcast of rank 0's text that carries the straggler loop's decision to
every rank."""

import datetime
import math
import os
from typing import Dict, Mapping, Optional

import torch
import torch.distributed as dist

from .._malleus import expand_hostlist

__all__ = ["init_from_env", "comm_device", "broadcast_text", "DEFAULT_TIMEOUT_S"]

# How long a collective waits for a rank that stopped answering before it fails on the others
# (the process group's timeout: its watchdog). A rank that exits fails them at once.
DEFAULT_TIMEOUT_S = 300.0

# MASTER_PORT under srun when none is given: this base plus (job id + step id) mod the span, the
# same number on every rank of a step and different for the steps of one job.
SLURM_PORT_BASE = 15000
SLURM_PORT_SPAN = 20000


def slurm_rendezvous(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """torch's rendezvous variables from Slurm's, for a rank that ``srun`` started: RANK from
    SLURM_PROCID, WORLD_SIZE from SLURM_NTASKS, LOCAL_RANK from SLURM_LOCALID, MASTER_ADDR the
    first host of the step's node list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, read by
    malleus's C++ host-list reader), MASTER_PORT ``SLURM_PORT_BASE + (SLURM_JOB_ID +
    SLURM_STEP_ID) % SLURM_PORT_SPAN``. Returns only the variables ``environ`` lacks; nothing
    when it holds torch's RANK already or no SLURM_PROCID (not under srun)."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env:
        return {}

    def need(name: str) -> str:
        value = env.get(name, "")
        if value == "":
            raise RuntimeError(f"malleus.torch: $SLURM_PROCID is set (a rank started by srun) "
                               f"but ${name} is not: cannot form the process group from "
                               f"Slurm's variables (or set MASTER_ADDR, MASTER_PORT, RANK and "
                               f"WORLD_SIZE)")
        return value

    def whole(name: str) -> int:
        value = need(name)
        if not value.isdigit():
            raise ValueError(f"malleus.torch: ${name} must be a non-negative integer, got "
                             f"{value!r}")
        return int(value)

    values = {"RANK": str(whole("SLURM_PROCID")), "WORLD_SIZE": str(whole("SLURM_NTASKS"))}
    if "SLURM_LOCALID" in env:
        values["LOCAL_RANK"] = str(whole("SLURM_LOCALID"))
    list_name = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    values["MASTER_ADDR"] = expand_hostlist(need(list_name), "$" + list_name)[0]
    step = env.get("SLURM_STEP_ID", "0")
    step_id = int(step) if step.isdigit() else 0  # the batch and extern steps have names
    values["MASTER_PORT"] = str(SLURM_PORT_BASE + (whole("SLURM_JOB_ID") + step_id) %
                                SLURM_PORT_SPAN)
    return {k: v for k, v in values.items() if k not in env}


def init_from_env(backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S):
    """torch.distributed.init_process_group from MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE
    (what ``python3 -m malleus.torch.run`` sets); under ``srun``, where those are absent, from
    Slurm's variables (``slurm_rendezvous``), which it puts in ``os.environ`` too. NCCL where
    CUDA is available, else gloo. ``timeout_s``: a collective that a rank does not join within
    it fails on the others with an error instead of waiting forever (docs/python.md)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"malleus.torch: timeout_s must be a positive number of seconds, got "
                         f"{timeout_s!r}")
    os.environ.update(slurm_rendezvous())
    for name, integer in (("MASTER_ADDR", False), ("MASTER_PORT", True), ("RANK", True),
                          ("WORLD_SIZE", True)):
        value = os.environ.get(name)
        if not value:
            raise RuntimeError(f"malleus.torch: ${name} is not set (start the ranks with "
                               "python3 -m malleus.torch.run or srun, or set MASTER_ADDR, "
                               "MASTER_PORT, RANK and WORLD_SIZE)")
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


def positive_int(name: str, value) -> int:
    """``value`` when it is a positive int (not a bool); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"malleus.torch: {name} must be a positive int, got {value!r}")
    return value


def check_wrapper_args(global_batch, micro_batch, total_steps=None):
    """The checks every malleus.torch wrapper makes of its arguments before any work:
    torch.distributed initialized, positive batch sizes (the global batch a multiple of the
    micro-batch) and, when given, a positive run length."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("malleus.torch: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group or "
                           "malleus.torch.init_from_env first)")
    positive_int("global_batch", global_batch)
    positive_int("micro_batch", micro_batch)
    if global_batch % micro_batch:
        raise ValueError(f"malleus.torch: global_batch {global_batch} is not a multiple of "
                         f"micro_batch {micro_batch}")
    if total_steps is not None:
        positive_int("total_steps", total_steps)


def comm_device(group=None) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under NCCL, else the
    CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_text(text: str, group=None) -> str:
    """Rank 0's ``text`` on every rank of ``group`` (the others pass anything, e.g. ""): the
    ``broadcast`` a ``malleus.StragglerLoop`` takes to make its decision collective."""
    device = comm_device(group)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    data = text.encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(length, root, group=group)
    n = int(length.item())
    if dist.get_rank(group) == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if n else \
            torch.empty(0, dtype=torch.uint8, device=device)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=device)
    if n:
        dist.broadcast(buf, root, group=group)
    return buf.cpu().numpy().tobytes().decode()
