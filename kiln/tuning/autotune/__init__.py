"""Legality-checked autotuning of loop schedules (``docs/tuning.md``, "Autotuning schedules").

* :func:`autotune` / :func:`tune` (:mod:`.search`): search the schedules of one loop program
  -- random or evolutionary, optionally ranked by a cost model -- with every candidate
  checked by isl before it is compiled, measured with the cpu backend's code and
  :func:`~kiln.runtime.timing.best_time`, the result written as a tuning record;
* :mod:`.space` (the primitives searched), :mod:`.measure` (compiling in a process pool,
  checking results, timing), :mod:`.features` and :mod:`.costmodel` (the learned cost
  model and its rank correlation);
* :func:`tune_model` (:mod:`.model`): tune every generated kernel of a model's cpu build;
  the records make later builds replay the tuned schedules;
* :mod:`.env`: ``kiln/ScheduleKernel-v0``, a gymnasium environment whose action mask is
  the legality check (registered on import when gymnasium is installed);
  :mod:`.policy` (``SlotPolicy``, a MaskablePPO policy that scores each loop slot with
  shared weights) and :mod:`.imitation` (measured greedy demonstrations, and fitting a
  policy to them before PPO).
"""

from .search import STRATEGIES, TuneResult, autotune, tune

ENV_ID = "kiln/ScheduleKernel-v0"


def _register_env() -> bool:
    try:
        import gymnasium
    except ImportError:
        return False
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="kiln.tuning.autotune.env:ScheduleKernelEnv")
    return True


GYM_REGISTERED = _register_env()


def tune_model(*args, **kwargs):
    """See :func:`kiln.tuning.autotune.model.tune_model`."""
    from .model import tune_model as run  # noqa: PLC0415 (captures models: loads the frontends)

    return run(*args, **kwargs)


__all__ = ["ENV_ID", "GYM_REGISTERED", "STRATEGIES", "TuneResult", "autotune", "tune", "tune_model"]
