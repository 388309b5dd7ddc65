"""Integer ranges of kernels: whether the CUDA printer may compute indices in 32 bits.

:func:`fits_int` bounds every integer subexpression of a kernel that C would evaluate in
``int`` -- iterators (their loops' ranges), literals, narrow integer loads and casts, their
arithmetic, and the row-major flat offsets of global accesses (:func:`flat_offset`, as the
printer writes them) -- and says whether all stay within ``int``.  Subexpressions with a
64-bit operand are evaluated in ``long`` by C and need no bound.  32-bit indices are much
cheaper on a GPU; a kernel that might overflow them keeps ``long``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from kiln.ir.loops.expr import Binary, Cast, Const, Expr, Load, Select, Unary, Var, walk
from kiln.ir.loops.program import If, Loop, Node, Program, Reduce, Shuffle, Store, VectorCopy
from kiln.ir.types import DType

INT_LIMIT = 2**31 - 1


def flat_offset(indices: tuple[Expr, ...], shape: tuple[int, ...]) -> Expr | None:
    """The row-major offset of ``indices`` in a buffer of ``shape`` (``None`` for 0-d)."""
    offset: Expr | None = None
    stride = 1
    for index, extent in zip(reversed(indices), reversed(shape)):
        term = index if stride == 1 else Binary("*", index, Const(stride))
        offset = term if offset is None else Binary("+", term, offset)
        stride *= extent
    return offset


_LONG = -1
"""Marks an expression C evaluates in 64 bits whatever the iterators' type."""
_WIDE_INTS = (DType.int64,)


def fits_int(program: Program, shapes: Mapping[str, tuple[int, ...]], globals_: set[str]) -> bool:
    """Whether 32-bit iterators are safe: every integer subexpression that C would evaluate
    in ``int`` (iterators, literals within ``int``, narrow integer loads and their
    arithmetic; the flat offsets of global accesses included) provably stays within
    ``int`` given the loops' ranges.  A subexpression holding a 64-bit operand (an ``i64``
    load, a cast to ``i64``, a literal beyond ``int``) is evaluated in ``long`` by C and is
    safe; one whose range is unknown makes the kernel use ``long``."""
    buffers = {b.name: b for b in program.buffers}
    ranges: dict[str, int] = {}
    failed: list[str] = []

    def narrow(dtype: DType) -> int:
        return 1 if dtype == DType.bool else int(np.iinfo(dtype.numpy).max)

    def bound(e: Expr) -> int | None:
        """Largest absolute value of ``e`` (``_LONG``: evaluated in 64 bits; 0 for floats);
        records a failure for an ``int`` subexpression that may not fit."""
        out = _bound(e)
        if out is None or (out != _LONG and out > INT_LIMIT):
            failed.append(str(e))
        return out

    def _bound(e: Expr) -> int | None:
        if isinstance(e, Const):
            if e.dtype.is_floating:
                return 0
            return _LONG if abs(int(e.value)) > INT_LIMIT else abs(int(e.value))
        if isinstance(e, Var):
            return ranges.get(e.name)
        if isinstance(e, Load):
            for i in e.indices:
                bound(i)
            dtype = buffers[e.buffer].dtype
            return _LONG if dtype in _WIDE_INTS else 0 if dtype.is_floating else narrow(dtype)
        parts = [bound(c) for c in e.children()]
        if isinstance(e, Cast):
            return _LONG if e.dtype in _WIDE_INTS else 0 if e.dtype.is_floating else narrow(e.dtype)
        if isinstance(e, Unary):
            return 1 if e.op == "!" else parts[0]
        if isinstance(e, Select):
            a, b = parts[1], parts[2]
            return None if a is None or b is None else _LONG if _LONG in (a, b) else max(a, b)
        if isinstance(e, Binary):
            if e.op in ("<", "<=", "==", "!=", ">", ">=", "&&", "||"):
                return 1
            a, b = parts
            if a == _LONG or b == _LONG or e.op in ("floordiv", "floormod"):  # the helpers are long
                return _LONG
            if a is None or b is None:
                return None
            if e.op in ("+", "-"):
                return a + b
            if e.op == "*":
                return a * b
            return max(a, b) if e.op in ("/", "min", "max") else b  # %
        return 0  # math calls compute in floating point

    def access(buffer: str, indices: tuple[Expr, ...]) -> None:
        for i in indices:
            bound(i)
        offset = flat_offset(indices, shapes[buffer]) if buffer in globals_ else None
        if offset is not None:
            bound(offset)

    def nodes(body: tuple[Node, ...]) -> None:
        for n in body:
            if isinstance(n, Loop):
                lo, hi = bound(n.lower), bound(n.upper)
                if lo is None or hi is None or _LONG in (lo, hi) or max(lo, hi) > INT_LIMIT - n.step:
                    failed.append(f"loop {n.iterator}")
                    return
                ranges[n.iterator] = max(lo, hi)
                nodes(n.body)
            elif isinstance(n, If):
                bound(n.cond)
                nodes(n.then)
                nodes(n.orelse)
            elif isinstance(n, (Store, Reduce)):
                access(n.buffer, n.indices)
                bound(n.value)
            elif isinstance(n, Shuffle):
                access(n.buffer, n.indices)
                bound(n.value)
                bound(n.offset)
            elif isinstance(n, VectorCopy):
                access(n.dst, n.dst_indices)
                access(n.src, n.src_indices)

    if any(math.prod(s) > INT_LIMIT for s in shapes.values()):
        return False
    nodes(program.body)
    if failed:
        return False
    for e in _all_exprs(program.body):  # loads' flat offsets, now that every range is known
        for x in walk(e):
            if isinstance(x, Load) and x.buffer in globals_:
                access(x.buffer, x.indices)
    return not failed


def _all_exprs(body: tuple[Node, ...]) -> list[Expr]:
    out: list[Expr] = []
    for n in body:
        if isinstance(n, Loop):
            out += [n.lower, n.upper, *_all_exprs(n.body)]
        elif isinstance(n, If):
            out += [n.cond, *_all_exprs(n.then), *_all_exprs(n.orelse)]
        elif isinstance(n, (Store, Reduce)):
            out.append(n.value)
        elif isinstance(n, Shuffle):
            out += [n.value, n.offset]
    return out


__all__ = ["INT_LIMIT", "fits_int", "flat_offset"]
