"""Cost rules: the estimated floating-point operations of an op, declared with it.

An op's ``cost=`` rule is ``cost(input_types, output_types, **attrs) -> float``.  The
helpers here build the common ones; ops with a formula of their own (``matmul``, ``conv``,
attention) declare it beside their declaration.  An op without a rule costs what the cost
model gives by default (:func:`kiln.passes.ordering.cost.node_flops`): one operation per
result element, or per element of the first operand for reductions and normalizations, and
nothing for views and creation ops.

Sizes count only static shapes: a tensor with a symbolic size counts as empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..types import TensorType

CostRule = Callable[..., float]


def numel(t: TensorType) -> int:
    """Elements of ``t``; 0 when its shape is not static."""
    return t.numel if t.is_static else 0


def per_element(flops: float) -> CostRule:
    """``flops`` operations per result element (transcendental elementwise ops cost several)."""

    def cost(input_types: Sequence[TensorType], output_types: Sequence[TensorType], **_) -> float:
        return flops * sum(numel(t) for t in output_types)

    cost.__doc__ = f"{flops:g} FLOPs per result element."
    return cost


def per_input_element(flops: float) -> CostRule:
    """``flops`` operations per element of the first operand, or per result element when the
    results are larger (reductions, normalizations, pooling, scans)."""

    def cost(input_types: Sequence[TensorType], output_types: Sequence[TensorType], **_) -> float:
        first = numel(input_types[0]) if input_types else 0
        return flops * max(first, sum(numel(t) for t in output_types))

    cost.__doc__ = f"{flops:g} FLOPs per operand element."
    return cost


__all__ = ["CostRule", "numel", "per_element", "per_input_element"]
