"""What a lowered loop program looks like to the Triton code generator.

A lowered kernel (:func:`kiln.passes.lower.lower_node`) is a sequence of top-level loop
nests over static shapes.  Each top-level node is one *phase*, run as one Triton kernel
launch (launches of one stream run in order, so a phase sees what earlier ones wrote).  In a
phase:

* the **band** is the longest chain of directly nested outer loops with constant bounds
  whose iterations touch disjoint memory: for each band iterator ``b`` and every buffer the
  phase writes, one index position holds exactly ``b`` in every access of that buffer.  The
  band's iterations are therefore independent; they are flattened into one index space and
  spread over program instances and their ``XBLOCK`` lanes;
* **registers** are local buffers used only in this phase, always at one index tuple that
  depends only on band iterators (row statistics, accumulators): one value per lane, kept in
  registers; every other local buffer lives in device memory (*scratch*);
* below the band, a loop nest is a **vector nest** (run over ``RBLOCK`` lanes of a second
  block axis, persistent or in chunks) when its iterations may run at once: perfectly nested
  loops whose bounds depend only on enclosing iterators, holding only statements, where each
  reduction goes into a cell independent of the nest's iterators (a row reduction, read
  only after the nest) or into cells indexed by every iterator, each store writes cells
  indexed by every iterator, and a buffer written in the nest is read there only at the
  cell the same iteration wrote.  Other loops run one iteration after the other
  (*sequential*), each iteration over all lanes.

Bounds that depend on band iterators (adaptive pooling windows) are handled by running the
largest extent and masking: :func:`bound_range` computes the extreme bounds exactly by
evaluating them over every combination of the iterators they use (intervals beyond
:data:`EXACT_POINTS` points).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from kiln.ir.loops import Expr, If, Loop, Program, Var, loads_of
from kiln.ir.loops.expr import Binary, Const, Unary, free_vars
from kiln.ir.loops.program import Reduce, Store

EXACT_POINTS = 1 << 20
"""Bounds over at most this many iterator combinations are evaluated exactly."""

Ranges = Mapping[str, tuple[int, int]]
"""Iterator -> inclusive ``(lowest, highest)`` value."""


class UnsupportedProgram(ValueError):
    """A loop program the Triton generator does not handle (the kernel falls back)."""


# ============================================================================ integer ranges
def interval(e: Expr, ranges: Ranges) -> tuple[int, int] | None:
    """Inclusive integer bounds of ``e`` given iterator ``ranges``, or ``None`` when unknown
    (loads, non-integer parts)."""
    if isinstance(e, Const):
        return (int(e.value), int(e.value)) if e.dtype.is_integer else None
    if isinstance(e, Var):
        return ranges.get(e.name)
    if isinstance(e, Unary) and e.op == "-":
        inner = interval(e.operand, ranges)
        return None if inner is None else (-inner[1], -inner[0])
    if not isinstance(e, Binary):
        return None
    a, b = interval(e.lhs, ranges), interval(e.rhs, ranges)
    if a is None or b is None:
        return None
    if e.op == "+":
        return a[0] + b[0], a[1] + b[1]
    if e.op == "-":
        return a[0] - b[1], a[1] - b[0]
    if e.op == "*":
        products = [x * y for x in a for y in b]
        return min(products), max(products)
    if e.op == "min":
        return min(a[0], b[0]), min(a[1], b[1])
    if e.op == "max":
        return max(a[0], b[0]), max(a[1], b[1])
    if e.op in ("floordiv", "/") and b[0] == b[1] and b[0] > 0 and (e.op == "floordiv" or a[0] >= 0):
        return a[0] // b[0], a[1] // b[0]
    if e.op in ("floormod", "%") and b[0] == b[1] and b[0] > 0 and (e.op == "floormod" or a[0] >= 0):
        return (a[0], a[1]) if 0 <= a[0] and a[1] < b[0] else (0, b[0] - 1)
    return None


def nonnegative(e: Expr, ranges: Ranges) -> bool:
    """Whether ``e`` is provably ``>= 0`` under ``ranges``."""
    bounds = interval(e, ranges)
    return bounds is not None and bounds[0] >= 0


def evaluate(e: Expr, env: Mapping[str, np.ndarray]) -> np.ndarray:
    """``e`` (integer arithmetic of iterators) on arrays of iterator values."""
    if isinstance(e, Const):
        return np.asarray(int(e.value), dtype=np.int64)
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Unary) and e.op == "-":
        return -evaluate(e.operand, env)
    if isinstance(e, Binary):
        a, b = evaluate(e.lhs, env), evaluate(e.rhs, env)
        ops = {"+": np.add, "-": np.subtract, "*": np.multiply, "min": np.minimum, "max": np.maximum,
               "floordiv": np.floor_divide, "floormod": np.mod}
        if e.op in ops:
            return ops[e.op](a, b)
        if e.op == "/":
            return np.trunc(a / b).astype(np.int64)
        if e.op == "%":
            return np.fmod(a, b)
    raise UnsupportedProgram(f"loop bound {e} is not integer arithmetic of iterators")


def bound_range(e: Expr, ranges: Ranges) -> tuple[int, int]:
    """Inclusive ``(min, max)`` of the bound ``e`` over every iterator value in ``ranges``."""
    names = sorted(free_vars(e))
    if any(n not in ranges for n in names) or any(loads_of(e)):
        raise UnsupportedProgram(f"loop bound {e} depends on values other than enclosing iterators")
    points = 1
    for n in names:
        points *= ranges[n][1] - ranges[n][0] + 1
    if points <= EXACT_POINTS:
        axes = [np.arange(ranges[n][0], ranges[n][1] + 1, dtype=np.int64) for n in names]
        grids = np.meshgrid(*axes, indexing="ij") if axes else []
        values = np.broadcast_to(evaluate(e, dict(zip(names, grids))), grids[0].shape if grids else ())
        return int(values.min()), int(values.max())
    bounds = interval(e, ranges)
    if bounds is None:
        raise UnsupportedProgram(f"loop bound {e} has no computable range")
    return bounds


def loop_extent(loop: Loop, ranges: Ranges) -> tuple[int, int, int]:
    """``(lowest lower bound, highest upper bound, largest trip count)`` of ``loop`` over the
    values of the iterators its bounds use."""
    lo_min, _ = bound_range(loop.lower, ranges)
    _, hi_max = bound_range(loop.upper, ranges)
    trips = bound_range(Binary("-", loop.upper, loop.lower), ranges)[1]
    trips = max(0, -(-trips // loop.step))
    return lo_min, hi_max, trips


def is_constant_loop(loop: Loop) -> bool:
    return isinstance(loop.lower, Const) and isinstance(loop.upper, Const)


def constant_trips(loop: Loop) -> int:
    return max(0, -(-(int(loop.upper.value) - int(loop.lower.value)) // loop.step))


# ============================================================================ accesses
@dataclass
class Access:
    """One read or write of a buffer: its index tuple and whether it writes."""

    buffer: str
    indices: tuple[Expr, ...]
    write: bool


def accesses(nodes: Iterable) -> Iterator[Access]:
    """Every access under ``nodes``: loop bounds, conditions, statement values and indices."""
    for node in nodes:
        if isinstance(node, Loop):
            for e in (node.lower, node.upper):
                yield from _reads(e)
            yield from accesses(node.body)
        elif isinstance(node, If):
            yield from _reads(node.cond)
            yield from accesses(node.then)
            yield from accesses(node.orelse)
        elif isinstance(node, (Store, Reduce)):
            for e in (*node.indices, node.value):
                yield from _reads(e)
            if isinstance(node, Reduce):
                yield Access(node.buffer, node.indices, False)
            yield Access(node.buffer, node.indices, True)
        else:
            raise UnsupportedProgram(f"loop node {type(node).__name__} has no Triton translation")


def _reads(e: Expr) -> Iterator[Access]:
    for ld in loads_of(e):
        yield Access(ld.buffer, ld.indices, False)


def private_to(var: str, buffer_accesses: list[Access]) -> bool:
    """Whether some index position holds exactly ``var`` in every access of the list."""
    if not buffer_accesses:
        return True
    rank = len(buffer_accesses[0].indices)
    target = Var(var)
    return any(all(a.indices[q] == target for a in buffer_accesses) for q in range(rank))


def by_buffer(found: Iterable[Access]) -> dict[str, list[Access]]:
    table: dict[str, list[Access]] = {}
    for a in found:
        table.setdefault(a.buffer, []).append(a)
    return table


# ============================================================================ phases
@dataclass
class Phase:
    """One top-level node of a program and how it maps to a Triton launch (module docstring)."""

    index: int
    band: list[Loop]
    body: tuple
    registers: dict[str, tuple[Expr, ...]] = field(default_factory=dict)
    """Register locals and the one index tuple they are accessed at."""

    @property
    def band_vars(self) -> list[str]:
        return [lp.iterator for lp in self.band]

    @property
    def xnumel(self) -> int:
        n = 1
        for lp in self.band:
            n *= constant_trips(lp)
        return n

    def band_ranges(self) -> dict[str, tuple[int, int]]:
        return {lp.iterator: (int(lp.lower.value), int(lp.lower.value) + lp.step * max(constant_trips(lp) - 1, 0))
                for lp in self.band}


def phases(program: Program) -> tuple[list[Phase], set[str]]:
    """The phases of ``program`` and the local buffers that live in scratch memory."""
    locals_ = {b.name for b in program.buffers if b.scope != "global"}
    per_phase = [by_buffer(accesses([node])) for node in program.body]
    uses: dict[str, int] = {}
    for table in per_phase:
        for name in table:
            uses[name] = uses.get(name, 0) + 1
    result: list[Phase] = []
    scratch: set[str] = set()
    for index, (node, table) in enumerate(zip(program.body, per_phase)):
        written = {name: acc for name, acc in table.items() if any(a.write for a in acc)}
        band: list[Loop] = []
        current = node
        while isinstance(current, Loop) and is_constant_loop(current) and constant_trips(current) > 0:
            if not all(private_to(current.iterator, acc) for acc in written.values()):
                break
            band.append(current)
            if len(current.body) != 1:
                break
            current = current.body[0]
        body = band[-1].body if band else (node,)
        band_vars = {lp.iterator for lp in band}
        phase = Phase(index, band, body)
        for name, acc in table.items():
            if name not in locals_:
                continue
            first = acc[0].indices
            if (uses[name] == 1 and all(a.indices == first for a in acc)
                    and all(free_vars(e) <= band_vars and not loads_of(e) for e in first)):
                phase.registers[name] = first
            else:
                scratch.add(name)
        result.append(phase)
    return result, scratch


# ============================================================================ vector nests
@dataclass
class VectorNest:
    """A loop nest run as one block axis: its loops (outermost first) and innermost body."""

    loops: list[Loop]
    body: tuple
    reductions: dict[int, bool] = field(default_factory=dict)
    """``id(statement)`` -> whether a reduction goes into one cell per lane (a row reduction)."""


def statements(nodes: Iterable) -> Iterator:
    for node in nodes:
        if isinstance(node, If):
            yield from statements(node.then)
            yield from statements(node.orelse)
        else:
            yield node


def vector_nest(loop: Loop, outer: set[str], registers: Mapping[str, tuple]) -> VectorNest | None:
    """``loop`` as a :class:`VectorNest` when its iterations may run at once (module
    docstring); ``outer`` are the iterators of enclosing loops (its bounds may use them)."""
    loops = [loop]
    while len(loops[-1].body) == 1 and isinstance(loops[-1].body[0], Loop):
        loops.append(loops[-1].body[0])
    body = loops[-1].body
    mine = {lp.iterator for lp in loops}
    for lp in loops:
        for bound in (lp.lower, lp.upper):
            if loads_of(bound) or not free_vars(bound) <= outer:
                return None
    if any(isinstance(n, Loop) for n in _walk_nodes(body)):
        return None
    nest = VectorNest(loops, body)
    writes: dict[str, tuple] = {}
    row_cells: set[str] = set()
    for stmt in statements(body):
        if not isinstance(stmt, (Store, Reduce)):
            return None
        used = set().union(*(free_vars(e) for e in stmt.indices)) if stmt.indices else set()
        row = not (used & mine)
        per_iteration = all(private_to(v, [Access(stmt.buffer, stmt.indices, True)]) for v in mine)
        if isinstance(stmt, Reduce) and row:
            if stmt.buffer in writes:
                return None
            row_cells.add(stmt.buffer)
            nest.reductions[id(stmt)] = True
        elif per_iteration and stmt.buffer not in registers:
            if stmt.buffer in row_cells or writes.get(stmt.buffer, stmt.indices) != stmt.indices:
                return None
            writes[stmt.buffer] = stmt.indices
            if isinstance(stmt, Reduce):
                nest.reductions[id(stmt)] = False
        else:
            return None
    # reads: never a row accumulator; a buffer written here only at the cell its iteration writes
    for node in _walk_nodes(body):
        exprs: list[Expr] = [node.cond] if isinstance(node, If) else [*node.indices, node.value] \
            if isinstance(node, (Store, Reduce)) else []
        for e in exprs:
            for ld in loads_of(e):
                if ld.buffer in row_cells or (ld.buffer in writes and ld.indices != writes[ld.buffer]):
                    return None
    return nest


def _walk_nodes(nodes: Iterable) -> Iterator:
    for node in nodes:
        yield node
        if isinstance(node, Loop):
            yield from _walk_nodes(node.body)
        elif isinstance(node, If):
            yield from _walk_nodes(node.then)
            yield from _walk_nodes(node.orelse)


def written_buffers(nodes: Iterable) -> set[str]:
    return {a.buffer for a in accesses(nodes) if a.write}


def read_buffers(nodes: Iterable) -> set[str]:
    return {a.buffer for a in accesses(nodes) if not a.write}


def has_loops(nodes: Iterable) -> bool:
    return any(isinstance(n, Loop) for n in _walk_nodes(nodes))


def product(values: Iterable[int]) -> int:
    n = 1
    for v in values:
        n *= v
    return n


__all__ = ["EXACT_POINTS", "Access", "Phase", "UnsupportedProgram", "VectorNest", "accesses", "bound_range",
           "by_buffer", "constant_trips", "evaluate", "has_loops", "interval", "is_constant_loop", "loop_extent",
           "nonnegative", "phases", "private_to", "product", "read_buffers", "statements", "vector_nest",
           "written_buffers"]
