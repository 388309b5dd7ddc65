"""``recompute``: duplicate cheap elementwise producers so each consumer gets its own copy.

Registered pass ``recompute{max_users=4}``.  A pure elementwise node (trait ``elementwise``)
whose result is used by 2 to ``max_users`` distinct nodes, and is not a graph output, is
copied for its consumers that can take it into their kernel (elementwise and reduction
consumers, which fusion lets absorb a prologue; a matmul or conv consumer cannot), so each
of those reads its own copy; the other consumers share the original.  Nodes are visited from the
outputs backwards, so the producers of a copied node are considered with their new users.
The graph grows by at most its own size per run.

Why: ``fuse`` puts every node in one kernel, so a value shared by two kernels is written to
memory by one and read back by the other.  With a copy per consumer, each copy fuses into
its consumer's kernel and the value never reaches memory: more arithmetic, fewer bytes,
the trade XLA's fusion makes by duplicating cheap producers.  In a training graph (forward
and backward in one graph, :mod:`kiln.passes.autodiff`) the copies that feed the backward
part recompute forward values instead of keeping them alive: rematerialization.  ``cse``
undoes it, so where it goes in a pipeline matters.

Guarantees: the input graph is untouched; outputs are unchanged (the copies compute exactly
what the original computes); types, inputs, params and output order are kept; idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, Node, Value
from kiln.passes.base import Pass, PassResult, register_pass
from kiln.passes.fusion import node_class

_ABSORBING = frozenset({"elementwise", "reduction"})


def is_recomputable(node: Node) -> bool:
    """Pure, single-result, elementwise, with operands (creation ops are free already), and
    reading at most one operand as large as its result: a copy then reads no more memory
    than reading the shared result would."""
    if not (
        node.op.has("elementwise")
        and not node.op.has("random")
        and len(node.outputs) == 1
        and node.inputs
        and node.output.type.is_static
    ):
        return False
    size = node.output.type.numel
    large = [v for v in node.inputs if not v.type.is_static or v.type.numel >= size]
    return len(large) <= 1


@register_pass
@dataclass(frozen=True)
class Recompute(Pass):
    """Give each consumer of a cheap shared elementwise value its own copy (see module)."""

    name: ClassVar[str] = "recompute"
    max_users: int = 4

    def __post_init__(self) -> None:
        if self.max_users < 2:
            raise ValueError(f"recompute: max_users must be at least 2, got {self.max_users}")

    def _plan(self, node: Node, consumers: list[Node], outputs: set[Value]) -> list[Node]:
        """The consumers of ``node`` that get a copy (empty: leave ``node`` alone)."""
        if not is_recomputable(node) or node.output in outputs or not 2 <= len(consumers) <= self.max_users:
            return []
        absorbing = [c for c in consumers if node_class(c) in _ABSORBING]
        if len(absorbing) == len(consumers):
            return absorbing[1:]  # the original serves the first one
        return absorbing

    def run(self, graph: Graph) -> PassResult:
        outputs = set(graph.outputs)
        users = graph.users()
        if not any(
            self._plan(n, list(dict.fromkeys(users.get(n.outputs[0], []))), outputs)
            for n in graph.nodes
            if n.outputs
        ):
            return PassResult(graph, False)
        g = graph.clone()
        outputs = set(g.outputs)
        users = g.users()
        budget = len(g.nodes)
        for node in reversed(list(g.nodes)):
            if not node.outputs:
                continue
            consumers = list(dict.fromkeys(users.get(node.outputs[0], [])))  # distinct, in order
            copies_for = self._plan(node, consumers, outputs)
            if not copies_for or budget < len(copies_for):
                continue
            for consumer in copies_for:
                copy = g.add_node(node.op, node.inputs, node.attrs, before=consumer, loc=node.loc)
                consumer.inputs = tuple(copy.output if v is node.output else v for v in consumer.inputs)
                for v in node.inputs:
                    users.setdefault(v, []).append(copy)
                users[copy.output] = [consumer]
                budget -= 1
            users[node.output] = [c for c in consumers if c not in copies_for]
        g.sort()
        return PassResult(g, True)
