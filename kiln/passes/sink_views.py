"""View sinking: move layout ops (permute, reshape, expand) towards the outputs.

A view -- an op with trait ``whole_view``, one that reads every element of its operand:
``permute``, ``reshape``, ``expand`` (see :attr:`kiln.ir.OpDef.traits`) -- feeding an
elementwise op is moved after it, or absorbed into it, so that views meet
each other (and cancel: ``permute(p^-1)`` after ``permute(p)``) or reach consumers that read
them for free.  The rules (``ew`` is any op with trait ``elementwise``):

1. ``ew(permute(a, p))`` (unary)  ->  ``permute(ew(a), p)``; the same for ``reshape`` and
   ``expand`` (after ``expand`` the op runs on the smaller tensor).
2. ``ew(view(a), view(b))`` with the same view (same op, same attributes) and operands of
   the same shape  ->  ``view(ew(a, b))``: one view instead of two.
3. ``ew(view(a), s)`` or ``ew(s, view(a))`` with ``s`` of rank 0  ->  ``view(ew(a, s))``.
4. ``ew(..., expand(a), ...)``  ->  ``ew(..., a, ...)`` when implicit broadcasting gives the
   same result shape: the expand disappears into the consumer.
5. ``permute(permute(x))`` compose into one ``permute`` (or none), as in ``simplify``.
6. ``permute(matmul(a, b), [1, 0])`` of matrices, the product used only there  ->
   ``matmul(permute(b), permute(a))`` (``(AB)^T = B^T A^T``): the transposes move onto the
   operands, which GEMMs read transposed at no cost (and which cancel against operands that
   are transposes themselves), instead of making the consumers read the product with a
   stride (the weight gradients of ``nn.Linear`` layers: their optimizer update then reads
   them in order).

Rules 1-3 fire only when every moved view has no other user, so the number of view nodes
never grows; rule 6 trades one view for two free ones.  Apart from rule 6, views are never
moved past non-elementwise ops: a ``permute`` swapping the last two dims in front of
``matmul`` stays where it is, since a backend reads the operand transposed at no cost.
Every rewrite keeps the exact result type, and the values (rule 6 up to the order in which
a GEMM sums its products).  The pass
terminates (views only move towards the outputs, except that rule 6 moves a transpose from
a product onto its operands, towards the inputs) and is idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Node, Value, all_ops
from kiln.ir.types import broadcast_shapes
from kiln.passes.base import register_pass
from kiln.passes.cse import freeze_attr
from kiln.passes.pattern import Builder, Match, PatternPass, Rewrite, any_value
from kiln.passes.pattern import op as op_pattern
from kiln.passes.simplify import identity_permute, permute_of_permute

def _movable_view(v: Value, m: Match) -> bool:
    """``v`` is a ``whole_view`` result whose only uses are operands of the matched root."""
    producer = v.producer
    return (producer is not None and producer.op.has("whole_view")
            and m.use_count(v) == m.root.inputs.count(v))


def _view_key(node: Node) -> tuple:
    return (node.op_name, tuple((k, freeze_attr(v)) for k, v in node.attrs.items()))


def _same_type(out: Value, m: Match) -> Value | None:
    return out if out.type == m.value.type else None


def _sink_views(m: Match, b: Builder) -> Value | None:
    """Rules 1-3: ``ew(view(a), view(b), s)`` -> ``view(ew(a, b, s))``."""
    node = m.root
    views = [v.producer for v in node.inputs if _movable_view(v, m)]
    if not views:
        return None
    key = _view_key(views[0])
    sources: list[Value] = []
    operands: list[Value] = []
    for v in node.inputs:
        if _movable_view(v, m) and _view_key(v.producer) == key:
            sources.append(v.producer.inputs[0])
            operands.append(v.producer.inputs[0])
        elif v.type.rank == 0:
            operands.append(v)
        else:
            return None
    if len({s.shape for s in sources}) != 1:
        return None
    inner = b.node(node.op_name, operands, node.attrs).output
    if inner.shape != sources[0].shape:
        return None
    return _same_type(b.op(views[0].op_name, inner, **views[0].attrs), m)


def _absorb_expands(m: Match, b: Builder) -> Value | None:
    """Rule 4: drop ``expand`` operands that implicit broadcasting reproduces."""
    node = m.root
    if len(node.inputs) < 2:
        return None
    operands = list(node.inputs)
    absorbed = False
    for i, v in enumerate(operands):
        if v.producer is None or v.producer.op_name != "expand":
            continue
        trial = [*operands[:i], v.producer.inputs[0], *operands[i + 1:]]
        try:
            shape = broadcast_shapes(*(t.shape for t in trial))
        except ValueError:
            continue
        if shape == m.value.shape:
            operands, absorbed = trial, True
    if not absorbed:
        return None
    return _same_type(b.node(node.op_name, operands, node.attrs).output, m)


def _transpose_of_product(m: Match, b: Builder) -> Value | None:
    if [d % 2 for d in m.value.producer.attrs["dims"]] != [1, 0]:
        return None
    out = b.op("matmul", b.op("permute", m["b"], dims=[1, 0]), b.op("permute", m["a"], dims=[1, 0]))
    return _same_type(out, m)


def _elementwise_op_names() -> tuple[str, ...]:
    return tuple(sorted(name for name, d in all_ops().items()
                        if d.has("elementwise") and not d.has("random")))


def sink_view_rewrites() -> tuple[Rewrite, ...]:
    """The rewrites of the pass, built over every op registered with trait ``elementwise``."""
    names = _elementwise_op_names()
    return (
        Rewrite("absorb_expands", op_pattern(names), _absorb_expands),
        Rewrite("sink_views", op_pattern(names), _sink_views),
        permute_of_permute,
        identity_permute,
        Rewrite("transpose_of_product",
                op_pattern("permute", op_pattern("matmul", any_value("a", rank=2), any_value("b", rank=2),
                                                 one_use=True)),
                _transpose_of_product),
    )


@register_pass
@dataclass(frozen=True)
class SinkViews(PatternPass):
    """Move permute/reshape/expand past elementwise ops (rules in :mod:`kiln.passes.sink_views`).

    Guarantees: exact result types, and values (up to a GEMM's summation order for rule 6);
    the number of view nodes grows only by rule 6 (one transpose of a product becomes two of
    its operands, which GEMMs read for free); views in front of non-elementwise ops (e.g. a
    transposed ``matmul`` operand) are left in place; idempotent.
    """

    name: ClassVar[str] = "sink-views"

    def rewrites(self) -> Sequence[Rewrite]:
        return sink_view_rewrites()
