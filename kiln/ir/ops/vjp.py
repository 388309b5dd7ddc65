"""Gradient-rule vocabulary: the builder rules write backward nodes with, and helpers.

A gradient rule (a vector-Jacobian product, VJP) is attached to an op beside its
declaration, either as ``defop(..., vjp=rule)`` or with the :func:`defvjp` decorator placed
directly after it.  Its signature is::

    rule(b: GradBuilder, inputs: tuple[Value, ...], outputs: tuple[Value, ...],
         cotangents: tuple[Value, ...], attrs: dict) -> Sequence[Value | None]

``inputs``/``outputs`` are the forward node's values, ``cotangents`` hold one cotangent per
output (same type as that output) and ``attrs`` the node's normalized attributes.  The rule
returns one entry per input: a Value of exactly that input's type (shape and dtype), or
``None`` when the gradient is structurally zero or the input is not differentiable
(integer/bool operands, conditions, indices).  Rules add nodes only through ``b``.

Helpers: :func:`unbroadcast` (sum a cotangent back to an operand's broadcast shape and cast
it to its dtype), :func:`expand_reduced` (broadcast a reduction's cotangent back over the
reduced axes), :func:`deflinear` / :func:`defbilinear` (rules of linear and bilinear ops
from their transposes), :func:`elementwise` (rules of unary elementwise ops from their
derivative) and :data:`nondifferentiable` (the explicit rule of ops whose inputs never get a
gradient: comparisons, logical ops, arg-reductions, creation ops).

This module imports nothing outside :mod:`kiln.ir`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


from ..errors import KilnError
from ..builder import GraphBuilder
from ..graph import Graph, Value
from ..registry import _REGISTRY
from ..types import TensorType

VjpRule = Callable[..., Sequence["Value | None"]]


class GradBuilder(GraphBuilder):
    """Adds backward nodes to a graph on behalf of a gradient rule.

    Every node it builds carries ``loc`` (the forward node's source location), so errors
    and dumps point at the user's line.  ``wants(i)`` tells whether input ``i`` needs a
    gradient at all; rules may use it to skip work (the autodiff pass also drops nodes whose
    results are unused, so skipping is an optimization, never required).
    """

    def __init__(self, graph: Graph, loc: str | None = None, wants: Sequence[bool] = ()):
        super().__init__(graph, loc=loc)
        self._wants = tuple(wants)

    def wants(self, index: int) -> bool:
        return self._wants[index] if index < len(self._wants) else True


# ------------------------------------------------------------------------------ helpers
def unbroadcast(b: GradBuilder, g: Value, like: Value | TensorType) -> Value:
    """``g`` summed back to ``like``'s shape and cast to its dtype.

    ``g`` has a shape ``like``'s shape broadcasts to: extra leading axes are summed away,
    axes where ``like`` has size 1 are summed with ``keepdim``.
    """
    target = like.type if isinstance(like, Value) else like
    lead = g.type.rank - target.rank
    if lead < 0:
        raise KilnError(f"unbroadcast: cotangent {g.type} has fewer axes than {target}")
    dims = list(range(lead))
    dims += [lead + i for i, d in enumerate(target.shape) if d == 1 and g.shape[lead + i] != 1]
    out = b.sum(g, dims, keepdim=False) if dims else g
    out = b.reshape(out, target.shape)
    return b.cast(out, target.dtype)


def expand_reduced(b: GradBuilder, g: Value, x: Value, axes: Sequence[int], keepdim: bool) -> Value:
    """The cotangent ``g`` of a reduction over ``axes`` of ``x`` broadcast back to ``x``'s shape."""
    if not keepdim:
        g = b.reshape(g, tuple(1 if i in axes else d for i, d in enumerate(x.shape)))
    if tuple(g.shape) == tuple(x.shape):
        return g
    return b.op("expand", g, shape=tuple(x.shape))


def deflinear(transpose: Callable[..., Value | None]) -> VjpRule:
    """Rule of a single-operand linear op from its transpose ``transpose(b, g, x, y, attrs)``."""

    def rule(b: GradBuilder, inputs, outputs, cotangents, attrs):
        return [transpose(b, cotangents[0], inputs[0], outputs[0], attrs)]

    rule.__doc__ = transpose.__doc__
    return rule


def defbilinear(lhs: Callable[..., Value | None], rhs: Callable[..., Value | None]) -> VjpRule:
    """Rule of a bilinear op ``f(a, b)``: ``lhs(b, g, a, bv, attrs)`` gives the cotangent of
    ``a`` (linear in ``g`` and ``bv``), ``rhs(b, g, a, bv, attrs)`` that of ``bv``."""

    def rule(b: GradBuilder, inputs, outputs, cotangents, attrs):
        a, other = inputs[:2]
        g = cotangents[0]
        return [lhs(b, g, a, other, attrs) if b.wants(0) else None,
                rhs(b, g, a, other, attrs) if b.wants(1) else None]

    return rule


def elementwise(derivative: Callable[[GradBuilder, Value, Value], Value]) -> VjpRule:
    """Rule of a unary elementwise op from ``derivative(b, x, y) -> dy/dx`` (same shape)."""

    def rule(b: GradBuilder, inputs, outputs, cotangents, attrs):
        x, y = inputs[0], outputs[0]
        if not x.dtype.is_floating:
            return [None]
        return [b.cast(b.mul(cotangents[0], derivative(b, x, y)), x.dtype)]

    return rule


def zero_gradient(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """Rule of ops that are piecewise constant (floor, sign, ...): the gradient is zero."""
    return [None] * len(inputs)


def nondifferentiable(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """Rule of ops whose inputs never get a gradient (comparisons, logical ops, argmax,
    creation ops): every input gets ``None``."""
    return [None] * len(inputs)


def is_nondifferentiable(rule: VjpRule | None) -> bool:
    return rule is nondifferentiable


def defvjp(*names: str) -> Callable[[VjpRule], VjpRule]:
    """Decorator attaching the decorated rule to the already declared ops ``names``."""

    def wrap(rule: VjpRule) -> VjpRule:
        for name in names:
            set_vjp(name, rule)
        return rule

    return wrap


def set_vjp(name: str, rule: VjpRule) -> None:
    """Attach ``rule`` to op ``name``; an op gets at most one rule."""
    opdef = _REGISTRY.get(name)
    if opdef is None:
        raise KilnError(f"defvjp: op '{name}' is not declared (declare it before its rule)")
    if opdef.vjp is not None:
        raise KilnError(f"defvjp: op '{name}' already has a gradient rule")
    opdef.vjp = rule


__all__ = [
    "GradBuilder", "VjpRule", "defbilinear", "deflinear", "defvjp", "elementwise",
    "expand_reduced", "is_nondifferentiable", "nondifferentiable", "set_vjp", "unbroadcast",
    "zero_gradient",
]
