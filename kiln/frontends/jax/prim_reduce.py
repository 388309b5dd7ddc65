"""Reductions and scans along an axis: ``reduce_sum/max/min/prod/and/or``, ``argmax``,
``argmin``, ``cumsum``, ``cumprod``, ``cummax``, ``cummin``.

A reduction over no axes is the operand itself.  ``argmax``/``argmin`` return the first
extreme index (JAX and kiln agree), cast to ``index_dtype``.  A ``reverse=True`` scan is the
forward scan of the flipped operand, flipped back.
"""

from __future__ import annotations

from kiln.ir import Value

from .rules import JaxContext, kiln_dtype, lowers

_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "amax", "reduce_min": "amin",
               "reduce_prod": "prod", "reduce_and": "all", "reduce_or": "any"}


def _reduction(op: str):
    def lower(ctx: JaxContext, x: Value, *, axes, **_) -> Value:
        if not axes:
            return x
        return ctx.op(op, x, dims=tuple(int(a) for a in axes))
    return lower


for _name, _op in _REDUCTIONS.items():
    lowers(_name)(_reduction(_op))


def _arg_reduction(op: str):
    def lower(ctx: JaxContext, x: Value, *, axes, index_dtype, **_) -> Value:
        (axis,) = axes
        return ctx.cast(ctx.op(op, x, dim=int(axis)), kiln_dtype(index_dtype))
    return lower


lowers("argmax")(_arg_reduction("argmax"))
lowers("argmin")(_arg_reduction("argmin"))


def _scan_along(lower_forward):
    def lower(ctx: JaxContext, x: Value, *, axis, reverse=False, **_) -> Value:
        axis = int(axis)
        if not reverse:
            return lower_forward(ctx, x, axis)
        flipped = ctx.op("flip", x, dims=(axis,))
        return ctx.op("flip", lower_forward(ctx, flipped, axis), dims=(axis,))
    return lower


@lowers("cumsum")
@_scan_along
def _cumsum(ctx: JaxContext, x: Value, axis: int) -> Value:
    return ctx.op("cumsum", x, dim=axis, dtype=x.dtype)


@lowers("cumprod")
@_scan_along
def _cumprod(ctx: JaxContext, x: Value, axis: int) -> Value:
    return ctx.op("cumprod", x, dim=axis)


def _running(mode: str):
    """The running maximum or minimum: ``x`` gathered at kiln's ``cumarg`` positions."""
    def lower_forward(ctx: JaxContext, x: Value, axis: int) -> Value:
        where = ctx.op("cumarg", x, dim=axis, mode=mode)
        return ctx.op("gather", x, where, dim=axis)
    return lower_forward


lowers("cummax")(_scan_along(_running("max")))
lowers("cummin")(_scan_along(_running("min")))
