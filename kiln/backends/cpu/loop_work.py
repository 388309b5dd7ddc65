"""How much work a loop nest does: constant extents and statement-instance counts, which the
cpu backend's printer and default schedules use to decide what runs on several threads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln.ir.loops.expr import Binary, Const, Expr, Var
from kiln.ir.loops.program import If, Loop, Node


def _const_extent(loop: Loop) -> int | None:
    if isinstance(loop.lower, Const) and isinstance(loop.upper, Const):
        return max(0, -(-(int(loop.upper.value) - int(loop.lower.value)) // loop.step))
    return None


def _extent_bound(loop: Loop) -> int | None:
    """The loop's extent when its bounds are constant; for a constant lower bound and an
    upper bound ``min(c, ...)`` (the last block of a ``split`` that does not divide its
    loop), at most ``c - lower`` iterations; else ``None``."""
    extent = _const_extent(loop)
    if extent is not None or not isinstance(loop.lower, Const):
        return extent
    upper = loop.upper
    if isinstance(upper, Binary) and upper.op == "min":
        bound = next((int(e.value) for e in (upper.lhs, upper.rhs) if isinstance(e, Const)), None)
        if bound is not None:
            return max(0, -(-(bound - int(loop.lower.value)) // loop.step))
    return None


def nest_work(body: Sequence[Node], hint: Mapping[str, int] | None = None) -> int | None:
    """Statement instances executed by ``body`` when every bound is constant (at most that
    many where a loop's upper bound is the minimum of a constant and an expression), else
    ``None``.  ``hint`` gives size parameters a typical value (bounds that are sums,
    products, min/max and floor divisions of them and of constants then count too)."""
    total = 0
    for n in body:
        if isinstance(n, Loop):
            extent, inner = _loop_extent(n, hint), nest_work(n.body, hint)
            if extent is None or inner is None:
                return None
            total += extent * inner
        elif isinstance(n, If):
            a, b = nest_work(n.then, hint), nest_work(n.orelse, hint)
            if a is None or b is None:
                return None
            total += max(a, b)
        else:
            total += 1
    return total


def _loop_extent(loop: Loop, hint: Mapping[str, int] | None) -> int | None:
    extent = _extent_bound(loop)
    if extent is not None or not hint:
        return extent
    lo, hi = _value(loop.lower, hint), _value(loop.upper, hint)
    return None if lo is None or hi is None else max(0, -(-(hi - lo) // loop.step))


def _value(e: Expr, hint: Mapping[str, int]) -> int | None:
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return hint.get(e.name)
    if isinstance(e, Binary) and e.op in ("+", "-", "*", "floordiv", "min", "max"):
        a, b = _value(e.lhs, hint), _value(e.rhs, hint)
        if a is None or b is None or (e.op == "floordiv" and b == 0):
            return None
        return {"+": a + b, "-": a - b, "*": a * b, "min": min(a, b), "max": max(a, b)}.get(e.op, a // b if b else 0)
    return None


__all__ = ["nest_work"]
