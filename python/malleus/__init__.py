"""malleus from Python: the planner, the simulator, the presets, and the straggler loop are
malleus's C++ code (the module ``malleus._malleus``, typed in ``_malleus.pyi``); ``malleus.torch``
brings the straggler loop into a PyTorch training loop.

- ``Plan``: a parallel plan (pipelines of stages of tensor-parallel ranks), ``to_dict()`` for its
  JSON form, ``role(rank)`` for what one rank runs;
- ``StragglerLoop``: the C++ trainer's straggler loop (monitor, link monitor, controller): one
  observation per step in (every rank's compute seconds), ``None`` or a ``Decision`` out;
- ``Decision``: the one decision record (the metrics line's keys; ``str()`` is the log line).

Bad input raises ``malleus.Error`` (a ``ValueError``) carrying the C++ message, which names the
file, key or value at fault.
"""

from ._malleus import (  # noqa: F401  (the package's interface)
    PROBE_FLOPS,
    PROBE_REPEATS,
    PROBE_SIZE,
    Decision,
    Error,
    Monitor,
    Plan,
    StragglerLoop,
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
    "PROBE_FLOPS", "PROBE_REPEATS", "PROBE_SIZE", "Decision", "Error", "Monitor", "Plan",
    "StragglerLoop", "cluster", "cluster_presets", "model_config", "model_presets", "plan",
    "plan_summary", "simulate", "simulate_scenario", "strategies", "training_flops",
    "uniform_plan",
]
