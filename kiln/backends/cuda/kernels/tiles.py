"""Task mappings as explicit per-thread loops, for register tiles.

A thread's tasks under ``spatial(...) * repeat(...) * ...`` are addressed by its worker id
(the spatial atoms) and by the iterators of serial loops (the repeat atoms).  Register
tiles must be indexed by the repeat iterators only (never by thread ids), so kernels that
keep a register fragment per task expand the mapping here instead of writing a
:class:`~kiln.ir.loops.TaskLoop`: :func:`expand` gives the task coordinates, the loops and
the register index, exactly as :func:`kiln.ir.loops.lower_mappings` would lower the task
loop (same task order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kiln.ir.loops import Annotation, Binary, Const, Expr, If, Loop, Node, TaskMapping, Var, repeat, spatial

from .common import const_int


@dataclass(frozen=True)
class Expanded:
    """One worker's tasks: ``coords`` per task dimension (expressions of the worker and the
    ``loops`` iterators), ``loops`` (iterator, extent, task dimension) outermost first,
    ``guard`` the condition that the worker exists (``None``: always)."""

    coords: tuple[Expr, ...]
    loops: tuple[tuple[str, int, int], ...]
    guard: Expr | None

    def register(self, dims: Collection[int] | None = None) -> Expr:
        """The row-major index over the loops of ``dims`` (default: all), from 0."""
        out: Expr = Const(0)
        for it, extent, d in self.loops:
            if dims is None or d in dims:
                out = _add(_scale(out, extent), Var(it))
        return out

    def registers(self, dims: Collection[int] | None = None) -> int:
        """How many tasks the worker does (over the loops of ``dims``)."""
        return math.prod(e for _, e, d in self.loops if dims is None or d in dims)

    def wrap(self, body: Sequence[Node], dims: Collection[int] | None = None, unroll: bool = True,
             guard: bool = True) -> tuple[Node, ...]:
        """``body`` inside the repeat loops of ``dims`` (default all; unrolled) and the guard."""
        nodes = tuple(body)
        for it, extent, d in reversed(self.loops):
            if dims is not None and d not in dims:
                continue
            ann = Annotation("unrolled", factor=extent) if unroll else Annotation()
            nodes = (Loop(it, 0, extent, nodes, annotation=ann),)
        if guard and self.guard is not None:
            nodes = (If(self.guard, nodes),)
        return nodes


def _div(e: Expr, d: int) -> Expr:
    if d == 1:
        return e
    c = const_int(e)
    return Const(c // d) if c is not None else Binary("floordiv", e, Const(d))


def _mod(e: Expr, d: int) -> Expr:
    if d == 1:
        return Const(0)
    c = const_int(e)
    return Const(c % d) if c is not None else Binary("floormod", e, Const(d))


def _add(a: Expr, b: Expr) -> Expr:
    if const_int(a) == 0:
        return b
    if const_int(b) == 0:
        return a
    return Binary("+", a, b)


def _scale(a: Expr, c: int) -> Expr:
    if const_int(a) == 0:
        return Const(0)
    return a if c == 1 else Binary("*", a, Const(c))


def expand(mapping: TaskMapping, worker: Expr, fresh: Callable[[str], str], prefix: str = "r",
           workers: int | None = None) -> Expanded:
    """The tasks of ``worker`` under ``mapping`` (module docstring).  ``workers``: how many
    workers run (the block's threads); a guard is added when it exceeds the mapping's."""
    coords: list[Expr] = [Const(0)] * mapping.rank
    loops: list[tuple[str, int, int]] = []
    inner_workers = mapping.num_workers
    inner_shape = list(mapping.task_shape)
    first = True
    for atom in mapping.atoms:
        inner_workers //= atom.num_workers
        inner_shape = [s // e for s, e in zip(inner_shape, atom.shape)]
        if atom.kind == "spatial":
            share = _div(worker, inner_workers)
            if not first:
                share = _mod(share, atom.num_workers)
            for d, (stride, extent) in enumerate(zip(atom.strides(), atom.shape)):
                slowest = first and stride * extent == atom.num_workers
                t = _div(share, stride) if slowest else _mod(_div(share, stride), extent)
                coords[d] = _add(coords[d], _scale(t, inner_shape[d]))
        else:
            for d in atom.order():
                if atom.shape[d] == 1:
                    continue
                it = fresh(f"{prefix}{d}")
                loops.append((it, atom.shape[d], d))
                coords[d] = _add(coords[d], _scale(Var(it), inner_shape[d]))
        first = False
    guard = None
    if workers is not None and workers > mapping.num_workers:
        guard = Binary("<", worker, Const(mapping.num_workers))
    return Expanded(tuple(coords), tuple(loops), guard)


def tile_mapping(shape: tuple[int, int], workers: int, fast: int) -> TaskMapping:
    """``repeat * spatial`` over a 2-d tile with up to ``workers`` workers, consecutive
    workers along dimension ``fast`` (for coalesced global accesses)."""
    slow = 1 - fast
    s_fast = math.gcd(workers, shape[fast])
    s_slow = math.gcd(workers // s_fast, shape[slow])
    sp = [0, 0]
    sp[fast], sp[slow] = s_fast, s_slow
    rp = [shape[0] // sp[0], shape[1] // sp[1]]
    ranks = [0, 1] if fast == 1 else [1, 0]
    return repeat(*rp, ranks=ranks) * spatial(*sp, ranks=ranks)
