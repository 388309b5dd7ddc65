"""Pass ordering: a gymnasium environment over kiln's passes, baselines, and a learned pipeline.

See ``docs/pass-ordering.md``.  Importing this package registers the environment
``kiln/PassOrdering-v0`` with gymnasium when gymnasium is installed (``pip install kiln[rl]``);
everything else here (actions, costs, corpus, baselines, the learned pipeline) works without it.
"""

from kiln.passes.ordering.actions import ACTION_SETS, STOP, Action, action_set
from kiln.passes.ordering.cost import (
    COSTS,
    MACHINES,
    MachineModel,
    estimate_runtime,
    get_cost,
    measure_runtime,
    op_count,
)
from kiln.passes.ordering.decompose import Decompose
from kiln.passes.ordering.episode import CostModel, Episode
from kiln.passes.ordering.learned import LearnedPipeline, learned_pipeline
from kiln.passes.ordering.observation import ObservationSpec
from kiln.passes.ordering.transitions import TransitionCache, graph_key

ENV_ID = "kiln/PassOrdering-v0"


def _register_env() -> bool:
    try:
        import gymnasium
    except ImportError:
        return False
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="kiln.passes.ordering.env:PassOrderingEnv")
    return True


GYM_REGISTERED = _register_env()

__all__ = [
    "ACTION_SETS",
    "COSTS",
    "ENV_ID",
    "GYM_REGISTERED",
    "MACHINES",
    "STOP",
    "Action",
    "CostModel",
    "Decompose",
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
    "measure_runtime",
    "op_count",
]
