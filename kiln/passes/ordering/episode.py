"""One pass-ordering episode, without gymnasium: the state machine every user shares.

The gymnasium environment (:mod:`kiln.tuning.rl.env`), the baselines and the learned
pipeline all drive :class:`Episode`, so they see the same masks, observations, costs and
rewards.  An episode starts from one graph; each step applies one action; it ends when the
agent stops (terminated) or when ``budget`` steps have been taken (truncated).

Reward of a step: ``(cost before - cost after) / initial cost``, so the return of an episode
is the relative cost reduction of the final graph, comparable across graphs of any size
(an initial cost of zero scales by one instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kiln.ir import Graph
from kiln.passes.ordering.actions import Action
from kiln.passes.ordering.cost import CostFn, MachineModel, get_cost, get_machine
from kiln.passes.ordering.observation import ObservationSpec
from kiln.passes.ordering.transitions import TransitionCache


@dataclass
class CostModel:
    """A named cost, memoized per graph in a :class:`TransitionCache`.

    ``fn`` computes it; by default it is the estimate :func:`~kiln.passes.ordering.cost.get_cost`
    knows by ``name`` (a measured cost comes from :func:`kiln.tuning.rl.costs.cost_model`).
    """

    name: str = "op_count"
    machine: str | MachineModel | None = None
    fn: CostFn | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fn is None:
            self.fn = get_cost(self.name, self.machine)
        self.slot = f"cost:{self.name}:{get_machine(self.machine).name}"

    def __call__(self, cache: TransitionCache, key: str) -> float:
        return cache.cached(key, self.slot, self.fn)


@dataclass
class StepResult:
    reward: float
    changed: bool
    terminated: bool
    truncated: bool


class Episode:
    """State of one episode: current graph key, steps taken, recent actions, costs."""

    def __init__(
        self, graph: Graph, cache: TransitionCache, cost: CostModel, spec: ObservationSpec, budget: int
    ):
        if budget < 1:
            raise ValueError(f"the step budget must be at least 1, got {budget}")
        self.cache = cache
        self.cost_model = cost
        self.spec = spec
        self.budget = budget
        self.key = cache.intern(graph)
        self.initial_key = self.key
        self.initial_cost = cost(cache, self.key)
        self.steps = 0
        self.taken: list[int] = []
        self.finished = False
        self.tried = 0
        """Pass applications tried so far by whoever drives the episode (bookkeeping only)."""

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.cache.actions

    @property
    def graph(self) -> Graph:
        return self.cache.graph(self.key)

    @property
    def cost(self) -> float:
        return self.cost_model(self.cache, self.key)

    @property
    def scale(self) -> float:
        return self.initial_cost if self.initial_cost > 0 else 1.0

    def mask(self) -> np.ndarray:
        return self.cache.mask(self.key)

    def observation(self) -> np.ndarray:
        features = self.cache.cached(self.key, f"features:{hash(self.spec)}", self.spec.graph_features)
        mask = self.mask() if self.spec.include_mask else None
        return self.spec.encode(
            features, mask, self.cost / self.scale, self.steps / self.budget, self.taken[::-1]
        )

    def step(self, action: int) -> StepResult:
        """Apply action ``action``; a masked action leaves the graph as it is (reward 0)."""
        if self.finished:
            raise RuntimeError("the episode is over; start a new one")
        if not 0 <= action < len(self.actions):
            raise ValueError(f"action {action} is out of range for {len(self.actions)} actions")
        self.steps += 1
        self.taken.append(action)
        if self.actions[action].is_stop:
            self.finished = True
            return StepResult(0.0, False, True, False)
        before = self.cost
        new_key = self.cache.apply(self.key, action)
        changed = new_key != self.key
        self.key = new_key
        reward = (before - self.cost) / self.scale
        truncated = self.steps >= self.budget
        self.finished = truncated
        return StepResult(float(reward), changed, False, truncated)

    def trace(self) -> list[str]:
        """Pipeline texts of the actions taken, in order (``stop`` included)."""
        return [self.actions[a].name for a in self.taken]
