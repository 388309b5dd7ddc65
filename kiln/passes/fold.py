"""Constant folding with the registry's reference implementations."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.base import Pass, PassResult, register_pass


def evaluate(node: Node, operands: list[np.ndarray]) -> tuple[np.ndarray, ...] | None:
    """Run ``node``'s reference implementation; results cast to the node's result types.

    Returns ``None`` when the op has no reference, the reference raises, or a result's
    shape disagrees with the node's type (the node is then left for the runtime to run
    and report).
    """
    ref = node.op.reference
    if ref is None:
        return None
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            out = ref(*operands, **node.attrs)
    except Exception:  # noqa: BLE001 - folding is optional; the runtime reports the failure
        return None
    results = out if isinstance(out, tuple) else (out,)
    if len(results) != len(node.outputs):
        return None
    arrays = []
    for value, result in zip(node.outputs, results):
        arr = np.asarray(result)
        if tuple(arr.shape) != tuple(value.shape):
            return None
        arrays.append(arr.astype(value.dtype.numpy, copy=False))
    return tuple(arrays)


@register_pass
@dataclass(frozen=True)
class ConstantFolding(Pass):
    """Replace nodes whose operands are all constants by constants holding their results.

    A node folds when it is pure (no trait ``random``), every operand is a graph constant
    or an already folded result, every result is static with at most ``max_elements``
    elements, and its reference implementation runs.  Creation ops (``arange``, ``full``)
    have no operands, so they fold under the same size limit.  Parameters and inputs are
    never folded.  Results have exactly the node's types (the same arrays the reference
    executor would compute).  Idempotent.
    """

    name: ClassVar[str] = "fold"
    max_elements: int = 65536

    def run(self, graph: Graph) -> PassResult:
        g = graph.clone()
        known: dict[Value, np.ndarray] = {c: c.data for c in g.constants}
        replace: dict[Value, Value] = {}
        folded: list[Node] = []
        for node in g.nodes:
            if not self._foldable(node, known):
                continue
            results = evaluate(node, [known[v] for v in node.inputs])
            if results is None:
                continue
            for value, data in zip(node.outputs, results):
                new = g.add_constant(data, dtype=value.dtype)
                known[value] = new.data
                known[new] = new.data
                replace[value] = new
            folded.append(node)
        if not folded:
            return PassResult(graph, False)
        for node in g.nodes:
            node.inputs = tuple(replace.get(v, v) for v in node.inputs)
        g.outputs = [replace.get(v, v) for v in g.outputs]
        for node in folded:
            g.remove_node(node)
        g.remove_unused_constants()
        return PassResult(g, True)

    def _foldable(self, node: Node, known: dict[Value, np.ndarray]) -> bool:
        if node.op.has("random") or not node.outputs:
            return False
        if not all(v in known for v in node.inputs):
            return False
        return all(v.type.is_static and v.type.numel <= self.max_elements for v in node.outputs)
