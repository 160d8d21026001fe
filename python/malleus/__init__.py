"""malleus from Python: the planner, the simulator, the presets, the rate monitor and the
controller's decision are malleus's C++ code (the module ``malleus._malleus``); ``malleus.torch``
brings the straggler loop into a PyTorch data-parallel training loop.

Bad input raises ``malleus.Error`` (a ``ValueError``) carrying the C++ message, which names the
file, key or value at fault.
"""

from dataclasses import dataclass, field
from typing import List, Optional

from . import _malleus
from ._malleus import (  # noqa: F401  (the package's interface)
    Error,
    Monitor,
    cluster,
    cluster_presets,
    model_config,
    model_presets,
    plan,
    plan_summary,
    simulate,
    simulate_scenario,
    strategies,
    training_flops,
    uniform_plan,
)

__all__ = [
    "Controller", "Decision", "Error", "Monitor", "cluster", "cluster_presets", "model_config",
    "model_presets", "plan", "plan_summary", "simulate", "simulate_scenario", "strategies",
    "training_flops", "uniform_plan",
]


@dataclass
class Decision:
    """One decision of the controller (elastic::Decision): ``plan`` is set when it switches."""

    asked: bool = False            # the rates moved enough to ask the planner
    take: bool = False             # the switch rule says switch (then ``plan`` is the new plan)
    plan: Optional[dict] = None
    step: int = 0
    rates: List[float] = field(default_factory=list)  # the effective rates planned for
    link_rates: List[float] = field(default_factory=list)
    old_plan: str = ""
    new_plan: str = ""             # empty when no plan was found
    current_step_s: float = 0.0    # predicted time per step of the running plan
    proposed_step_s: float = 0.0   # of the proposed plan
    switch_s: float = 0.0          # what switching costs
    horizon_steps: float = 0.0
    same_plan: bool = False
    gain_s: float = 0.0            # (current - proposed) x horizon
    reason: str = ""               # why not, when declined
    planning_s: float = float("nan")
    incremental: bool = False      # re-planned from the running plan (few devices' rates moved)
    held: bool = False             # on hold, a plan the rule would take was declined


class Controller:
    """The C++ controller (elastic/controller.h): when the monitored rates moved by the
    hysteresis, it asks the planner for a plan for them and switches only when the switch rule
    (replan::weigh_switch) says the time saved over the horizon pays for the switch.

    ``model`` and ``cluster`` are preset names, JSON files or dicts; a cluster preset is given one
    device per rank on one node, as the trainer does.
    """

    def __init__(self, model, *, world_size, global_batch, micro_batch=1, seq_len=0,
                 cluster="cpu-local", strategy="malleus", straggler_threshold=1.2,
                 hysteresis=0.3, horizon_steps=50, min_samples=3, distributed_optimizer=True,
                 profile=None):
        self._impl = _malleus.Controller(
            model, cluster, world_size, global_batch, micro_batch, seq_len, strategy,
            straggler_threshold, hysteresis, horizon_steps, min_samples, distributed_optimizer,
            profile)

    def decide(self, current, rates, monitored_steps, step, remaining_steps, *, root=True,
               broadcast=None):
        """Collective when ``broadcast`` is given (a function: rank 0's plan text in, the same
        text out on every rank; ``root`` on rank 0 only). Returns a Decision."""
        return Decision(**self._impl.decide(current, list(rates), monitored_steps, step,
                                            remaining_steps, root, broadcast))

    def note_step_rates(self, rates):
        """The rates of the step just run, unsmoothed (``Monitor.step_rates``): what the
        controller counts the realised gain of its switches with. Call before ``decide``."""
        self._impl.note_step_rates(list(rates))

    @property
    def holding(self):
        """Whether a switch that did not pay has put the controller on hold."""
        return self._impl.holding

    def propose(self, current, rates, step=0, remaining_steps=50):
        """What rank 0 decides for ``rates``, whether or not they moved."""
        return Decision(**self._impl.propose(current, list(rates), step, remaining_steps))
