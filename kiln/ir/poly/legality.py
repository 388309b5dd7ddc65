"""Legality and exact parallelism of schedules, with explanations in words.

A schedule is legal iff every dependence ``s -> t`` of the program keeps
``time(s) <<lex time(t)`` under the new schedule.  A loop (band at time position ``k``)
may run in parallel iff no dependence between two statements inside it is *carried* by it:
none has equal times at positions ``0..k-1`` (same iteration of everything around the loop)
and different times at ``k``.  Dependences already carried by an outer loop have different outer times and do not
count -- that is exact, not the conservative "no dependence has a non-zero distance at this
level" test.

When a check fails, one violated dependence is picked (the lexicographically smallest
instance pair, with the smallest parameter values) and described: the two statement
instances, the array cell, the kind, the distance vector in the original loops, and the
new times.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import islpy as isl

from .affine import isl_name, plain_name
from .deps import Dependence, Dependences
from .model import PolyModel
from .tree import TreeNode, bands, time_maps, union_time_map

_VERBS = {"flow": ("writes", "reads"), "anti": ("reads", "writes"), "output": ("writes", "overwrites")}


@dataclass(frozen=True)
class Instance:
    """One statement instance, e.g. ``S1[i=3, j=4]``."""

    statement: str
    point: tuple[tuple[str, int], ...]

    @property
    def values(self) -> dict[str, int]:
        return dict(self.point)

    def __str__(self) -> str:
        return f"{self.statement}[{', '.join(f'{k}={v}' for k, v in self.point)}]"


@dataclass(frozen=True)
class Violation:
    """One dependence a schedule breaks. ``loop`` is set for a parallelism violation."""

    kind: str
    array: str
    cell: tuple[int, ...]
    source: Instance
    sink: Instance
    params: tuple[tuple[str, int], ...]
    distance: tuple[tuple[str, int], ...]
    source_time: tuple[int, ...]
    sink_time: tuple[int, ...]
    loop: str | None = None
    loop_dim: int | None = None

    def explain(self) -> str:
        a, b = _VERBS[self.kind]
        cell = f"{self.array}[{', '.join(map(str, self.cell))}]"
        dist = ", ".join(f"{n}: {v}" for n, v in self.distance) or "no common loop"
        head = (f"{self.kind} dependence on {cell}: {self.source} {a} it before {self.sink} {b} it "
                f"(distance {dist})")
        params = f" [with {', '.join(f'{k}={v}' for k, v in self.params)}]" if self.params else ""
        if self.loop is not None:
            k = self.loop_dim
            return (f"loop '{self.loop}' cannot run in parallel: {head}; both run in the same iteration of "
                    f"the loops around '{self.loop}' but in different iterations of it "
                    f"({self.loop}={self.source_time[k]} and {self.loop}={self.sink_time[k]}){params}")
        when = "at the same time as" if self.source_time == self.sink_time else "before"
        return (f"illegal schedule: {head}, but the new schedule runs {self.sink} {when} {self.source} "
                f"(new times {self.sink_time} and {self.source_time}){params}")

    def __str__(self) -> str:
        return self.explain()


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check; truthy iff legal."""

    legal: bool
    violation: Violation | None = None

    @property
    def explanation(self) -> str:
        return "legal: every dependence is preserved" if self.violation is None else self.violation.explain()

    def __bool__(self) -> bool:
        return self.legal


@lru_cache(maxsize=64)
def _lex_ge(depth: int) -> isl.Map:
    return isl.Map.lex_ge(isl.Space.set_alloc(isl.DEFAULT_CONTEXT, 0, depth))


@lru_cache(maxsize=256)
def _carried(depth: int, k: int) -> isl.Map:
    t = [f"t{i}" for i in range(depth)]
    u = [f"u{i}" for i in range(depth)]
    cons = [f"t{i} = u{i}" for i in range(k)] + [f"(t{k} < u{k} or t{k} > u{k})"]
    return isl.Map(f"{{ [{', '.join(t)}] -> [{', '.join(u)}] : {' and '.join(cons)} }}")


def check_schedule(model: PolyModel, deps: Dependences, tree: TreeNode,
                   times: dict[str, isl.Map] | None = None) -> Verdict:
    """Whether ``tree`` preserves every dependence and every parallel mark is exact."""
    times = time_maps(tree, model) if times is None else times
    if not times or not deps.records:
        return Verdict(True)
    depth = next(iter(times.values())).dim(isl.dim_type.out)
    t_all = union_time_map(times)
    in_time = deps.union.apply_domain(t_all).apply_range(t_all)
    lex_ge = _lex_ge(depth)
    if not in_time.intersect(isl.UnionMap.from_map(lex_ge)).is_empty():
        return Verdict(False, _find_violation(model, deps, times, lex_ge))
    for band, path in bands(tree):
        if not band.annotation.is_parallel:
            continue
        inside = set(band.funcs)
        under = isl.UnionSet.empty(model.context.get_space())
        for stmt in inside:
            under = under.union(isl.UnionSet.from_set(model.statements[stmt].domain))
        local = deps.union.intersect_domain(under).intersect_range(under)
        carried = _carried(depth, len(path))
        local_time = local.apply_domain(t_all).apply_range(t_all)
        if not local_time.intersect(isl.UnionMap.from_map(carried)).is_empty():
            return Verdict(False, _find_violation(model, deps, times, carried, band.name, len(path), inside))
    return Verdict(True)


def _find_violation(model: PolyModel, deps: Dependences, times: dict[str, isl.Map], bad_times: isl.Map,
                    loop: str | None = None, loop_dim: int | None = None,
                    inside: set[str] | None = None) -> Violation:
    for dep in deps.records:
        if inside is not None and (dep.source not in inside or dep.sink not in inside):
            continue
        bad = times[dep.source].apply_range(bad_times).apply_range(times[dep.sink].reverse())
        hit = dep.relation.intersect(bad)
        if not hit.is_empty():
            return describe(model, dep, hit, times, loop, loop_dim)
    raise AssertionError("a violated dependence was detected but no record contains it")


def _nonneg_params(m: isl.Map) -> isl.Map:
    n = m.dim(isl.dim_type.param)
    if n == 0:
        return m
    names = [m.get_dim_name(isl.dim_type.param, i) for i in range(n)]
    ctx = isl.Set(f"[{', '.join(names)}] -> {{ : {' and '.join(f'{p} >= 0' for p in names)} }}")
    return m.intersect_params(ctx)


def smallest_pair(rel: isl.Map) -> tuple[dict[str, int], tuple[int, ...], tuple[int, ...]]:
    """The pair of ``rel`` with the smallest parameters, then smallest source, then sink."""
    rel = _nonneg_params(rel)
    if rel.is_empty():
        raise ValueError("no pair with non-negative parameters")
    nparam = rel.dim(isl.dim_type.param)
    pnames = [rel.get_dim_name(isl.dim_type.param, i) for i in range(nparam)]
    n_in, n_out = rel.dim(isl.dim_type.in_), rel.dim(isl.dim_type.out)
    flat = rel.wrap().move_dims(isl.dim_type.set, 0, isl.dim_type.param, 0, nparam)
    best = flat.lexmin()
    pt = (best if not best.is_empty() else flat).sample_point()
    vals = [pt.get_coordinate_val(isl.dim_type.set, i).to_python() for i in range(nparam + n_in + n_out)]
    params = dict(zip(pnames, vals[:nparam]))
    return params, tuple(vals[nparam:nparam + n_in]), tuple(vals[nparam + n_in:])


def _point(model: PolyModel, stmt: str, values: tuple[int, ...], params: dict[str, int]) -> isl.Set:
    cons = " and ".join(f"{isl_name(p)} = {params[p]}" for p in model.params if p in params) or "0 = 0"
    coords = ", ".join(str(v) for v in values)
    return isl.Set(f"{model.param_prefix}{{ {isl_name(stmt)}[{coords}] : {cons} }}")


def _coords(s: isl.Set) -> tuple[int, ...]:
    pt = s.sample_point()
    return tuple(pt.get_coordinate_val(isl.dim_type.set, i).to_python() for i in range(s.dim(isl.dim_type.set)))


def describe(model: PolyModel, dep: Dependence, pairs: isl.Map, times: dict[str, isl.Map],
             loop: str | None = None, loop_dim: int | None = None) -> Violation:
    """A :class:`Violation` for the smallest instance pair of ``pairs`` (a subset of ``dep``)."""
    raw_params, src_vals, snk_vals = smallest_pair(pairs)
    params = {plain_name(k): v for k, v in raw_params.items()}
    src, snk = model.statements[dep.source], model.statements[dep.sink]
    src_pt, snk_pt = _point(model, src.name, src_vals, params), _point(model, snk.name, snk_vals, params)
    cells = dep.source_access.intersect_domain(src_pt).range().intersect(
        dep.sink_access.intersect_domain(snk_pt).range())
    common = 0
    for a, b in zip(src.loops, snk.loops):
        if a != b:
            break
        common += 1
    distance = tuple((src.loops[i], snk_vals[i] - src_vals[i]) for i in range(common))
    return Violation(
        kind=dep.kind, array=dep.array, cell=_coords(cells),
        source=Instance(src.name, tuple(zip(src.iterators, src_vals))),
        sink=Instance(snk.name, tuple(zip(snk.iterators, snk_vals))),
        params=tuple(sorted(params.items())), distance=distance,
        source_time=_coords(times[src.name].intersect_domain(src_pt).range()),
        sink_time=_coords(times[snk.name].intersect_domain(snk_pt).range()),
        loop=loop, loop_dim=loop_dim)
