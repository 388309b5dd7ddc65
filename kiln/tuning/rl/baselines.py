"""Baselines a pass-ordering policy is measured against, all on the same cost and cache.

* :func:`default_fixpoint` -- ``DEFAULT_PIPELINE`` repeated until nothing changes
  (:func:`default_once`: run once).
* :func:`random_rollout` -- one episode of uniformly random *unmasked-valid* actions
  (never a no-op; ``stop`` only when nothing else changes the graph).
* :func:`random_search` -- the best of random rollouts, given a number of pass
  applications (by default what a policy spends at inference: it tries every action at every
  step to compute its mask).
* :func:`greedy` -- one-step lookahead: apply the action with the lowest resulting cost,
  stop when no action lowers the cost.
* :func:`search_fixed_order` / :func:`fixed_order` -- the single action sequence with the
  best mean relative cost over a set of (training) graphs, found by hill climbing from the
  default order, then applied unchanged to any graph.

Each returns an :class:`Outcome`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kiln.ir import Graph
from kiln.passes.manager import PassManager, parse_pipeline
from kiln.passes.ordering.episode import CostModel
from kiln.passes.ordering.transitions import TransitionCache
from kiln.passes.pipeline import DEFAULT_PIPELINE


@dataclass
class Outcome:
    """Result of one method on one graph."""

    method: str
    cost: float
    initial_cost: float
    applications: int
    """Passes run: applied, plus tried (lookahead, masks) where the method tries them."""
    trace: list[str] = field(default_factory=list)
    seconds: float = 0.0
    graph: Graph | None = field(default=None, repr=False)

    @property
    def improvement(self) -> float:
        """Relative cost reduction: ``1 - cost / initial_cost``."""
        return 1.0 - self.cost / self.initial_cost if self.initial_cost else 0.0


def _timed(fn: Callable[[], Outcome]) -> Outcome:
    start = time.perf_counter()
    outcome = fn()
    outcome.seconds = time.perf_counter() - start
    return outcome


def default_fixpoint(
    graph: Graph, cost: CostModel, cache: TransitionCache, max_iterations: int = 16
) -> Outcome:
    """The default pipeline, repeated until no pass changes the graph."""
    return _default(graph, cost, cache, max_iterations, "default")


def default_once(graph: Graph, cost: CostModel, cache: TransitionCache) -> Outcome:
    """The default pipeline run once, without iterating to a fixpoint."""
    return _default(graph, cost, cache, 1, "default-once")


def _default(graph: Graph, cost: CostModel, cache: TransitionCache, iterations: int, method: str) -> Outcome:
    def run() -> Outcome:
        pm = PassManager(DEFAULT_PIPELINE, fixpoint=iterations > 1, max_iterations=iterations, verify=False)
        result = pm.run(graph).graph
        key = cache.intern(result)
        return Outcome(
            method,
            cost(cache, key),
            cost(cache, cache.intern(graph)),
            len(pm.stats),
            [s.pass_spec for s in pm.stats],
            graph=result,
        )

    return _timed(run)


def apply_actions(graph: Graph, actions: Sequence[int], cache: TransitionCache) -> str:
    """Key of the graph after applying ``actions`` in order (no-ops included)."""
    key = cache.intern(graph)
    for action in actions:
        key = cache.apply(key, action)
    return key


def _rollout(
    key: str, cache: TransitionCache, budget: int, rng: np.random.Generator, allow_stop: bool
) -> tuple[str, list[int]]:
    stop = len(cache.actions) - 1
    taken: list[int] = []
    for _ in range(budget):
        mask = cache.mask(key).copy()
        if not allow_stop and mask[:stop].any():
            mask[stop] = False
        action = int(rng.choice(np.flatnonzero(mask)))
        taken.append(action)
        if action == stop:
            break
        key = cache.apply(key, action)
    return key, taken


def random_rollout(
    graph: Graph, cost: CostModel, cache: TransitionCache, budget: int, seed: int = 0
) -> Outcome:
    """One episode of random valid actions, ``stop`` included among them."""

    def run() -> Outcome:
        start = cache.intern(graph)
        key, taken = _rollout(start, cache, budget, np.random.default_rng(seed), allow_stop=True)
        return Outcome(
            "random",
            cost(cache, key),
            cost(cache, start),
            len(taken),
            [cache.actions[a].name for a in taken],
            graph=cache.graph(key),
        )

    return _timed(run)


def random_search(
    graph: Graph,
    cost: CostModel,
    cache: TransitionCache,
    budget: int,
    applications: int | None = None,
    seed: int = 0,
) -> Outcome:
    """Best of random valid rollouts (no early stop) until ``applications`` pass runs are
    spent; each rollout step counts every action tried for its mask.  Default:
    ``budget * len(actions)``, what a masked policy spends on one rollout."""

    def run() -> Outcome:
        limit = applications if applications is not None else budget * len(cache.actions)
        rng = np.random.default_rng(seed)
        start = cache.intern(graph)
        best_key, best_taken, spent = start, [], 0
        while spent < limit:
            key, taken = _rollout(start, cache, budget, rng, allow_stop=False)
            spent += max(1, len(taken)) * len(cache.actions)
            if cost(cache, key) < cost(cache, best_key):
                best_key, best_taken = key, taken
        return Outcome(
            "random-search",
            cost(cache, best_key),
            cost(cache, start),
            spent,
            [cache.actions[a].name for a in best_taken],
            graph=cache.graph(best_key),
        )

    return _timed(run)


def greedy(graph: Graph, cost: CostModel, cache: TransitionCache, budget: int) -> Outcome:
    """One-step lookahead: the action with the lowest resulting cost, while it lowers it."""

    def run() -> Outcome:
        start = key = cache.intern(graph)
        taken: list[str] = []
        tried = 0
        for _ in range(budget):
            candidates = [(cost(cache, cache.apply(key, a)), a) for a in range(len(cache.actions) - 1)]
            tried += len(candidates)
            best_cost, best = min(candidates)
            if best_cost >= cost(cache, key):
                break
            key = cache.apply(key, best)
            taken.append(cache.actions[best].name)
        return Outcome("greedy", cost(cache, key), cost(cache, start), tried, taken, graph=cache.graph(key))

    return _timed(run)


def default_order(cache: TransitionCache) -> list[int]:
    """``DEFAULT_PIPELINE`` as action indices (passes missing from the action set dropped)."""
    index = {a.name: i for i, a in enumerate(cache.actions)}
    return [index[p.spec()] for p in parse_pipeline(DEFAULT_PIPELINE) if p.spec() in index]


def mean_relative_cost(
    order: Sequence[int], graphs: Sequence[Graph], cost: CostModel, cache: TransitionCache
) -> float:
    """Mean over ``graphs`` of final cost / initial cost after applying ``order``."""
    ratios = []
    for graph in graphs:
        start = cache.intern(graph)
        initial = cost(cache, start) or 1.0
        ratios.append(cost(cache, apply_actions(graph, order, cache)) / initial)
    return float(np.mean(ratios))


def search_fixed_order(
    graphs: Sequence[Graph],
    cost: CostModel,
    cache: TransitionCache,
    length: int,
    iterations: int = 300,
    seed: int = 0,
) -> list[int]:
    """Hill climbing over action sequences of at most ``length`` passes, starting from the
    default order, minimizing :func:`mean_relative_cost` over ``graphs``.  Mutations:
    replace, insert, delete or swap one action; ties keep the shorter sequence."""
    rng = np.random.default_rng(seed)
    n = len(cache.actions) - 1  # stop is never part of a fixed order
    best = default_order(cache)[:length]
    best_score = mean_relative_cost(best, graphs, cost, cache)
    for _ in range(iterations):
        candidate = list(best)
        move = int(rng.integers(4))
        if move == 0 and candidate:
            candidate[int(rng.integers(len(candidate)))] = int(rng.integers(n))
        elif move == 1 and len(candidate) < length:
            candidate.insert(int(rng.integers(len(candidate) + 1)), int(rng.integers(n)))
        elif move == 2 and len(candidate) > 1:
            del candidate[int(rng.integers(len(candidate)))]
        elif len(candidate) > 1:
            i, j = rng.choice(len(candidate), size=2, replace=False)
            candidate[i], candidate[j] = candidate[j], candidate[i]
        score = mean_relative_cost(candidate, graphs, cost, cache)
        if score < best_score - 1e-12 or (abs(score - best_score) <= 1e-12 and len(candidate) < len(best)):
            best, best_score = candidate, score
    return best


def fixed_order(graph: Graph, order: Sequence[int], cost: CostModel, cache: TransitionCache) -> Outcome:
    """Apply the fixed action sequence ``order`` (actions that change nothing are no-ops)."""

    def run() -> Outcome:
        start = cache.intern(graph)
        key = apply_actions(graph, order, cache)
        return Outcome(
            "fixed-order",
            cost(cache, key),
            cost(cache, start),
            len(order),
            [cache.actions[a].name for a in order],
            graph=cache.graph(key),
        )

    return _timed(run)
