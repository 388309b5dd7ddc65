"""Lowering task loops (:class:`~kiln.ir.loops.program.TaskLoop`) into index arithmetic.

``for (i, j) in m on w { body }`` becomes, for the atoms of ``m`` outermost first:

* a ``spatial`` atom: its task coordinates are ``(w // (inner_workers * stride)) % extent``
  (``inner_workers``: the workers of the atoms after it; ``stride * extent`` divides the
  atom's worker count, so no ``% atom_workers`` is needed) -- substituted into the body, no
  loop.  The slowest dimension of the outermost atom with several workers needs no
  ``% extent`` either (the guard bounds ``w``); extent-1 dimensions contribute nothing;
* a ``repeat`` atom: serial loops ``<iterator>_r`` over its extents, in rank order
  (extent-1 dimensions give no loop), nested in atom order, outer atoms outside;
* the coordinates combine as ``sum_k t_k * inner_task_shape_k``;
* a guard ``if (0 <= w && w < m.num_workers)`` (``0 <= w`` dropped when ``w`` is provably
  non-negative), left out when the values of ``w`` provably lie in ``[0, m.num_workers)``
  (:func:`worker_range`: iterators of constant-bound loops combined by ``+ - *``,
  ``min``/``max``, ``floordiv``/``floormod`` by constants).

The result runs the body for exactly the tasks ``m.worker2task(w)`` lists, in that order
(``tests/test_mapping.py`` checks it by running lowered programs against the enumeration).
It has no task loop; every other node is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ..names import claim_name
from .expr import Binary, Const, Expr, Var, substitute
from .mapping import TaskMapping
from .program import If, Loop, Node, Program, TaskLoop, map_nodes


def lower_mappings(program: Program) -> Program:
    """``program`` with every task loop lowered (module docstring)."""
    names = {p.name for p in program.params} | {b.name for b in program.buffers}
    names |= {lp.iterator for lp in program.loops()}
    names |= {it for n, _ in program.walk() if isinstance(n, TaskLoop) for it in n.iterators}
    lowering = _Lowering(names)
    body = lowering.nodes(program.body, {})
    if not lowering.changed:
        return program
    return program.replace(body=body)


def worker_range(worker: Expr, ranges: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """``[lo, hi)``, the values an integer expression takes, or ``None`` when unknown.

    Variables take their range from ``ranges`` (iterators of constant-bound loops);
    constants, ``+``, ``-``, ``*`` of non-negative operands, ``min``/``max`` and
    ``floordiv``/``floormod`` by positive constants are understood.  The interval is a
    sound over-approximation: every value the expression takes lies in it."""
    if isinstance(worker, Const):
        if not worker.dtype.is_integer:
            return None
        return (int(worker.value), int(worker.value) + 1)
    if isinstance(worker, Var):
        return ranges.get(worker.name)
    if not isinstance(worker, Binary):
        return None
    a = worker_range(worker.lhs, ranges)
    if a is None or a[0] >= a[1]:
        return None
    if worker.op in ("floordiv", "floormod"):
        if not (isinstance(worker.rhs, Const) and worker.rhs.dtype.is_integer and worker.rhs.value > 0):
            return None
        d = int(worker.rhs.value)
        if worker.op == "floordiv":
            return (a[0] // d, (a[1] - 1) // d + 1)
        if a[0] // d == (a[1] - 1) // d:
            return (a[0] % d, (a[1] - 1) % d + 1)
        return (0, d)
    b = worker_range(worker.rhs, ranges)
    if b is None or b[0] >= b[1]:
        return None
    if worker.op == "+":
        return (a[0] + b[0], a[1] + b[1] - 1)
    if worker.op == "-":
        return (a[0] - (b[1] - 1), a[1] - b[0])
    if worker.op == "min":
        return (min(a[0], b[0]), min(a[1], b[1]))
    if worker.op == "max":
        return (max(a[0], b[0]), max(a[1], b[1]))
    if worker.op == "*" and a[0] >= 0 and b[0] >= 0:
        return (a[0] * b[0], (a[1] - 1) * (b[1] - 1) + 1)
    return None


def _div(e: Expr, d: int) -> Expr:
    return e if d == 1 else Binary("floordiv", e, Const(d))


def _mod(e: Expr, d: int) -> Expr:
    return Const(0) if d == 1 else Binary("floormod", e, Const(d))


def _add(a: Expr, b: Expr) -> Expr:
    if isinstance(a, Const) and a.value == 0:
        return b
    if isinstance(b, Const) and b.value == 0:
        return a
    return Binary("+", a, b)


def _scale(a: Expr, c: int) -> Expr:
    if c == 1 or (isinstance(a, Const) and a.value == 0):
        return a
    return Binary("*", a, Const(c))


class _Lowering:
    def __init__(self, taken: set[str]):
        self.taken = set(taken)
        self.changed = False

    def fresh(self, base: str) -> str:
        return claim_name(base, self.taken)

    def nodes(self, nodes: tuple[Node, ...], ranges: dict[str, tuple[int, int]]) -> tuple[Node, ...]:
        out: list[Node] = []
        for n in nodes:
            if isinstance(n, Loop):
                inner = dict(ranges)
                if isinstance(n.lower, Const) and isinstance(n.upper, Const):
                    inner[n.iterator] = (int(n.lower.value), int(n.upper.value))
                else:
                    inner.pop(n.iterator, None)
                out.append(replace(n, body=self.nodes(n.body, inner)))
            elif isinstance(n, If):
                out.append(If(n.cond, self.nodes(n.then, ranges), self.nodes(n.orelse, ranges)))
            elif isinstance(n, TaskLoop):
                self.changed = True
                out.extend(self.task_loop(n, ranges))
            else:
                out.append(n)
        return tuple(out)

    def task_loop(self, n: TaskLoop, ranges: dict[str, tuple[int, int]]) -> list[Node]:
        m = n.mapping
        inner_ranges = dict(ranges)
        for it in n.iterators:
            inner_ranges.pop(it, None)
        body = self.nodes(n.body, inner_ranges)
        coords, loops = task_coordinates(m, n.worker, n.iterators, self.fresh)
        mapping = dict(zip(n.iterators, coords))
        lowered: tuple[Node, ...] = map_nodes(body, lambda e: substitute(e, mapping))
        for it, extent in reversed(loops):
            lowered = (Loop(it, 0, extent, lowered),)
        span = worker_range(n.worker, ranges)
        if span is not None and 0 <= span[0] and span[1] <= m.num_workers:
            return list(lowered)
        cond: Expr = Binary("<", n.worker, Const(m.num_workers))
        if span is None or span[0] < 0:
            cond = Binary("&&", Binary(">=", n.worker, Const(0)), cond)
        return [If(cond, lowered)]


def task_coordinates(mapping: TaskMapping, worker: Expr, iterators: Sequence[str],
                     fresh: Callable[[str], str] | None = None) -> tuple[list[Expr], list[tuple[str, int]]]:
    """The task coordinates of ``worker`` under ``mapping``, as expressions of ``worker`` and
    of the serial loops of its ``repeat`` atoms, and those loops ``(iterator, extent)``
    outermost first (named ``<iterator>_r``, made unique by ``fresh``).

    The expressions are exact for ``0 <= worker < mapping.num_workers`` (the caller guards
    the rest; module docstring)."""
    fresh = fresh or (lambda base: base)
    coords: list[Expr] = [Const(0)] * mapping.rank
    loops: list[tuple[str, int]] = []
    inner_workers = mapping.num_workers
    inner_shape = list(mapping.task_shape)
    outermost = True  # no atom with several workers seen yet
    for atom in mapping.atoms:
        inner_workers //= atom.num_workers
        inner_shape = [s // e for s, e in zip(inner_shape, atom.shape)]
        if atom.kind == "spatial":
            if atom.num_workers == 1:
                continue
            for d, (stride, extent) in enumerate(zip(atom.strides(), atom.shape)):
                if extent == 1:
                    continue
                slowest = outermost and stride * extent == atom.num_workers
                share = _div(worker, inner_workers * stride)
                t = share if slowest else _mod(share, extent)
                coords[d] = _add(coords[d], _scale(t, inner_shape[d]))
            outermost = False
        else:
            for d in atom.order():
                if atom.shape[d] == 1:
                    continue
                it = fresh(f"{iterators[d]}_r")
                loops.append((it, atom.shape[d]))
                coords[d] = _add(coords[d], _scale(Var(it), inner_shape[d]))
    return coords, loops


__all__ = ["lower_mappings", "task_coordinates", "worker_range"]
