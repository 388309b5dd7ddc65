"""Default schedules of the cpu backend, one per kernel kind, built from ``Schedule`` primitives.

Every transformation goes through :class:`kiln.loops.Schedule`, so each is checked for
legality with isl before it applies; a step that is illegal for a given kernel (a parallel
mark on a loop that carries a reduction) is skipped and the next candidate is tried.  The
applied steps are kept as the schedule's replayable ``trace``.

Strategies (``kind`` is the kernel template of the fused node, see :mod:`kiln.ir.ops.fused`):

* ``elementwise`` and matmul/conv epilogues: each top-level loop nest with at least
  :data:`PARALLEL_MIN_WORK` statement instances gets its outermost legal loop marked
  ``parallel``; when that loop has fewer than :data:`MIN_PARALLEL_EXTENT` iterations, the
  directly nested loop is marked too (the C printer collapses both into one region).  Every
  innermost loop that is not parallel is ``vectorized`` when legal.
* ``reduction`` and normalizations (softmax, layer norm): the same; reduction loops cannot
  be marked (they carry the reduction), and the C printer accumulates them in registers
  with vectorized partial sums.
* ``matmul`` and ``conv`` when generated instead of a library call: the same, and the
  innermost output loop is moved below the reduction loops (``fission`` of the
  initialization, ``interchange``), ``vectorized`` along the output row, and tiled with
  the innermost reduction loop by :data:`MATMUL_TILE` when both are longer.

Programs the polyhedral model cannot take (non-affine loop bounds) are emitted as written,
serially; ``ScheduledKernel.notes`` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.ir.errors import IllegalTransformError, KilnError, ScheduleError
from kiln.ir.loops.program import If, Loop, Program

from .codegen import _const_extent, nest_work, reduction_cells

PARALLEL_MIN_WORK = 1 << 14
"""Statement instances from which a loop nest runs on several threads."""
MIN_PARALLEL_EXTENT = 8
"""A parallel loop shorter than this also marks its inner loop (collapsed region)."""
MATMUL_TILE = (32, 32)


@dataclass
class ScheduledKernel:
    """A scheduled program, the applied steps (a ``Schedule.trace``) and notes."""

    program: Program
    trace: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def default_schedule(program: Program, kind: str, *, threads: int = 2) -> ScheduledKernel:
    """The default schedule of ``program`` for a kernel of template ``kind`` (module docstring).

    ``program`` must use identifier names only (see
    :func:`kiln.backends.cpu.codegen.sanitize_program`).  With ``threads <= 1`` nothing is
    marked parallel.
    """
    try:
        from kiln.passes.schedule import Schedule  # noqa: PLC0415 (islpy loads on first use)
    except ImportError as e:
        return ScheduledKernel(program, notes=[f"unscheduled: the loop scheduler needs islpy ({e})"])
    try:
        schedule = Schedule(program)
    except (ScheduleError, KilnError, ValueError) as e:
        return ScheduledKernel(program, notes=[f"unscheduled: {e}"])
    notes: list[str] = []
    parallel: set[str] = set()
    for nest in (n for n in program.body if isinstance(n, Loop)):
        if threads > 1:
            parallel |= _mark_parallel(schedule, nest, notes)
    if kind in ("matmul", "conv"):
        _sink_output_loops(schedule, program, parallel, notes)
    for loop in _innermost_loops(program.body):
        if loop.name not in parallel:
            _try(schedule, notes, "vectorize", loop=loop.name)
    if not schedule.trace:
        return ScheduledKernel(program, notes=notes)
    return ScheduledKernel(schedule.program(name=program.name), list(schedule.trace), notes)


def _mark_parallel(schedule: Any, nest: Loop, notes: list[str]) -> set[str]:
    """Mark the outermost legal loop of ``nest`` (and maybe its inner loop) parallel."""
    work = nest_work((nest,))
    if work is None or work < PARALLEL_MIN_WORK:
        return set()
    loop: Loop | None = nest
    while loop is not None:
        if _try(schedule, notes, "parallel", loop=loop.name):
            marked = {loop.name}
            extent = _const_extent(loop)
            inner = _only_loop(loop)
            if extent is not None and extent < MIN_PARALLEL_EXTENT and inner is not None \
                    and _try(schedule, notes, "parallel", loop=inner.name):
                marked.add(inner.name)
            return marked
        loop = _only_loop(loop)
    return set()


def _sink_output_loops(schedule: Any, program: Program, parallel: set[str], notes: list[str]) -> None:
    """Matmul-like nests: move the innermost output loop below the reduction loops.

    ``for j { C[j] = 0; for k { C[j] += A[k] * B[k, j] } }`` becomes
    ``for j { C[j] = 0 }  for k { for j_b { C[j] += ... } }`` (``fission``, then one
    ``interchange`` per reduction loop), so the innermost loop runs along the output row and
    vectorizes (``vectorize``); the ``k``/``j_b`` pair is then tiled by :data:`MATMUL_TILE`.
    Each step is checked; the first one that does not apply ends the attempt."""
    for loop in program.loops():
        if loop.name in parallel or len(loop.body) != 2 or not isinstance(loop.body[1], Loop):
            continue
        init, nest = loop.body
        if isinstance(init, (Loop, If)) or reduction_cells(nest) is None:
            continue
        chain = [nest]
        while (inner := _only_loop(chain[-1])) is not None:
            chain.append(inner)
        if not _try(schedule, notes, "fission", loop=loop.name, split_before_child=nest.name):
            continue
        moved = next(name for name in reversed(schedule.loops()) if name.startswith(loop.name + "_b"))
        if not all(_try(schedule, notes, "interchange", a=moved, b=r.name) for r in chain):
            continue
        _try(schedule, notes, "vectorize", loop=moved)
        last = chain[-1]
        extents = (_const_extent(last), _const_extent(loop))
        if all(e is not None and e > size for e, size in zip(extents, MATMUL_TILE)):
            _try(schedule, notes, "tile", loops=[last.name, moved], sizes=list(MATMUL_TILE))


def _only_loop(loop: Loop) -> Loop | None:
    if len(loop.body) == 1 and isinstance(loop.body[0], Loop):
        return loop.body[0]
    return None


def _innermost_loops(body: tuple[Any, ...]) -> list[Loop]:
    out: list[Loop] = []
    for n in body:
        if isinstance(n, Loop):
            inner = _innermost_loops(n.body)
            out += inner if inner else [n]
        elif hasattr(n, "then"):
            out += _innermost_loops(n.then) + _innermost_loops(n.orelse)
    return out


def _try(schedule: Any, notes: list[str], primitive: str, **args: Any) -> bool:
    """Apply one checked primitive; an illegal or misapplied one is noted and skipped."""
    try:
        schedule.apply(primitive, **args)
    except (IllegalTransformError, ScheduleError) as e:
        notes.append(f"skipped {primitive}({args}): {str(e).splitlines()[0][:160]}")
        return False
    return True


__all__ = ["MATMUL_TILE", "MIN_PARALLEL_EXTENT", "PARALLEL_MIN_WORK", "ScheduledKernel", "default_schedule"]
