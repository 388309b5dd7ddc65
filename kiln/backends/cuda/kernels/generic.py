"""The generic kind: accepts every lowered program.

Each top-level group of the program (a loop nest, or consecutive loop-free statements)
becomes one launch.  For a nest, the outermost band of perfectly nested, constant-bound
loops that carry no dependence (proved by isl, :meth:`PlanContext.parallel_band`) is
flattened row-major (innermost loop fastest, so consecutive threads touch consecutive
cells of the usual innermost-contiguous outputs) and distributed grid-stride over
``grid x block`` threads by the task mapping ``repeat(R) * spatial(G * T)``; the rest of the
nest runs serially per task, in its original order.  A group without a parallel loop runs on
one thread.  Per-task temporaries (a matmul's accumulator) live in registers when
:func:`~.common.privatize` proves it sound; other ``local`` buffers become scratch globals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.ir.loops import Binary, Const, If, Loop, Node, Var, repeat, spatial

from .common import PlanContext, band_coordinates, privatize, subst_nodes, trip_count
from .plan import GpuKernel


def generic_kernels(ctx: PlanContext, group: Sequence[Node], index: int) -> list[GpuKernel]:
    """The kernels of ``group`` (module docstring): loop-free nodes before a nest with a
    parallel band run as a one-thread kernel of their own, then the band kernel."""
    last = group[-1]
    band = ctx.parallel_band(last) if isinstance(last, Loop) else []
    if not band:
        return [serial_kernel(ctx, group)]
    head = [serial_kernel(ctx, group[:-1])] if len(group) > 1 else []
    return head + [band_kernel(ctx, band, index)]


def serial_kernel(ctx: PlanContext, nodes: Sequence[Node]) -> GpuKernel:
    """``nodes`` on one thread (grid 1, block 1)."""
    return ctx.kernel(ctx.frame((1,), (1,)), tuple(nodes), "generic")


def launch_shape(ctx: PlanContext, tasks: int) -> tuple[int, int, int]:
    """``(grid, block, repeats)`` of a grid-stride launch over ``tasks`` tasks: blocks of
    ``options.block_size`` threads (fewer, a multiple of 32, for small task counts), at most
    ``options.max_blocks`` blocks, each thread doing ``repeats`` tasks."""
    opts = ctx.options
    block = max(1, min(opts.block_size, 32 * -(-tasks // 32)))
    grid = max(1, min(opts.max_blocks, -(-tasks // block)))
    repeats = max(1, -(-tasks // (grid * block)))
    return grid, block, repeats


def band_kernel(ctx: PlanContext, band: Sequence[Loop], index: int, kind: str = "generic") -> GpuKernel:
    """The grid-stride kernel of a parallel ``band`` (module docstring)."""
    tasks = math.prod(trip_count(lp) for lp in band)
    grid, block, repeats = launch_shape(ctx, tasks)
    frame = ctx.frame((grid,), (block,))
    body, registers = privatize(ctx, index, band[-1].body, {lp.iterator for lp in band})
    flat = ctx.fresh("f")
    body = subst_nodes(body, band_coordinates(band, Var(flat)))
    if repeats * grid * block != tasks:
        body = (If(Binary("<", Var(flat), Const(tasks)), body),)
    workers = grid * block
    mapping = spatial(workers) if repeats == 1 else repeat(repeats) * spatial(workers)
    worker = frame.t("x") if grid == 1 else frame.b("x") * block + frame.t("x")
    task_loop = mapping.on(worker).loop([flat], body)
    return ctx.kernel(frame, (task_loop,), kind, registers)
