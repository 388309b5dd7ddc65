"""The rows kind: reductions and normalizations, one block or one warp per row.

For a row program (:func:`~.rows_match.match_rows`: sum/mean/max, softmax, log-softmax,
layer norm, RMS norm, argmax, ...):

* *block mode* (long rows, or few rows): grid = rows, ``T`` threads per row; *warp mode*
  (rows of at most 256 elements, or at most 1024 when there are many rows): 32 threads per
  row, several rows per block;
* each thread takes positions ``j * T_row + lane`` of every stage (so coalesced along the
  row when the row is the contiguous axis); operands read by several stages at the same
  positions (softmax's and the norms' ``x``) are loaded once into registers, when they fit;
* a reduction stage: per-thread partial in a register, a warp tree of ``xor`` shuffles
  (offsets 16 .. 1), then in block mode one shared slot per warp, a barrier, and every
  thread combines the slots -- so every thread holds the row's value (the broadcast)
  without a second barrier; each stage has its own slots, so stages never overwrite what
  another warp still reads;
* consumers read the reduced values from registers; accumulators that are results or are
  read by later kernels are stored once per row (by the row's first thread);
* memory accesses of positions past the row's end, and of rows past the last in warp mode,
  are masked; shuffles and barriers are reached by every thread.

Reductions combine partials in a tree, so float sums may differ from the serial order by
rounding; ``max``/``min`` are exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kiln.ir.loops import (
    Barrier, Binary, Buffer, Const, Expr, If, Load, Loop, Node, Reduce, Shuffle, Store, Var, loads_of,
)

from kiln.ir.types import DType

from .common import PlanContext, band_coordinates, free_vars_of, rewrite_loads, subst_nodes, unconditional_loads
from .generic import serial_kernel
from .plan import GpuKernel
from .rows_match import MapStage, Reduction, RowsMatch, ScalarStage, contiguous_reduction, match_rows

CACHE_REGISTERS = 64
"""Registers per thread the cached row operands may take."""


def rows_kernels(ctx: PlanContext, group: Sequence[Node], index: int) -> list[GpuKernel] | None:
    """The kernels of a row program, or ``None`` when ``group`` is not one, or when one
    thread per row (the generic kernel) does better: many rows whose reductions do not read
    warp-wide runs of consecutive cells (column sums, small convolution windows)."""
    match = match_rows(ctx, group)
    if match is None or any(ctx.program.buffer(r.acc).dtype == DType.bool for r in match.reductions):
        return None  # (bool accumulators: any/all -- left to one thread per row)
    if match.rows >= 1024 and not contiguous_reduction(match):
        return None  # many rows, not read in warp-wide runs: a thread per row
    head = [serial_kernel(ctx, match.head)] if match.head else []
    return head + [_build(ctx, match, index)]


def combine(combiner: str, a: Expr, b: Expr) -> Expr:
    """``a op b`` for a reduction combiner (``+``, ``*``, ``max``, ``min``)."""
    return Binary(combiner, a, b)


def _identity(red: Reduction, dtype) -> Const:
    return Const(Reduce(red.acc, (), red.combiner, Const(0)).identity(dtype), dtype)


def _build(ctx: PlanContext, match: RowsMatch, index: int) -> GpuKernel:
    opts = ctx.options
    rows = match.rows
    lengths = [s.length for s in match.stages if not isinstance(s, ScalarStage)]
    longest = max(lengths)
    warp_mode = rows > 1 and (longest <= 256 or (longest <= 1024 and rows >= 2112))
    if warp_mode:
        per_block = min(4, rows)
        t_row, grid = 32, -(-rows // per_block)
        threads = 32 * per_block
    else:
        per_block, grid = 1, rows
        t_row = threads = max(32, min(opts.block_size, 32 * -(-longest // 128)))
    frame = ctx.frame((grid,), (threads,))
    tid = frame.t("x")
    if warp_mode:
        lane = Binary("floormod", tid, Const(32)) if threads > 32 else tid
        warp = Binary("floordiv", tid, Const(32))
        row = warp if grid == 1 else Binary("+", Binary("*", frame.b("x"), Const(per_block)), warp)
        row_ok = Binary("<", row, Const(rows)) if rows % per_block else None
    else:
        lane, warp, row, row_ok = tid, Binary("floordiv", tid, Const(32)), frame.b("x"), None
    row_env = band_coordinates(match.band, row) if match.band else {}
    j = ctx.fresh("j")
    pos = Binary("+", Binary("*", Var(j), Const(t_row)), lane)
    buffers = {b.name: b for b in ctx.program.buffers}
    extra: list[Buffer] = []
    registers: dict[Load, Load] = {}  # accumulator cell -> its register

    def guard(length: int | None, first: bool = False) -> Expr | None:
        conds = []
        if length is not None and length % t_row:
            conds.append(Binary("<", pos, Const(length)))
        if first:
            conds.append(Binary("==", lane, Const(0)))
        if row_ok is not None:
            conds.append(row_ok)
        out = None
        for c in conds:
            out = c if out is None else Binary("&&", out, c)
        return out

    def guarded(nodes: Sequence[Node], cond: Expr | None) -> tuple[Node, ...]:
        return tuple(nodes) if cond is None else (If(cond, tuple(nodes)),)

    def localize(nodes: Sequence[Node], env: dict[str, Expr]) -> tuple[Node, ...]:
        nodes = rewrite_loads(nodes, lambda ld: registers.get(ld))
        return subst_nodes(nodes, {**row_env, **env})

    # per stage: the statements at one position, as they will run
    staged: list[tuple[object, tuple[Node, ...], int | None]] = []
    for s in match.stages:
        if isinstance(s, Reduction):
            staged.append((s, (Reduce(s.acc, s.index, s.combiner, s.value),), s.length))
        elif isinstance(s, MapStage):
            staged.append((s, s.body, s.length))
        else:
            staged.append((s, (s.node,), None))
    # operands read by several stages at the same positions: cached in registers
    positioned = {k: subst_nodes(nodes, {**row_env, **band_coordinates(s.loops, pos)})
                  for k, (s, nodes, length) in enumerate(staged) if length is not None}
    counts: Counter = Counter()
    accs = {r.acc for r in match.reductions}
    for k, nodes in positioned.items():
        seen = {(ld, staged[k][2]) for ld in _operand_loads(nodes, buffers)
                if j in free_vars_of(ld) and ld.buffer not in accs}
        counts.update(seen)
    cached = [(ld, length) for (ld, length), c in counts.items() if c >= 2]
    cache: dict[Load, Load] = {}
    body: list[Node] = []
    budget = CACHE_REGISTERS
    for ld, length in cached:
        slots = -(-length // t_row)
        if slots > budget:
            continue
        budget -= slots
        reg = ctx.fresh(f"{ld.buffer}_row")
        extra.append(Buffer(reg, (slots,), buffers[ld.buffer].dtype, "register"))
        cache[(ld, length)] = Load(reg, (Var(j),))
        body.append(Loop(j, 0, slots, guarded([Store(reg, (Var(j),), ld)], guard(length))))

    for k, (s, nodes, length) in enumerate(staged):
        if length is not None:
            env = band_coordinates(s.loops, pos)
            here = localize(nodes, env)
            hits = {ld: r for (ld, n), r in cache.items() if n == length}
            here = rewrite_loads(here, lambda e: hits.get(e))
        if isinstance(s, Reduction):
            dt = buffers[s.acc].dtype
            p, q = ctx.fresh(f"{s.acc}_p"), ctx.fresh(f"{s.acc}_q")
            extra += [Buffer(p, (), dt, "register"), Buffer(q, (), dt, "register")]
            red = here[0]
            part = Reduce(p, (), s.combiner, red.value)
            body.append(Store(p, (), _identity(s, dt)))
            body.append(Loop(j, 0, -(-length // t_row), guarded([part], guard(length))))
            body.extend(_warp_tree(p, q, s.combiner))
            warps = threads // 32
            if not warp_mode and warps > 1:
                slots = ctx.fresh(f"{s.acc}_slots")
                extra.append(Buffer(slots, (warps,), dt, "shared"))
                body.append(If(Binary("==", Binary("floormod", tid, Const(32)), Const(0)),
                               (Store(slots, (warp,), Load(p, ())),)))
                body.append(Barrier())
                total: Expr = Load(slots, (Const(0),))
                for w in range(1, warps):
                    total = combine(s.combiner, total, Load(slots, (Const(w),)))
                body.append(Store(p, (), total))
            init = localize((Store(p, (), s.init),), {})[0].value
            if init != _identity(s, dt):
                body.append(Store(p, (), combine(s.combiner, init, Load(p, ()))))
            cell = Load(s.acc, s.index)
            if not ctx.private_to(s.acc, index):
                body.extend(guarded(localize((Store(s.acc, s.index, Load(p, ())),), {}), guard(None, first=True)))
            registers[cell] = Load(p, ())
        elif isinstance(s, MapStage):
            body.append(Loop(j, 0, -(-length // t_row), guarded(here, guard(length))))
        else:
            body.extend(guarded(localize(nodes, {}), guard(None, first=True)))
    return ctx.kernel(frame, body, "rows", extra)


def _operand_loads(nodes: Sequence[Node], buffers: dict[str, Buffer]) -> list[Load]:
    """Loads of global buffers every position of a stage performs (not those a ``select``
    guards: caching them ahead could read out of bounds)."""
    out = []
    for n in nodes:
        for e in (n.value, *n.indices):
            out += [ld for ld in unconditional_loads(e) if buffers[ld.buffer].scope == "global"
                    and not any(loads_of(i) for i in ld.indices)]
    return out


def _warp_tree(p: str, q: str, combiner: str) -> list[Node]:
    out: list[Node] = []
    for off in (16, 8, 4, 2, 1):
        out.append(Shuffle(q, (), Load(p, ()), "xor", Const(off), 32))
        out.append(Store(p, (), combine(combiner, Load(p, ()), Load(q, ()))))
    return out


__all__ = ["combine", "rows_kernels"]
