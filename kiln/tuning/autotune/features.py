"""Features of a loop program and its schedule, for the cost model and the RL observation.

A fixed-length vector (:data:`FEATURE_NAMES`) read from the original program (work, bytes,
statements) and from the scheduled program the candidate generates: loop depth, the
parallel, vectorized and unrolled loops and their extents, and, for the statements of every
innermost loop, how their accesses move along that loop (unit stride, invariant, strided)
-- what decides vectorization and cache behaviour on a CPU.  Extents of loops whose bounds
depend on outer iterators (tiles) are estimated at the first iteration of those.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from kiln.ir.loops.expr import Binary, Const, Expr, Load, Var, affine_form, walk
from kiln.ir.loops.program import If, Loop, Program, Reduce, Store

PRIMITIVE_COUNTS = ("tile", "interchange", "parallel", "vectorize", "unroll", "fission", "fuse", "compute_at")
FEATURE_NAMES = (
    "log_work", "log_bytes", "statements", "loops", "max_depth", "reductions",
    "parallel_loops", "log_parallel_extent", "parallel_depth", "parallel_outermost_work",
    "vector_loops", "log_vector_extent", "unrolled_loops", "unroll_factor",
    "inner_unit", "inner_invariant", "inner_strided", "inner_other", "log_inner_extent",
    "inner_reduction", "tile_levels", "log_min_tile",
    *(f"n_{p}" for p in PRIMITIVE_COUNTS),
)


def _eval(e: Expr, env: dict[str, int]) -> int | None:
    if isinstance(e, Const):
        return int(e.value)
    if isinstance(e, Var):
        return env.get(e.name, 0)
    if isinstance(e, Binary):
        a, b = _eval(e.lhs, env), _eval(e.rhs, env)
        if a is None or b is None:
            return None
        op = e.op
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op in ("/", "floordiv") and b:
            return a // b
        if op in ("%", "floormod") and b:
            return a % b
        if op == "min":
            return min(a, b)
        if op == "max":
            return max(a, b)
    return None


def _extent(loop: Loop, env: dict[str, int]) -> int:
    lo, hi = _eval(loop.lower, env), _eval(loop.upper, env)
    if lo is None or hi is None:
        return 16
    return max(1, (hi - lo + loop.step - 1) // loop.step)


def _log(x: float) -> float:
    return math.log2(max(1.0, float(x)))


def features(original: Program, schedule: Any, scheduled: Program) -> list[float]:
    """The feature vector of ``schedule`` (whose generated program is ``scheduled``) of ``original``."""
    stats: dict[str, float] = Counter()
    work = [0.0]

    def visit(body: tuple, env: dict[str, int], depth: int, outer: list[tuple[Loop, int]]) -> None:
        for n in body:
            if isinstance(n, Loop):
                e = _extent(n, env)
                mode = n.annotation.mode
                stats["loops"] += 1
                stats["max_depth"] = max(stats["max_depth"], depth + 1)
                if mode == "parallel":
                    stats["parallel_loops"] += 1
                    stats["log_parallel_extent"] = max(stats["log_parallel_extent"], _log(e))
                    stats["parallel_depth"] = max(stats["parallel_depth"], depth + 1)
                elif mode == "vectorized":
                    stats["vector_loops"] += 1
                    stats["log_vector_extent"] = max(stats["log_vector_extent"], _log(e))
                elif mode == "unrolled":
                    stats["unrolled_loops"] += 1
                    stats["unroll_factor"] = max(stats["unroll_factor"], float(n.annotation.factor or 1))
                inner_env = dict(env)
                inner_env[n.iterator] = _eval(n.lower, env) or 0
                visit(n.body, inner_env, depth + 1, outer + [(n, e)])
            elif isinstance(n, If):
                visit(n.then, env, depth, outer)
                visit(n.orelse, env, depth, outer)
            elif isinstance(n, (Store, Reduce)):
                count = 1.0
                for _, e in outer:
                    count *= e
                work[0] += count
                if isinstance(n, Reduce):
                    stats["reductions"] += 1
                if outer:
                    inner, e = outer[-1]
                    stats["log_inner_extent"] = max(stats["log_inner_extent"], _log(e))
                    accesses = [Load(n.buffer, n.indices), *(x for x in walk(n.value) if isinstance(x, Load))]
                    for a in accesses:
                        stats["inner_" + _stride(a, inner.iterator)] += 1
                    if isinstance(n, Reduce) and not any(inner.iterator in _names(i) for i in n.indices):
                        stats["inner_reduction"] += 1
                    par = [i for i, (lp, _) in enumerate(outer) if lp.annotation.mode == "parallel"]
                    if par:
                        rest = 1.0
                        for _, ex in outer[par[0] + 1:]:
                            rest *= ex
                        stats["parallel_outermost_work"] = max(stats["parallel_outermost_work"], _log(rest))

    visit(scheduled.body, {}, 0, [])
    stats["log_work"] = _log(work[0])
    nbytes = 0
    for b in original.buffers:
        size = 1
        for d in b.shape:
            size *= int(d.value) if isinstance(d, Const) else 64
        nbytes += size * b.dtype.itemsize
    stats["log_bytes"] = _log(nbytes)
    stats["statements"] = len(original.statements())
    trace = list(getattr(schedule, "trace", []))
    tiles = [s for s in trace if s["primitive"] == "tile"]
    stats["tile_levels"] = len(tiles)
    if tiles:
        stats["log_min_tile"] = min(_log(x) for s in tiles for x in s["args"]["sizes"])
    for s in trace:
        if s["primitive"] in PRIMITIVE_COUNTS:
            stats[f"n_{s['primitive']}"] += 1
    return [float(stats.get(name, 0.0)) for name in FEATURE_NAMES]


LOOP_FEATURE_NAMES = ("log_unit", "log_strided", "log_invariant", "log_other", "reduction")
"""Per loop of a scheduled program: how the accesses of the statements inside it move along
its iterator (``log2(1 + count)`` of unit-stride, strided, invariant and non-affine ones),
and whether it carries a reduction (a statement inside it writes an element that does not
depend on its iterator) -- what decides whether interchanging, vectorizing or unrolling it
pays."""


def loop_features(scheduled: Program) -> dict[str, list[float]]:
    """:data:`LOOP_FEATURE_NAMES` for every loop of ``scheduled``, by loop name."""
    out: dict[str, list[float]] = {}

    def statements(body: tuple) -> list[Store | Reduce]:
        found: list[Store | Reduce] = []
        for n in body:
            if isinstance(n, (Store, Reduce)):
                found.append(n)
            elif isinstance(n, Loop):
                found += statements(n.body)
            elif isinstance(n, If):
                found += statements(n.then) + statements(n.orelse)
        return found

    def visit(body: tuple) -> None:
        for n in body:
            if isinstance(n, Loop):
                counts: Counter[str] = Counter()
                reduction = 0.0
                for st in statements(n.body):
                    for a in (Load(st.buffer, st.indices), *(x for x in walk(st.value) if isinstance(x, Load))):
                        counts[_stride(a, n.iterator)] += 1
                    if not any(n.iterator in _names(i) for i in st.indices):
                        reduction = 1.0
                out[n.name] = [math.log2(1 + counts[k]) for k in ("unit", "strided", "invariant", "other")]
                out[n.name].append(reduction)
                visit(n.body)
            elif isinstance(n, If):
                visit(n.then)
                visit(n.orelse)

    visit(scheduled.body)
    return out


def _names(e: Expr) -> set[str]:
    return {x.name for x in walk(e) if isinstance(x, Var)}


def _stride(access: Load, iterator: str) -> str:
    if not access.indices:
        return "invariant"
    forms = [affine_form(i) for i in access.indices]
    if any(f is None for f in forms):
        return "other"
    coeffs = [f.coeff(iterator) for f in forms]  # type: ignore[union-attr]
    if not any(coeffs):
        return "invariant"
    if coeffs[-1] in (1, -1) and not any(coeffs[:-1]):
        return "unit"
    return "strided"


__all__ = ["FEATURE_NAMES", "LOOP_FEATURE_NAMES", "features", "loop_features"]
