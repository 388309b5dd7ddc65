"""Task mappings: which worker (thread, warp, block) does which task of a task grid.

A :class:`TaskMapping` assigns the tasks of an n-dimensional grid (``task_shape``) to
``num_workers`` workers.  Mappings are built from two atoms and composed with ``*``:

* ``spatial(*shape, ranks=None)`` -- ``prod(shape)`` workers, one task each: worker ``w``
  gets task ``((w // stride_i) % shape_i)_i``, the strides row-major in the order ``ranks``
  gives (rank 0 varies slowest; the default is dimension order);
* ``repeat(*shape, ranks=None)`` -- one worker that does every task, in rank order (a
  serial loop nest, rank 0 outermost);
* ``auto_map(*shape, workers=n, ranks=None)`` -- ``repeat(...) * spatial(...)`` that
  spreads ``n`` workers over ``shape`` from the fastest dimension outwards (each takes the
  largest part of the remaining workers that divides its extent, ``gcd``) and repeats
  the rest;
* ``outer * inner`` -- ``outer.num_workers * inner.num_workers`` workers over the
  elementwise product of the task shapes: worker ``w`` acts as worker ``w // inner.num_workers``
  of ``outer`` and ``w % inner.num_workers`` of ``inner``, and each pair of tasks combines as
  ``outer_task * inner.task_shape + inner_task`` (outer tasks loop outside inner ones).

Composition is associative: a mapping is its sequence of atoms, outermost first, and ``*``
concatenates sequences, so ``(a * b) * c`` and ``a * (b * c)`` are one mapping.

Mappings are values of the loop IR: :meth:`TaskMapping.on` with an integer worker lists its
tasks; with an expression it builds a :class:`~kiln.ir.loops.program.TaskLoop`, the loop-IR
node ``for (i, j) in spatial(4, 8) * repeat(2, 2) on t { ... }`` that iterates a worker's
tasks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .expr import Expr, as_expr

if TYPE_CHECKING:  # pragma: no cover
    from .program import Node, TaskLoop

ATOMS = ("spatial", "repeat")


@dataclass(frozen=True)
class MappingAtom:
    """``spatial`` or ``repeat`` over ``shape``, dimensions ordered by ``ranks``."""

    kind: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in ATOMS:
            raise ValueError(f"unknown task-mapping atom {self.kind!r}; known: {', '.join(ATOMS)}")
        if not self.shape or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in self.shape):
            raise ValueError(f"{self.kind}{self.shape}: extents must be positive integers")
        if sorted(self.ranks) != list(range(len(self.shape))):
            raise ValueError(f"{self.kind}{self.shape}: ranks {list(self.ranks)} must be a permutation of "
                             f"0..{len(self.shape) - 1}")

    @property
    def num_workers(self) -> int:
        return math.prod(self.shape) if self.kind == "spatial" else 1

    def order(self) -> list[int]:
        """Dimensions from slowest (rank 0) to fastest."""
        return sorted(range(len(self.shape)), key=lambda d: self.ranks[d])

    def strides(self) -> tuple[int, ...]:
        """Each dimension's stride in the row-major order of ``ranks``."""
        strides = [0] * len(self.shape)
        s = 1
        for d in reversed(self.order()):
            strides[d] = s
            s *= self.shape[d]
        return tuple(strides)

    def tasks(self, w: int) -> list[tuple[int, ...]]:
        if self.kind == "spatial":
            return [tuple((w // st) % ext for st, ext in zip(self.strides(), self.shape))]
        order = self.order()
        out: list[tuple[int, ...]] = []
        for flat in range(math.prod(self.shape)):
            task = [0] * len(self.shape)
            for d in reversed(order):
                flat, task[d] = divmod(flat, self.shape[d])
            out.append(tuple(task))
        return out

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        if self.ranks != tuple(range(len(self.shape))):
            dims += f", ranks=[{', '.join(str(r) for r in self.ranks)}]"
        return f"{self.kind}({dims})"


@dataclass(frozen=True)
class TaskMapping:
    """A composition of atoms, outermost first (module docstring)."""

    atoms: tuple[MappingAtom, ...]

    def __post_init__(self) -> None:
        if not self.atoms:
            raise ValueError("a task mapping needs at least one atom")
        rank = len(self.atoms[0].shape)
        for a in self.atoms:
            if len(a.shape) != rank:
                raise ValueError(f"cannot compose task mappings of different ranks: "
                                 f"{self.atoms[0]} has {rank} dimension(s), {a} has {len(a.shape)}")

    # ----------------------------------------------------------------- properties
    @property
    def num_workers(self) -> int:
        return math.prod(a.num_workers for a in self.atoms)

    @property
    def task_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(dims) for dims in zip(*(a.shape for a in self.atoms)))

    @property
    def rank(self) -> int:
        return len(self.atoms[0].shape)

    def __mul__(self, other: TaskMapping) -> TaskMapping:
        if not isinstance(other, TaskMapping):
            return NotImplemented
        return TaskMapping(self.atoms + other.atoms)

    # ----------------------------------------------------------------- semantics
    def worker2task(self, w: int) -> list[tuple[int, ...]]:
        """The tasks of worker ``w`` in the order it does them (``[]`` for ``w`` outside
        ``[0, num_workers)``)."""
        if not 0 <= w < self.num_workers:
            return []
        tasks: list[tuple[int, ...]] = [(0,) * self.rank]
        rest = w
        inner_workers = self.num_workers
        for a in self.atoms:
            inner_workers //= a.num_workers
            aw, rest = divmod(rest, inner_workers)
            tasks = [tuple(t * e + s for t, e, s in zip(outer, a.shape, sub))
                     for outer in tasks for sub in a.tasks(aw)]
        return tasks

    def on(self, worker: int | Expr | str) -> TaskIteration:
        """The tasks of ``worker``: iterable for an integer worker, and the loop-IR node
        builder :meth:`TaskIteration.loop` for an expression."""
        return TaskIteration(self, worker)

    def __str__(self) -> str:
        return " * ".join(str(a) for a in self.atoms)

    def __repr__(self) -> str:
        return f"TaskMapping({self})"


@dataclass(frozen=True)
class TaskIteration:
    """``mapping.on(worker)``."""

    mapping: TaskMapping
    worker: Any

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        if not isinstance(self.worker, int):
            raise TypeError(f"iterating {self.mapping}.on({self.worker}) needs an integer worker; "
                            f"with an expression, build the loop-IR node with .loop(iterators, body)")
        return iter(self.mapping.worker2task(self.worker))

    def loop(self, iterators: Sequence[str], body: Sequence[Node]) -> TaskLoop:
        """``for (iterators) in mapping on worker { body }``."""
        from .program import TaskLoop  # noqa: PLC0415 (program imports this module)

        return TaskLoop(self.mapping, as_expr(self.worker), tuple(iterators), tuple(body))


def _atom(kind: str, shape: tuple[int, ...], ranks: Sequence[int] | None) -> TaskMapping:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    ranks = tuple(range(len(shape))) if ranks is None else tuple(ranks)
    return TaskMapping((MappingAtom(kind, tuple(shape), ranks),))


def spatial(*shape: int, ranks: Sequence[int] | None = None) -> TaskMapping:
    """One worker per task of ``shape`` (module docstring)."""
    return _atom("spatial", shape, ranks)


def repeat(*shape: int, ranks: Sequence[int] | None = None) -> TaskMapping:
    """One worker doing every task of ``shape`` in rank order (module docstring)."""
    return _atom("repeat", shape, ranks)


def auto_map(*task_shape: int, workers: int, ranks: Sequence[int] | None = None) -> TaskMapping:
    """``repeat(r...) * spatial(s...)`` over ``task_shape`` with ``prod(s) == workers``.

    Dimensions are visited from the fastest (the highest rank) to the slowest; each takes
    ``s_d = gcd(remaining workers, extent_d)`` workers and repeats ``extent_d // s_d`` times.
    Both atoms share ``ranks``.  ``auto_map(8, 32, workers=64) == repeat(4, 1) * spatial(2, 32)``.
    Raises ``ValueError`` when ``workers`` does not divide the number of tasks (then no
    split of this kind exists), naming the shape and the worker count.
    """
    if len(task_shape) == 1 and isinstance(task_shape[0], (tuple, list)):
        task_shape = tuple(task_shape[0])
    shape = tuple(task_shape)
    if not shape or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape):
        raise ValueError(f"auto_map{shape}: task extents must be positive integers")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"auto_map{shape}: workers must be a positive integer, got {workers!r}")
    order = list(range(len(shape))) if ranks is None else list(ranks)
    if sorted(order) != list(range(len(shape))):
        raise ValueError(f"auto_map{shape}: ranks {order} must be a permutation of 0..{len(shape) - 1}")
    spatial_shape = [1] * len(shape)
    repeat_shape = list(shape)
    remaining = workers
    for d in sorted(range(len(shape)), key=lambda d: -order[d]):
        spatial_shape[d] = math.gcd(remaining, shape[d])
        repeat_shape[d] = shape[d] // spatial_shape[d]
        remaining //= spatial_shape[d]
    if remaining != 1:
        raise ValueError(f"auto_map: {workers} workers cannot be spread over the task shape "
                         f"{'x'.join(map(str, shape))} ({math.prod(shape)} tasks): the number of workers must "
                         f"divide the number of tasks; pad the task shape or use fewer workers")
    return repeat(*repeat_shape, ranks=order) * spatial(*spatial_shape, ranks=order)


__all__ = ["ATOMS", "MappingAtom", "TaskIteration", "TaskMapping", "auto_map", "repeat", "spatial"]
