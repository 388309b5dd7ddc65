"""What every kernel generator shares: the plan context (fresh names, scratch buffers), the
kernel frame (block and thread loops of kernel form), buffer collection, expression
rewriting, the dependence-checked parallel band of a loop nest, and privatization of
per-iteration temporaries into registers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kiln.ir.errors import IllegalTransformError, ScheduleError
from kiln.ir.loops import (
    Annotation, Barrier, Binary, Buffer, Const, CopyCommit, CopyWait, Expr, If, Load, Loop, Node, Program, Reduce,
    Select, Shuffle, Store, TaskLoop, Var, VectorCopy, loads_of, map_expr, map_nodes, substitute, walk,
)

from kiln.ir.names import claim_name
from kiln.ir.types import DType

from .plan import GpuKernel, KernelOptions

BOOL = DType.bool

AXES = ("x", "y", "z")


# ============================================================================ expressions
def rewrite_loads(nodes: Sequence[Node], fn: Callable[[Load], Expr | None]) -> tuple[Node, ...]:
    """``nodes`` with every load and access ``b[idx]`` replaced by ``fn(b[idx])`` (``None``
    keeps it), innermost first; an access must stay a load."""
    def repl(e: Expr) -> Expr | None:
        return fn(e) if isinstance(e, Load) else None

    return map_nodes(tuple(nodes), lambda e: map_expr(e, repl))


def subst_nodes(nodes: Sequence[Node], mapping: dict[str, Expr]) -> tuple[Node, ...]:
    """``nodes`` with variables replaced by expressions."""
    if not mapping:
        return tuple(nodes)
    return map_nodes(tuple(nodes), lambda e: substitute(e, mapping))


def const_int(e: Expr) -> int | None:
    return int(e.value) if isinstance(e, Const) and e.dtype.is_integer else None


def trip_count(loop: Loop) -> int | None:
    """The number of iterations of a loop with constant bounds, else ``None``."""
    lo, hi = const_int(loop.lower), const_int(loop.upper)
    if lo is None or hi is None:
        return None
    return max(0, -(-(hi - lo) // loop.step))


def accesses(nodes: Iterable[Node]) -> list[tuple[Load, bool, Node]]:
    """Every access under ``nodes`` in execution order within a statement (reads of the
    value and indices first, then the write): ``(cell, is_write, statement)``."""
    out: list[tuple[Load, bool, Node]] = []

    def reads(e: Expr, n: Node) -> None:
        out.extend((ld, False, n) for ld in loads_of(e))

    def visit(ns: Iterable[Node]) -> None:
        for n in ns:
            if isinstance(n, Loop):
                reads(n.lower, n)
                reads(n.upper, n)
                visit(n.body)
            elif isinstance(n, If):
                reads(n.cond, n)
                visit(n.then)
                visit(n.orelse)
            elif isinstance(n, TaskLoop):
                reads(n.worker, n)
                visit(n.body)
            elif isinstance(n, (Store, Reduce)):
                for i in n.indices:
                    reads(i, n)
                reads(n.value, n)
                if isinstance(n, Reduce):
                    out.append((n.target, False, n))
                out.append((n.target, True, n))
            elif isinstance(n, Shuffle):
                reads(n.value, n)
                reads(n.offset, n)
                for i in n.indices:
                    reads(i, n)
                out.append((n.target, True, n))
            elif isinstance(n, VectorCopy):
                for dst, src in n.lanes():
                    out.append((src, False, n))
                    out.append((dst, True, n))

    visit(nodes)
    return out


def buffers_used(nodes: Iterable[Node]) -> set[str]:
    return {ld.buffer for ld, _, _ in accesses(nodes)}


# ============================================================================ plan context
@dataclass(frozen=True)
class Frame:
    """The launch of one kernel being built: grid and block extents (x, y, z) and the
    names of the block and thread iterators."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    block_vars: tuple[str, str, str]
    thread_vars: tuple[str, str, str]

    def b(self, axis: str = "x") -> Expr:
        k = AXES.index(axis)
        return Var(self.block_vars[k]) if self.grid[k] > 1 else Const(0)

    def t(self, axis: str = "x") -> Expr:
        k = AXES.index(axis)
        return Var(self.thread_vars[k]) if self.block[k] > 1 else Const(0)

    @property
    def threads(self) -> int:
        return math.prod(self.block)


class PlanContext:
    """State shared by the generators while one program is planned."""

    def __init__(self, program: Program, options: KernelOptions):
        self.program = program
        self.options = options
        self.scratch: dict[str, Buffer] = {}
        self.kernel_count = 0
        self.uses: dict[str, set[int]] = {}
        self._bands: dict[int, list[Loop]] = {}
        base = {b.name for b in program.buffers} | {p.name for p in program.params}
        for n, _ in program.walk():
            if isinstance(n, Loop):
                base.add(n.iterator)
                base.add(n.name)
            elif isinstance(n, TaskLoop):
                base.update(n.iterators)
            elif getattr(n, "name", ""):
                base.add(n.name)
        self._base_taken = frozenset(base)
        self.taken: set[str] = set(base)

    # ----------------------------------------------------------------- names
    def fresh(self, base: str) -> str:
        return claim_name(base, self.taken)

    def count_uses(self, groups: Sequence[Sequence[Node]]) -> None:
        """Record which top-level groups touch each buffer (for privatization)."""
        for k, group in enumerate(groups):
            for name in buffers_used(group):
                self.uses.setdefault(name, set()).add(k)

    def private_to(self, name: str, index: int) -> bool:
        """Whether ``name`` is a local buffer that only group ``index`` touches."""
        try:
            buf = self.program.buffer(name)
        except KeyError:
            return False
        return buf.scope == "local" and self.uses.get(name, set()) <= {index}

    # ----------------------------------------------------------------- kernels
    def frame(self, grid: Sequence[int], block: Sequence[int]) -> Frame:
        """A new kernel's launch; fresh names from here on are the kernel's own."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        self.taken = set(self._base_taken)  # names are per kernel
        if math.prod(block) > 1024:
            raise ValueError(f"a block of {block} has more than 1024 threads")
        bv = tuple(self.fresh(f"b{a}") for a in AXES)
        tv = tuple(self.fresh(f"t{a}") for a in AXES)
        return Frame(grid, block, bv, tv)

    def kernel(self, frame: Frame, body: Sequence[Node], kind: str,
               extra: Sequence[Buffer] = ()) -> GpuKernel:
        """The kernel-form program of ``body`` (per-thread code over ``frame``'s iterators).

        Global buffers of the lowered program that ``body`` uses become the kernel's
        arguments (in the program's order); its ``local`` ones become scratch globals;
        ``extra`` (shared and register buffers) follow."""
        used = buffers_used(body)
        extra_names = {b.name for b in extra}
        globals_: list[Buffer] = []
        for b in self.program.buffers:
            if b.name not in used or b.name in extra_names:
                continue
            if b.scope != "global":
                b = self.scratch.setdefault(b.name, replace(b, scope="global"))
            globals_.append(b)
        unknown = used - {b.name for b in globals_} - extra_names
        if unknown:
            raise AssertionError(f"kernel body uses undeclared buffer(s) {sorted(unknown)}")
        ranges = {v: (0, e - 1) for v, e in zip(frame.block_vars + frame.thread_vars, frame.grid + frame.block)}
        nest: tuple[Node, ...] = simplify_nodes(tuple(body), ranges)
        for k in range(3):  # thread loops: x innermost
            if frame.block[k] > 1 or k == 0:
                nest = (Loop(frame.thread_vars[k], 0, frame.block[k], nest,
                             annotation=Annotation("mapped", axis=f"threadIdx.{AXES[k]}")),)
        for k in range(3):
            if frame.grid[k] > 1 or k == 0:
                nest = (Loop(frame.block_vars[k], 0, frame.grid[k], nest,
                             annotation=Annotation("mapped", axis=f"blockIdx.{AXES[k]}")),)
        name = f"{self.program.name}_k{self.kernel_count}"
        self.kernel_count += 1
        program = Program(name, (), tuple(globals_) + tuple(extra), _strip_names(nest))
        return GpuKernel(name, program, kind)

    # ----------------------------------------------------------------- analysis
    def parallel_band(self, nest: Loop) -> list[Loop]:
        """The outermost loops of ``nest`` -- perfectly nested, constant bounds -- that carry
        no dependence, proved with isl (:class:`kiln.loops.Schedule`); ``[]`` when the
        outermost does (or when the nest is outside the polyhedral model)."""
        key = id(nest)
        if key not in self._bands:
            self._bands[key] = _parallel_band(self.program, nest)
        return self._bands[key]


def _strip_names(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
    """Loops keep their iterators but lose copied names (the new program names them)."""
    out: list[Node] = []
    for n in nodes:
        if isinstance(n, Loop):
            n = replace(n, name="", body=_strip_names(n.body))
        elif isinstance(n, If):
            n = replace(n, then=_strip_names(n.then), orelse=_strip_names(n.orelse))
        elif isinstance(n, TaskLoop):
            n = replace(n, body=_strip_names(n.body))
        elif isinstance(n, (Store, Reduce, Shuffle, VectorCopy)):
            n = replace(n, name="")
        out.append(n)
    return tuple(out)


def perfect_chain(nest: Loop) -> list[Loop]:
    """``nest`` and the loops directly nested in it, each the only node of its parent."""
    chain = [nest]
    while len(chain[-1].body) == 1 and isinstance(chain[-1].body[0], Loop):
        chain.append(chain[-1].body[0])
    return chain


def _parallel_band(program: Program, nest: Loop) -> list[Loop]:
    try:
        from kiln.passes.schedule import Schedule
    except ImportError as e:  # no islpy: nothing can be proved parallel
        warnings.warn(f"kiln cannot prove loops parallel without islpy ({e}): generated CUDA kernels run "
                      f"their loop nests on one thread; install islpy (pip install islpy)", stacklevel=2)
        return []

    candidates: list[Loop] = []
    for lp in perfect_chain(nest):
        if trip_count(lp) is None:
            break
        candidates.append(lp)
    if not candidates:
        return []
    try:
        schedule = Schedule(Program(f"{program.name}_nest", (), program.buffers, (nest,)))
    except (ScheduleError, ValueError):
        return []  # outside the polyhedral model: nothing is proved parallel
    band: list[Loop] = []
    for lp in candidates:
        try:
            schedule.parallel(lp.name)
        except (IllegalTransformError, ScheduleError):
            break
        band.append(lp)
    return band


def band_coordinates(band: Sequence[Loop], flat: Expr) -> dict[str, Expr]:
    """Each band iterator as a function of the row-major flat index of the band's
    iteration space (innermost loop fastest)."""
    extents = [trip_count(lp) for lp in band]
    out: dict[str, Expr] = {}
    stride = 1
    for k in range(len(band) - 1, -1, -1):
        lp, e = band[k], extents[k]
        c = flat if stride == 1 else flat // stride
        if k > 0 and e > 1:
            c = c % e
        if e == 1:
            c = Const(0)
        lo = const_int(lp.lower)
        c = c if lp.step == 1 else c * lp.step
        out[lp.iterator] = c if lo == 0 else c + lo
        stride *= e
    return out


# ============================================================================ registers
def privatize(ctx: PlanContext, index: int, body: Sequence[Node], band_iters: set[str],
              ) -> tuple[tuple[Node, ...], list[Buffer]]:
    """Local buffers only group ``index`` touches, accessed in ``body`` (one iteration of a
    parallel band) through one index tuple of band iterators and first written by an
    unconditional store, become 0-d registers.  Sound because the band carries no
    dependence: the cells an iteration writes are touched by no other iteration, and the
    first access of each iteration initializes the register."""
    found: dict[str, tuple[Expr, ...] | None] = {}
    for ld, _, _ in accesses(body):
        if not ctx.private_to(ld.buffer, index):
            continue
        ok = all(not loads_of(i) and free_vars_of(i) <= band_iters for i in ld.indices)
        prev = found.get(ld.buffer, ld.indices)
        found[ld.buffer] = ld.indices if ok and prev == ld.indices else None
    chosen = [name for name, idx in found.items() if idx is not None and _first_is_store(body, name)]
    if not chosen:
        return tuple(body), []
    names = set(chosen)
    regs = [Buffer(n, (), ctx.program.buffer(n).dtype, "register") for n in chosen]
    new = rewrite_loads(body, lambda ld: Load(ld.buffer, ()) if ld.buffer in names else None)
    return new, regs


def free_vars_of(e: Expr) -> set[str]:
    return {x.name for x in walk(e) if isinstance(x, Var)}


def _first_is_store(body: Sequence[Node], name: str) -> bool:
    def visit(ns: Sequence[Node], certain: bool) -> bool | None:
        for n in ns:
            if isinstance(n, Loop):
                if any(ld.buffer == name for e in (n.lower, n.upper) for ld in loads_of(e)):
                    return False
                tc = trip_count(n)
                r = visit(n.body, certain and tc is not None and tc > 0)
            elif isinstance(n, If):
                if any(ld.buffer == name for ld in loads_of(n.cond)):
                    return False
                r = visit(n.then, False)
                r = visit(n.orelse, False) if r is None else r
            elif isinstance(n, TaskLoop):
                r = visit(n.body, False)
            elif isinstance(n, (Barrier, CopyCommit, CopyWait)):
                r = None
            else:
                touched = [ld for ld, w, _ in accesses([n]) if ld.buffer == name]
                if not touched:
                    r = None
                else:
                    reads = [ld for ld, w, _ in accesses([n]) if ld.buffer == name and not w]
                    r = isinstance(n, Store) and n.buffer == name and not reads and certain
            if r is not None:
                return r
        return None

    return bool(visit(body, True))


def top_level_groups(body: Sequence[Node]) -> list[list[Node]]:
    """The top-level nodes in groups: each loop with the loop-free nodes right before it
    (a reduction's initialization), and trailing loop-free nodes together."""
    groups: list[list[Node]] = []
    pending: list[Node] = []
    for n in body:
        pending.append(n)
        if isinstance(n, Loop):
            groups.append(pending)
            pending = []
    if pending:
        groups.append(pending)
    return groups


# ============================================================================ index simplification
Range = tuple[int, int]  # inclusive


def _range(e: Expr, ranges: dict[str, Range]) -> Range | None:
    if isinstance(e, Const):
        return (int(e.value), int(e.value)) if e.dtype.is_integer else None
    if isinstance(e, Var):
        return ranges.get(e.name)
    if isinstance(e, Binary):
        a, b = _range(e.lhs, ranges), _range(e.rhs, ranges)
        if a is None or b is None:
            return None
        if e.op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if e.op == "-":
            return (a[0] - b[1], a[1] - b[0])
        if e.op == "*":
            products = [x * y for x in a for y in b]
            return (min(products), max(products))
        if e.op in ("floordiv", "floormod") and b[0] == b[1] and b[0] > 0:
            d = b[0]
            if e.op == "floordiv":
                return (a[0] // d, a[1] // d)
            return a if 0 <= a[0] and a[1] < d else (0, d - 1)
        if e.op in ("min", "max"):
            f = min if e.op == "min" else max
            return (f(a[0], b[0]), f(a[1], b[1]))
    return None


def simplify_index(e: Expr, ranges: dict[str, Range]) -> Expr:
    """``e`` with ``floordiv``/``floormod`` by constants removed where the ranges of the
    variables (inclusive bounds) prove them identities or zero, nested ones merged, integer
    ``+ 0``, ``* 0``, ``* 1`` folded, and comparisons the ranges prove true replaced by
    ``true`` (dropped from ``&&``)."""
    def fn(x: Expr) -> Expr | None:
        if not isinstance(x, Binary):
            return None
        a, b = const_int(x.lhs), const_int(x.rhs)
        if x.op in ("+", "*") and _is_int(x.lhs, ranges) and _is_int(x.rhs, ranges):
            if x.op == "+" and (a == 0 or b == 0):
                return x.rhs if a == 0 else x.lhs
            if x.op == "*" and (a == 0 or b == 0):
                return Const(0)
            if x.op == "*" and (a == 1 or b == 1):
                return x.rhs if a == 1 else x.lhs
        if x.op in ("<", "<=", ">", ">="):
            return _compare(x, ranges)
        if x.op == "&&":
            for p, q in ((x.lhs, x.rhs), (x.rhs, x.lhs)):
                if isinstance(p, Const) and p.dtype.name == "bool" and p.value:
                    return q
            return None
        if x.op not in ("floordiv", "floormod"):
            return None
        d = const_int(x.rhs)
        if d is None or d <= 0:
            return None
        r = _range(x.lhs, ranges)
        if r is not None and 0 <= r[0] and r[1] < d:
            return x.lhs if x.op == "floormod" else Const(0)
        inner = x.lhs
        if isinstance(inner, Binary) and inner.op == "*" and const_int(inner.rhs) and const_int(inner.rhs) > 0 \
                and d % const_int(inner.rhs) == 0 and _is_int(inner.lhs, ranges):
            c = const_int(inner.rhs)
            if x.op == "floordiv":
                return Binary("floordiv", inner.lhs, Const(d // c)) if d > c else inner.lhs
            return Binary("*", Binary("floormod", inner.lhs, Const(d // c)), Const(c)) if d > c else Const(0)
        if isinstance(inner, Binary) and inner.op == x.op and const_int(inner.rhs) and const_int(inner.rhs) > 0:
            a = const_int(inner.rhs)
            if x.op == "floordiv":
                return Binary("floordiv", inner.lhs, Const(a * d))
            if a % d == 0:
                return fn(Binary("floormod", inner.lhs, Const(d))) or Binary("floormod", inner.lhs, Const(d))
        return None

    return map_expr(e, fn)


def _is_int(e: Expr, ranges: dict[str, Range]) -> bool:
    """Integer arithmetic over iterators and integer constants (kernels have no other
    variables)."""
    if isinstance(e, Const):
        return e.dtype.is_integer
    if isinstance(e, Var):
        return True
    return isinstance(e, Binary) and e.op in ("+", "-", "*", "floordiv", "floormod", "min", "max") \
        and _is_int(e.lhs, ranges) and _is_int(e.rhs, ranges)


def _compare(x: Binary, ranges: dict[str, Range]) -> Expr | None:
    a, b = _range(x.lhs, ranges), _range(x.rhs, ranges)
    if a is None or b is None:
        return None
    always = {"<": a[1] < b[0], "<=": a[1] <= b[0], ">": a[0] > b[1], ">=": a[0] >= b[1]}[x.op]
    return Const(True, BOOL) if always else None


def simplify_nodes(nodes: Sequence[Node], ranges: dict[str, Range]) -> tuple[Node, ...]:
    """:func:`simplify_index` over every expression, with the ranges of the iterators of
    constant-bound loops added as they are entered."""
    out: list[Node] = []
    for n in nodes:
        if isinstance(n, Loop):
            lo, hi = const_int(n.lower), const_int(n.upper)
            inner = dict(ranges)
            if lo is not None and hi is not None and hi > lo:
                inner[n.iterator] = (lo, hi - 1)
            else:
                inner.pop(n.iterator, None)
            n = replace(n, lower=simplify_index(n.lower, ranges), upper=simplify_index(n.upper, ranges),
                        body=simplify_nodes(n.body, inner))
        elif isinstance(n, If):
            n = replace(n, cond=simplify_index(n.cond, ranges), then=simplify_nodes(n.then, ranges),
                        orelse=simplify_nodes(n.orelse, ranges))
        elif isinstance(n, TaskLoop):
            inner = {k: v for k, v in ranges.items() if k not in n.iterators}
            inner.update({it: (0, e - 1) for it, e in zip(n.iterators, n.mapping.task_shape)})
            n = replace(n, worker=simplify_index(n.worker, ranges), body=simplify_nodes(n.body, inner))
        else:
            n = map_nodes((n,), lambda e: simplify_index(e, ranges))[0]
        out.append(n)
    return tuple(out)


def unconditional_loads(e: Expr) -> list[Load]:
    """The loads evaluating ``e`` always performs: not those inside a ``select`` branch or on
    the right of ``&&``/``||`` (evaluated only when the condition allows; hoisting them
    could read out of bounds)."""
    out: list[Load] = []
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, Load):
            out.append(x)
            stack.extend(x.indices)
        elif isinstance(x, Select):
            stack.append(x.cond)
        elif isinstance(x, Binary) and x.op in ("&&", "||"):
            stack.append(x.lhs)
        else:
            stack.extend(x.children())
    return out
