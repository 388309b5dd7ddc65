"""Exactly-once proofs of task mappings, with isl.

A task mapping (:mod:`kiln.ir.loops.mapping`) promises that its workers together do every
task of the box ``0 <= t < task_shape`` exactly once.  :func:`prove_coverage` proves it
for the code kiln generates, not for the enumeration: it lowers the mapping the way kernels
lower it (:func:`~kiln.ir.loops.tasks.lower_mappings`: ``floordiv``/``floormod`` of the worker,
serial loops for the ``repeat`` atoms), reads the relation

    { [w, r_0, ..., r_k] -> [t_0, ..., t_n] : 0 <= w < num_workers, 0 <= r_j < R_j }

of worker ``w`` in iteration ``(r_0, ...)`` of its repeat loops to the task it does, from the
lowered index arithmetic (quasi-affine, so isl represents it exactly), and checks with isl:

* **coverage** -- every task of the box is in the relation's range, and no task outside it;
* **exactly once** -- the relation is injective: no two (worker, iteration) pairs share a task.

A relation built by other means (say, from a hand-written lowering) is checked the same way
with ``prove_coverage(relation, task_shape=...)``: its first input dimension is the worker,
the others the iteration.  A failed proof raises :class:`CoverageError` naming a task that
is missed, done twice (with both workers and iterations) or outside the box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import islpy as isl

from ..errors import ScheduleError
from ..loops.expr import INDEX, Const, Var
from ..loops.mapping import TaskMapping
from ..loops.program import Buffer, Loop, Program, Store
from .model import build_model, robust_lexmin


class CoverageError(ScheduleError):
    """A mapping (or relation) misses a task, does one twice, or leaves the box.

    ``task`` is the task; ``workers`` the ``(worker, iteration)`` pairs that do it (none for
    a missed task, two for a doubled one)."""

    def __init__(self, message: str, task: tuple[int, ...], workers: tuple[tuple[int, tuple[int, ...]], ...] = ()):
        self.task = task
        self.workers = workers
        super().__init__(message)


@dataclass(frozen=True, eq=False)
class CoverageProof:
    """What :func:`prove_coverage` proved: ``relation`` maps each ``(worker, iteration)`` of
    the ``num_workers`` workers, ``tasks_per_worker`` iterations each, to one task of the box
    ``task_shape``, and every task of the box is reached exactly once."""

    mapping: TaskMapping | None
    task_shape: tuple[int, ...]
    num_workers: int
    tasks_per_worker: int
    relation: isl.Map

    def __str__(self) -> str:
        what = str(self.mapping) if self.mapping is not None else "the relation"
        return (f"{what}: {self.num_workers} worker(s) x {self.tasks_per_worker} task(s) each do every task of "
                f"the {_box(self.task_shape)} box exactly once")


def task_relation(mapping: TaskMapping) -> isl.Map:
    """``{ [w, r...] -> [t...] }`` of ``mapping``, read from its lowered index arithmetic."""
    iters = tuple(f"t{d}" for d in range(mapping.rank))
    store = Store("task", tuple(Var(i) for i in iters), Const(1), name="task")
    loop = Loop("w", 0, mapping.num_workers, (mapping.on(Var("w")).loop(iters, (store,)),))
    program = Program("coverage", (), (Buffer("task", mapping.task_shape, INDEX),), (loop,))
    model = build_model(program)
    (access,) = model.statement("task").writes
    rel = access.relation
    return rel.reset_tuple_id(isl.dim_type.in_).reset_tuple_id(isl.dim_type.out)


def prove_coverage(mapping: TaskMapping | isl.Map, task_shape: tuple[int, ...] | None = None) -> CoverageProof:
    """Prove that ``mapping`` does every task of ``task_shape`` (default: its own task shape)
    exactly once and nothing else; :class:`CoverageError` names a counter-example."""
    if isinstance(mapping, TaskMapping):
        rel = task_relation(mapping)
        shape = tuple(mapping.task_shape if task_shape is None else task_shape)
        what = f"{mapping} ({mapping.num_workers} workers)"
        source: TaskMapping | None = mapping
    elif isinstance(mapping, isl.Map):
        if task_shape is None:
            raise ValueError("prove_coverage(relation): give the task_shape the relation should cover")
        rel, shape, what, source = mapping, tuple(task_shape), "the relation", None
        if rel.dim(isl.dim_type.param):
            raise ValueError(f"prove_coverage: the relation {rel} has parameters; fix them first")
        if rel.dim(isl.dim_type.in_) < 1:
            raise ValueError(f"prove_coverage: the relation {rel} needs the worker as its first input dimension")
    else:
        raise TypeError(f"prove_coverage needs a TaskMapping or an isl.Map, got {type(mapping).__name__}")
    if rel.dim(isl.dim_type.out) != len(shape) or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"prove_coverage: task shape {list(shape)} does not fit {what}, which has "
                         f"{rel.dim(isl.dim_type.out)} task dimension(s)")
    box = isl.Set.universe(rel.get_space().range())
    for d, extent in enumerate(shape):
        box = box.lower_bound_val(isl.dim_type.set, d, isl.Val(0))
        box = box.upper_bound_val(isl.dim_type.set, d, isl.Val(extent - 1))
    reached = rel.range()
    missed = box.subtract(reached)
    if not missed.is_empty():
        task = _point(robust_lexmin(missed))
        raise CoverageError(f"coverage: no worker of {what} does task {task} of the {_box(shape)} box; "
                            f"the mapping's task shape must equal the box (pad the box, or add workers or "
                            f"repeats)", task)
    outside = rel.intersect_range(reached.subtract(box))
    if not outside.is_empty():
        src, task = _pair(outside)
        raise CoverageError(f"coverage: {_who(src)} of {what} does task {task}, outside the {_box(shape)} box; "
                            f"guard the tasks or shrink the mapping", task, (src,))
    if not rel.is_injective():
        space = rel.get_space().domain()
        twice = rel.apply_range(rel.reverse()).intersect(isl.Map.lex_lt(space))
        first, other = _pair(twice)
        second = (other[0], tuple(other[1:]))
        task = _pair(rel.intersect_domain(_as_set(space, first)))[1]
        raise CoverageError(f"coverage: task {task} of {what} is done twice, by {_who(first)} and by "
                            f"{_who(second)}; each task must have exactly one worker", task, (first, second))
    domain = rel.domain()
    workers = domain.project_out(isl.dim_type.set, 1, domain.dim(isl.dim_type.set) - 1)
    num_workers = workers.count_val().to_python() if workers.is_bounded() else -1
    total = math.prod(shape)
    per_worker = total // num_workers if num_workers > 0 else 0
    if source is not None:
        num_workers, per_worker = source.num_workers, total // source.num_workers
    return CoverageProof(source, shape, num_workers, per_worker, rel)


# ----------------------------------------------------------------------------- helpers
def _box(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _coords(pt: isl.Point, kind, n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(pt.get_coordinate_val(kind, start + i).to_python() for i in range(n))


def _point(s: isl.Set) -> tuple[int, ...]:
    return _coords(s.sample_point(), isl.dim_type.set, s.dim(isl.dim_type.set))


def _pair(rel: isl.Map) -> tuple[tuple[int, tuple[int, ...]], tuple[int, ...]]:
    """The lexicographically smallest pair of ``rel``: ``((worker, iteration), range point)``."""
    n_in, n_out = rel.dim(isl.dim_type.in_), rel.dim(isl.dim_type.out)
    wrapped = robust_lexmin(rel.wrap())
    vals = _point(wrapped)
    src = vals[:n_in]
    return (src[0], tuple(src[1:])), tuple(vals[n_in:n_in + n_out])


def _as_set(space: isl.Space, who: tuple[int, tuple[int, ...]]) -> isl.Set:
    s = isl.Set.universe(space)
    for d, v in enumerate((who[0], *who[1])):
        s = s.fix_val(isl.dim_type.set, d, isl.Val(v))
    return s


def _who(who: tuple[int, tuple[int, ...]]) -> str:
    w, it = who
    return f"worker {w}" + (f" in repeat iteration {it}" if it else "")


__all__ = ["CoverageError", "CoverageProof", "prove_coverage", "task_relation"]
