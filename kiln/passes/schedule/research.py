"""A research API over schedules: the tree's nodes, the action space and random legal
sequences.

The action space is a list of small :class:`Step` records; :func:`applicable` filters it to
the steps that apply at a node (and optionally to the legal ones) by trying each on a copy
of the schedule, so it never disagrees with the primitives themselves.  Timing the
generated C of a schedule and writing datasets of (program, transformations, verdict,
explanation, runtime) need the C toolchain: :mod:`kiln.tuning.schedules`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kiln.ir.errors import IllegalTransformError, ScheduleError
from kiln.ir.loops.program import Program
from kiln.ir.poly.tree import Band, Leaf, Sequence, statements_under, walk_tree

from .schedule import Schedule


@dataclass(frozen=True)
class Step:
    """One primitive application, as recorded in traces."""

    primitive: str
    args: tuple[tuple[str, Any], ...]

    @staticmethod
    def of(primitive: str, **args: Any) -> Step:
        return Step(primitive, tuple((k, _frozen(v)) for k, v in args.items()))

    def as_dict(self) -> dict[str, Any]:
        return {"primitive": self.primitive, "args": {k: _thawed(v) for k, v in self.args}}

    def apply(self, schedule: Schedule) -> Schedule:
        return schedule.apply(self.primitive, **self.as_dict()["args"])

    def __str__(self) -> str:
        return f"{self.primitive}({', '.join(f'{k}={v!r}' for k, v in self.args)})"


def _frozen(v: Any) -> Any:
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def _thawed(v: Any) -> Any:
    return [_thawed(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class NodeInfo:
    """A schedule-tree node: ``kind`` is ``band``, ``sequence`` or ``leaf``."""

    kind: str
    name: str | None
    path: tuple[int, ...]
    statements: tuple[str, ...]
    annotation: str = "serial"
    children: tuple[str, ...] = field(default_factory=tuple)


def nodes(schedule: Schedule) -> list[NodeInfo]:
    """Every node of the schedule tree, pre-order."""
    out: list[NodeInfo] = []
    for n, path in walk_tree(schedule.tree):
        stmts = tuple(statements_under(n))
        if isinstance(n, Band):
            out.append(NodeInfo("band", n.name, path, stmts, n.annotation.mode, (_label(n.child),)))
        elif isinstance(n, Sequence):
            out.append(NodeInfo("sequence", None, path, stmts, children=tuple(_label(c) for c in n.children)))
        else:
            out.append(NodeInfo("leaf", n.stmt, path, stmts))
    return out


def _label(n) -> str:
    return n.name if isinstance(n, Band) else n.stmt if isinstance(n, Leaf) else "<sequence>"


def candidate_steps(schedule: Schedule, loop: str | None = None, tile_sizes: tuple[int, ...] = (4, 16),
                    factors: tuple[int, ...] = (2, 4), offsets: tuple[int, ...] = (1, -1)) -> list[Step]:
    """Steps that might apply at ``loop`` (every loop when ``None``), before any check."""
    out: list[Step] = []
    tree_nodes = nodes(schedule)
    by_path = {n.path: n for n in tree_nodes}
    for n in tree_nodes:
        if n.kind != "band" or (loop is not None and n.name != loop):
            continue
        child = by_path.get(n.path + (0,))
        ancestors = [by_path[n.path[:d]] for d in range(len(n.path)) if by_path[n.path[:d]].kind == "band"]
        inner = [m for m in tree_nodes if m.kind == "band" and len(m.path) > len(n.path)
                 and m.path[:len(n.path)] == n.path]
        if child is not None and child.kind == "band":
            out.append(Step.of("interchange", a=n.name, b=child.name))
            out += [Step.of("tile", loops=[n.name, child.name], sizes=[s, s]) for s in tile_sizes]
        out += [Step.of("tile", loops=[n.name], sizes=[s]) for s in tile_sizes]
        out += [Step.of("split", loop=n.name, factor=f) for f in factors]
        out += [Step.of("skew", target=n.name, source=a.name, factor=f) for a in ancestors for f in offsets]
        out += [Step.of("skew", target=n.name, source=m.name, factor=f) for m in inner[:1] for f in offsets]
        out.append(Step.of("reverse", loop=n.name))
        out.append(Step.of("scale", loop=n.name, factor=2))
        if len(n.statements) > 1:
            out += [Step.of("shift", loop=n.name, statement=s, offset=o) for s in n.statements for o in offsets]
        sibling = by_path.get(n.path[:-1] + (n.path[-1] + 1,)) if n.path else None
        if sibling is not None and sibling.kind == "band":
            out.append(Step.of("fuse", a=n.name, b=sibling.name))
            parent = by_path.get(n.path[:-1])
            if n.path[-1] == 0 and parent is not None and len(parent.children) > 2:
                out.append(Step.of("full_fuse", loop=n.name))
        if child is not None and child.kind == "sequence":
            out += [Step.of("fission", loop=n.name, split_before_child=k) for k in range(1, len(child.children))]
            if len(child.children) > 2:
                out.append(Step.of("full_split", loop=n.name))
            out += [Step.of("compute_at", statement=s, loop=n.name) for s in schedule.statements()
                    if s not in n.statements]
        out.append(Step.of("parallel", loop=n.name))
        out.append(Step.of("vectorize", loop=n.name))
        out += [Step.of("unroll", loop=n.name, factor=f) for f in factors]
    if loop is None:
        program = schedule.model.program
        for s in schedule.statements():
            stmt = schedule.model.statements[s].stmt
            if program.buffer(stmt.buffer).scope != "global":
                out.append(Step.of("inline", statement=s))
    return out


def applicable(schedule: Schedule, loop: str | None = None, legal_only: bool = False, **kwargs: Any) -> list[Step]:
    """The candidate steps that apply structurally (and, with ``legal_only``, legally)."""
    out = []
    for step in candidate_steps(schedule, loop, **kwargs):
        trial = schedule.copy()
        trial.check = legal_only
        try:
            step.apply(trial)
        except (ScheduleError, IllegalTransformError):
            continue
        out.append(step)
    return out


def random_legal_sequence(program: Program | Schedule, length: int, seed: int = 0, max_tries: int = 40,
                          **kwargs: Any) -> Schedule:
    """A schedule with up to ``length`` random legal steps applied (seeded, reproducible)."""
    rng = random.Random(seed)
    schedule = program.copy() if isinstance(program, Schedule) else Schedule(program)
    schedule.check = True
    for _ in range(length):
        cands = candidate_steps(schedule, **kwargs)
        rng.shuffle(cands)
        for step in cands[:max_tries]:
            try:
                step.apply(schedule)
                break
            except (ScheduleError, IllegalTransformError):
                continue
    return schedule


def random_sequence(program: Program, length: int, seed: int = 0, **kwargs: Any) -> Schedule:
    """A schedule with ``length`` random structurally valid steps applied without checking."""
    rng = random.Random(seed)
    schedule = Schedule(program, check=False)
    for _ in range(length):
        cands = candidate_steps(schedule, **kwargs)
        rng.shuffle(cands)
        for step in cands:
            try:
                step.apply(schedule)
                break
            except ScheduleError:
                continue
    return schedule
