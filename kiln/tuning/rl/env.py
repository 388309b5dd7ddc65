"""``kiln/PassOrdering-v0``: a gymnasium environment for choosing the order of kiln's passes.

An episode optimizes one graph drawn from a corpus.  Each step applies one action (a pass
from :mod:`kiln.passes.ordering.actions`, or ``stop``); the episode terminates on ``stop``
and is truncated after ``budget`` steps.  Observations are the fixed-size vectors of
:mod:`kiln.passes.ordering.observation`; the reward of a step is the decrease of the chosen
cost divided by the graph's initial cost (so the return is the relative improvement).

Action masking: :meth:`PassOrderingEnv.action_masks` is true for the actions that change the
graph (and for ``stop``), as sb3-contrib's ``MaskablePPO`` expects; the mask is also in
``info["action_mask"]`` and in the observation.  A masked action may still be taken: it
leaves the graph unchanged, gives reward 0 and uses a step.

Reproducibility: graphs are drawn with the environment's seeded generator
(``reset(seed=...)``); passes are deterministic, so a seed and an action sequence determine
every observation and reward.  ``reset(options={"index": i})`` picks corpus graph ``i``.

::

    import gymnasium, kiln.tuning.rl
    env = gymnasium.make("kiln/PassOrdering-v0", cost="kernel_count", budget=12)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.unwrapped.action_masks().argmax())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from kiln.ir import Graph
from kiln.passes.ordering.actions import Action, action_set
from kiln.passes.ordering.cost import MachineModel
from kiln.passes.ordering.episode import Episode
from kiln.passes.ordering.observation import ObservationSpec, default_op_names
from kiln.passes.ordering.transitions import TransitionCache
from kiln.tuning.rl.corpus import CorpusEntry, random_graph
from kiln.tuning.rl.costs import cost_model


def default_corpus() -> list[Graph]:
    """Eight random graphs: cheap to build, and every pass has work on them."""
    return [random_graph(seed, size=16 + 2 * seed) for seed in range(8)]


class PassOrderingEnv(gym.Env):
    """See the module docstring.

    Args:
        corpus: graphs or :class:`~kiln.tuning.rl.corpus.CorpusEntry` objects
            (default: :func:`default_corpus`).
        actions: an action-set name (``"base"``, ``"extended"``) or pipeline texts.
        cost: ``"op_count"`` (default), ``"kernel_count"``, ``"runtime"`` or ``"measured"``
            (:mod:`kiln.tuning.rl.costs`).
        budget: steps per episode.
        history: recent actions in the observation.
        observe_mask: put the action mask in the observation too.
        machine: machine model for ``cost="runtime"`` (a preset name or a ``MachineModel``).
        op_names: the observation's op vocabulary (default: the registry's ops now).
        cache: a shared :class:`TransitionCache` (it must use the same actions).
        verify: verify every graph a pass produces.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        corpus: Sequence[Graph | CorpusEntry] | None = None,
        *,
        actions: str | Sequence[str] = "base",
        cost: str = "op_count",
        budget: int = 12,
        history: int = 2,
        observe_mask: bool = True,
        machine: str | MachineModel | None = None,
        op_names: Sequence[str] | None = None,
        cache: TransitionCache | None = None,
        verify: bool = True,
        render_mode: str | None = None,
    ):
        super().__init__()
        entries = list(corpus) if corpus is not None else default_corpus()
        if not entries:
            raise ValueError("the corpus is empty: give at least one graph")
        self.graphs = [e.graph if isinstance(e, CorpusEntry) else e for e in entries]
        self.names = [e.name for e in entries]  # a CorpusEntry's name, or the graph's
        self.actions: tuple[Action, ...] = cache.actions if cache is not None else action_set(actions)
        self.cache = cache if cache is not None else TransitionCache(self.actions, verify=verify)
        self.cost_model = cost_model(cost, machine)
        self.budget = budget
        self.observation_spec = ObservationSpec(
            tuple(op_names or default_op_names()), len(self.actions), history, observe_mask
        )
        self.action_space = spaces.Discrete(len(self.actions))
        self.observation_space = spaces.Box(0.0, 1.0, shape=(self.observation_spec.size,), dtype=np.float32)
        self.render_mode = render_mode
        self.episode: Episode | None = None
        self.index = 0

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "index" in options:
            self.index = int(options["index"]) % len(self.graphs)
        else:
            self.index = int(self.np_random.integers(len(self.graphs)))
        self.episode = Episode(
            self.graphs[self.index], self.cache, self.cost_model, self.observation_spec, self.budget
        )
        return self.episode.observation(), self._info(changed=False)

    def step(self, action):
        if self.episode is None:
            raise RuntimeError("call reset() before step()")
        result = self.episode.step(int(action))
        info = self._info(changed=result.changed, action=int(action))
        return self.episode.observation(), result.reward, result.terminated, result.truncated, info

    def action_masks(self) -> np.ndarray:
        """Actions that change the current graph, and stop (for ``MaskablePPO``)."""
        if self.episode is None:
            return np.ones(len(self.actions), dtype=bool)
        return self.episode.mask().copy()

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.episode is None:
            return None
        e = self.episode
        return (
            f"{self.names[self.index]}: step {e.steps}/{e.budget}, {self.cost_model.name} "
            f"{e.initial_cost:g} -> {e.cost:g}, actions: {', '.join(e.trace()) or '-'}"
        )

    # ------------------------------------------------------------------ helpers
    @property
    def graph(self) -> Graph:
        """The current graph (never edit it: it is shared with the transition cache)."""
        if self.episode is None:
            raise RuntimeError("call reset() first")
        return self.episode.graph

    def _info(self, *, changed: bool, action: int | None = None) -> dict[str, Any]:
        e = self.episode
        info = {
            "graph": self.names[self.index],
            "cost": e.cost,
            "initial_cost": e.initial_cost,
            "steps": e.steps,
            "changed": changed,
            "action_mask": e.mask().copy(),
        }
        if action is not None:
            info["action"] = self.actions[action].name
        return info
