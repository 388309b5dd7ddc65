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
* any other kernel whose reduction cells are contiguous along an output loop that the
  reduced loops read across (a pooling window over a channels-last input:
  ``out[h][w][c] max= x[2h+i][2w+j][c]`` with ``c`` outside ``i, j``): before the steps
  above, that loop is moved innermost of the output loops (``interchange``) and then below
  the reduction loops (``fission`` of the initialization, ``interchange``), so it runs along
  the contiguous axis and vectorizes (ResNet-18's channels-last 3x3 max pooling: 1.6 ->
  0.05 ms).
* ``matmul`` and ``conv`` when generated instead of a library call: the same, and the
  innermost output loop is moved below the reduction loops (``fission`` of the
  initialization, ``interchange``), ``vectorized`` along the output row, and tiled with
  the innermost reduction loop by :data:`MATMUL_TILE` when both are longer.

Programs the polyhedral model cannot take (non-affine loop bounds) are emitted as written,
serially; ``ScheduledKernel.notes`` says so.  Loops with symbolic extents (size parameters)
are never marked for their amount of work, which is unknown: only vectorized.

**Tuning records.**  With ``records`` (a folder or a
:class:`~kiln.backends.common.records.RecordStore`), a kernel that has a record for this
machine and thread count (written by :mod:`kiln.tuning.autotune`) replays the recorded trace
instead -- through ``Schedule``, so every step is checked again; a record that no longer
applies (or is illegal) is noted and the default strategy runs.  :func:`observe_kernels`
lets the tuner see every program a build schedules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln.ir.errors import IllegalTransformError, KilnError, ScheduleError
from kiln.ir.loops.expr import Load, Var, free_vars, walk
from kiln.ir.loops.program import If, Loop, Program

from ..common.records import RecordStore, machine_key, store_for, structural_key
from .codegen import reduction_cells
from .loop_work import _const_extent, nest_work

PARALLEL_MIN_WORK = 1 << 14
"""Statement instances from which a loop nest runs on several threads."""
MIN_PARALLEL_EXTENT = 8
"""A parallel loop shorter than this also marks its inner loop (collapsed region)."""
MATMUL_TILE = (32, 32)
COLUMN_BLOCK = 256
"""Most cells per block of a sum over rows whose output loop is sunk (``_sink_strided_reductions``)."""


@dataclass
class ScheduledKernel:
    """A scheduled program, the applied steps (a ``Schedule.trace``) and notes."""

    program: Program
    trace: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


_OBSERVERS: list[list[tuple[Program, str, int]]] = []


@contextlib.contextmanager
def observe_kernels() -> Iterator[list[tuple[Program, str, int]]]:
    """Collect ``(program, kind, threads)`` of every kernel :func:`default_schedule` sees
    inside the block (what the autotuner tunes for a model)."""
    seen: list[tuple[Program, str, int]] = []
    _OBSERVERS.append(seen)
    try:
        yield seen
    finally:
        _OBSERVERS.remove(seen)


def records_store(records: str | Path | RecordStore | None) -> RecordStore | None:
    """``records`` as a store (a folder names its record file)."""
    if records is None or isinstance(records, RecordStore):
        return records
    return store_for(records)


def default_schedule(program: Program, kind: str, *, threads: int = 2,
                     records: str | Path | RecordStore | None = None,
                     size_hint: dict[str, int] | None = None,
                     ranges: dict[str, tuple[int, int]] | None = None) -> ScheduledKernel:
    """The default schedule of ``program`` for a kernel of template ``kind`` (module docstring),
    or its tuned one when ``records`` holds a record for it.  ``ranges`` bounds the size
    parameters (a symbolic graph's recorded ranges): every step is checked for all sizes in
    them.

    ``program`` must use identifier names only (see
    :func:`kiln.backends.cpu.codegen.sanitize_program`).  With ``threads <= 1`` nothing is
    marked parallel.
    """
    for seen in _OBSERVERS:
        seen.append((program, kind, threads))
    store = records_store(records)
    if store is not None:
        tuned = tuned_schedule(program, store, threads, ranges)
        if tuned is not None:
            return tuned
    return strategy_schedule(program, kind, threads=threads, size_hint=size_hint, ranges=ranges)


def tuned_schedule(program: Program, store: RecordStore, threads: int,
                   ranges: dict[str, tuple[int, int]] | None = None) -> ScheduledKernel | None:
    """The schedule of ``program``'s record in ``store`` replayed (every step checked), or
    ``None`` when it has none or its trace no longer replays legally (the caller then runs
    the default strategy)."""
    record = store.lookup(structural_key(program), machine_key(threads))
    if record is None:
        return None
    try:
        from kiln.passes.schedule import Schedule  # noqa: PLC0415
        schedule = Schedule.replay(program, record.trace, ranges=ranges)
        if not schedule.verify():
            return None
        scheduled = schedule.program(name=program.name) if schedule.trace else program
    except (ImportError, IllegalTransformError, ScheduleError, KilnError, ValueError, KeyError, TypeError):
        return None
    note = f"tuned: record {record.key[:12]} ({record.speedup:.2f}x over the default when measured)"
    return ScheduledKernel(scheduled, list(schedule.trace), [note])


def strategy_schedule(program: Program, kind: str, *, threads: int = 2,
                      size_hint: dict[str, int] | None = None,
                      ranges: dict[str, tuple[int, int]] | None = None) -> ScheduledKernel:
    """The default strategy of the module docstring (no records).  ``size_hint`` gives size
    parameters a typical value (a symbolic graph's kernels): nests are then marked parallel
    by their work at those values; without it a nest of symbolic extent stays serial."""
    try:
        from kiln.passes.schedule import Schedule  # noqa: PLC0415 (islpy loads on first use)
    except ImportError as e:
        return ScheduledKernel(program, notes=[f"unscheduled: the loop scheduler needs islpy ({e})"])
    try:
        schedule = Schedule(program, ranges=ranges)
    except (ScheduleError, KilnError, ValueError) as e:
        return ScheduledKernel(program, notes=[f"unscheduled: {e}"])
    notes: list[str] = []
    parallel: set[str] = set()
    if kind not in ("matmul", "conv") and _sink_strided_reductions(schedule, program, threads, notes):
        program = schedule.program(name=program.name)
    for nest in (n for n in program.body if isinstance(n, Loop)):
        if threads > 1:
            parallel |= _mark_parallel(schedule, nest, notes, size_hint)
    if kind in ("matmul", "conv"):
        _sink_output_loops(schedule, program, parallel, notes)
    vectorized = {step["args"]["loop"] for step in schedule.trace if step["primitive"] == "vectorize"}
    for loop in _innermost_loops(program.body):
        if loop.name not in parallel and loop.name not in vectorized:
            _try(schedule, notes, "vectorize", loop=loop.name)
    if not schedule.trace:
        return ScheduledKernel(program, notes=notes)
    return ScheduledKernel(schedule.program(name=program.name), list(schedule.trace), notes)


def _mark_parallel(schedule: Any, nest: Loop, notes: list[str], size_hint: dict[str, int] | None = None) -> set[str]:
    """Mark the outermost legal loop of ``nest`` (and maybe its inner loop) parallel."""
    work = nest_work((nest,), size_hint)
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
        if _sink(schedule, loop, nest, notes):
            last = chain[-1]
            extents = (_const_extent(last), _const_extent(loop))
            moved = _moved_name(schedule, loop)
            if all(e is not None and e > size for e, size in zip(extents, MATMUL_TILE)):
                _try(schedule, notes, "tile", loops=[last.name, moved], sizes=list(MATMUL_TILE))


def _moved_name(schedule: Any, loop: Loop) -> str:
    return next(name for name in reversed(schedule.loops()) if name.startswith(loop.name + "_b"))


def _sink(schedule: Any, loop: Loop, nest: Loop, notes: list[str]) -> bool:
    """``for j { init; nest; epilogue }`` -> ``for j { init }  for k... { for j_b { ... } }
    for j_b_b { epilogue }``: fission before the reduction ``nest`` (and after it, when
    statements follow it), then the copy of ``j`` around the nest interchanged below each of
    the nest's loops and vectorized.  Whether every step applied."""
    chain = [nest]
    while (inner := _only_loop(chain[-1])) is not None:
        chain.append(inner)
    if not _try(schedule, notes, "fission", loop=loop.name, split_before_child=nest.name):
        return False
    moved = _moved_name(schedule, loop)
    if len(loop.body) > 2 and not _try(schedule, notes, "fission", loop=moved, split_before_child=1):
        return False
    if not all(_try(schedule, notes, "interchange", a=moved, b=r.name) for r in chain):
        return False
    _try(schedule, notes, "vectorize", loop=moved)
    return True


def _sink_strided_reductions(schedule: Any, program: Program, threads: int, notes: list[str]) -> bool:
    """Reductions whose cells are contiguous along an output loop that their reduced loops
    read across: a pooling window over a channels-last input (``out[h][w][c] max= x[2h+i][2w+j][c]``
    with the loops ``c, h, w`` outside ``i, j``), or a sum over rows (``out[j] += x[i][j]``,
    a bias gradient).  That output loop is moved innermost of the output loops
    (``interchange``) and then below the reduction loops (as matmul-like nests,
    :func:`_sink`), so the innermost loop runs along the contiguous axis and vectorizes.
    When it is the only output loop, it is first split into blocks of
    :func:`_column_block` cells (``split``), so that the blocks stay outside and can run in
    parallel.  Each nest's steps apply as one unit or not at all.  Whether any nest changed."""
    changed = False
    for outer in _cell_chains(program.body, []):
        last = outer[-1]
        init, nest = last.body[:2]
        cells = reduction_cells(nest)
        if cells is None or len(cells) != 1 or not init.indices:
            continue
        contiguous = init.indices[-1]
        iterators = [loop.iterator for loop in outer]
        if not isinstance(contiguous, Var) or contiguous.name not in iterators:
            continue
        if not _reads_along(nest, contiguous.name):
            continue
        at = iterators.index(contiguous.name)
        target = outer[at]
        snapshot = schedule.copy()
        if not all(_try(schedule, notes, "interchange", a=target.name, b=loop.name) for loop in outer[at + 1:]):
            schedule.restore(snapshot)
            continue
        rotated = replace(target, body=last.body)
        extent = _const_extent(target)
        block = _column_block(extent, threads) if len(outer) == 1 and extent is not None else None
        if block is not None:
            if not _try(schedule, notes, "split", loop=target.name, factor=block):
                schedule.restore(snapshot)
                continue
            rotated = replace(rotated, name=f"{target.name}_i")
        if _sink(schedule, rotated, nest, notes):
            changed = True
        else:
            schedule.restore(snapshot)
    return changed


def _column_block(extent: int, threads: int) -> int | None:
    """Cells per block when a reduction's only output loop is sunk below its reduced loops:
    at most :data:`COLUMN_BLOCK`, a multiple of 16, and a number of blocks that is a multiple
    of ``threads`` where the extent allows; ``None`` when one block holds every cell."""
    workers = max(1, threads)
    blocks = workers * -(-extent // (workers * COLUMN_BLOCK))
    block = -(-extent // blocks)
    block = -(-block // 16) * 16
    return block if block < extent else None


def _cell_chains(body: tuple[Any, ...], chain: list[Loop]) -> Iterator[list[Loop]]:
    """Each loop whose body is ``[initialization, reduction nest, epilogue statements...]``
    (the epilogue may be empty), with the perfectly nested
    loops around it (outer to inner, itself last)."""
    for n in body:
        if not isinstance(n, Loop):
            continue
        here = [*chain, n] if len(body) == 1 else [n]
        if len(n.body) >= 2 and isinstance(n.body[1], Loop) \
                and not any(isinstance(c, (Loop, If)) for k, c in enumerate(n.body) if k != 1):
            yield here
        else:
            yield from _cell_chains(n.body, here)


def _reads_along(nest: Loop, iterator: str) -> bool:
    """Whether every buffer the reduction ``nest`` reads has ``iterator`` in its last index
    and the innermost reduced loop's iterator in none of its last indices."""
    chain = [nest]
    while (inner := _only_loop(chain[-1])) is not None:
        chain.append(inner)
    innermost = chain[-1].iterator
    loads = [e for s in chain[-1].body if not isinstance(s, (Loop, If)) for e in walk(s.value) if isinstance(e, Load)]
    if not loads:
        return False
    return all(e.indices and iterator in free_vars(e.indices[-1]) and innermost not in free_vars(e.indices[-1])
               for e in loads)


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


__all__ = ["MATMUL_TILE", "MIN_PARALLEL_EXTENT", "PARALLEL_MIN_WORK", "ScheduledKernel", "default_schedule",
           "observe_kernels", "records_store", "strategy_schedule", "tuned_schedule"]
