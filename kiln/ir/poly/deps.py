"""Exact memory-based dependences.

Two statement instances depend on each other when they access the same array cell, at
least one of them writes it, and the *source* runs before the *sink* in the original
program.  The kind names the pair of accesses: ``flow`` (write then read), ``anti`` (read
then write), ``output`` (write then write).  Dependences are computed directly from the
access relations and the original schedule: for a pair of accesses ``X`` (of ``S``) and
``Y`` (of ``T``) the relation ``X . Y^-1`` pairs instances touching a common cell, and
intersecting it with ``{ s -> t : time(s) <<lex time(t) }`` keeps the ordered pairs.  For
affine accesses the result is exact -- every pair in the relation truly conflicts -- not a
conservative approximation; may-accesses (non-affine indices) over-approximate.

All dependences, not only the transitively reduced ones, are kept: a schedule is legal iff
it keeps every one of them in order, so checking all of them is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import islpy as isl

from .model import PolyModel
from .tree import TreeNode, initial_tree, time_maps

KINDS = ("flow", "anti", "output")


@dataclass(frozen=True, eq=False)
class Dependence:
    """All instance pairs of one kind between two statements through one array."""

    kind: str
    array: str
    source: str
    sink: str
    relation: isl.Map
    source_access: isl.Map
    sink_access: isl.Map
    exact: bool

    def __str__(self) -> str:
        return f"{self.kind} {self.source} -> {self.sink} on {self.array}: {self.relation}"


@dataclass(frozen=True, eq=False)
class Dependences:
    records: tuple[Dependence, ...]
    union: isl.UnionMap

    def __iter__(self):
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def between(self, source: str, sink: str) -> list[Dependence]:
        return [d for d in self.records if d.source == source and d.sink == sink]


def _union_access(maps: list[isl.Map]) -> isl.Map | None:
    out: isl.Map | None = None
    for m in maps:
        out = m if out is None else out.union(m)
    return out


def compute_dependences(model: PolyModel, tree: TreeNode | None = None) -> Dependences:
    """Every flow, anti and output dependence of the program in the order given by ``tree``
    (the program's own order by default)."""
    tree = initial_tree(model) if tree is None else tree
    times = time_maps(tree, model)
    reads: dict[tuple[str, str], isl.Map] = {}
    writes: dict[tuple[str, str], isl.Map] = {}
    exact: dict[tuple[str, str], bool] = {}
    for s in model.statements.values():
        for arr in {a.array for a in s.accesses}:
            r = _union_access([a.relation for a in s.accesses if a.array == arr and not a.is_write])
            w = _union_access([a.relation for a in s.accesses if a.array == arr and a.is_write])
            if r is not None:
                reads[(s.name, arr)] = r
            if w is not None:
                writes[(s.name, arr)] = w
            exact[(s.name, arr)] = all(a.exact for a in s.accesses if a.array == arr)
    records: list[Dependence] = []
    names = list(model.statements)
    for src in names:
        for snk in names:
            order: isl.Map | None = None
            arrays = sorted({a for (s, a) in list(reads) + list(writes) if s == src}
                            & {a for (s, a) in list(reads) + list(writes) if s == snk})
            for arr in arrays:
                pairs = (("flow", writes.get((src, arr)), reads.get((snk, arr))),
                         ("anti", reads.get((src, arr)), writes.get((snk, arr))),
                         ("output", writes.get((src, arr)), writes.get((snk, arr))))
                for kind, a, b in pairs:
                    if a is None or b is None:
                        continue
                    conflict = a.apply_range(b.reverse())
                    if conflict.is_empty():
                        continue
                    if order is None:
                        order = times[src].lex_lt_map(times[snk])
                    rel = conflict.intersect(order).coalesce()
                    if rel.is_empty():
                        continue
                    records.append(Dependence(kind, arr, src, snk, rel, a, b,
                                              exact[(src, arr)] and exact[(snk, arr)]))
    union: isl.UnionMap = isl.UnionMap.empty(model.context.get_space())
    for d in records:
        union = union.union(isl.UnionMap.from_map(d.relation))
    return Dependences(tuple(records), union.coalesce())
