"""Recognizing row reductions and normalizations in lowered loop nests.

A *row program* is a band of row loops (perfectly nested, constant bounds, carrying no
dependence -- proved by isl; possibly no loop at all: one row) whose body is a sequence of

* **reduction stages**: ``acc[I] = init`` then a perfect chain of constant-bound loops whose
  only statement is ``acc[I] op= value`` (``I`` of row iterators only);
* **map stages**: a perfect chain of constant-bound loops over stores (the consumers: a
  softmax's normalization, a norm's scale and shift), each store's cell indexed by every
  loop iterator as a whole index (so different positions write different cells);
* **scalar stages**: loop-free stores of one value per row (``mean = sum / n``).

Every stage reads only buffers that nothing in the nest writes, plus the accumulators of
earlier reduction stages at their own cell ``I``.  That is what makes the kernel sound: a
reduction's positions can be split across threads and combined in any order (the
combiners are associative and commutative), consumers read each accumulator only after its
reduction finished, and no thread reads a cell another thread writes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir.loops import Expr, Load, Loop, Node, Reduce, Store, Var, loads_of

from .common import PlanContext, accesses, free_vars_of, perfect_chain, trip_count


@dataclass(frozen=True)
class Reduction:
    acc: str
    index: tuple[Expr, ...]
    init: Expr
    combiner: str
    loops: tuple[Loop, ...]
    value: Expr

    @property
    def length(self) -> int:
        return math.prod(trip_count(lp) for lp in self.loops)


@dataclass(frozen=True)
class MapStage:
    loops: tuple[Loop, ...]
    body: tuple[Node, ...]

    @property
    def length(self) -> int:
        return math.prod(trip_count(lp) for lp in self.loops)


@dataclass(frozen=True)
class ScalarStage:
    node: Store


Stage = Reduction | MapStage | ScalarStage


@dataclass(frozen=True)
class RowsMatch:
    """``band``: the row loops; ``stages`` in program order; ``head``: loop-free nodes of
    the group before the nest that are not part of the rows (run on their own)."""

    band: tuple[Loop, ...]
    stages: tuple[Stage, ...]
    head: tuple[Node, ...]

    @property
    def rows(self) -> int:
        return math.prod(trip_count(lp) for lp in self.band)

    @property
    def reductions(self) -> list[Reduction]:
        return [s for s in self.stages if isinstance(s, Reduction)]


def match_rows(ctx: PlanContext, group: Sequence[Node]) -> RowsMatch | None:
    """The row program of ``group`` or ``None`` (module docstring)."""
    last = group[-1]
    if not isinstance(last, Loop):
        return None
    band = ctx.parallel_band(last)
    if band:
        if band != perfect_chain(last)[:len(band)]:
            return None
        head, body = tuple(group[:-1]), band[-1].body
    else:
        head, body = (), tuple(group)
    stages = _stages(body, {lp.iterator for lp in band})
    if stages is None or not any(isinstance(s, Reduction) for s in stages):
        return None
    written = {ld.buffer for ld, w, _ in accesses(body) if w}
    accs: dict[str, tuple[Expr, ...]] = {}
    writers: dict[str, int] = {}
    for k, s in enumerate(stages):
        for ld, w, _ in accesses(_nodes_of(s)):
            if w and writers.setdefault(ld.buffer, k) != k:
                return None  # a buffer written by two stages
    for s in stages:
        nodes = (s.node,) if isinstance(s, ScalarStage) else s.body if isinstance(s, MapStage) else ()
        exprs = [s.init, s.value] if isinstance(s, Reduction) else []
        for n in nodes:
            exprs += [n.value, *n.indices]
        for e in exprs:
            for ld in loads_of(e):
                if ld.buffer in written and accs.get(ld.buffer) != ld.indices:
                    return None
        if isinstance(s, Reduction):
            if s.acc in accs:
                return None  # one stage per accumulator
            accs[s.acc] = s.index
        for n in nodes:
            if n.buffer in accs:
                return None
    return RowsMatch(tuple(band), tuple(stages), head)


def _nodes_of(s: Stage) -> tuple[Node, ...]:
    if isinstance(s, Reduction):
        return (Store(s.acc, s.index, s.init),)
    return (s.node,) if isinstance(s, ScalarStage) else s.body


def _band_only(indices: Sequence[Expr], band: set[str]) -> bool:
    return all(not loads_of(i) and free_vars_of(i) <= band for i in indices)


def _stages(body: Sequence[Node], band: set[str]) -> list[Stage] | None:
    stages: list[Stage] = []
    k = 0
    body = list(body)
    while k < len(body):
        n = body[k]
        if isinstance(n, Store) and k + 1 < len(body) and isinstance(body[k + 1], Loop):
            red = _reduction(n, body[k + 1], band)
            if red is not None:
                stages.append(red)
                k += 2
                continue
        if isinstance(n, Store):
            if not _band_only(n.indices, band) or not free_vars_of(n.value) <= band:
                return None
            stages.append(ScalarStage(n))
        elif isinstance(n, Loop):
            chain = perfect_chain(n)
            if any(trip_count(lp) in (None, 0) for lp in chain):
                return None
            inner = chain[-1].body
            its = {lp.iterator for lp in chain}
            for s in inner:
                if not isinstance(s, Store) or any(loads_of(i) for i in s.indices):
                    return None
                if not its <= {i.name for i in s.indices if isinstance(i, Var)}:
                    return None
                if not free_vars_of(s.value) | set().union(*map(free_vars_of, s.indices)) <= band | its:
                    return None
            stages.append(MapStage(tuple(chain), tuple(inner)))
        else:
            return None
        k += 1
    return stages


def _reduction(init: Store, loop: Loop, band: set[str]) -> Reduction | None:
    chain = perfect_chain(loop)
    inner = chain[-1].body
    if len(inner) != 1 or not isinstance(inner[0], Reduce) or any(trip_count(lp) in (None, 0) for lp in chain):
        return None
    red = inner[0]
    if red.buffer != init.buffer or red.indices != init.indices or not _band_only(init.indices, band):
        return None
    its = {lp.iterator for lp in chain}
    if not free_vars_of(red.value) <= band | its or not free_vars_of(init.value) <= band:
        return None
    if any(ld.buffer == init.buffer for ld in loads_of(red.value) + loads_of(init.value)):
        return None
    return Reduction(init.buffer, init.indices, init.value, red.combiner, tuple(chain), red.value)


def contiguous_reduction(match: RowsMatch, run: int = 32) -> bool:
    """Whether a reduction reads its operands in runs of at least ``run`` consecutive cells
    along the reduced axes: the last index of a load varies with the innermost reduction
    iterator, whose loop has at least ``run`` iterations.  Then the lanes of a warp, taking
    consecutive positions of the row, read consecutive addresses."""
    for red in match.reductions:
        inner = red.loops[-1]
        if trip_count(inner) < run:
            continue
        for ld in loads_of(red.value):
            if isinstance(ld, Load) and ld.indices and inner.iterator in free_vars_of(ld.indices[-1]):
                return True
    return False


__all__ = ["MapStage", "Reduction", "RowsMatch", "ScalarStage", "contiguous_reduction", "match_rows"]
