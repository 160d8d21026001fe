"""malleus.torch: malleus's straggler loop in a PyTorch training loop over torch.distributed.

Modules:

- ``data_parallel``: ``DataParallel`` (and its ``StepResult``), straggler-resilient data
  parallelism;
- ``pipeline``: ``PipelineParallel`` (and its ``PipelineStepResult``), pipeline (and data)
  parallelism over a model given as blocks, re-partitioned around slow ranks (``pipeline_plan``,
  ``pipeline_schedule``, ``pipeline_blocks``: the plan read as blocks, 1F1B, moving blocks);
- ``plans``: a data-parallel split and its malleus plan, both ways;
- ``distributed``: ``init_from_env``, the process group from the environment;
- ``run``: ``python3 -m malleus.torch.run``, the launcher of N local ranks;
- ``watchdog``: ``Watchdog``, which ends a job a rank or a host no longer answers, naming it.

See docs/python.md.
"""

import sys

try:
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
except ImportError as e:  # most often a python3 earlier on PATH than Debian's, which has torch
    raise ImportError(
        f"malleus.torch needs PyTorch, which {sys.executable} cannot import ({e}); Debian's is "
        "python3-torch (scripts/setup.sh), for /usr/bin/python3: run that interpreter "
        "(docs/python.md)") from e

from .data_parallel import DataParallel, StepResult  # noqa: E402
from .distributed import init_from_env  # noqa: E402
from .pipeline import PipelineParallel, PipelineStepResult  # noqa: E402
from .plans import plan_of_split, split_of_plan  # noqa: E402
from .watchdog import Watchdog  # noqa: E402

__all__ = ["DataParallel", "StepResult", "PipelineParallel", "PipelineStepResult", "Watchdog",
           "init_from_env", "split_of_plan", "plan_of_split"]
