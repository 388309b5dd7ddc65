"""``decompose``: expand composite ops into primitive ops (the inverse of ``composites``).

Registered pass ``decompose{ops="all"}``; ``ops`` is ``"all"`` or a comma-separated subset of
:data:`DECOMPOSITIONS`.  Each decomposition writes the form that the ``composites`` pass
recognizes, so ``decompose`` then ``composites`` gives the composite ops back:

==================  =========================================================================
op                  becomes
==================  =========================================================================
``gelu``            ``0.5 * x * (1 + erf(x * (1/sqrt 2)))``, or the ``tanh`` form
``silu``            ``x * sigmoid(x)``
``silu_mul``        ``silu(a) * b``
``softmax``         ``exp(x - amax(x)) / sum(exp(x - amax(x)))``
``log_softmax``     ``(x - amax(x)) - log(sum(exp(x - amax(x))))``
``layer_norm``      ``(x - mean(x)) * rsqrt(mean((x - mean(x))^2) + eps) [* w] [+ b]``
``rms_norm``        ``x * rsqrt(mean(x * x) + eps) [* w]``
==================  =========================================================================

It exists so pass ordering can choose between composite recognition and decomposition (a
decomposed op exposes its pieces to fusion and simplification; a composite op is one
kernel).  Only ``f32`` and ``f64`` ops are expanded: the references of the composite ops
compute half precision in ``f32``, which a decomposition in the op's own dtype would not.

Guarantees: the input graph is untouched; outputs are unchanged up to floating-point
rounding (a few ulps); result types, inputs, params and output order are kept; idempotent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kiln.ir import DType, Graph, Node, Value
from kiln.passes.base import Pass, PassResult, register_pass

_WIDE_FLOATS = (DType.float32, DType.float64)


class _Emitter:
    """Adds nodes before ``anchor`` and scalar constants of one dtype."""

    def __init__(self, graph: Graph, anchor: Node, dtype: DType):
        self.graph = graph
        self.anchor = anchor
        self.dtype = dtype

    def op(self, kind: str, *inputs: Value, **attrs) -> Value:
        return self.graph.add_node(kind, inputs, attrs, before=self.anchor, loc=self.anchor.loc).output

    def scalar(self, value: float) -> Value:
        return self.graph.add_constant(np.array(value, dtype=self.dtype.numpy))


def _axes(rank: int, normalized_rank: int) -> tuple[int, ...]:
    return tuple(range(rank - normalized_rank, rank))


def _gelu(e: _Emitter, node: Node) -> Value:
    x = node.inputs[0]
    if node.attrs["approximate"] == "tanh":
        cube = e.op("mul", e.op("mul", x, x), x)
        inner = e.op("add", x, e.op("mul", cube, e.scalar(0.044715)))
        t = e.op("tanh", e.op("mul", inner, e.scalar(math.sqrt(2.0 / math.pi))))
    else:
        t = e.op("erf", e.op("mul", x, e.scalar(1.0 / math.sqrt(2.0))))
    return e.op("mul", e.op("mul", x, e.scalar(0.5)), e.op("add", t, e.scalar(1.0)))


def _silu(e: _Emitter, node: Node) -> Value:
    x = node.inputs[0]
    return e.op("mul", x, e.op("sigmoid", x))


def _silu_mul(e: _Emitter, node: Node) -> Value:
    a, b = node.inputs
    return e.op("mul", e.op("silu", a), b)


def _shifted(e: _Emitter, x: Value, dim: int) -> Value:
    return e.op("sub", x, e.op("amax", x, dims=(dim,), keepdim=True))


def _softmax(e: _Emitter, node: Node) -> Value:
    exp = e.op("exp", _shifted(e, node.inputs[0], node.attrs["dim"]))
    return e.op("div", exp, e.op("sum", exp, dims=(node.attrs["dim"],), keepdim=True))


def _log_softmax(e: _Emitter, node: Node) -> Value:
    dim = node.attrs["dim"]
    z = _shifted(e, node.inputs[0], dim)
    total = e.op("sum", e.op("exp", z), dims=(dim,), keepdim=True)
    return e.op("sub", z, e.op("log", total))


def _affine(e: _Emitter, y: Value, node: Node) -> Value:
    for kind, param in zip(("mul", "add"), node.inputs[1:]):
        y = e.op(kind, y, param)
    return y


def _layer_norm(e: _Emitter, node: Node) -> Value:
    x = node.inputs[0]
    axes = _axes(x.type.rank, node.attrs["normalized_rank"])
    d = e.op("sub", x, e.op("mean", x, dims=axes, keepdim=True))
    var = e.op("mean", e.op("mul", d, d), dims=axes, keepdim=True)
    y = e.op("mul", d, e.op("rsqrt", e.op("add", var, e.scalar(node.attrs["eps"]))))
    return _affine(e, y, node)


def _rms_norm(e: _Emitter, node: Node) -> Value:
    x = node.inputs[0]
    axes = _axes(x.type.rank, node.attrs["normalized_rank"])
    ms = e.op("mean", e.op("mul", x, x), dims=axes, keepdim=True)
    y = e.op("mul", x, e.op("rsqrt", e.op("add", ms, e.scalar(node.attrs["eps"]))))
    return _affine(e, y, node)


DECOMPOSITIONS: dict[str, Callable[[_Emitter, Node], Value]] = {
    "gelu": _gelu,
    "silu": _silu,
    "silu_mul": _silu_mul,
    "softmax": _softmax,
    "log_softmax": _log_softmax,
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
}
"""Decomposition rule per composite op name."""


def select_ops(ops: str) -> tuple[str, ...]:
    """Op names selected by an ``ops`` option (``"all"`` or comma-separated names)."""
    if ops.strip() == "all":
        return tuple(DECOMPOSITIONS)
    chosen = tuple(p.strip() for p in ops.split(",") if p.strip())
    unknown = [p for p in chosen if p not in DECOMPOSITIONS]
    if unknown:
        raise ValueError(
            f"decompose: unknown op(s) {', '.join(unknown)}; known: all, {', '.join(DECOMPOSITIONS)}"
        )
    return chosen


@register_pass
@dataclass(frozen=True)
class Decompose(Pass):
    """Expand the selected composite ops into primitives (see :mod:`kiln.passes.decompose`)."""

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
            replacement = DECOMPOSITIONS[node.op_name](_Emitter(g, node, node.output.dtype), node)
            g.replace_all_uses(node.output, replacement)
            g.remove_node(node)
        return PassResult(g, True)
