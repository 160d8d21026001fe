"""A data-parallel split (micro-batches per rank) and its malleus plan (JSON form), both ways."""

from typing import List, Sequence, Union

import malleus


def plan_of_split(split: Sequence[int], micro_batch: int, num_layers: int) -> dict:
    """The malleus plan (JSON form) of a data-parallel split: one pipeline of one stage per rank
    that has micro-batches."""
    return {
        "world_size": len(split),
        "micro_batch_size": micro_batch,
        "pipelines": [{"micro_batches": m, "stages": [{"layers": [0, num_layers], "ranks": [r]}]}
                      for r, m in enumerate(split) if m > 0],
    }


def split_of_plan(plan: Union[malleus.Plan, dict], world_size: int) -> List[int]:
    """Micro-batches per rank of a data-parallel plan (ranks it leaves idle get 0)."""
    split = [0] * world_size
    for p in plan.pipelines if isinstance(plan, malleus.Plan) else plan["pipelines"]:
        stages = p["stages"]
        if len(stages) != 1 or len(stages[0]["ranks"]) != 1:
            raise ValueError("not a data-parallel plan (a pipeline with several stages or "
                             "tensor-parallel ranks): " + str(p))
        split[stages[0]["ranks"][0]] = p["micro_batches"]
    return split
