"""``inline-custom-vjp``: replace every ``custom_vjp`` node by its forward graph.

A ``custom_vjp`` node (:mod:`kiln.ir.ops.custom`, a ``torch.autograd.Function``) must stay
whole until autodiff has run, since its gradient rule is the Function's own backward graph.
After that it is just its forward computation: this pass copies the forward graph's nodes
into the surrounding graph in the node's place (nested ``custom_vjp`` nodes too), so every
later pass and every backend sees ordinary ops.  It is the first pass of the default pipeline;
:func:`inline_custom_vjp` is the same transformation for callers that build a graph without a
pipeline (``kiln.compiler`` applies it to every forward graph it builds after autodiff).

Guarantees: the graph's inputs, params and outputs are unchanged; results of the node nobody
reads (the saved tensors of an inference graph) become dead code for ``dce``; a graph
without ``custom_vjp`` nodes is returned as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph
from kiln.ir.ops.custom import inline_body
from kiln.passes.base import Pass, PassResult, register_pass

OP = "custom_vjp"


def has_custom_vjp(graph: Graph) -> bool:
    return any(n.op_name == OP for n in graph.nodes)


def inline_custom_vjp(graph: Graph) -> Graph:
    """A clone of ``graph`` with every ``custom_vjp`` node replaced by its forward graph's
    nodes, or ``graph`` itself when it has none."""
    if not has_custom_vjp(graph):
        return graph
    g = graph.clone()
    while has_custom_vjp(g):  # a forward graph may hold custom_vjp nodes of its own
        for node in [n for n in g.nodes if n.op_name == OP]:
            results = inline_body(g, node.attrs["forward"], node.inputs, loc=node.loc, before=node)
            for out, value in zip(node.outputs, results):
                g.replace_all_uses(out, value)
            g.remove_node(node)
    return g


@register_pass
@dataclass(frozen=True)
class InlineCustomVjp(Pass):
    """Replace ``custom_vjp`` nodes by their forward graphs (see the module docstring)."""

    name: ClassVar[str] = "inline-custom-vjp"

    def run(self, graph: Graph) -> PassResult:
        result = inline_custom_vjp(graph)
        return PassResult(result, result is not graph)


__all__ = ["InlineCustomVjp", "has_custom_vjp", "inline_custom_vjp"]
