"""Training tools for the learned pass ordering: the gymnasium environment, the corpus of
graphs, baselines, PPO training and the evaluation (``docs/pass-ordering.md``).

Importing this package registers the environments ``kiln/PassOrdering-v0``,
``kiln/FusionSites-v0`` (per-site fusion decisions, :mod:`kiln.tuning.rl.sites`) and
``kiln/DuplicateSites-v0``, ``kiln/LayoutSites-v0``, ``kiln/RematSites-v0`` (the other
per-site action kinds, :mod:`kiln.tuning.rl.site_kinds`) with gymnasium when gymnasium is
installed (``pip install kiln[rl]``).  What a trained policy needs at
compile time stays in :mod:`kiln.passes.ordering`.
"""

ENV_ID = "kiln/PassOrdering-v0"
SITES_ENV_ID = "kiln/FusionSites-v0"
KIND_ENV_IDS = {
    "duplicate": ("kiln/DuplicateSites-v0", "kiln.tuning.rl.site_kinds:DuplicateSitesEnv"),
    "layout": ("kiln/LayoutSites-v0", "kiln.tuning.rl.site_kinds:LayoutSitesEnv"),
    "remat": ("kiln/RematSites-v0", "kiln.tuning.rl.site_kinds:RematSitesEnv"),
}
"""Gymnasium ids and entry points of the per-site action kinds besides fusion."""


def _register_env() -> bool:
    try:
        import gymnasium
    except ImportError:
        return False
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="kiln.tuning.rl.env:PassOrderingEnv")
    if SITES_ENV_ID not in gymnasium.registry:
        gymnasium.register(id=SITES_ENV_ID, entry_point="kiln.tuning.rl.sites:FusionSitesEnv")
    for env_id, entry_point in KIND_ENV_IDS.values():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry_point)
    return True


GYM_REGISTERED = _register_env()

__all__ = ["ENV_ID", "GYM_REGISTERED", "KIND_ENV_IDS", "SITES_ENV_ID"]
