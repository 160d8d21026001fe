"""A malleus plan (docs/plan-format.md) read for a model handed over as blocks: which blocks each
rank holds, which ranks it exchanges activations with, which samples of the global batch its
pipeline runs, and which ranks hold each block (one per pipeline).

The planner plans ``num_layers`` layers (the malleus model config's). A model of as many blocks
maps layer i to block i; a model of ``num_layers + 2`` blocks has an embedding before the layers
and a head after them, held by the first and the last stage of every pipeline (as malleus's own
engine holds its embedding and LM head). The plan is checked by the C++ rules (``malleus.Plan``:
plan::validate), each rank's part is the C++ ``Plan.role``; here only what malleus.torch runs is
checked on top: one rank per stage (no tensor parallelism) and no activation recomputation.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import malleus

__all__ = ["BlockPlan", "Role", "block_ends", "even_plan"]


@dataclass(frozen=True)
class Role:
    """What one rank does under a plan."""
    pipeline: int = -1           # -1: idle (no stage names it)
    stage: int = 0
    num_stages: int = 0
    micro_batches: int = 0       # of its pipeline, per step
    first_sample: int = 0        # its pipeline's first sample in the global batch
    blocks: range = range(0)     # the blocks it holds, in order
    prev: Optional[int] = None   # rank of the stage before (None on the first stage)
    next: Optional[int] = None   # rank of the stage after (None on the last stage)

    @property
    def idle(self) -> bool:
        return self.pipeline < 0


def _error(message: str) -> ValueError:
    return ValueError(f"malleus.torch: {message}")


class BlockPlan:
    """``plan`` (a ``malleus.Plan``, its JSON form, a JSON file or a ``malleus.plan()`` result) for
    ``num_blocks`` blocks of a model the planner knows as ``config``, checked for a job of
    ``world_size`` ranks, ``global_batch`` samples in micro-batches of ``micro_batch``. Raises
    ``malleus.Error`` (the C++ rules), or ``ValueError``/``TypeError`` naming what is wrong."""

    def __init__(self, plan, config: dict, num_blocks: int, world_size: int,
                 global_batch: int, micro_batch: int):
        if isinstance(plan, dict) and "plan" in plan and "pipelines" not in plan:
            plan = plan["plan"]  # malleus.plan()'s result
        if not isinstance(plan, (dict, str, malleus.Plan)):
            raise TypeError(f"malleus.torch: a plan is a malleus.Plan, a dict in the JSON form "
                            f"of docs/plan-format.md or a JSON file, got {type(plan).__name__}")
        self.plan = malleus.Plan(plan, config)  # validated against this model (C++ rules)
        self.summary = self.plan.summary
        pipelines = self.plan.pipelines
        self._check_runnable(pipelines)
        self.num_layers, self.num_blocks = config["num_layers"], num_blocks
        self.ends = block_ends(num_blocks, self.num_layers)
        if self.plan.world_size != world_size:
            raise _error(f"the plan is for {self.plan.world_size} ranks, the process group has "
                         f"{world_size}")
        if self.plan.micro_batch_size != micro_batch:
            raise _error(f"the plan's micro_batch_size is {self.plan.micro_batch_size}, "
                         f"micro_batch is {micro_batch}")
        if self.plan.global_batch != global_batch:
            raise _error(f"the plan's micro-batches x micro_batch_size sum to "
                         f"{self.plan.global_batch} samples, the global batch is {global_batch}")
        firsts, first = [], 0  # pipelines take consecutive samples, in plan order
        for p in pipelines:
            firsts.append(first)
            first += p["micro_batches"] * micro_batch
        self.roles = [self._role(self.plan.role(r), firsts) for r in range(world_size)]
        self.owners: List[List[int]] = [[] for _ in range(num_blocks)]
        for rank, role in enumerate(self.roles):
            for b in role.blocks:
                self.owners[b].append(rank)

    @staticmethod
    def _check_runnable(pipelines: List[dict]):
        for i, p in enumerate(pipelines):
            for j, s in enumerate(p["stages"]):
                where = f"plan: pipeline {i} stage {j}"
                if len(s["ranks"]) != 1:
                    raise _error(f"{where} has ranks {s['ranks']}: malleus.torch runs one rank "
                                 "per stage (no tensor parallelism; that stays in malleus train)")
                if s.get("recompute", "none") != "none":
                    raise _error(f"{where}: recompute {s['recompute']!r}: malleus.torch does not "
                                 "recompute activations")

    def _role(self, r: Optional[dict], firsts: List[int]) -> Role:
        if r is None:
            return Role()
        return Role(pipeline=r["pipeline"], stage=r["stage"], num_stages=r["stages"],
                    micro_batches=r["micro_batches"], first_sample=firsts[r["pipeline"]],
                    blocks=self.blocks_of(tuple(r["layers"])),
                    prev=r["previous_ranks"][0] if r["previous_ranks"] else None,
                    next=r["next_ranks"][0] if r["next_ranks"] else None)

    def blocks_of(self, layers: Tuple[int, int]) -> range:
        """The blocks of a stage holding planner layers [begin, end)."""
        begin, end = layers
        lo = 0 if begin == 0 else begin + self.ends
        hi = self.num_blocks if end == self.num_layers else end + self.ends
        return range(lo, hi)

    def reduction_groups(self) -> List[Tuple[int, ...]]:
        """The sets of ranks (sorted, two or more) that hold one block each, in a fixed order:
        each block's gradient is summed over its set (one rank per pipeline)."""
        return sorted({tuple(sorted(o)) for o in self.owners if len(o) > 1})


def block_ends(num_blocks: int, num_layers: int) -> int:
    """Blocks before the first layer (and after the last): 0 when every block is a layer, 1 when
    an embedding comes first and a head last. Raises ValueError for another count."""
    if num_blocks == num_layers:
        return 0
    if num_blocks == num_layers + 2:
        return 1
    raise _error(f"{num_blocks} blocks for a model_config of {num_layers} layers: give one block "
                 f"per layer ({num_layers}), or an embedding, one block per layer and a head "
                 f"({num_layers + 2}); model_config's num_layers is what the planner splits")


def even_plan(config: dict, world_size: int, global_batch: int, micro_batch: int):
    """One pipeline over every rank (as many as there are layers), the layers split as evenly as
    they go, earlier stages taking the remainder: the fixed split PyTorch users run today."""
    stages = min(world_size, config["num_layers"])
    return malleus.uniform_plan(config, 1, 1, stages, global_batch, micro_batch, world_size)
