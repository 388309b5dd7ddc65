"""Recognizing contractions in lowered loop nests: ``acc = init; acc += X * Y over r;
epilogue(acc)``.

:func:`match_matmul` accepts a nest only when all of this holds:

* the nest is one perfect chain of constant-bound loops, all of which carry no dependence
  (proved by isl: the band of :meth:`PlanContext.parallel_band` is the whole chain), at
  least two of them;
* the innermost band body is exactly: a store ``acc[I] = init``; a perfect chain of
  constant-bound reduction loops whose only statement is ``acc[I] += value`` (same cell
  ``I``, indices of band iterators only); then plain statements (the epilogue) that read
  ``acc`` only at ``I`` and never write it;
* nothing the init or the value reads is written in the nest;
* ``value`` is a product whose factors split into two groups ``X * Y`` such that the band
  iterators ``X`` uses and those ``Y`` uses overlap only in batch iterators: ``X`` is then a
  function of (batch, m, k), ``Y`` of (batch, k, n).  Band iterators neither factor uses are
  batch iterators too.

The reduction order is unchanged by tiling (``k`` ascending per output cell), so the
tiled kernel computes each cell with the same sequence of additions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir.loops import Binary, Expr, Load, Loop, Node, Reduce, Store, loads_of

from .common import PlanContext, accesses, free_vars_of, perfect_chain, trip_count


@dataclass(frozen=True)
class MatmulMatch:
    """A recognized contraction (module docstring); loops in band order."""

    batch: tuple[Loop, ...]
    m_loops: tuple[Loop, ...]
    n_loops: tuple[Loop, ...]
    r_loops: tuple[Loop, ...]
    acc: str
    acc_index: tuple[Expr, ...]
    init: Expr
    x: Expr
    y: Expr
    epilogue: tuple[Node, ...]

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(batch, M, N, K)``."""
        def prod(loops):
            return math.prod(trip_count(lp) for lp in loops)
        return prod(self.batch), prod(self.m_loops), prod(self.n_loops), prod(self.r_loops)


def factors(e: Expr) -> list[Expr]:
    """The operands of a product tree ``a * b * c``."""
    if isinstance(e, Binary) and e.op == "*":
        return factors(e.lhs) + factors(e.rhs)
    return [e]


def _product(es: Sequence[Expr]) -> Expr:
    out = es[0]
    for e in es[1:]:
        out = Binary("*", out, e)
    return out


def match_matmul(ctx: PlanContext, group: Sequence[Node]) -> MatmulMatch | None:
    """The contraction of ``group`` or ``None`` (module docstring)."""
    if len(group) != 1 or not isinstance(group[0], Loop):
        return None
    nest = group[0]
    chain = perfect_chain(nest)
    if len(chain) < 2 or any(trip_count(lp) in (None, 0) for lp in chain):
        return None
    body = chain[-1].body
    if len(body) < 2 or not isinstance(body[0], Store) or not isinstance(body[1], Loop):
        return None
    init, rchain = body[0], perfect_chain(body[1])
    red = rchain[-1].body
    if len(red) != 1 or not isinstance(red[0], Reduce) or red[0].combiner != "+":
        return None
    red = red[0]
    if any(trip_count(lp) in (None, 0) for lp in rchain) or red.buffer != init.buffer:
        return None
    acc, index = init.buffer, init.indices
    band_iters = {lp.iterator for lp in chain}
    r_iters = {lp.iterator for lp in rchain}
    if red.indices != index or any(loads_of(i) or not free_vars_of(i) <= band_iters for i in index):
        return None
    epilogue = tuple(body[2:])
    if any(not isinstance(n, (Store, Reduce)) for n in epilogue):
        return None
    written = {ld.buffer for ld, w, _ in accesses([nest]) if w}
    for e in (init.value, red.value):
        if any(ld.buffer in written for ld in loads_of(e)) or not free_vars_of(e) <= band_iters | r_iters:
            return None
    if free_vars_of(init.value) & r_iters:
        return None
    for ld, w, n in accesses(epilogue):
        if ld.buffer == acc and (w or ld.indices != index):
            return None
    if ctx.parallel_band(nest) != chain:
        return None
    split = _split(red.value, chain)
    if split is None:
        return None
    x, y, batch, ms, ns = split
    return MatmulMatch(tuple(batch), tuple(ms), tuple(ns), tuple(rchain), acc, index, init.value, x, y, epilogue)


def _split(value: Expr, band: Sequence[Loop]):
    fs = factors(value)
    if len(fs) < 2 or len(fs) > 8:
        return None
    order = [lp.iterator for lp in band]
    used = [free_vars_of(f) & set(order) for f in fs]
    best, best_score = None, None
    for mask in range(1, 2 ** len(fs) - 1):
        xs = [k for k in range(len(fs)) if mask >> k & 1]
        ys = [k for k in range(len(fs)) if not mask >> k & 1]
        vx = set().union(*(used[k] for k in xs))
        vy = set().union(*(used[k] for k in ys))
        batch = (vx & vy) | (set(order) - vx - vy)
        ms, ns = vx - batch, vy - batch
        if not ms or not ns:
            continue
        # prefer: the innermost band loop on the N side (coalesced stores), few batch loops
        score = (order[-1] in ns, -len(batch), -mask)
        if best_score is None or score > best_score:
            best_score = score
            best = (_product([fs[k] for k in xs]), _product([fs[k] for k in ys]), batch, ms, ns)
    if best is None:
        return None
    x, y, batch, ms, ns = best
    pick = lambda names: [lp for lp in band if lp.iterator in names]  # noqa: E731
    return x, y, pick(batch), pick(ms), pick(ns)


def fast_axis(e: Expr, along: set[str]) -> bool:
    """Whether the loads of ``e`` have their last index varying with ``along`` (so that
    consecutive values of those iterators are consecutive addresses)."""
    for ld in loads_of(e):
        if isinstance(ld, Load) and ld.indices:
            return bool(free_vars_of(ld.indices[-1]) & along)
    return False


__all__ = ["MatmulMatch", "factors", "fast_axis", "match_matmul"]
