"""The costs a pass-ordering agent is trained and evaluated on.

The estimates (``op_count``, ``kernel_count``, ``runtime``) are
:mod:`kiln.passes.ordering.cost`'s, which is all a compile needs; ``measured`` runs the
graph: :func:`kiln.tuning.measure.measure_runtime`, the median wall time of the numpy
reference implementations on seeded random arguments -- slow, noisy, and optional.
"""

from __future__ import annotations

from kiln.passes.ordering.cost import COSTS as ESTIMATES
from kiln.passes.ordering.cost import MachineModel
from kiln.passes.ordering.episode import CostModel
from kiln.tuning.measure import measure_runtime

COSTS = (*ESTIMATES, "measured")
"""Names accepted by :func:`cost_model`."""


def cost_model(name: str, machine: str | MachineModel | None = None) -> CostModel:
    """The :class:`~kiln.passes.ordering.episode.CostModel` called ``name`` (one of
    :data:`COSTS`); ``machine`` is the machine model of the ``runtime`` estimate."""
    if name not in COSTS:
        raise ValueError(f"unknown cost {name!r}; choose one of {', '.join(COSTS)}")
    if name == "measured":
        return CostModel(name, machine, fn=measure_runtime)
    return CostModel(name, machine)


__all__ = ["COSTS", "ESTIMATES", "cost_model"]
