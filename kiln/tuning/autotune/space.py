"""The search space of loop schedules: traces of ``Schedule`` primitives.

A candidate is a trace (a list of ``{"primitive", "args"}`` steps, as ``Schedule.trace``).
Proposals draw steps from the schedule primitives that matter for speed on a CPU:

* ``tile`` of one, two or three directly nested loops (sizes :data:`TILE_SIZES`, below the
  loop's extent); tiling a tile loop again gives multi-level tiles;
* ``interchange`` of directly nested loops; ``fission`` / ``fuse`` of loop bodies and
  siblings; ``compute_at`` of a producer statement into a consumer loop;
* ``parallel`` on one loop, or two directly nested ones (one collapsed OpenMP region);
* ``vectorize`` of an innermost loop and ``unroll`` (factors :data:`UNROLL_FACTORS`).

Proposals are structural only: :func:`build` applies a trace with every step checked by
isl (dropping a step that does not apply structurally) and returns the schedule with its
verdict, so the search sees -- and counts -- the illegal candidates the isl check prunes
before anything is compiled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kiln.ir.errors import IllegalTransformError, KilnError, ScheduleError
from kiln.ir.loops.expr import Const
from kiln.ir.loops.program import Loop, Program
from kiln.passes.schedule import Schedule
from kiln.passes.schedule.research import nodes

TILE_SIZES = (4, 8, 16, 32, 64, 128)
UNROLL_FACTORS = (2, 4, 8)
Trace = list[dict[str, Any]]


@dataclass(frozen=True)
class Band:
    """One loop of a schedule tree: its name, depth, the band directly inside it (if its
    child is a band), whether it is innermost, and its statements."""

    name: str
    depth: int
    child: str | None
    innermost: bool
    statements: tuple[str, ...]
    sequence_child: int
    mode: str


def bands_of(schedule: Schedule) -> list[Band]:
    """The loops of ``schedule``, outer to inner, in program order."""
    infos = nodes(schedule)
    by_path = {n.path: n for n in infos}
    out = []
    for n in infos:
        if n.kind != "band":
            continue
        child = by_path.get(n.path + (0,))
        inner = any(m.kind == "band" and len(m.path) > len(n.path) and m.path[:len(n.path)] == n.path
                    for m in infos)
        depth = sum(1 for d in range(len(n.path)) if by_path[n.path[:d]].kind == "band")
        seq = len(child.children) if child is not None and child.kind == "sequence" else 0
        out.append(Band(n.name, depth, child.name if child is not None and child.kind == "band" else None,
                        not inner, tuple(n.statements), seq, n.annotation or "serial"))
    return out


def extents(program: Program) -> dict[str, int]:
    """Constant extents of the program's loops, by name."""
    out = {}
    for loop in program.loops():
        if isinstance(loop.lower, Const) and isinstance(loop.upper, Const):
            out[loop.name] = max(0, (int(loop.upper.value) - int(loop.lower.value) + loop.step - 1) // loop.step)
    return out


def _base(name: str) -> str:
    while name.endswith(("_tile", "_b")) or name.rsplit("_", 1)[-1].isdigit():
        if name.endswith("_tile"):
            name = name[:-5]
        elif name.endswith("_b"):
            name = name[:-2]
        else:
            name = name.rsplit("_", 1)[0]
    return name


def _sizes(loop: str, ext: dict[str, int], rng: random.Random) -> int:
    e = ext.get(loop, ext.get(_base(loop)))
    choices = [s for s in TILE_SIZES if e is None or s < e] or [TILE_SIZES[0]]
    return rng.choice(choices)


def propose(schedule: Schedule, ext: dict[str, int], rng: random.Random) -> dict[str, Any] | None:
    """One random step for ``schedule`` (structural only; ``None`` when nothing applies)."""
    bands = bands_of(schedule)
    if not bands:
        return None
    by_name = {b.name: b for b in bands}
    kinds = ["tile", "tile", "interchange", "parallel", "parallel", "vectorize", "unroll", "tile1", "fission",
             "fuse", "compute_at", "parallel2"]
    for _ in range(12):
        kind = rng.choice(kinds)
        b = rng.choice(bands)
        if kind == "tile" and b.child is not None:
            loops = [b.name, b.child]
            grand = by_name[b.child].child
            if grand is not None and rng.random() < 0.4:
                loops.append(grand)
            return _step("tile", loops=loops, sizes=[_sizes(n, ext, rng) for n in loops])
        if kind == "tile1":
            return _step("tile", loops=[b.name], sizes=[_sizes(b.name, ext, rng)])
        if kind == "interchange" and b.child is not None:
            return _step("interchange", a=b.name, b=b.child)
        if kind == "parallel":
            outer = [x for x in bands if x.depth <= 1] or bands
            return _step("parallel", loop=rng.choice(outer).name)
        if kind == "parallel2" and b.child is not None and b.depth == 0:
            return [_step("parallel", loop=b.name), _step("parallel", loop=b.child)]  # type: ignore[return-value]
        if kind == "vectorize":
            inner = [x for x in bands if x.innermost]
            return _step("vectorize", loop=rng.choice(inner).name)
        if kind == "unroll":
            cands = [x for x in bands if x.innermost or (x.child is not None and by_name[x.child].innermost)]
            return _step("unroll", loop=rng.choice(cands).name, factor=rng.choice(UNROLL_FACTORS))
        if kind == "fission" and b.sequence_child > 1:
            return _step("fission", loop=b.name, split_before_child=rng.randrange(1, b.sequence_child))
        if kind == "fuse":
            siblings = _siblings(schedule, b.name)
            if siblings:
                return _step("fuse", a=b.name, b=rng.choice(siblings))
        if kind == "compute_at" and b.sequence_child == 0 and b.depth == 0:
            consumers = [x.name for x in bands if x.depth == 0 and x.name != b.name
                         and not set(x.statements) & set(b.statements)]
            if consumers and len(b.statements) == 1:
                return _step("compute_at", statement=b.statements[0], loop=rng.choice(consumers))
    return None


def _siblings(schedule: Schedule, loop: str) -> list[str]:
    infos = nodes(schedule)
    mine = next(n for n in infos if n.kind == "band" and n.name == loop)
    if not mine.path:
        return []
    parent = mine.path[:-1]
    return [n.name for n in infos if n.kind == "band" and len(n.path) == len(mine.path)
            and n.path[:-1] == parent and n.path[-1] > mine.path[-1]]


def _step(primitive: str, **args: Any) -> dict[str, Any]:
    return {"primitive": primitive, "args": args}


def flatten(step: Any) -> list[dict[str, Any]]:
    return list(step) if isinstance(step, list) else [step]


@dataclass
class Built:
    """A trace applied to a program: the schedule, the steps that applied, and its verdict."""

    schedule: Schedule
    trace: Trace
    legal: bool
    explanation: str = ""


def build(program: Program, trace: Trace) -> Built:
    """Apply ``trace`` to ``program`` step by step, each step checked with isl as
    ``Schedule.replay`` checks it: a step that does not apply structurally is dropped; a step
    that is illegal makes the candidate illegal (a trace whose end state is legal but that
    passes through an illegal schedule would not replay, so it is pruned too)."""
    schedule = Schedule(program)
    for step in trace:
        try:
            schedule.apply(step["primitive"], **step["args"])
        except IllegalTransformError as e:
            return Built(schedule, list(schedule.trace) + [step], False, str(e))
        except (ScheduleError, KilnError, ValueError, KeyError, TypeError):
            continue
    return Built(schedule, list(schedule.trace), True)


def random_trace(program: Program, base: Trace, length: int, ext: dict[str, int], rng: random.Random) -> Trace:
    """``base`` followed by up to ``length`` random proposals (each applied, unchecked, to
    see the loops the next one can name)."""
    schedule = build(program, base).schedule.copy()
    schedule.check = False  # proposals are structural: the isl check comes in build()
    for _ in range(length):
        step = propose(schedule, ext, rng)
        if step is None:
            break
        for s in flatten(step):
            trial = schedule.copy()
            try:
                trial.apply(s["primitive"], **s["args"])
            except (ScheduleError, IllegalTransformError, KilnError, ValueError, KeyError, TypeError):
                continue
            schedule = trial
    return list(schedule.trace)


def mutate(program: Program, trace: Trace, ext: dict[str, int], rng: random.Random) -> Trace:
    """A neighbour of ``trace``: a step appended, dropped, re-drawn, or a size changed."""
    choice = rng.random()
    if not trace or choice < 0.35:
        return random_trace(program, trace, 1, ext, rng)
    if choice < 0.55:
        i = rng.randrange(len(trace))
        return trace[:i] + trace[i + 1:]
    if choice < 0.8:
        out = [dict(primitive=s["primitive"], args=dict(s["args"])) for s in trace]
        sized = [s for s in out if s["primitive"] in ("tile", "unroll")]
        if sized:
            s = rng.choice(sized)
            if s["primitive"] == "tile":
                s["args"]["sizes"] = [_sizes(n, ext, rng) for n in s["args"]["loops"]]
            else:
                s["args"]["factor"] = rng.choice(UNROLL_FACTORS)
            return out
    i = rng.randrange(len(trace))
    return random_trace(program, trace[:i], rng.randint(1, 2), ext, rng)


def crossover(a: Trace, b: Trace, rng: random.Random) -> Trace:
    """A prefix of ``a`` followed by a suffix of ``b`` (steps that no longer apply are
    skipped when the child is built)."""
    i = rng.randint(0, len(a))
    j = rng.randint(0, len(b))
    return a[:i] + b[j:]


def innermost_loops(program: Program) -> list[Loop]:
    out: list[Loop] = []
    for loop in program.loops():
        if not any(isinstance(n, Loop) for n, _ in _walk(loop.body)):
            out.append(loop)
    return out


def _walk(body: tuple) -> Any:
    for n in body:
        yield n, None
        for attr in ("body", "then", "orelse"):
            if hasattr(n, attr):
                yield from _walk(getattr(n, attr))


__all__ = ["TILE_SIZES", "UNROLL_FACTORS", "Band", "Built", "bands_of", "build", "crossover", "extents",
           "innermost_loops", "mutate", "propose", "random_trace"]
