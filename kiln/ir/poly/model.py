"""Statements of a loop program as isl objects: iteration domains and access relations.

Every statement instance is a point ``S[i, j, ...]`` (one coordinate per enclosing loop, outer
first) of its parameterized iteration domain.  Loop bounds and affine ``if`` conditions
become the domain's constraints; a loop with a non-affine bound cannot be modeled and is
rejected with :class:`~kiln.ir.errors.ScheduleError`.  A non-affine ``if`` condition stays
with the statement as a *guard*: the domain over-approximates, the generated code keeps the
test, and the statement's accesses become may-accesses.

Accesses are relations ``S[i, j] -> A[cells]``.  An affine index tuple gives an exact
(must) access; any other index makes it a may-access of the whole array (bounded by the
buffer's shape when that is affine), which is conservative for dependence analysis.

Kernels (GPU loop programs) are accepted too.  Task loops are lowered first
(:func:`~kiln.ir.loops.tasks.lower_mappings`, so the model sees their index arithmetic and
repeat loops).  A warp shuffle is a statement that writes its target and reads the loads of
its value, offset and indices; a vector copy of width ``w`` is one statement whose accesses
cover its ``w`` consecutive cells of the destination (written) and of the source (read).
Barriers, ``commit_copies`` and ``wait_copies`` are not statements; with
``build_model(program, syncs=True)`` they become access-less pseudo-statements
``barrier0``, ``commit0``, ``wait0``, ... (numbered in program order, names made unique
against the program's statements) that take part in the schedule tree, which is how the
race checker places barrier phases.
"""

from __future__ import annotations

from dataclasses import dataclass

import islpy as isl

from ..errors import ScheduleError
from ..loops.expr import Expr, Load, Unary, loads_of
from ..loops.program import (
    Annotation, Barrier, CopyCommit, CopyWait, If, Loop, Node, Program, Reduce, Shuffle, Store, TaskLoop, VectorCopy,
)
from ..loops.tasks import lower_mappings
from .affine import cond_to_isl, isl_name, to_isl


@dataclass(frozen=True, eq=False)
class Access:
    """One read or write of a statement: ``relation`` maps instances to array cells."""

    array: str
    relation: isl.Map
    is_write: bool
    exact: bool
    ref: Load
    affine: bool = True


SYNC_NAMES = {Barrier: "barrier", CopyCommit: "commit", CopyWait: "wait"}
"""Name stems of the pseudo-statements of synchronization nodes (``syncs=True``)."""


@dataclass(frozen=True, eq=False)
class PolyStatement:
    """One statement (or, with ``syncs=True``, one synchronization node) of the program."""

    name: str
    stmt: Store | Reduce | Shuffle | VectorCopy | Barrier | CopyCommit | CopyWait
    iterators: tuple[str, ...]
    loops: tuple[str, ...]
    domain: isl.Set
    guards: tuple[Expr, ...]
    accesses: tuple[Access, ...]

    @property
    def is_sync(self) -> bool:
        """Whether this is the pseudo-statement of a barrier or an asynchronous-copy sync."""
        return isinstance(self.stmt, (Barrier, CopyCommit, CopyWait))

    @property
    def reads(self) -> list[Access]:
        return [a for a in self.accesses if not a.is_write]

    @property
    def writes(self) -> list[Access]:
        return [a for a in self.accesses if a.is_write]

    def instance_text(self, values: tuple[int, ...]) -> str:
        inner = ", ".join(f"{it}={v}" for it, v in zip(self.iterators, values))
        return f"{self.name}[{inner}]"


@dataclass(frozen=True, eq=False)
class LoopShape:
    """A loop of the original program, as the initial schedule tree needs it."""

    name: str
    iterator: str
    annotation: Annotation
    children: tuple[LoopShape | str, ...]


@dataclass(frozen=True, eq=False)
class PolyModel:
    """The polyhedral view of one program. ``statements`` are in textual order."""

    program: Program
    params: tuple[str, ...]
    statements: dict[str, PolyStatement]
    shape: tuple[LoopShape | str, ...]
    context: isl.Set

    @property
    def param_prefix(self) -> str:
        return "[" + ", ".join(isl_name(p) for p in self.params) + "] -> "

    def statement(self, name: str) -> PolyStatement:
        try:
            return self.statements[name]
        except KeyError:
            raise ScheduleError(f"unknown statement '{name}'; statements: {', '.join(self.statements)}") from None

    def domains(self) -> isl.UnionSet:
        out = isl.UnionSet.empty(self.context.get_space())
        for s in self.statements.values():
            out = out.union(isl.UnionSet.from_set(s.domain))
        return out


def build_model(program: Program, bound_may_accesses: bool = True, syncs: bool = False) -> PolyModel:
    """The polyhedral model of ``program``; ``ScheduleError`` if a loop bound is not affine.

    Task loops are lowered first (``model.program`` is then the lowered program); ``syncs``
    adds the pseudo-statements of barriers and copy syncs (module docstring)."""
    if any(isinstance(n, TaskLoop) for n, _ in program.walk()):
        program = lower_mappings(program)
    builder = _Builder(program, bound_may_accesses, syncs)
    shape = builder.nodes(program.body, [], [], [], [])
    context = isl.Set(builder.prefix + "{ : }")
    return PolyModel(program, builder.params, builder.statements, tuple(shape), context)


class _Builder:
    def __init__(self, program: Program, bound_may_accesses: bool, syncs: bool):
        self.program = program
        self.syncs = syncs
        self.taken = {st.name for st in program.statements()}
        self.taken |= {n.name for n, _ in program.walk() if isinstance(n, (Shuffle, VectorCopy))}
        self.sync_counts: dict[str, int] = {}
        self.params = program.size_params
        self.prefix = "[" + ", ".join(isl_name(p) for p in self.params) + "] -> "
        self.bound = bound_may_accesses
        self.statements: dict[str, PolyStatement] = {}

    def nodes(self, nodes: tuple[Node, ...], iters: list[str], loops: list[str], constraints: list[str],
              guards: list[Expr]) -> list[LoopShape | str]:
        out: list[LoopShape | str] = []
        for n in nodes:
            if isinstance(n, Loop):
                shape = self.loop(n, iters, loops, constraints, guards)
                if shape.children:
                    out.append(shape)
            elif isinstance(n, If):
                allowed = set(iters) | set(self.params)
                then_c = cond_to_isl(n.cond, allowed)
                else_c = cond_to_isl(n.cond, allowed, negate=True)
                if then_c is None or else_c is None:
                    out += self.nodes(n.then, iters, loops, constraints, guards + [n.cond])
                    out += self.nodes(n.orelse, iters, loops, constraints, guards + [Unary("!", n.cond)])
                else:
                    out += self.nodes(n.then, iters, loops, constraints + [then_c], guards)
                    out += self.nodes(n.orelse, iters, loops, constraints + [else_c], guards)
            elif isinstance(n, (Barrier, CopyCommit, CopyWait)):
                if self.syncs:
                    out.append(self.sync(n, iters, loops, constraints, guards))
            else:
                self.statement(n, iters, loops, constraints, guards)
                out.append(n.name)
        return out

    def sync(self, n: Barrier | CopyCommit | CopyWait, iters, loops, constraints, guards) -> str:
        stem = SYNC_NAMES[type(n)]
        while True:
            k = self.sync_counts.get(stem, 0)
            self.sync_counts[stem] = k + 1
            name = f"{stem}{k}"
            if name not in self.taken:
                break
        self.taken.add(name)
        self.statements[name] = PolyStatement(name, n, tuple(iters), tuple(loops),
                                              self.domain(name, iters, constraints), tuple(guards), ())
        return name

    def domain(self, name: str, iters, constraints) -> isl.Set:
        space = f"{isl_name(name)}[{', '.join(isl_name(i) for i in iters)}]"
        cond = " and ".join(constraints) if constraints else "0 = 0"
        return isl.Set(f"{self.prefix}{{ {space} : {cond} }}")

    def loop(self, n: Loop, iters, loops, constraints, guards) -> LoopShape:
        allowed = set(iters) | set(self.params)
        lo, hi = to_isl(n.lower, allowed), to_isl(n.upper, allowed)
        for label, text, bound in (("lower", lo, n.lower), ("upper", hi, n.upper)):
            if text is None:
                raise ScheduleError(f"the {label} bound '{bound}' of loop '{n.name}' is not affine in the "
                                    f"enclosing iterators and size parameters; kiln can only schedule "
                                    f"loops with affine bounds")
        it = isl_name(n.iterator)
        cons = [f"{it} >= {lo}", f"{it} < {hi}"]
        if n.step != 1:
            cons.append(f"exists (e: {it} = {lo} + {n.step} * e)")
        children = self.nodes(n.body, iters + [n.iterator], loops + [n.name], constraints + cons, guards)
        return LoopShape(n.name, n.iterator, n.annotation, tuple(children))

    def statement(self, s: Store | Reduce | Shuffle | VectorCopy, iters, loops, constraints, guards) -> None:
        space = f"{isl_name(s.name)}[{', '.join(isl_name(i) for i in iters)}]"
        domain = self.domain(s.name, iters, constraints)
        allowed = set(iters) | set(self.params)
        guarded = bool(guards)
        if isinstance(s, VectorCopy):
            dst, src = Load(s.dst, s.dst_indices), Load(s.src, s.src_indices)
            accesses = [self.access(space, domain, dst, True, allowed, guarded, s.width),
                        self.access(space, domain, src, False, allowed, guarded, s.width)]
            reads = [ld for i in (*s.dst_indices, *s.src_indices) for ld in loads_of(i)]
        else:
            accesses = [self.access(space, domain, s.target, True, allowed, guarded)]
            if isinstance(s, Reduce):
                accesses.append(self.access(space, domain, s.target, False, allowed, guarded))
            extra = (s.offset,) if isinstance(s, Shuffle) else ()
            reads = [ld for e in (s.value, *extra, *s.indices) for ld in loads_of(e)]
        for e in guards:
            reads += loads_of(e)
        for ld in reads:
            accesses.append(self.access(space, domain, ld, False, allowed, guarded))
        self.statements[s.name] = PolyStatement(s.name, s, tuple(iters), tuple(loops), domain, tuple(guards),
                                                tuple(accesses))

    def access(self, space: str, domain: isl.Set, ref: Load, is_write: bool, allowed: set[str],
               guarded: bool, width: int = 1) -> Access:
        """The access of ``ref``; ``width > 1``: the ``width`` cells from ``ref`` on along the
        last dimension (a vector copy's lanes)."""
        idx = [to_isl(i, allowed) for i in ref.indices]
        arr = isl_name(ref.buffer)
        if all(i is not None for i in idx):
            if width == 1 or not idx:
                rel = isl.Map(f"{self.prefix}{{ {space} -> {arr}[{', '.join(idx)}] }}")
            else:
                lane = "lane__"
                while lane in allowed:
                    lane += "_"
                cells = ", ".join(idx[:-1] + [lane])
                rel = isl.Map(f"{self.prefix}{{ {space} -> {arr}[{cells}] : "
                              f"{idx[-1]} <= {lane} < {idx[-1]} + {width} }}")
            return Access(ref.buffer, rel.intersect_domain(domain), is_write, not guarded, ref)
        outs = [f"o{k}" for k in range(len(idx))]
        bounds = []
        if self.bound:
            sizes = set(self.params)
            for o, extent in zip(outs, self.program.buffer(ref.buffer).shape):
                ext = to_isl(extent, sizes)
                if ext is not None:
                    bounds.append(f"0 <= {o} < {ext}")
        cond = " and ".join(bounds) if bounds else "0 = 0"
        rel = isl.Map(f"{self.prefix}{{ {space} -> {arr}[{', '.join(outs)}] : {cond} }}")
        return Access(ref.buffer, rel.intersect_domain(domain), is_write, False, ref, affine=False)


def robust_lexmin(obj):
    """``obj.lexmin()`` of an isl set or map; when isl's solver gives up on a
    representation (it can, with nested integer divisions), the same set with its
    equalities detected and redundant constraints removed, then basic set by basic set."""
    try:
        return obj.lexmin()
    except isl.Error:
        pass
    simpler = obj.detect_equalities().remove_redundancies()
    try:
        return simpler.lexmin()
    except isl.Error:
        pieces = [piece.lexmin() for piece in simpler.get_basic_maps()] if isinstance(obj, isl.Map) else \
            [piece.lexmin() for piece in simpler.get_basic_sets()]
    best = pieces[0]
    for piece in pieces[1:]:
        best = best.union(piece)
    return best.detect_equalities().remove_redundancies().lexmin()


def access_relation(model: PolyModel, stmt: str, ref: Load) -> isl.Map | None:
    """The exact relation ``S[iterators] -> A[indices]`` of ``ref`` in ``stmt``, or ``None``
    when an index is not affine."""
    ps = model.statement(stmt)
    allowed = set(ps.iterators) | set(model.params)
    idx = [to_isl(i, allowed) for i in ref.indices]
    if any(i is None for i in idx):
        return None
    space = f"{isl_name(ps.name)}[{', '.join(isl_name(i) for i in ps.iterators)}]"
    rel = isl.Map(f"{model.param_prefix}{{ {space} -> {isl_name(ref.buffer)}[{', '.join(idx)}] }}")
    return rel.intersect_domain(ps.domain)
