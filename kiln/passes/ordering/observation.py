"""The observation of pass ordering: a documented, fixed-size vector in ``[0, 1]``.

Layout of :meth:`ObservationSpec.encode` (``V`` = ``len(op_names)``, ``A`` = number of
actions, ``H`` = ``history``), in order:

====================  ======  =================================================================
block                 size    contents
====================  ======  =================================================================
op histogram          V + 1   share of the graph's top-level nodes of each op kind in the
                              vocabulary ``op_names``; the last entry collects unknown kinds
structure             10      :data:`STRUCTURE_FEATURES`, each squashed by ``x / (x + scale)``
                              with the scale in :data:`STRUCTURE_SCALES` (fractions as is)
progress              2       current cost / initial cost (clipped to [0, 2], halved), and
                              steps taken / step budget
action mask           A       1 where the action would change the graph (stop: always 1);
                              only with ``include_mask=True``
recent actions        H * A   one-hot of the last ``H`` actions, most recent first (zeros
                              before the first step)
====================  ======  =================================================================

Without the mask block a policy can be run lazily: try its actions from the highest score
down and take the first that changes the graph, instead of trying every action at every step
(:func:`kiln.passes.ordering.learned.rollout`); the environment still offers the mask to
``MaskablePPO`` through ``action_masks()``.

The vocabulary is part of the spec, not read from the registry at every call: a trained
policy stores its vocabulary, so ops declared later fall into the "unknown" bucket instead
of changing the vector's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kiln.ir import Graph, all_ops
from kiln.passes.fusion import kernel_count, node_class
from kiln.passes.ordering.cost import edge_count, op_count

STRUCTURE_FEATURES = (
    "nodes",
    "edges",
    "kernels",
    "op_count",
    "constants",
    "depth",
    "max_fanout",
    "mean_fanout",
    "view_fraction",
    "fused_fraction",
)
"""Structural statistics of the top-level graph (``op_count`` includes fused bodies)."""

STRUCTURE_SCALES = {
    "nodes": 100.0,
    "edges": 200.0,
    "kernels": 50.0,
    "op_count": 100.0,
    "constants": 20.0,
    "depth": 50.0,
    "max_fanout": 10.0,
    "mean_fanout": 2.0,
}
"""Scale ``s`` of the squashing ``x / (x + s)``: a feature equal to its scale encodes as 0.5."""


def default_op_names() -> tuple[str, ...]:
    """Every op name in the registry now, sorted: the default vocabulary."""
    return tuple(sorted(all_ops()))


def structure(graph: Graph) -> dict[str, float]:
    """The raw values of :data:`STRUCTURE_FEATURES` for ``graph``."""
    nodes = graph.nodes
    producer_depth: dict[object, int] = {}
    fanout: dict[object, int] = {}
    depth = 0
    for node in nodes:
        d = 1 + max((producer_depth.get(v, 0) for v in node.inputs), default=0)
        for v in node.outputs:
            producer_depth[v] = d
        for v in node.inputs:
            fanout[v] = fanout.get(v, 0) + 1
        depth = max(depth, d)
    n = len(nodes)
    return {
        "nodes": float(n),
        "edges": float(edge_count(graph)),
        "kernels": float(kernel_count(graph)),
        "op_count": float(op_count(graph)),
        "constants": float(len(graph.constants)),
        "depth": float(depth),
        "max_fanout": float(max(fanout.values(), default=0)),
        "mean_fanout": float(np.mean(list(fanout.values()))) if fanout else 0.0,
        "view_fraction": sum(node_class(x) == "view" for x in nodes) / n if n else 0.0,
        "fused_fraction": sum(x.op_name == "fused" for x in nodes) / n if n else 0.0,
    }


@dataclass(frozen=True)
class ObservationSpec:
    """Shape and meaning of observations (see the module docstring)."""

    op_names: tuple[str, ...]
    n_actions: int
    history: int = 2
    include_mask: bool = True

    @property
    def size(self) -> int:
        mask = self.n_actions if self.include_mask else 0
        return len(self.op_names) + 1 + len(STRUCTURE_FEATURES) + 2 + mask + self.n_actions * self.history

    def names(self) -> list[str]:
        """A name for every entry of the vector, in order."""
        out = [f"op:{k}" for k in self.op_names] + ["op:<unknown>"]
        out += [f"structure:{k}" for k in STRUCTURE_FEATURES] + ["cost_ratio", "step_fraction"]
        out += [f"mask:{i}" for i in range(self.n_actions)] if self.include_mask else []
        out += [f"recent{h}:{i}" for h in range(self.history) for i in range(self.n_actions)]
        return out

    def graph_features(self, graph: Graph) -> np.ndarray:
        """The op histogram and structure blocks for ``graph`` (cacheable per graph)."""
        index = {k: i for i, k in enumerate(self.op_names)}
        hist = np.zeros(len(self.op_names) + 1, dtype=np.float32)
        for node in graph.nodes:
            hist[index.get(node.op_name, len(self.op_names))] += 1
        if graph.nodes:
            hist /= len(graph.nodes)
        stats = structure(graph)
        squashed = [
            stats[k] / (stats[k] + STRUCTURE_SCALES[k]) if k in STRUCTURE_SCALES else stats[k]
            for k in STRUCTURE_FEATURES
        ]
        return np.concatenate([hist, np.asarray(squashed, dtype=np.float32)])

    def encode(
        self,
        graph_features: np.ndarray,
        mask: np.ndarray | None,
        cost_ratio: float,
        step_fraction: float,
        recent: Sequence[int],
    ) -> np.ndarray:
        """The full observation; ``recent`` holds past action indices, most recent first;
        ``mask`` is ignored (may be ``None``) without ``include_mask``."""
        history = np.zeros((self.history, self.n_actions), dtype=np.float32)
        for h, action in enumerate(list(recent)[: self.history]):
            history[h, action] = 1.0
        progress = np.array(
            [min(max(cost_ratio, 0.0), 2.0) / 2.0, min(max(step_fraction, 0.0), 1.0)], dtype=np.float32
        )
        blocks = [graph_features.astype(np.float32), progress]
        if self.include_mask:
            blocks.append(np.asarray(mask, dtype=np.float32))
        return np.concatenate(blocks + [history.reshape(-1)])
