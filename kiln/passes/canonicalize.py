"""Canonical forms: one spelling for each computation, so later passes match less variety.

The rules:

* Operands of commutative two-operand ops (trait ``commutative``) are ordered: constants
  (graph constants and ``full`` results) second, otherwise by definition order (inputs,
  params, constants, then node results in graph order).
* Axis attributes are non-negative: the attributes an op declares with ``axes=`` (see
  :class:`kiln.ir.Attr`; the table is :func:`axis_attrs`) are taken modulo the rank of the
  first operand; axis *sets* (reduction dims, flip dims) are also sorted and deduplicated;
  ``select``'s ``index`` is made non-negative and ``slice``'s ``start``/``end`` are clamped
  into ``[0, size]`` (static sizes only; these two rules name their ops).
* ``reshape`` and ``expand`` spell out their result shape (no ``-1``).
* ``permute`` by the identity, and ``reshape``/``expand``/``slice`` results with the
  operand's own shape, are removed.
* ``sub(x, c)`` with a floating constant ``c`` becomes ``add(x, -c)`` (exact: IEEE
  subtraction is addition of the negation), so it meets ``add``'s rewrites and CSE.

Every rule keeps exact result types and values.  Idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from kiln.ir import Graph, Node, Value, all_ops
from kiln.passes.base import PassResult, register_pass
from kiln.passes.pattern import (
    FLOAT_DTYPES,
    Builder,
    Match,
    PatternPass,
    Rewrite,
    any_value,
    apply_patterns,
    const,
    constant_data,
    is_constant,
    op,
    rewrite,
)
from kiln.passes.simplify import identity_permute, view_to_same_shape

def axis_attrs() -> dict[str, dict[str, str]]:
    """Op name -> {attribute: form} for every registered op with attributes declared
    ``Attr(..., axes=form)``: ``axis`` one axis (``None`` allowed), ``seq`` an ordered list
    of axes, ``set`` an unordered set of axes.  Axes count in the first operand's rank."""
    table: dict[str, dict[str, str]] = {}
    for name, opdef in all_ops().items():
        forms = {key: spec.axes for key, spec in opdef.attrs.items() if spec.axes is not None}
        if forms:
            table[name] = forms
    return table


def _normal_axes(node: Node) -> dict[str, Any]:
    """``node``'s attributes with axes, select index and slice bounds in canonical form."""
    attrs = dict(node.attrs)
    forms = {key: spec.axes for key, spec in node.op.attrs.items()
             if spec.axes is not None and attrs.get(key) is not None}
    if not forms or not node.inputs:
        return attrs
    rank = max(node.inputs[0].type.rank, 1)
    for key, form in forms.items():
        value = attrs[key]
        if form == "axis":
            attrs[key] = value % rank
        elif form == "seq":
            attrs[key] = tuple(d % rank for d in value)
        else:
            attrs[key] = tuple(sorted({d % rank for d in value}))
    if node.op_name == "select":
        size = node.inputs[0].shape[attrs["dim"]]
        if isinstance(size, int) and size > 0 and isinstance(attrs["index"], int):
            attrs["index"] = attrs["index"] % size
    if node.op_name == "slice":
        attrs.update(_clamped_slice(node.inputs[0].shape[attrs["dim"]], attrs))
    return attrs


def _clamped_slice(size: Any, attrs: dict[str, Any]) -> dict[str, int]:
    """Static bounds clamped into a static axis; symbolic sizes or bounds are left as they
    are (the clamp would depend on the sizes' values)."""
    if not all(isinstance(v, int) for v in (size, attrs["start"], attrs["end"])) or attrs.get("step", 1) <= 0:
        return {}
    start, end = attrs["start"], attrs["end"]
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, 0), size)
    return {"start": start, "end": max(end, start)}


def _has_noncanonical_axes(v: Value) -> bool:
    node = v.producer
    return node is not None and _normal_axes(node) != node.attrs


def _normalize_axes(m: Match, b: Builder) -> Value | Sequence[Value] | None:
    node = m.root
    new = b.node(node.op_name, node.inputs, _normal_axes(node))
    return new.outputs


@rewrite(op(("reshape", "expand"), any_value("x"),
            where=lambda v: v.type.is_static and tuple(v.producer.attrs["shape"]) != tuple(v.shape)))
def explicit_view_shape(m: Match, b: Builder) -> Value | None:
    return b.op(m.root.op_name, m["x"], shape=tuple(m.value.shape))


@rewrite(op("sub", any_value("x"), const("c", dtype=FLOAT_DTYPES)))
def sub_const_to_add(m: Match, b: Builder) -> Value | None:
    data = constant_data(m["c"], max_elements=1 << 16)
    if data is None:
        return None
    negated = b.const(np.negative(data), dtype=m["c"].dtype)
    out = b.op("add", m["x"], negated)
    return out if out.type == m.value.type else None


def canonicalize_rewrites() -> tuple[Rewrite, ...]:
    """The rewrites of the pass; axis normalization covers every registered op that declares
    an attribute with ``axes=`` (:func:`axis_attrs`)."""
    normalize_axes = Rewrite("normalize_axes",
                             op(tuple(sorted(axis_attrs())), where=_has_noncanonical_axes),
                             _normalize_axes)
    return (normalize_axes, explicit_view_shape, identity_permute, view_to_same_shape,
            sub_const_to_add)


def order_commutative_operands(graph: Graph) -> bool:
    """Put operands of commutative binary nodes in canonical order, in place. Returns changed."""
    position = {v: i for i, v in enumerate(graph.values())}
    changed = False
    for node in graph.nodes:
        if len(node.inputs) != 2 or not node.op.has("commutative"):
            continue
        a, b = node.inputs
        if _order_key(a, position) > _order_key(b, position):
            node.inputs = (b, a)
            changed = True
    return changed


def _order_key(v: Value, position: dict[Value, int]) -> tuple[bool, int]:
    return (is_constant(v), position[v])


@register_pass
@dataclass(frozen=True)
class Canonicalize(PatternPass):
    """Rewrite the graph into canonical form (see :mod:`kiln.passes.canonicalize`).

    Guarantees: exact result types and values are kept; idempotent (a second run reports
    ``changed=False``).
    """

    name: ClassVar[str] = "canonicalize"

    def rewrites(self) -> Sequence[Rewrite]:
        return canonicalize_rewrites()

    def run(self, graph: Graph) -> PassResult:
        rewritten = apply_patterns(graph, self.rewrites(), max_rounds=self.max_rounds)
        g = rewritten.graph if rewritten.changed else graph.clone()
        if order_commutative_operands(g):
            return PassResult(g, True)
        return PassResult(g if rewritten.changed else graph, rewritten.changed)
