"""Training tools for the learned pass ordering: the gymnasium environment, the corpus of
graphs, baselines, PPO training and the evaluation (``docs/pass-ordering.md``).

Importing this package registers the environments ``kiln/PassOrdering-v0`` and
``kiln/FusionSites-v0`` (per-site fusion decisions, :mod:`kiln.tuning.rl.sites`) with gymnasium
when gymnasium is installed (``pip install kiln[rl]``).  What a trained policy needs at
compile time stays in :mod:`kiln.passes.ordering`.
"""

ENV_ID = "kiln/PassOrdering-v0"
SITES_ENV_ID = "kiln/FusionSites-v0"


def _register_env() -> bool:
    try:
        import gymnasium
    except ImportError:
        return False
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="kiln.tuning.rl.env:PassOrderingEnv")
    if SITES_ENV_ID not in gymnasium.registry:
        gymnasium.register(id=SITES_ENV_ID, entry_point="kiln.tuning.rl.sites:FusionSitesEnv")
    return True


GYM_REGISTERED = _register_env()

__all__ = ["ENV_ID", "GYM_REGISTERED", "SITES_ENV_ID"]
