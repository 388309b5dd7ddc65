"""Data races of GPU kernels, found exactly with isl.

A kernel (the kernel form of ``docs/gpu.md``: block loops ``@mapped("blockIdx.*")`` around
thread loops ``@mapped("threadIdx.*")`` around per-thread code) is race-free when no two
statement instances that touch one cell -- one of them writing it -- may run at the same
time on different workers.  :func:`check_races` decides it on the polyhedral model:

* Task loops are lowered first; every instance is a point over all its enclosing loop
  iterators: block coordinates, thread coordinates, then the per-thread loops.  Stores,
  reductions, shuffles (a write of their target) and vector copies (``width`` cells) are
  statements (:mod:`.model`).
* The **barrier phase** of an instance is the first barrier its thread executes after it:
  that barrier's block coordinates and its time in the per-thread 2d+1 schedule (loop
  iterators and positions in sequences), computed by isl as a parametric ``lexmin`` over
  the barrier instances.  A virtual barrier closes the per-thread code.  Two instances of
  one block are in the same phase exactly when they passed the same number of barriers, so
  the last statements of one iteration of a barrier loop and the first of the next share a
  phase, as they do on the GPU.  ``barrier warp`` separates threads of one warp only
  (warp = ``linear_tid // 32``, ``linear_tid = x + X * (y + Y * z)``).
* Two accesses of one cell **conflict** when at least one writes (a reduction reads and
  writes: two threads' ``+=`` into one cell race, there are no atomics) and they come from
  different threads of one block in one phase (``shared`` and ``global`` buffers), or from
  different blocks in any phase (``global`` buffers: blocks never synchronize).
  ``register`` (and ``local``) buffers are private to a thread: never a race.
* An asynchronous vector copy (``cp.async``) writes its cells at some time until it
  completes: at the first ``wait_copies n`` of its thread that follows at least ``n``
  further ``commit_copies`` after the one closing its group (or at the kernel's end).  Its
  write conflicts with other threads' accesses in every phase from its issue to that one.

Accesses with non-affine indices are may-accesses of their whole buffer and barriers under
non-affine conditions are not counted, so the check never misses a race of the model; it
may then report one that cannot happen, and says the index was not affine.

Control flow around barriers and shuffles must not depend on thread iterators or loaded
values (every thread reaches them); :func:`check_races` refuses such kernels with a
:class:`~kiln.ir.errors.VerificationError`.  A race raises :class:`RaceError` naming the
two statements, their workers (block and thread coordinates, ``x`` first), the buffer and
cell, for the lexicographically smallest conflicting pair of instances.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import islpy as isl

from ..errors import ScheduleError, VerificationError
from ..loops.expr import Const, Expr, free_vars, loads_of
from ..loops.program import (
    Barrier, CopyCommit, CopyWait, If, Loop, Node, Program, Reduce, Shuffle, TaskLoop, VectorCopy,
)
from ..loops.tasks import lower_mappings
from .affine import isl_name
from .model import Access, PolyModel, PolyStatement, build_model, robust_lexmin
from .tree import initial_tree, time_maps

BLOCK_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
THREAD_AXES = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
PRIVATE_SCOPES = ("register", "local")
WARP_SIZE = 32


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Worker:
    """One thread: its block and thread coordinates, ``x`` first."""

    block: tuple[int, ...]
    thread: tuple[int, ...]

    def __str__(self) -> str:
        thread = f"thread {_tuple(self.thread)}"
        return f"block {_tuple(self.block)} {thread}" if self.block else thread


@dataclass(frozen=True)
class RaceSide:
    """One of the two accesses of a race."""

    statement: str
    worker: Worker
    action: str  # "writes", "reads", "accumulates into"
    instance: tuple[tuple[str, int], ...]

    def __str__(self) -> str:
        inner = self.instance[len(self.worker.block) + len(self.worker.thread):]
        at = f" ({', '.join(f'{k}={v}' for k, v in inner)})" if inner else ""
        return f"{self.statement}{at} in {self.worker} {self.action}"


class RaceError(ScheduleError):
    """Two workers may touch one cell at the same time, one of them writing it.

    ``first``/``second`` are the two accesses (:class:`RaceSide`), ``buffer``/``cell`` what
    they touch, ``same_block`` whether the workers share a block (same barrier phase) or not
    (blocks never synchronize)."""

    def __init__(self, message: str, kernel: str, buffer: str, cell: tuple[int, ...], first: RaceSide,
                 second: RaceSide, same_block: bool):
        self.kernel = kernel
        self.buffer = buffer
        self.cell = cell
        self.first = first
        self.second = second
        self.same_block = same_block
        super().__init__(message)


def _tuple(values: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, values)) + ("," if len(values) == 1 else "") + ")"


# ----------------------------------------------------------------------------- kernel form
@dataclass(frozen=True, eq=False)
class KernelNest:
    """A kernel split into its block loops, thread loops and per-thread code (task loops
    lowered)."""

    program: Program
    blocks: tuple[Loop, ...]
    threads: tuple[Loop, ...]
    body: tuple[Node, ...]

    @property
    def block_iterators(self) -> tuple[str, ...]:
        return tuple(lp.iterator for lp in self.blocks)

    @property
    def thread_iterators(self) -> tuple[str, ...]:
        return tuple(lp.iterator for lp in self.threads)


def kernel_nest(kernel: Program) -> KernelNest:
    """The loops of ``kernel`` (kernel form); ``VerificationError`` naming what is off."""
    program = lower_mappings(kernel)
    where = f"kernel '{kernel.name}'"
    if program.params:
        raise VerificationError(f"{where}: a kernel has static shapes, but this one has parameters "
                                f"{', '.join(p.name for p in program.params)}; bind them to constants first")
    nodes = program.body
    groups: list[list[Loop]] = [[], []]
    for group, axes in zip(groups, (BLOCK_AXES, THREAD_AXES)):
        while len(nodes) == 1 and isinstance(nodes[0], Loop) and nodes[0].annotation.mode == "mapped" \
                and nodes[0].annotation.axis in axes:
            lp = nodes[0]
            if lp.annotation.axis in {g.annotation.axis for g in group}:
                raise VerificationError(f"{where}: loop '{lp.name}' maps a second loop to {lp.annotation.axis}; "
                                        f"each axis is mapped at most once")
            lo, hi = lp.lower, lp.upper
            if not (_const(lo) == 0 and _const(hi) is not None and _const(hi) > 0 and lp.step == 1):
                raise VerificationError(f"{where}: mapped loop '{lp.name}' must run over [0, N) with a constant "
                                        f"N > 0 and step 1, got [{lo}, {hi}) step {lp.step}")
            group.append(lp)
            nodes = lp.body
    for n in _walk_nodes(nodes):
        if isinstance(n, Loop) and n.annotation.mode == "mapped":
            raise VerificationError(f"{where}: loop '{n.name}' mapped to {n.annotation.axis} is not part of the "
                                    f"perfect nest of block loops then thread loops around the per-thread code")
    nest = KernelNest(program, tuple(groups[0]), tuple(groups[1]), nodes)
    _check_uniform(nest, where)
    return nest


def _const(e: Expr) -> int | None:
    return int(e.value) if isinstance(e, Const) and e.dtype.is_integer else None


def _walk_nodes(nodes: tuple[Node, ...]):
    for n in nodes:
        yield n
        if isinstance(n, (Loop, TaskLoop)):
            yield from _walk_nodes(n.body)
        elif isinstance(n, If):
            yield from _walk_nodes(n.then)
            yield from _walk_nodes(n.orelse)


def _check_uniform(nest: KernelNest, where: str) -> None:
    threads = set(nest.thread_iterators)

    def visit(nodes: tuple[Node, ...], ctrl: list[tuple[str, Expr]]) -> None:
        for n in nodes:
            if isinstance(n, Loop):
                inner = ctrl + [(f"loop '{n.name}'", n.lower), (f"loop '{n.name}'", n.upper)]
                visit(n.body, inner)
            elif isinstance(n, If):
                inner = ctrl + [(f"if ({n.cond})", n.cond)]
                visit(n.then, inner)
                visit(n.orelse, inner)
            elif isinstance(n, (Barrier, Shuffle)):
                what = "a barrier" if isinstance(n, Barrier) else f"shuffle {n.name}"
                for desc, e in ctrl:
                    bad = sorted(free_vars(e) & threads)
                    if bad or loads_of(e):
                        why = f"thread iterator(s) {', '.join(bad)}" if bad else "a loaded value"
                        raise VerificationError(f"{where}: {what} sits under {desc}, which depends on {why}; "
                                                f"every thread of the block must reach it: move it out, or make "
                                                f"the bound or condition the same for all threads")

    visit(nest.body, [])


def _with_end_barrier(nest: KernelNest) -> Program:
    def rebuild(loops: tuple[Loop, ...]) -> tuple[Node, ...]:
        if not loops:
            return nest.body + (Barrier(),)
        return (replace(loops[0], body=rebuild(loops[1:])),)

    return nest.program.replace(body=rebuild(nest.blocks + nest.threads))


# ----------------------------------------------------------------------------- the check
def check_races(kernel: Program) -> None:
    """Raise :class:`RaceError` for the first race of ``kernel`` (module docstring); return
    ``None`` when the kernel is race-free."""
    _Checker(kernel).run()


class _Checker:
    def __init__(self, kernel: Program):
        self.kernel = kernel
        self.nest = kernel_nest(kernel)
        self.model: PolyModel = build_model(_with_end_barrier(self.nest), syncs=True)
        self.nb, self.nt = len(self.nest.blocks), len(self.nest.threads)
        self.scopes = {b.name: b.scope for b in self.model.program.buffers}
        self.order = {name: k for k, name in enumerate(self.model.statements)}
        self.statements = [ps for ps in self.model.statements.values() if not ps.is_sync]

    @cached_property
    def phases(self) -> Phases:
        return Phases(self.model, self.nb, self.nt, self.warp_of)

    def warp_of(self, names: list[str]) -> str:
        """isl text of the warp number of the thread whose iterators are ``names`` (the
        thread dimensions, in loop order)."""
        by_axis = {lp.annotation.axis: (name, int(lp.upper.value)) for lp, name in zip(self.nest.threads, names)}
        linear, scale = [], 1
        for axis in THREAD_AXES:
            if axis in by_axis:
                name, extent = by_axis[axis]
                linear.append(f"{scale} * {name}")
                scale *= extent
        return f"floor(({' + '.join(linear) or '0'}) / {WARP_SIZE})"

    def run(self) -> None:
        for s in self.statements:
            for x in s.accesses:
                if not x.is_write or self.scopes[x.array] in PRIVATE_SCOPES:
                    continue
                for t in self.statements:
                    for y in t.accesses:
                        if y.array != x.array or (y.is_write and self.order[t.name] < self.order[s.name]):
                            continue
                        self.pair(s, x, t, y)

    def pair(self, s: PolyStatement, x: Access, t: PolyStatement, y: Access) -> None:
        cells = x.relation.apply_range(y.relation.reverse())
        if cells.is_empty():
            return
        if self.nt:
            same = cells.intersect(self.relation(s, t, self.same_block_other_thread))
            if not same.is_empty():
                same = self.phases.concurrent(s, x, t, y, same)
                if not same.is_empty():
                    self.report(s, x, t, y, same, same_block=True)
        if self.nb and self.scopes[x.array] == "global":
            other = cells.intersect(self.relation(s, t, self.other_block))
            if not other.is_empty():
                self.report(s, x, t, y, other, same_block=False)

    # ------------------------------------------------------------------ relations
    def relation(self, s: PolyStatement, t: PolyStatement, cond) -> isl.Map:
        a = [f"a{k}" for k in range(len(s.iterators))]
        b = [f"b{k}" for k in range(len(t.iterators))]
        text = (f"{self.model.param_prefix}{{ {isl_name(s.name)}[{', '.join(a)}] -> "
                f"{isl_name(t.name)}[{', '.join(b)}] : {cond(a, b)} }}")
        return isl.Map(text)

    def same_block_other_thread(self, a: list[str], b: list[str]) -> str:
        same = [f"{a[k]} = {b[k]}" for k in range(self.nb)]
        other = [f"{a[k]} < {b[k]} or {a[k]} > {b[k]}" for k in range(self.nb, self.nb + self.nt)]
        return " and ".join(same + [f"({' or '.join(other)})"])

    def other_block(self, a: list[str], b: list[str]) -> str:
        return "(" + " or ".join(f"{a[k]} < {b[k]} or {a[k]} > {b[k]}" for k in range(self.nb)) + ")"

    # ------------------------------------------------------------------ the message
    def report(self, s: PolyStatement, x: Access, t: PolyStatement, y: Access, pairs: isl.Map,
               same_block: bool) -> None:
        params, src, snk = _smallest_pair(pairs)
        cell = self.cell(x, src, y, snk, params)
        first = RaceSide(s.name, self.worker(src), _action(s, x), tuple(zip(s.iterators, src)))
        second = RaceSide(t.name, self.worker(snk), _action(t, y), tuple(zip(t.iterators, snk)))
        ref = f"{x.array}[{', '.join(map(str, cell))}]"
        head = f"race in kernel '{self.kernel.name}': {first} {ref} and {second} {ref}"
        if same_block:
            if _is_async(s) or _is_async(t):
                copy = s if _is_async(s) else t
                text = (f"{head} while the asynchronous copy {copy.name} may still be in flight; complete it "
                        f"(wait_copies, then a barrier) before other threads touch these cells")
            elif _is_reduction_target(s, x) and _is_reduction_target(t, y):
                text = (f"{head} in the same barrier phase; there are no atomics: reduce into one cell per "
                        f"thread (or a register), then combine after a barrier")
            else:
                text = (f"{head} in the same barrier phase; put a barrier between them or give each thread "
                        f"its own cell")
        else:
            text = (f"{head}; blocks never synchronize: give each block its own cells of '{x.array}' (or "
                    f"combine the blocks' results in a later kernel)")
        may = [st.name for st, acc in ((s, x), (t, y)) if not acc.exact]
        if may:
            text += (f" (the access of {' and '.join(dict.fromkeys(may))} to '{x.array}' is not affine or is "
                     f"guarded by a non-affine condition, so kiln assumes it may touch any cell)")
        raise RaceError(text, self.kernel.name, x.array, cell, first, second, same_block)

    def worker(self, values: tuple[int, ...]) -> Worker:
        def ordered(loops: tuple[Loop, ...], vals: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, ...]:
            by_axis = {lp.annotation.axis: v for lp, v in zip(loops, vals)}
            return tuple(by_axis[a] for a in axes if a in by_axis)

        return Worker(ordered(self.nest.blocks, values[:self.nb], BLOCK_AXES),
                      ordered(self.nest.threads, values[self.nb:self.nb + self.nt], THREAD_AXES))

    def cell(self, x: Access, src: tuple[int, ...], y: Access, snk: tuple[int, ...],
             params: dict[str, int]) -> tuple[int, ...]:
        def at(access: Access, values: tuple[int, ...]) -> isl.Set:
            rel = access.relation
            for name, v in params.items():
                pos = rel.find_dim_by_name(isl.dim_type.param, name)
                rel = rel.fix_val(isl.dim_type.param, pos, isl.Val(v))
            for k, v in enumerate(values):
                rel = rel.fix_val(isl.dim_type.in_, k, isl.Val(v))
            return rel.range()

        common = robust_lexmin(at(x, src).intersect(at(y, snk)))
        pt = common.sample_point()
        return tuple(pt.get_coordinate_val(isl.dim_type.set, k).to_python() for k in range(common.dim(isl.dim_type.set)))


# ----------------------------------------------------------------------------- phases
class Phases:
    """Barrier phases of the instances of a kernel's model (module docstring).

    Time vectors come from the initial schedule tree: the block and thread iterators first
    (the ``prefix``), then the per-thread 2d+1 schedule.  A phase is the time of the next
    barrier of the instance's own thread with the thread coordinates dropped, so phases
    compare across threads of a block.  ``level`` ``"block"`` counts ``barrier`` only;
    ``"warp"`` counts ``barrier warp`` too (for threads of one warp)."""

    def __init__(self, model: PolyModel, nb: int, nt: int, warp_of):
        self.model, self.nb, self.nt, self.warp_of = model, nb, nt, warp_of
        self.times = time_maps(initial_tree(model), model)
        self.depth = next(iter(self.times.values())).dim(isl.dim_type.out)
        self.prefix = nb + nt
        sets: dict[str, isl.Set | None] = {"block": None, "warp": None, "commit": None, "end": None}
        self.waits: dict[int, isl.Set] = {}
        syncs = [ps for ps in model.statements.values() if ps.is_sync and not ps.guards]
        for ps in syncs:
            when = self.times[ps.name].range()
            kinds = []
            if isinstance(ps.stmt, Barrier):
                kinds = ["block", "warp"] if ps.stmt.scope == "block" else ["warp"]
            elif isinstance(ps.stmt, CopyCommit):
                kinds = ["commit"]
            elif isinstance(ps.stmt, CopyWait):
                self.waits[ps.stmt.pending] = _union(self.waits.get(ps.stmt.pending), when)
            for k in kinds:
                sets[k] = _union(sets[k], when)
        sets["end"] = self.times[syncs[-1].name].range()  # the virtual closing barrier
        self.sets = sets
        self.has_warp_barriers = any(isinstance(ps.stmt, Barrier) and ps.stmt.scope == "warp" for ps in syncs)
        self._cache: dict[tuple, isl.Map] = {}

    @cached_property
    def later(self) -> isl.Map:
        """``{ [t] -> [u] : same block and thread, t <lex u }`` on time vectors."""
        space = isl.Space.set_alloc(isl.DEFAULT_CONTEXT, 0, self.depth)
        t = [f"t{k}" for k in range(self.depth)]
        u = [f"u{k}" for k in range(self.depth)]
        same = " and ".join(f"{t[k]} = {u[k]}" for k in range(self.prefix)) or "0 = 0"
        prefix = isl.Map(f"{{ [{', '.join(t)}] -> [{', '.join(u)}] : {same} }}")
        return isl.Map.lex_lt(space).intersect(prefix)

    def after(self, times: isl.Map, targets: isl.Set) -> isl.Map:
        """``times`` composed with 'a later point of ``targets``, same thread'."""
        return times.apply_range(self.later.intersect_range(targets))

    def to_phase(self, times: isl.Map, level: str) -> isl.Map:
        """The phase (next barrier, thread coordinates dropped) after each time of ``times``."""
        nxt = robust_lexmin(self.after(times, self.sets[level]))
        return nxt.project_out(isl.dim_type.out, self.nb, self.nt)

    def interval(self, s: PolyStatement, level: str) -> tuple[isl.Map, isl.Map]:
        """``(first, last)`` phase in which instances of ``s`` may touch memory: the same for
        ordinary statements; up to its completion for an asynchronous copy."""
        key = (s.name, level)
        if key not in self._cache:
            first = self.to_phase(self.times[s.name], level)
            last = first
            if isinstance(s.stmt, VectorCopy) and s.stmt.asynchronous:
                last = self.completion(s, level)
            self._cache[key] = (first, last)
        return self._cache[key]

    def completion(self, s: PolyStatement, level: str) -> isl.Map:
        """The phase in which each instance of asynchronous copy ``s`` is complete at the
        latest: that of the first ``wait_copies n`` followed, after the commit closing the
        copy's group, by ``n`` more commits; the last phase if no wait completes it."""
        times = self.times[s.name]
        done: isl.Map | None = None
        if self.sets["commit"] is not None:
            committed = self.after(times, self.sets["commit"])
            for pending, waits in sorted(self.waits.items()):
                reach = committed
                for _ in range(pending):
                    reach = reach.apply_range(self.later.intersect_range(self.sets["commit"]))
                done = _union(done, reach.apply_range(self.later.intersect_range(waits)))
        phase = None if done is None else self.to_phase(done, level)
        missing = times.domain() if phase is None else times.domain().subtract(phase.domain())
        if not missing.is_empty():
            end = self.to_phase(times.intersect_domain(missing), "end")
            phase = end if phase is None else phase.union(end)
        return phase

    def concurrent(self, s: PolyStatement, x: Access, t: PolyStatement, y: Access, pairs: isl.Map) -> isl.Map:
        """The pairs of ``pairs`` (same block, different threads) that may run at once."""
        pairs = pairs.intersect(self.overlap(s, t, "block"))
        if pairs.is_empty() or not self.has_warp_barriers:
            return pairs
        a = [f"a{k}" for k in range(len(s.iterators))]
        b = [f"b{k}" for k in range(len(t.iterators))]
        threads_a, threads_b = a[self.nb:self.prefix], b[self.nb:self.prefix]
        other_warp = isl.Map(f"{self.model.param_prefix}{{ {isl_name(s.name)}[{', '.join(a)}] -> "
                             f"{isl_name(t.name)}[{', '.join(b)}] : "
                             f"{self.warp_of(threads_a)} < {self.warp_of(threads_b)} or "
                             f"{self.warp_of(threads_a)} > {self.warp_of(threads_b)} }}")
        return pairs.intersect(other_warp.union(self.overlap(s, t, "warp")))

    def overlap(self, s: PolyStatement, t: PolyStatement, level: str) -> isl.Map:
        """``{ S[a] -> T[b] }`` whose phase intervals meet."""
        key = (s.name, t.name, level)
        if key not in self._cache:
            s_first, s_last = self.interval(s, level)
            t_first, t_last = self.interval(t, level)
            if s_first is s_last and t_first is t_last:
                rel = s_first.apply_range(t_first.reverse())
            else:
                le = isl.Map.lex_le(s_first.get_space().range())
                a = s_first.apply_range(le).apply_range(t_last.reverse())
                b = t_first.apply_range(le).apply_range(s_last.reverse()).reverse()
                rel = a.intersect(b)
            self._cache[key] = rel
        return self._cache[key]


def _union(a, b):
    return b if a is None else a.union(b)


def _smallest_pair(rel: isl.Map) -> tuple[dict[str, int], tuple[int, ...], tuple[int, ...]]:
    """The pair of ``rel`` with the smallest parameters (non-negative), then source, then sink."""
    nparam = rel.dim(isl.dim_type.param)
    names = [rel.get_dim_name(isl.dim_type.param, k) for k in range(nparam)]
    flat = rel.wrap().move_dims(isl.dim_type.set, 0, isl.dim_type.param, 0, nparam)
    for k in range(nparam):
        flat = flat.lower_bound_val(isl.dim_type.set, k, isl.Val(0))
    best = robust_lexmin(flat)
    pt = (best if not best.is_empty() else flat).sample_point()
    n_in = rel.dim(isl.dim_type.in_)
    vals = [pt.get_coordinate_val(isl.dim_type.set, k).to_python() for k in range(flat.dim(isl.dim_type.set))]
    return dict(zip(names, vals[:nparam])), tuple(vals[nparam:nparam + n_in]), tuple(vals[nparam + n_in:])


def _is_async(s: PolyStatement) -> bool:
    return isinstance(s.stmt, VectorCopy) and s.stmt.asynchronous


def _is_reduction_target(s: PolyStatement, a: Access) -> bool:
    return isinstance(s.stmt, Reduce) and a.ref == s.stmt.target


def _action(s: PolyStatement, a: Access) -> str:
    if not a.is_write:
        return "reads"
    if isinstance(s.stmt, Reduce):
        return "accumulates into"
    if isinstance(s.stmt, VectorCopy) and s.stmt.asynchronous:
        return "copies asynchronously into"
    return "writes"


__all__ = ["KernelNest", "RaceError", "RaceSide", "Worker", "check_races", "kernel_nest"]
