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
it keeps every one of them in order, so checking all of them is exact.  ``Dependences.pairs``
holds, per (source, sink) statement pair, the union of every kind and array: what the
legality checker tests.

:func:`prove` explains a legal schedule: for every dependence, the time dimensions that
carry its instance pairs (the first position where the two times differ: a loop, or the
order of a sequence's children) and the distance vectors of the new times there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import islpy as isl

from .model import PolyModel
from .tree import Band, TreeNode, bands, initial_tree, leaf_vectors, time_maps

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
    pairs: dict[tuple[str, str], isl.Map] = field(default_factory=dict)

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
    pairs: dict[tuple[str, str], isl.Map] = {}
    for d in records:
        union = union.union(isl.UnionMap.from_map(d.relation))
        key = (d.source, d.sink)
        pairs[key] = pairs[key].union(d.relation) if key in pairs else d.relation
    return Dependences(tuple(records), union.coalesce(), {k: v.coalesce() for k, v in pairs.items()})


# ----------------------------------------------------------------------------- proofs
@dataclass(frozen=True)
class Carrier:
    """The pairs of one dependence that one time dimension carries."""

    dim: int
    by: str
    distances: str
    box: str


@dataclass(frozen=True)
class ProofStep:
    """One dependence of a legal schedule: who carries its pairs, and its distances in the
    original iterators (``distance``, for a statement depending on itself)."""

    kind: str
    array: str
    source: str
    sink: str
    carriers: tuple[Carrier, ...]
    distance: str | None = None

    def __str__(self) -> str:
        head = f"{self.kind} {self.source} -> {self.sink} on {self.array}"
        if self.distance is not None:
            head += f" (iteration distances {self.distance})"
        parts = [f"  carried by {c.by} (time position {c.dim}): time distances {c.box}" for c in self.carriers]
        return "\n".join([head] + parts)


@dataclass(frozen=True)
class Proof:
    """Why a schedule is legal: every dependence with its carriers, and every parallel loop
    with the reason no dependence is carried by it.  ``str()`` prints it."""

    steps: tuple[ProofStep, ...]
    parallel: tuple[str, ...]

    def __str__(self) -> str:
        if not self.steps and not self.parallel:
            return "no dependences: every order of the instances is legal"
        lines = [str(s) for s in self.steps] + list(self.parallel)
        return "\n".join(lines)


def _carry_pattern(depth: int, k: int) -> isl.Map:
    t = [f"t{i}" for i in range(depth)]
    u = [f"u{i}" for i in range(depth)]
    cons = [f"t{i} = u{i}" for i in range(k)] + [f"t{k} < u{k}"]
    return isl.Map(f"{{ [{', '.join(t)}] -> [{', '.join(u)}] : {' and '.join(cons)} }}")


def _box(deltas: isl.Set) -> str:
    """``(1, 0, -1..1, 1.., *)``: per dimension the constant, the constant range, the
    constant lower or upper bound, or ``*``."""
    out = []
    for k in range(deltas.dim(isl.dim_type.set)):
        lo, hi = _bound(deltas.dim_min(k), min), _bound(deltas.dim_max(k), max)
        if lo is not None and hi is not None:
            out.append(str(lo) if lo == hi else f"{lo}..{hi}")
        else:
            out.append(f"{lo}.." if lo is not None else f"..{hi}" if hi is not None else "*")
    return f"({', '.join(out)})"


def _bound(pa: isl.PwAff, pick) -> int | None:
    """The bound of ``pa`` over every parameter value (``pick`` is ``min`` or ``max``):
    isl's minimum or maximum of the piecewise expression over its whole domain (integer
    bounds: rounded inwards), ``None`` where it is unbounded or empty."""
    val = pa.min_val() if pick is min else pa.max_val()
    if val.is_infty() or val.is_neginfty() or val.is_nan():
        return None
    num, den = val.get_num_si(), val.get_den_val().to_python()
    return -((-num) // den) if pick is min else num // den


def _set_text(s: isl.Set) -> str:
    text = str(s.coalesce())
    return text[text.index("{"):text.rindex("}") + 1]


def prove(model: PolyModel, deps: Dependences, tree: TreeNode, context: isl.Set | None = None) -> Proof:
    """The :class:`Proof` of a legal ``tree`` (``context``: the parameter ranges assumed)."""
    times = time_maps(tree, model)
    if not times:
        return Proof((), ())
    depth = next(iter(times.values())).dim(isl.dim_type.out)
    labels: dict[str, dict[int, set[str]]] = {}
    for leaf, _, vec in leaf_vectors(tree):
        for k, d in enumerate(vec):
            text = f"loop '{d.name}'" if isinstance(d, Band) else "the order of a sequence's children"
            labels.setdefault(leaf.stmt, {}).setdefault(k, set()).add(text)
    patterns = [_carry_pattern(depth, k) for k in range(depth)]
    steps = []
    for dep in deps.records:
        rel = dep.relation if context is None else dep.relation.intersect_params(context)
        in_time = rel.apply_domain(times[dep.source]).apply_range(times[dep.sink])
        carriers = []
        for k in range(depth):
            carried = in_time.intersect(patterns[k])
            if carried.is_empty():
                continue
            names = labels[dep.source].get(k, set()) | labels[dep.sink].get(k, set())
            delta = carried.deltas()
            carriers.append(Carrier(k, " / ".join(sorted(names)) or "padding", _set_text(delta), _box(delta)))
        distance = _box(rel.deltas()) if dep.source == dep.sink and not rel.is_empty() else None
        steps.append(ProofStep(dep.kind, dep.array, dep.source, dep.sink, tuple(carriers), distance))
    lines = []
    for band, path in bands(tree):
        if not band.annotation.is_parallel:
            continue
        inside = [d for d in deps.records if d.source in band.funcs and d.sink in band.funcs]
        lines.append(f"loop '{band.name}' ({band.annotation.mode}, time position {len(path)}): "
                     f"{len(inside)} dependence(s) between its statements, none carried at position {len(path)} "
                     f"(each is carried by an outer loop or ordered inside one iteration)")
    return Proof(tuple(steps), tuple(lines))
