"""Memoized pass applications: what each action does to each graph, keyed by graph text.

Episodes revisit the same graphs over and over (every episode of one corpus graph starts
from the same state, and many orders reach the same intermediate graphs), and computing an
action mask means trying every action.  :class:`TransitionCache` runs each (graph, action)
pair once: graphs are identified by a hash of their canonical text, the result of an action
is stored as the key of the result graph, and costs and structural features are cached per
graph.  Passes are functional, so cached graphs are shared, never copied; nothing may edit a
graph obtained from the cache.

"Changes the graph" means "changes its text": the mask of an action is true exactly when the
result's text differs from the input's.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.ir import Graph, KilnError, verify
from kiln.passes.ordering.actions import Action


def graph_key(graph: Graph) -> str:
    """A 128-bit hash of ``graph``'s text form: equal keys mean equal text."""
    return hashlib.blake2b(str(graph).encode(), digest_size=16).hexdigest()


class TransitionCache:
    """Results of actions on graphs, costs and features per graph, bounded in size.

    Args:
        actions: the action set; action ``i`` of :meth:`apply` is ``actions[i]``.
        max_graphs: graphs kept (least recently used ones are dropped first; their
            transitions are recomputed when needed).
        verify: run :func:`kiln.ir.verify` on every new result graph.

    A pass that raises is reported once as a warning and treated as not changing the graph,
    so one faulty pass cannot end a training run; :attr:`failures` lists them.
    """

    def __init__(self, actions: Sequence[Action], *, max_graphs: int = 4096, verify: bool = True):
        self.actions = tuple(actions)
        self.max_graphs = max_graphs
        self.verify = verify
        self._graphs: OrderedDict[str, Graph] = OrderedDict()
        self._next: dict[tuple[str, int], str] = {}
        self._values: dict[str, dict[str, Any]] = {}
        self.failures: list[str] = []
        self.pass_runs = 0
        self.hits = 0

    # ------------------------------------------------------------------ graphs
    def intern(self, graph: Graph) -> str:
        """Store ``graph`` (if new) and return its key."""
        key = graph_key(graph)
        self._store(key, graph)
        return key

    def graph(self, key: str) -> Graph:
        """The graph with key ``key`` (``KeyError`` if it was never stored or was dropped)."""
        graph = self._graphs[key]
        self._graphs.move_to_end(key)
        return graph

    def _store(self, key: str, graph: Graph) -> None:
        if key in self._graphs:
            self._graphs.move_to_end(key)
            return
        self._graphs[key] = graph
        while len(self._graphs) > self.max_graphs:
            dropped, _ = self._graphs.popitem(last=False)
            self._values.pop(dropped, None)

    # ----------------------------------------------------------------- actions
    def apply(self, key: str, action: int) -> str:
        """Key of the graph that action ``action`` makes of graph ``key`` (``key`` for stop)."""
        spec = self.actions[action]
        if spec.is_stop:
            return key
        known = self._next.get((key, action))
        if known is not None and known in self._graphs:
            self.hits += 1
            self._graphs.move_to_end(known)
            return known
        source = self.graph(key)
        self.pass_runs += 1
        try:
            result = spec.pass_.run(source).graph
            if result is not source and self.verify:
                verify(result)
        except (KilnError, ValueError, TypeError, KeyError, IndexError) as error:
            message = f"pass {spec.name} failed on graph @{source.name}: {error}"
            if message not in self.failures:
                self.failures.append(message)
                warnings.warn(message + "; treated as not changing the graph", stacklevel=2)
            result = source
        new_key = key if result is source else graph_key(result)
        if new_key != key:
            self._store(new_key, result)
        self._next[(key, action)] = new_key
        return new_key

    def mask(self, key: str) -> np.ndarray:
        """Boolean vector: action ``i`` changes graph ``key`` (stop is always allowed)."""
        return self.cached(
            key,
            "mask",
            lambda g: np.array(
                [a.is_stop or self.apply(key, i) != key for i, a in enumerate(self.actions)], dtype=bool
            ),
        )

    def cached(self, key: str, what: str, compute: Callable[[Graph], Any]) -> Any:
        """``compute(graph)`` for graph ``key``, computed once per (graph, ``what``)."""
        values = self._values.setdefault(key, {})
        if what not in values:
            values[what] = compute(self.graph(key))
        return values[what]

    @property
    def size(self) -> int:
        return len(self._graphs)
