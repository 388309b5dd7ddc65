"""The pointwise kind: elementwise and broadcast nests, vectorized.

A nest is pointwise when it is one perfect chain of loops that all carry no dependence
(proved by isl) and whose innermost body is plain stores.  Its iteration space is
flattened and distributed grid-stride (as the generic kind does); when the innermost extent
is a multiple of the vector width ``V`` (``KernelOptions.vector_width``) -- or the nest is
one loop, whose last ``N % V`` elements are then a scalar tail, one per thread -- each task is
``V`` consecutive elements of the innermost axis:

* operands read at ``(..., i_last)`` by every element (not under a ``select`` branch, which
  may guard an out-of-range cell) -- the last index the bare innermost iterator, the others
  independent of it, the buffer's last extent a multiple of ``V`` and its base aligned to
  ``V`` elements -- are loaded with one vector access (:class:`VectorCopy`) into registers;
* results stored at such cells are computed into registers and written with one vector
  store; other loads and stores stay scalar, lane by lane.

Bodies whose statements read what an earlier statement of the nest wrote are not
vectorized (the registers would hide the write); they, and multi-dimensional shapes whose
rows do not divide, run the scalar grid-stride kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.ir.loops import (
    Annotation, Binary, Buffer, Const, If, Load, Loop, Node, Store, Var, VectorCopy, loads_of, repeat, spatial,
    substitute,
)

from .common import (
    PlanContext, accesses, band_coordinates, const_int, free_vars_of, perfect_chain, rewrite_loads, subst_nodes,
    trip_count, unconditional_loads,
)
from .generic import band_kernel, launch_shape
from .plan import GpuKernel


def pointwise_kernels(ctx: PlanContext, group: Sequence[Node], index: int) -> list[GpuKernel] | None:
    """The pointwise kernel of ``group``, or ``None`` when it is not an elementwise nest."""
    if len(group) != 1 or not isinstance(group[0], Loop):
        return None
    chain = perfect_chain(group[0])
    body = chain[-1].body
    if not all(isinstance(n, Store) for n in body) or ctx.parallel_band(group[0]) != chain:
        return None
    made = _vector_kernel(ctx, chain, body)
    return [made if made is not None else band_kernel(ctx, chain, index, "pointwise")]


def _vectorizable(ld: Load, last: str, width: int, ctx: PlanContext) -> bool:
    """``ld`` reads ``width`` consecutive, aligned cells at ``last, last + 1, ...``: its last
    index is the bare innermost iterator, the others do not depend on it, and the row it
    reads starts at a multiple of ``width`` cells of a buffer aligned to ``width`` cells."""
    if not ld.indices or ld.indices[-1] != Var(last):
        return False
    if any(last in free_vars_of(i) or loads_of(i) for i in ld.indices[:-1]):
        return False
    buf = ctx.program.buffer(ld.buffer)
    extent = buf.shape[-1]
    rows_aligned = all(isinstance(i, Const) and i.value == 0 for i in ld.indices[:-1])
    if not rows_aligned and (not isinstance(extent, Const) or int(extent.value) % width):
        return False
    align = ctx.options.aligned(ld.buffer) if buf.scope == "global" else 16
    return align % (width * buf.dtype.itemsize) == 0


def _vector_kernel(ctx: PlanContext, chain: list[Loop], body: Sequence[Store]) -> GpuKernel | None:
    width = ctx.options.vector_width
    last = chain[-1].iterator
    extent = trip_count(chain[-1])
    if width == 1 or chain[-1].step != 1 or const_int(chain[-1].lower) != 0 or extent < width:
        return None
    tail = extent % width
    if tail and len(chain) > 1:
        return None  # rows would start unaligned
    written = {n.buffer for n in body}
    if any(ld.buffer in written for ld, w, _ in accesses(body) if not w):
        return None
    loads = {ld for n in body for e in (n.value, *n.indices) for ld in unconditional_loads(e)
             if _vectorizable(ld, last, width, ctx)}
    stores = [k for k, n in enumerate(body) if _vectorizable(n.target, last, width, ctx)]
    if not stores and not loads:
        return None
    tasks = math.prod(trip_count(lp) for lp in chain) // width
    if tail and not (loads or stores):
        return None
    grid, block, repeats = launch_shape(ctx, tasks)
    frame = ctx.frame((grid,), (block,))
    v = ctx.fresh("v")
    lane = ctx.fresh("l")
    start = band_coordinates(chain, Binary("*", Var(v), Const(width)))
    at_lane = dict(start)
    at_lane[last] = Binary("+", start[last], Var(lane))
    extra: list[Buffer] = []
    nodes: list[Node] = []
    regs: dict[Load, Load] = {}
    for ld in sorted(loads, key=str):
        buf = ctx.program.buffer(ld.buffer)
        reg = ctx.fresh(f"{ld.buffer}_v")
        extra.append(Buffer(reg, (width,), buf.dtype, "register"))
        regs[ld] = Load(reg, (Var(lane),))
        nodes.append(VectorCopy(reg, (Const(0),), ld.buffer, _subst(ld.indices, start), width))
    lanes: list[Node] = []
    outs: list[tuple[str, Store]] = []
    for k, n in enumerate(body):
        value = rewrite_loads([Store(n.buffer, n.indices, n.value)], lambda e: regs.get(e))[0].value
        if k in stores:
            buf = ctx.program.buffer(n.buffer)
            reg = ctx.fresh(f"{n.buffer}_v")
            extra.append(Buffer(reg, (width,), buf.dtype, "register"))
            lanes.append(Store(reg, (Var(lane),), value))
            outs.append((reg, n))
        else:
            lanes.append(Store(n.buffer, n.indices, value))
    nodes.append(Loop(lane, 0, width, subst_nodes(lanes, at_lane), annotation=_unrolled(width)))
    for reg, n in outs:
        nodes.append(VectorCopy(n.buffer, _subst(n.indices, start), reg, (Const(0),), width))
    workers = grid * block
    task_body: tuple[Node, ...] = tuple(nodes)
    if repeats * workers != tasks:
        task_body = (If(Binary("<", Var(v), Const(tasks)), task_body),)
    mapping = spatial(workers) if repeats == 1 else repeat(repeats) * spatial(workers)
    worker = frame.t("x") if grid == 1 else frame.b("x") * block + frame.t("x")
    kernel_body: list[Node] = [mapping.on(worker).loop([v], task_body)]
    if tail:  # the last elements of a 1-d nest, one per thread
        t = ctx.fresh("t")
        scalar = subst_nodes(body, {last: Binary("+", Const(tasks * width), Var(t))})
        kernel_body.append(spatial(workers).on(worker).loop([t], [If(Binary("<", Var(t), Const(tail)), scalar)]))
    return ctx.kernel(frame, kernel_body, "pointwise", extra)


def _subst(indices, env):
    return tuple(substitute(i, env) for i in indices)


def _unrolled(n: int) -> Annotation:
    return Annotation("unrolled", factor=n)
