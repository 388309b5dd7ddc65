"""Training tools for the learned pass ordering: the gymnasium environment, the corpus of
graphs, baselines, PPO training and the evaluation (``docs/pass-ordering.md``).

Importing this package registers the environment ``kiln/PassOrdering-v0`` with gymnasium
when gymnasium is installed (``pip install kiln[rl]``).  What a trained policy needs at
compile time stays in :mod:`kiln.passes.ordering`.
"""

ENV_ID = "kiln/PassOrdering-v0"


def _register_env() -> bool:
    try:
        import gymnasium
    except ImportError:
        return False
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="kiln.tuning.rl.env:PassOrderingEnv")
    return True


GYM_REGISTERED = _register_env()

__all__ = ["ENV_ID", "GYM_REGISTERED"]
