"""Pass ordering at compile time: the action sets, the observation of a graph, cost
estimates, and the learned pipeline that a trained policy drives.

The training side (the gymnasium environment, the corpus, baselines, PPO training, the
evaluation and the measured cost) lives in :mod:`kiln.tuning.rl`; nothing here imports it.
See ``docs/pass-ordering.md``.
"""

from kiln.passes.ordering.actions import ACTION_SETS, STOP, Action, action_set
from kiln.passes.ordering.cost import (
    COSTS,
    MACHINES,
    MachineModel,
    estimate_runtime,
    get_cost,
    op_count,
)
from kiln.passes.ordering.episode import CostModel, Episode
from kiln.passes.ordering.learned import LearnedPipeline, learned_pipeline
from kiln.passes.ordering.observation import ObservationSpec
from kiln.passes.ordering.transitions import TransitionCache, graph_key

__all__ = [
    "ACTION_SETS",
    "COSTS",
    "MACHINES",
    "STOP",
    "Action",
    "CostModel",
    "Episode",
    "LearnedPipeline",
    "MachineModel",
    "ObservationSpec",
    "TransitionCache",
    "action_set",
    "estimate_runtime",
    "get_cost",
    "graph_key",
    "learned_pipeline",
    "op_count",
]
