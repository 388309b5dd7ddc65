"""``decompose``: expand composite ops into simpler ops (the inverse of ``composites``).

Registered pass ``decompose{ops="all"}``; ``ops`` is ``"all"`` or a comma-separated subset of
:func:`decomposable_ops`, the ops whose declaration carries a decomposition
(``defop(..., decompose=rule)``, :attr:`kiln.ir.OpDef.decompose`).  The pass has no list of
its own: a node is expanded by its op's rule, ``rule(builder, node)``, which adds the simpler
nodes through a :class:`~kiln.ir.builder.GraphBuilder` inserting before the node (at the
node's source location) and returns one value per result.

kiln's own decompositions (``gelu``, ``silu``, ``silu_mul``, ``softmax``, ``log_softmax``,
``layer_norm``, ``rms_norm``; each written beside its op in :mod:`kiln.ir.ops`) write the
form that the ``composites`` pass recognizes, so ``decompose`` then ``composites`` gives the
composite ops back.

It exists so pass ordering can choose between composite recognition and decomposition (a
decomposed op exposes its pieces to fusion and simplification; a composite op is one
kernel).  Only nodes whose results are all ``f32`` or ``f64`` are expanded: the references
of the composite ops compute half precision in ``f32``, which a decomposition in the op's
own dtype would not.

Guarantees: the input graph is untouched; outputs are unchanged up to floating-point
rounding (a few ulps); result types, inputs, params and output order are kept (a rule whose
values differ in number or type from the node's results raises :class:`~kiln.ir.KilnError`
naming the op).  One run expands the nodes of the input graph, not the ones a rule
emits: ``silu_mul`` becomes ``silu(a) * b``, whose ``silu`` a second run expands; for the
other ops the pass is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import DType, Graph, KilnError, Node, Value, all_ops
from kiln.ir.builder import GraphBuilder
from kiln.passes.base import Pass, PassResult, register_pass

_WIDE_FLOATS = (DType.float32, DType.float64)


def decomposable_ops() -> tuple[str, ...]:
    """Names of the registered ops that declare a decomposition, sorted."""
    return tuple(sorted(name for name, op in all_ops().items() if op.decompose is not None))


def select_ops(ops: str) -> tuple[str, ...]:
    """Op names selected by an ``ops`` option (``"all"`` or comma-separated names)."""
    known = decomposable_ops()
    if ops.strip() == "all":
        return known
    chosen = tuple(p.strip() for p in ops.split(",") if p.strip())
    unknown = [p for p in chosen if p not in known]
    if unknown:
        raise ValueError(
            f"decompose: unknown op(s) {', '.join(unknown)}; known: all, {', '.join(known)}"
        )
    return chosen


def expand(graph: Graph, node: Node) -> tuple[Value, ...]:
    """Insert ``node``'s decomposition before it in ``graph``; its values, one per result."""
    builder = GraphBuilder(graph, loc=node.loc, before=node)
    values = node.op.decompose(builder, node)
    values = (values,) if isinstance(values, Value) else tuple(values)
    got = [v.type if isinstance(v, Value) else type(v).__name__ for v in values]
    if got != [v.type for v in node.outputs]:
        raise KilnError(
            f"decompose: the decomposition of {node.op_name} returned {', '.join(map(str, got)) or 'nothing'}"
            f" for results {', '.join(str(v.type) for v in node.outputs)}; it must return one value "
            "of exactly each result's type"
        )
    return values


@register_pass
@dataclass(frozen=True)
class Decompose(Pass):
    """Expand the selected composite ops into simpler ones (see :mod:`kiln.passes.decompose`)."""

    name: ClassVar[str] = "decompose"
    ops: str = "all"

    def __post_init__(self) -> None:
        select_ops(self.ops)

    def run(self, graph: Graph) -> PassResult:
        chosen = set(select_ops(self.ops))

        def wanted(node: Node) -> bool:
            return node.op_name in chosen and all(v.dtype in _WIDE_FLOATS for v in node.outputs)

        if not any(wanted(n) for n in graph.nodes):
            return PassResult(graph, False)
        g = graph.clone()
        for node in [n for n in g.nodes if wanted(n)]:
            for old, new in zip(node.outputs, expand(g, node)):
                g.replace_all_uses(old, new)
            g.remove_node(node)
        return PassResult(g, True)


__all__ = ["Decompose", "decomposable_ops", "expand", "select_ops"]

