"""Dead code elimination."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, Node
from kiln.passes.base import Pass, PassResult, register_pass


def live_nodes(graph: Graph) -> list[Node]:
    """The nodes of ``graph`` that DCE keeps, in graph order.

    A node is live when one of its results is a graph output or an operand of a live node,
    when it is impure (trait ``random``: removing it would change later random draws), or
    when it has no results at all (it exists for an effect kiln cannot see).
    """
    live_values = set(graph.outputs)
    keep: list[Node] = []
    for node in reversed(graph.nodes):
        needed = (node.op.has("random") or not node.outputs
                  or any(v in live_values for v in node.outputs))
        if needed:
            keep.append(node)
            live_values.update(node.inputs)
    keep.reverse()
    return keep


@register_pass
@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    """Remove nodes whose results are unused, and unused constants.

    Guarantees: graph outputs and every value they depend on are kept; impure nodes (trait
    ``random``) and result-less nodes are never removed; inputs and parameters are never
    removed (they are the graph's interface), even when unused.  Idempotent.
    """

    name: ClassVar[str] = "dce"

    def run(self, graph: Graph) -> PassResult:
        keep = live_nodes(graph)
        used = {v for n in keep for v in n.inputs} | set(graph.outputs)
        dead_consts = [c for c in graph.constants if c not in used]
        if len(keep) == len(graph.nodes) and not dead_consts:
            return PassResult(graph, False)
        g = graph.clone()
        # clone() copies nodes one to one and in order, so positions identify them.
        keep_set = set(keep)
        live_positions = {i for i, n in enumerate(graph.nodes) if n in keep_set}
        for i, node in reversed(list(enumerate(g.nodes))):
            if i not in live_positions:
                g.remove_node(node)
        g.remove_unused_constants()
        return PassResult(g, True)
