"""Legality and exact parallelism of schedules, with explanations in words.

A schedule is legal iff every dependence ``s -> t`` of the program keeps
``time(s) <<lex time(t)`` under the new schedule.  A loop (band at time position ``k``)
may run in parallel iff no dependence between two statements inside it is *carried* by it:
none has equal times at positions ``0..k-1`` (same iteration of everything around the loop)
and different times at ``k``.  Dependences already carried by an outer loop have different
outer times and do not count -- that is exact, not the conservative "no dependence has a
non-zero distance at this level" test.

**How the check works.**  Dependences are grouped per statement pair (``Dependences.pairs``).
For two leaves of the tree, only their common ancestors decide their order: the bands
above their lowest common ancestor (a sequence) and the order of the two children of that
sequence.  So a pair is checked on the common bands' functions only (a same-leaf pair on
all of its bands), and the answer is memoized per program under the identity of those
functions: a step that rewrites some bands re-checks only the statement pairs whose common
bands it changed (``Checker``; the memo is shared by every schedule of one program).

**Symbolic verdicts.**  ``ranges={"N": (2, 4096)}`` restricts the size parameters to
intervals (others stay free); the verdict is then "legal for all sizes in range" or
illegal exactly when ``Verdict.illegal_when`` holds (a condition on the parameters,
computed with isl over every dependence), with the parameter values of the smallest
counterexample in ``Verdict.counterexample``.

When a check fails, one violated dependence is picked (the dependence record whose violated
pairs need the smallest parameter values; of it, the lexicographically smallest instance
pair, with the smallest parameter values) and described: the two statement instances, the array cell, the kind,
the distance vector in the original loops, and the new times.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import islpy as isl

from ..errors import ScheduleError
from .affine import isl_name, plain_name
from .deps import Dependence, Dependences, Proof, prove
from .model import PolyModel
from .tree import Band, Leaf, TreeNode, bands, leaf_vectors, subtree_domains, time_maps

_VERBS = {"flow": ("writes", "reads"), "anti": ("reads", "writes"), "output": ("writes", "overwrites")}

Ranges = tuple[tuple[str, tuple[int, int]], ...]


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
    """The outcome of a check; truthy iff legal.

    ``ranges`` are the parameter ranges the check assumed (``()``: none).  ``illegal_when``
    (for an illegal verdict) is the exact condition on the parameters under which the
    schedule breaks a dependence or a parallel mark; ``counterexample`` the parameter values
    of the described violation; ``proof()`` (for a legal one) says why it is legal."""

    legal: bool
    violation: Violation | None = None
    ranges: Ranges = ()
    _context: Any = field(default=None, compare=False, repr=False)

    @property
    def explanation(self) -> str:
        if self.violation is None:
            if self.ranges:
                return f"legal for all sizes in range {_ranges_text(self.ranges)}: every dependence is preserved"
            return "legal: every dependence is preserved"
        if self.ranges:
            cond = self.illegal_when
            when = f"illegal when {cond}" if cond else "illegal for all sizes"
            return f"{when} in range {_ranges_text(self.ranges)}: {self.violation.explain()}"
        return self.violation.explain()

    @property
    def counterexample(self) -> dict[str, int] | None:
        return None if self.violation is None else dict(self.violation.params)

    @property
    def illegal_when(self) -> str | None:
        """The parameter condition (isl syntax, ranges left out) under which the schedule is
        illegal; ``""`` when it is illegal for every size in range, ``None`` when legal."""
        if self.legal:
            return None
        cache = self._context["cache"]
        if "when" not in cache:
            checker, tree = self._context["checker"], self._context["tree"]
            cache["when"] = checker.illegal_params(tree, self.ranges)
        return cache["when"]

    def proof(self) -> Proof:
        """For a legal verdict: every dependence, the time dimension (loop or statement
        order) that carries it and its distance vectors there; the parallel loops and why."""
        if not self.legal:
            raise ScheduleError(f"no proof: the schedule is illegal: {self.explanation}")
        if self._context is None:
            return Proof((), ())
        checker, tree = self._context["checker"], self._context["tree"]
        return prove(checker.model, checker.deps, tree, checker.range_context(self.ranges))

    def __bool__(self) -> bool:
        return self.legal


def _ranges_text(ranges: Ranges) -> str:
    return ", ".join(f"{p} in [{lo}, {hi}]" for p, (lo, hi) in ranges)


def normalize_ranges(model: PolyModel, ranges: dict[str, tuple[int, int]] | Ranges | None) -> Ranges:
    """``ranges`` checked against the program's size parameters, as a sorted tuple."""
    if not ranges:
        return ()
    items = ranges.items() if isinstance(ranges, dict) else ranges
    out = []
    for name, bounds in items:
        if name not in model.params:
            raise ScheduleError(f"ranges: '{name}' is not a size parameter of the program; size parameters: "
                                f"{', '.join(model.params) or 'none'}")
        try:
            lo, hi = (int(b) for b in bounds)
        except (TypeError, ValueError):
            raise ScheduleError(f"ranges: the range of '{name}' must be a pair (low, high) of integers, "
                                f"got {bounds!r}") from None
        if lo > hi:
            raise ScheduleError(f"ranges: the range of '{name}' is empty: ({lo}, {hi})")
        out.append((name, (lo, hi)))
    return tuple(sorted(out))


@lru_cache(maxsize=64)
def _lex_ge(depth: int) -> isl.Map:
    return isl.Map.lex_ge(isl.Space.set_alloc(isl.DEFAULT_CONTEXT, 0, depth))


@lru_cache(maxsize=256)
def _carried(depth: int, k: int) -> isl.Map:
    t = [f"t{i}" for i in range(depth)]
    u = [f"u{i}" for i in range(depth)]
    cons = [f"t{i} = u{i}" for i in range(k)] + [f"(t{k} < u{k} or t{k} > u{k})"]
    return isl.Map(f"{{ [{', '.join(t)}] -> [{', '.join(u)}] : {' and '.join(cons)} }}")


# ----------------------------------------------------------------------------- the checker
_MEMO_LIMIT = 200_000


class Checker:
    """Memoized legality checks of schedule trees of one program (one ``Dependences``).

    A statement pair's verdict depends only on the functions of its common bands (and the
    order of the sequence children it diverges at), so it is cached under their identities;
    the cache keeps those objects alive so that identities are never reused."""

    def __init__(self, model: PolyModel, deps: Dependences):
        self.model = model
        self.deps = deps
        self._memo: dict[tuple, tuple[bool, tuple]] = {}
        self._maps: dict[tuple, tuple[isl.Map, tuple]] = {}
        self._rels: dict[tuple, tuple[isl.Map, tuple]] = {}
        self._contexts: dict[Ranges, isl.Set | None] = {}
        self.misses = 0
        """How many pair tests were computed rather than found in the memo."""

    def clear(self) -> None:
        """Forget every memoized result and restart the miss count (benchmarks use it to
        time cold checks)."""
        self._memo.clear()
        self._maps.clear()
        self._rels.clear()
        self.misses = 0

    # ------------------------------------------------------------- pieces
    def range_context(self, ranges: Ranges) -> isl.Set | None:
        if not ranges:
            return None
        if ranges not in self._contexts:
            cons = " and ".join(f"{lo} <= {isl_name(p)} <= {hi}" for p, (lo, hi) in ranges)
            self._contexts[ranges] = isl.Set(f"{self.model.param_prefix}{{ : {cons} }}")
        return self._contexts[ranges]

    def _relation(self, src: Leaf, snk: Leaf, ranges: Ranges) -> isl.Map:
        key = (src.stmt, snk.stmt, id(src.domain), id(snk.domain), ranges)
        hit = self._rels.get(key)
        if hit is None:
            rel = self.deps.pairs[(src.stmt, snk.stmt)]
            if src.domain is not None:
                rel = rel.intersect_domain(src.domain)
            if snk.domain is not None:
                rel = rel.intersect_range(snk.domain)
            ctx = self.range_context(ranges)
            if ctx is not None:
                rel = rel.intersect_params(ctx)
            hit = self._rels[key] = (rel.coalesce(), (src.domain, snk.domain))
        return hit[0]

    def _room(self) -> None:
        if len(self._memo) + len(self._maps) + len(self._rels) > _MEMO_LIMIT:
            self.clear()

    def _prefix(self, funcs: tuple[isl.PwAff, ...]) -> isl.Map:
        """The map ``S -> [f0, f1, ...]`` (memoized per prefix)."""
        key = tuple(map(id, funcs))
        hit = self._maps.get(key)
        if hit is not None:
            return hit[0]
        piece = isl.Map.from_pw_aff(funcs[-1])
        m = piece if len(funcs) == 1 else self._prefix(funcs[:-1]).flat_range_product(piece)
        self._maps[key] = (m, funcs)
        return m

    # ------------------------------------------------------------- the two tests
    def order_ok(self, src: tuple, snk: tuple, ranges: Ranges) -> bool:
        """Whether every dependence from leaf ``src`` to leaf ``snk`` (``(leaf, path,
        vector)`` triples) runs in order."""
        (la, pa, va), (lb, pb, _) = src, snk
        if la is lb:
            common, strict = va, False
        else:
            c = 0
            while pa[c] == pb[c]:
                c += 1
            common, strict = va[:c], pa[c] < pb[c]
        fs = tuple(d.funcs[la.stmt] for d in common if isinstance(d, Band))
        ft = tuple(d.funcs[lb.stmt] for d in common if isinstance(d, Band))
        key = ("o", la.stmt, lb.stmt, id(la.domain), id(lb.domain), strict, tuple(map(id, fs)), tuple(map(id, ft)),
               ranges)
        hit = self._memo.get(key)
        if hit is not None:
            return hit[0]
        self.misses += 1
        rel = self._relation(la, lb, ranges)
        if not fs:
            ok = strict or rel.is_empty()
        else:
            ms, mt = self._prefix(fs), self._prefix(ft)
            bad = ms.lex_gt_map(mt) if strict else ms.lex_ge_map(mt)
            ok = rel.intersect(bad).is_empty()
        self._memo[key] = (ok, (fs, ft, la.domain, lb.domain))
        return ok

    def parallel_ok(self, src: tuple, snk: tuple, depth: int, ranges: Ranges) -> bool:
        """Whether no dependence between the two leaves is carried by the band at time
        position ``depth`` (an ancestor of both)."""
        (la, _, va), (lb, _, _) = src, snk
        above = [d for d in va[:depth] if isinstance(d, Band)]
        band = va[depth]
        fs = tuple(d.funcs[la.stmt] for d in above)
        ft = tuple(d.funcs[lb.stmt] for d in above)
        gs, gt = band.funcs[la.stmt], band.funcs[lb.stmt]
        key = ("p", la.stmt, lb.stmt, id(la.domain), id(lb.domain), tuple(map(id, fs)), tuple(map(id, ft)),
               id(gs), id(gt), ranges)
        hit = self._memo.get(key)
        if hit is not None:
            return hit[0]
        self.misses += 1
        rel = self._relation(la, lb, ranges)
        if fs:
            rel = rel.intersect(self._prefix(fs).apply_range(self._prefix(ft).reverse()))
        ms, mt = isl.Map.from_pw_aff(gs), isl.Map.from_pw_aff(gt)
        ok = rel.intersect(ms.lex_lt_map(mt)).is_empty() and rel.intersect(ms.lex_gt_map(mt)).is_empty()
        self._memo[key] = (ok, (fs, ft, gs, gt, la.domain, lb.domain))
        return ok

    # ------------------------------------------------------------- whole trees
    def _groups(self, tree: TreeNode) -> dict[str, list[tuple]]:
        out: dict[str, list[tuple]] = {}
        for item in leaf_vectors(tree):
            out.setdefault(item[0].stmt, []).append(item)
        return out

    def failures(self, tree: TreeNode, ranges: Ranges, first: bool, both: bool = False) -> tuple[list, list]:
        """The failing statement pairs: ``(order, parallel)`` where ``order`` lists
        ``(src, snk)`` statement pairs and ``parallel`` ``(band, depth, src, snk)``; with
        ``first`` it stops at the first failure, and without ``both`` it tests parallel
        marks only when the order holds."""
        self._room()
        groups = self._groups(tree)
        order: list[tuple[str, str]] = []
        for (s, t) in self.deps.pairs:
            if s not in groups or t not in groups:
                continue
            if not all(self.order_ok(a, b, ranges) for a in groups[s] for b in groups[t]):
                order.append((s, t))
                if first:
                    return order, []
        parallel: list[tuple[Band, int, str, str]] = []
        if order and not both:
            return order, parallel
        for band, path in bands(tree):
            if not band.annotation.is_parallel:
                continue
            k = len(path)
            under = {s: [x for x in groups[s] if x[1][:k] == path] for s in band.funcs}
            for (s, t) in self.deps.pairs:
                if s not in under or t not in under:
                    continue
                if not all(self.parallel_ok(a, b, k, ranges) for a in under[s] for b in under[t]):
                    parallel.append((band, k, s, t))
                    if first:
                        return order, parallel
        return order, parallel

    def check(self, tree: TreeNode, ranges: Ranges = (), times: dict[str, isl.Map] | None = None) -> Verdict:
        context = {"checker": self, "tree": tree, "cache": {}}
        if not self.deps.records:
            return Verdict(True, None, ranges, context)
        order, parallel = self.failures(tree, ranges, first=True)
        if not order and not parallel:
            return Verdict(True, None, ranges, context)
        times = time_maps(tree, self.model) if times is None else times
        depth = next(iter(times.values())).dim(isl.dim_type.out)
        ctx = self.range_context(ranges)
        if order:
            order, _ = self.failures(tree, ranges, first=False)
            v = _find_violation(self.model, self.deps, times, _lex_ge(depth), pairs=set(order), context=ctx)
        else:
            band, k, _, _ = parallel[0]
            v = _find_violation(self.model, self.deps, times, _carried(depth, k), band.name, k,
                                subtree_domains(band, self.model), context=ctx)
        return Verdict(False, v, ranges, context)

    def illegal_params(self, tree: TreeNode, ranges: Ranges) -> str:
        """The exact parameter condition of illegality (every failing pair, both tests)."""
        times = time_maps(tree, self.model)
        depth = next(iter(times.values())).dim(isl.dim_type.out)
        ctx = self.range_context(ranges)
        order, parallel = self.failures(tree, ranges, first=False, both=True)
        bad: isl.Set | None = None
        tests = [(s, t, _lex_ge(depth), None) for s, t in order]
        tests += [(s, t, _carried(depth, k), subtree_domains(band, self.model)) for band, k, s, t in parallel]
        for s, t, pattern, inside in tests:
            rel = self.deps.pairs[(s, t)]
            if inside is not None:
                rel = rel.intersect_domain(inside[s]).intersect_range(inside[t])
            hit = rel.intersect(times[s].apply_range(pattern).apply_range(times[t].reverse())).params()
            bad = hit if bad is None else bad.union(hit)
        if bad is None:
            return ""
        bad = bad.coalesce()
        if ctx is not None:
            bad = bad.gist(ctx)
        return _params_text(bad)


def _params_text(s: isl.Set) -> str:
    text = str(s)
    body = text[text.index("{") + 1:text.rindex("}")].strip()
    body = body[1:].strip() if body.startswith(":") else body
    return " ".join(plain_name(w) for w in body.split(" "))


_CHECKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checker_for(model: PolyModel, deps: Dependences) -> Checker:
    """The (memoizing) checker of ``deps``; one per dependence set."""
    c = _CHECKERS.get(deps)
    if c is None or c.model is not model:
        c = Checker(model, deps)
        _CHECKERS[deps] = c
    return c


def check_schedule(model: PolyModel, deps: Dependences, tree: TreeNode,
                   times: dict[str, isl.Map] | None = None, ranges: dict | Ranges | None = None) -> Verdict:
    """Whether ``tree`` preserves every dependence and every parallel mark is exact, for
    every parameter value in ``ranges`` (every value when ``None``)."""
    return checker_for(model, deps).check(tree, normalize_ranges(model, ranges), times)


def _find_violation(model: PolyModel, deps: Dependences, times: dict[str, isl.Map], bad_times: isl.Map,
                    loop: str | None = None, loop_dim: int | None = None, inside: dict[str, isl.Set] | None = None,
                    pairs: set[tuple[str, str]] | None = None, context: isl.Set | None = None) -> Violation:
    """The violation with the smallest parameter values (non-negative ones preferred) whose
    times are in ``bad_times``: of the first record (in record order) violated at those
    values, the smallest instance pair.  ``inside``: only pairs of instances in those (per
    statement) sets; ``pairs``: only those statement pairs."""
    hits: dict[tuple[str, str], isl.Map] = {}
    for key, rel in deps.pairs.items():
        s, t = key
        if (pairs is not None and key not in pairs) or (inside is not None and (s not in inside or t not in inside)):
            continue
        bad = times[s].apply_range(bad_times).apply_range(times[t].reverse())
        hit = rel.intersect(bad) if context is None else rel.intersect(bad).intersect_params(context)
        if inside is not None:
            hit = hit.intersect_domain(inside[s]).intersect_range(inside[t])
        if not hit.is_empty():
            hits[key] = hit
    if not hits:
        raise AssertionError("a violated dependence was detected but no record contains it")
    fix = _smallest_params_set([h.params() for h in hits.values()])
    for dep in deps.records:
        key = (dep.source, dep.sink)
        if key not in hits or hits[key].intersect_params(fix).is_empty():
            continue
        hit = dep.relation.intersect(hits[key]).intersect_params(fix)
        if not hit.is_empty():
            return describe(model, dep, hit, times, loop, loop_dim)
    raise AssertionError("a violated dependence was detected but no record contains it")


def _smallest_params_set(sets: list[isl.Set]) -> isl.Set:
    """The lexicographically smallest parameter point of the union of ``sets`` (as a set
    fixing every parameter), non-negative values preferred."""
    union = sets[0]
    for x in sets[1:]:
        union = union.union(x)
    n = union.dim(isl.dim_type.param)
    if n == 0:
        return union
    names = [union.get_dim_name(isl.dim_type.param, i) for i in range(n)]
    nonneg = union.intersect_params(isl.Set(f"[{', '.join(names)}] -> {{ : "
                                            f"{' and '.join(f'{p} >= 0' for p in names)} }}"))
    if not nonneg.is_empty():
        union = nonneg
    flat = union.move_dims(isl.dim_type.set, 0, isl.dim_type.param, 0, n)
    try:
        flat = flat.lexmin()
    except isl.Error:
        pass
    pt = flat.sample_point()
    vals = [pt.get_coordinate_val(isl.dim_type.set, i).to_python() for i in range(n)]
    cons = " and ".join(f"{p} = {v}" for p, v in zip(names, vals))
    return isl.Set(f"[{', '.join(names)}] -> {{ : {cons} }}")


def _nonneg_params(m: isl.Map) -> isl.Map:
    """``m`` with non-negative parameters, or ``m`` itself (the same object) if that is empty."""
    n = m.dim(isl.dim_type.param)
    if n == 0:
        return m
    names = [m.get_dim_name(isl.dim_type.param, i) for i in range(n)]
    ctx = isl.Set(f"[{', '.join(names)}] -> {{ : {' and '.join(f'{p} >= 0' for p in names)} }}")
    nonneg = m.intersect_params(ctx)
    return nonneg if not nonneg.is_empty() else m


def smallest_pair(rel: isl.Map) -> tuple[dict[str, int], tuple[int, ...], tuple[int, ...]]:
    """The pair of ``rel`` with the smallest parameters (non-negative ones when there are
    any), then smallest source, then sink."""
    rel = _nonneg_params(rel)
    if rel.is_empty():
        raise ValueError("no pair in the relation")
    nparam = rel.dim(isl.dim_type.param)
    pnames = [rel.get_dim_name(isl.dim_type.param, i) for i in range(nparam)]
    n_in, n_out = rel.dim(isl.dim_type.in_), rel.dim(isl.dim_type.out)
    flat = rel.wrap().move_dims(isl.dim_type.set, 0, isl.dim_type.param, 0, nparam)
    try:
        best = flat.lexmin()
    except isl.Error:
        best = flat
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
