"""Common subexpression elimination."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from kiln.ir import DType, Graph, Node, Value
from kiln.passes.base import Pass, PassResult, register_pass


def freeze_attr(value: Any) -> Any:
    """A hashable key for an attribute value that tells apart what compares equal loosely.

    ``True`` and ``1``, ``0.0`` and ``-0.0`` get different keys; NaN equals NaN; nested
    graphs are keyed by their text form (which determines them).
    """
    if isinstance(value, bool) or value is None:
        return ("b", value)
    if isinstance(value, int):
        return ("i", value)
    if isinstance(value, float):
        return ("f", "nan" if math.isnan(value) else repr(value))
    if isinstance(value, (str, DType)):
        return ("s", value)
    if isinstance(value, (list, tuple)):
        return ("l", tuple(freeze_attr(v) for v in value))
    if type(value).__name__ == "Graph":
        return ("g", str(value))
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return ("o", type(value).__name__, value)


def node_key(node: Node, operands: tuple[Value, ...]) -> tuple:
    """The key under which two nodes compute the same results (given equal operands)."""
    ids = tuple(id(v) for v in operands)
    if node.op.has("commutative") and len(ids) == 2:
        ids = tuple(sorted(ids))
    attrs = tuple((k, freeze_attr(v)) for k, v in node.attrs.items())
    return (node.op_name, ids, attrs)


def _const_key(value: Value) -> tuple:
    data = value.data
    return (value.type, data.tobytes())


@register_pass
@dataclass(frozen=True)
class CommonSubexpressionElimination(Pass):
    """Merge nodes that compute the same thing, and constants with equal contents.

    Two nodes merge when they have the same op, the same operands (either order for ops with
    trait ``commutative`` and two operands) and equal attributes; the earlier node is kept
    and the later one's uses are redirected to it.  Equal constants (same type and bytes)
    are deduplicated.  Impure nodes (trait ``random``) are never merged.  Idempotent.
    """

    name: ClassVar[str] = "cse"

    def run(self, graph: Graph) -> PassResult:
        g = graph.clone()
        replace: dict[Value, Value] = {}
        seen_consts: dict[tuple, Value] = {}
        for c in g.constants:
            first = seen_consts.setdefault(_const_key(c), c)
            if first is not c:
                replace[c] = first
        seen_nodes: dict[tuple, Node] = {}
        dead: list[Node] = []
        for node in g.nodes:
            if any(v in replace for v in node.inputs):
                node.inputs = tuple(replace.get(v, v) for v in node.inputs)
            if node.op.has("random") or not node.outputs:
                continue
            key = node_key(node, node.inputs)
            first = seen_nodes.setdefault(key, node)
            if first is node:
                continue
            replace.update(zip(node.outputs, first.outputs))
            dead.append(node)
        if not replace:
            return PassResult(graph, False)
        g.outputs = [replace.get(v, v) for v in g.outputs]
        for node in dead:
            g.remove_node(node)
        g.remove_unused_constants()
        return PassResult(g, True)
