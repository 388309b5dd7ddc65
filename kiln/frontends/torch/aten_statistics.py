"""ATen -> kiln rules for statistics, segment reductions and index writes built from kiln ops.

Every rule here is a composition of existing kiln ops, so its gradient comes from theirs:

* ``histc`` / ``histogram``: the bin of each element from its position between the edges
  (computed as PyTorch computes them, data-derived when no range is given), counted with one
  ``scatter_add`` into a static number of bins.
* ``mode``: per element, how many elements equal it (an ``[n, n]`` comparison per row); the
  smallest value among the most frequent, at the last position holding it.
* ``nanmedian``: the lower median of the non-NaN elements, from the stable ascending order.
* ``logcumsumexp``: each prefix is a masked log-sum-exp over an ``[n, n]`` tensor per row
  (``O(n^2)`` work, exact and stable for any range of values).
* ``index_reduce``: ``scatter_reduce`` with the index broadcast over the other axes.
* ``put``: a scatter into the flattened tensor.
* ``diagonal_scatter``, ``narrow_copy``: a ``where`` over the diagonal, a ``slice``.
* ``take``, ``nonzero_static``: a gather from the flattened tensor; the coordinates of the
  first ``size`` non-zero elements from a running count (static result shape).
* ``histogramdd``: one bin index per axis, combined row-major into one ``scatter_add``.
* ``segment_reduce``: segment ids from constant lengths/offsets; lengths that are graph inputs
  are refused (the bags' sizes would be data).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, KilnError, Value

from .aten import LoweringContext, aten, lowers, meta, optional_ops
from .aten_indexing import _kth_results

I64 = DType.int64


def _axis(x: Value, dim: int) -> int:
    rank = x.type.rank
    return dim % rank if rank else 0


def _flat(ctx: LoweringContext, x: Value) -> Value:
    return ctx.reshape(x, (int(np.prod(x.shape, dtype=np.int64)),))


def _last(ctx: LoweringContext, x: Value, axis: int) -> tuple[Value, list[int]]:
    """``x`` with ``axis`` moved last, and the permutation that moves it back."""
    rank = x.type.rank
    order = [a for a in range(rank) if a != axis] + [axis]
    back = sorted(range(rank), key=order.__getitem__)
    if order == list(range(rank)):
        return x, back
    return ctx.op("permute", x, dims=tuple(order)), back


def _extreme(dtype: DType, high: bool) -> Any:
    if dtype.is_floating:
        return float("inf") if high else float("-inf")
    if dtype == DType.bool:
        return bool(high)
    info = np.iinfo(dtype.numpy)
    return int(info.max if high else info.min)


# ------------------------------------------------------------------------- histograms
def _float_input(node: torch.fx.Node, x: Any, what: str) -> str | None:
    m = meta(x)
    if isinstance(m, torch.Tensor) and not m.dtype.is_floating_point:
        return f"{what} needs a floating-point input, got {m.dtype}"
    return None


def _bin_counts(ctx: LoweringContext, pos: Value, valid: Value, weight: Value | None, bins: int,
                dtype: DType) -> Value:
    """``hist[b] = sum(weight[k] for k with valid[k] and pos[k] == b)`` as one scatter_add."""
    one = ctx.const(1, dtype) if weight is None else ctx.cast(weight, dtype)
    counted = ctx.op("where", valid, one, ctx.const(0, dtype))
    if tuple(counted.shape) != tuple(pos.shape):
        counted = ctx.op("expand", counted, shape=tuple(pos.shape))
    index = ctx.op("where", valid, pos, ctx.const(0, I64))
    zeros = ctx.op("full", shape=(bins,), value=0.0 if dtype.is_floating else 0, dtype=dtype)
    return ctx.op("scatter_add", zeros, index, counted, dim=0)


def _data_range(ctx: LoweringContext, x: Value, widen: float) -> tuple[Value, Value]:
    """The minimum and maximum of ``x``, widened by ``widen`` each way where they are equal
    (0 and 0 for an empty ``x``)."""
    if int(np.prod(x.shape)) == 0:
        return ctx.const(-widen, x.dtype), ctx.const(widen, x.dtype)
    lo, hi = ctx.op("amin", x), ctx.op("amax", x)
    same = ctx.op("eq", lo, hi)
    step = ctx.const(widen, x.dtype)
    return (ctx.op("where", same, ctx.op("sub", lo, step), lo),
            ctx.op("where", same, ctx.op("add", hi, step), hi))


def _histc_check(node: torch.fx.Node, x: Any, bins: int = 100, min: Any = 0, max: Any = 0) -> str | None:
    if float(min) > float(max):
        return f"histc got min={min} > max={max}"
    if int(bins) <= 0:
        return f"histc needs bins > 0, got {bins}"
    return _float_input(node, x, "histc")


@lowers(aten.histc.default, check=_histc_check)
def _histc(ctx: LoweringContext, x: Value, bins: int = 100, min: Any = 0, max: Any = 0) -> Value:
    """PyTorch's bin of ``e`` is ``int((e - lo) * bins / (hi - lo))`` (``hi`` itself in the last
    bin); equal bounds mean the data's own minimum and maximum (widened by 1 where equal)."""
    bins = int(bins)
    flat = _flat(ctx, x)
    if float(min) == float(max):
        lo, hi = _data_range(ctx, flat, 1.0)
    else:
        lo, hi = ctx.const(float(min), x.dtype), ctx.const(float(max), x.dtype)
    scaled = ctx.op("div", ctx.op("mul", ctx.op("sub", flat, lo), ctx.const(float(bins), x.dtype)),
                    ctx.op("sub", hi, lo))
    pos = ctx.op("minimum", ctx.cast(ctx.op("trunc", scaled), I64), ctx.const(bins - 1, I64))
    pos = ctx.op("maximum", pos, ctx.const(0, I64))
    valid = ctx.op("logical_and", ctx.op("ge", flat, lo), ctx.op("le", flat, hi))
    return _bin_counts(ctx, pos, valid, None, bins, x.dtype)


def _linspace(ctx: LoweringContext, lo: Value, hi: Value, steps: int, dtype: DType) -> Value:
    """``steps`` points from ``lo`` to ``hi`` as PyTorch's CPU linspace computes them: from
    the start for the first half, from the end for the rest."""
    step = ctx.op("div", ctx.op("sub", hi, lo), ctx.const(float(steps - 1), dtype))
    k = np.arange(steps)
    half = k < steps // 2
    from_lo = ctx.op("add", lo, ctx.op("mul", step, ctx.const(k.astype(np.float64), dtype)))
    from_hi = ctx.op("sub", hi, ctx.op("mul", step, ctx.const((steps - 1 - k).astype(np.float64), dtype)))
    return ctx.op("where", ctx.const(half, DType.bool), from_lo, from_hi)


def _histogram_of(ctx: LoweringContext, x: Value, edges: Value, weight: Value | None,
                  density: bool) -> tuple:
    """Counts of ``x`` in the bins between ``edges`` (``upper_bound - 1``, the last edge in
    the last bin, values outside dropped), optionally weighted and normalized."""
    bins = int(edges.shape[0]) - 1
    flat = _flat(ctx, x)
    w = None if weight is None else _flat(ctx, weight)
    found = ctx.op("searchsorted", edges, flat, right=True)
    pos = ctx.op("minimum", ctx.op("sub", found, ctx.const(1, I64)), ctx.const(bins - 1, I64))
    first = ctx.op("slice", edges, dim=0, start=0, end=1)
    last = ctx.op("slice", edges, dim=0, start=bins, end=bins + 1)
    valid = ctx.op("logical_and", ctx.op("ge", flat, first), ctx.op("le", flat, last))
    hist = _bin_counts(ctx, pos, valid, w, bins, x.dtype)
    if density:
        widths = ctx.op("sub", ctx.op("slice", edges, dim=0, start=1, end=bins + 1),
                        ctx.op("slice", edges, dim=0, start=0, end=bins))
        hist = ctx.op("div", ctx.op("div", hist, ctx.op("sum", hist)), widths)
    return hist, edges


def _histogram_check(node: torch.fx.Node, x: Any, bins: Any = 100, *_: Any, **__: Any) -> str | None:
    if isinstance(bins, int) and bins <= 0:
        return f"histogram needs bins > 0, got {bins}"
    return _float_input(node, x, "histogram")


@lowers(aten.histogram.bin_ct, check=_histogram_check)
def _histogram_bin_ct(ctx: LoweringContext, x: Value, bins: int = 100, range: Sequence[float] | None = None,
                      weight: Value | None = None, density: bool = False) -> tuple:
    bins = int(bins)
    if range is not None:
        lo, hi = float(range[0]), float(range[1])
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        lo_v, hi_v = ctx.const(lo, x.dtype), ctx.const(hi, x.dtype)
    else:
        lo_v, hi_v = _data_range(ctx, _flat(ctx, x), 0.5)
    edges = _linspace(ctx, lo_v, hi_v, bins + 1, x.dtype)
    return _histogram_of(ctx, x, edges, weight, bool(density))


@lowers(aten.histogram.bins_tensor, check=_histogram_check)
def _histogram_bins_tensor(ctx: LoweringContext, x: Value, bins: Value, weight: Value | None = None,
                           density: bool = False) -> tuple:
    return _histogram_of(ctx, x, ctx.cast(bins, x.dtype), weight, bool(density))


# ------------------------------------------------------------------- mode, nanmedian
@lowers(aten.mode.default)
def _mode(ctx: LoweringContext, x: Value, dim: int = -1, keepdim: bool = False) -> tuple:
    """The smallest of the most frequent values along ``dim`` and the last position holding
    it (PyTorch's CPU kernel: a sort, then the end of the longest run)."""
    if x.type.rank == 0:
        return (lambda: x, lambda: ctx.const(0, I64))
    axis = _axis(x, dim)
    xs, _ = _last(ctx, x, axis)
    n = int(xs.shape[-1])
    lead = tuple(int(d) for d in xs.shape[:-1])
    rows = ctx.reshape(xs, (*lead, n, 1))
    cols = ctx.reshape(xs, (*lead, 1, n))
    count = ctx.op("sum", ctx.op("eq", rows, cols), dims=(-1,), dtype=I64)  # [.., n]
    best = ctx.op("amax", count, dims=(-1,), keepdim=True)
    value = ctx.op("amin", ctx.op("where", ctx.op("eq", count, best), xs,
                                  ctx.const(_extreme(x.dtype, True), x.dtype)), dims=(-1,), keepdim=True)
    positions = ctx.const(np.arange(n, dtype=np.int64), I64)
    index = ctx.op("amax", ctx.op("where", ctx.op("eq", xs, value), positions, ctx.const(-1, I64)),
                   dims=(-1,), keepdim=True)  # [.., 1]
    out_shape = tuple(int(d) for d in ctx.out.shape)
    return (lambda: ctx.reshape(ctx.op("gather", xs, index, dim=xs.type.rank - 1), out_shape),
            lambda: ctx.reshape(index, out_shape))


def _nanmedian_position(ctx: LoweringContext, x: Value, dim: int):
    """Position of the lower median of the non-NaN elements in the ascending order (NaNs sort
    last); 0 for a row of NaNs only."""
    n = int(x.shape[dim])
    if not x.dtype.is_floating:
        return (n - 1) // 2

    def position() -> Value:
        nans = ctx.op("sum", ctx.op("isnan", x), dims=(dim,), keepdim=True, dtype=I64)
        count = ctx.op("sub", ctx.const(n, I64), nans)
        half = ctx.op("floor", ctx.op("mul", ctx.cast(ctx.op("sub", count, ctx.const(1, I64)), DType.float64),
                                      ctx.const(0.5, DType.float64)))
        return ctx.op("maximum", ctx.cast(half, I64), ctx.const(0, I64))

    return position


@lowers(aten.nanmedian.dim)
def _nanmedian_dim(ctx: LoweringContext, x: Value, dim: int, keepdim: bool = False) -> tuple:
    dim = _axis(x, dim)
    if x.type.rank == 0:
        return _kth_results(ctx, x, 0, dim, keepdim)
    return _kth_results(ctx, x, _nanmedian_position(ctx, x, dim), dim, keepdim)


@lowers(aten.nanmedian.default)
def _nanmedian(ctx: LoweringContext, x: Value) -> Value:
    flat = _flat(ctx, x)
    if int(flat.shape[0]) == 0:
        return ctx.op("full", shape=(), value=float("nan"), dtype=x.dtype)
    value = _kth_results(ctx, flat, _nanmedian_position(ctx, flat, 0), 0, True)[0]()
    return ctx.reshape(value, ())


# ------------------------------------------------------------------------ logcumsumexp
@lowers(aten.logcumsumexp.default)
def _logcumsumexp(ctx: LoweringContext, x: Value, dim: int) -> Value:
    """``out[i] = log(sum(exp(x[j]) for j <= i))``: row ``i`` of an ``[n, n]`` tensor holds
    ``x[j]`` for ``j <= i`` and -inf elsewhere; a log-sum-exp over its last axis, shifted by
    the row's maximum (kept out of the gradient; 0 where it is infinite)."""
    if x.type.rank == 0 or int(np.prod(x.shape)) == 0:
        return x if x.type.rank == 0 else ctx.op("add", x, ctx.const(0, x.dtype))
    axis = _axis(x, dim)
    xs, back = _last(ctx, x, axis)
    n = int(xs.shape[-1])
    lead = tuple(int(d) for d in xs.shape[:-1])
    upto = np.arange(n).reshape(1, n) <= np.arange(n).reshape(n, 1)
    rows = ctx.op("where", ctx.const(upto, DType.bool), ctx.reshape(xs, (*lead, 1, n)),
                  ctx.const(float("-inf"), x.dtype))  # [.., n(i), n(j)]
    peak = ctx.op("amax", rows, dims=(-1,), keepdim=True)
    peak = ctx.op("stop_gradient", ctx.op("where", ctx.op("isinf", peak), ctx.const(0.0, x.dtype), peak))
    total = ctx.op("sum", ctx.op("exp", ctx.op("sub", rows, peak)), dims=(-1,))
    out = ctx.op("add", ctx.op("log", total), ctx.reshape(peak, (*lead, n)))
    return out if back == list(range(len(back))) else ctx.op("permute", out, dims=tuple(back))


# ------------------------------------------------------------------------- index writes
def _index_reduce_check(node: torch.fx.Node, x: Any, dim: int, index: Any, source: Any, reduce: str,
                        include_self: bool = True) -> str | None:
    if reduce not in ("prod", "mean", "amax", "amin"):
        return f"index_reduce reduce={reduce!r} is not one of prod, mean, amax, amin"
    return None


@lowers(aten.index_reduce.default, check=_index_reduce_check)
def _index_reduce(ctx: LoweringContext, x: Value, dim: int, index: Value, source: Value, reduce: str,
                  include_self: bool = True) -> Value:
    scalar = x.type.rank == 0
    if scalar:
        x = ctx.reshape(x, (1,))
    source = ctx.cast(source, x.dtype)
    if source.type.rank == 0:
        source = ctx.reshape(source, (1,))
    axis = _axis(x, dim)
    index = ctx.reshape(index, (int(np.prod(index.shape)),))
    shape = tuple(int(d) for d in source.shape)
    spread = ctx.reshape(index, tuple(shape[a] if a == axis else 1 for a in range(len(shape))))
    if tuple(spread.shape) != shape:
        spread = ctx.op("expand", spread, shape=shape)
    out = ctx.op("scatter_reduce", x, spread, source, dim=axis, reduce=reduce, include_self=bool(include_self))
    return ctx.reshape(out, ()) if scalar else out


@lowers(aten.put.default)
def _put(ctx: LoweringContext, x: Value, index: Value, source: Value, accumulate: bool = False) -> Value:
    """``x.flatten()[index] = source`` (negative positions count from the end)."""
    numel = int(np.prod(x.shape, dtype=np.int64))
    if int(np.prod(index.shape)) == 0:
        return ctx.op("add", x, ctx.const(0, x.dtype)) if x.dtype != DType.bool else \
            ctx.op("logical_or", x, ctx.const(False, x.dtype))
    flat = _flat(ctx, x)
    idx = _flat(ctx, ctx.cast(index, I64))
    idx = ctx.op("where", ctx.op("lt", idx, ctx.const(0, I64)), ctx.op("add", idx, ctx.const(numel, I64)), idx)
    src = _flat(ctx, ctx.cast(source, x.dtype))
    if accumulate:
        out = ctx.op("scatter_add", flat, idx, src, dim=0)
    else:
        out = ctx.op("scatter", flat, idx, src, dim=0)
    return ctx.reshape(out, tuple(x.shape))


@lowers(aten.diagonal_scatter.default)
def _diagonal_scatter(ctx: LoweringContext, x: Value, src: Value, offset: int = 0, dim1: int = 0,
                      dim2: int = 1) -> Value:
    """``src`` on diagonal ``offset`` of the ``(dim1, dim2)`` planes of ``x``: the two axes
    moved last, the diagonal spread over each plane by one constant ``index_select``, a
    ``where`` over the diagonal's positions, the axes moved back."""
    rank = x.type.rank
    d1, d2 = dim1 % rank, dim2 % rank
    order = [a for a in range(rank) if a not in (d1, d2)] + [d1, d2]
    back = sorted(range(rank), key=order.__getitem__)
    xs = ctx.op("permute", x, dims=tuple(order)) if order != list(range(rank)) else x
    n1, n2 = int(x.shape[d1]), int(x.shape[d2])
    length = int(src.shape[-1]) if src.type.rank else 0
    if length == 0:
        return ctx.op("add", x, ctx.const(0, x.dtype)) if x.dtype != DType.bool else x
    i = np.arange(n1).reshape(n1, 1)
    j = np.arange(n2).reshape(1, n2)
    on = (j - i) == offset
    k = np.broadcast_to(i if offset >= 0 else j, (n1, n2))
    k = np.clip(k, 0, length - 1).reshape(-1).astype(np.int64)
    lead = tuple(int(d) for d in xs.shape[:-2])
    spread = ctx.op("index_select", ctx.cast(src, x.dtype), ctx.const(k, I64), dim=src.type.rank - 1)
    spread = ctx.reshape(spread, (*lead, n1, n2))
    out = ctx.op("where", ctx.const(on, DType.bool), spread, xs)
    return out if back == list(range(rank)) else ctx.op("permute", out, dims=tuple(back))


@lowers(*optional_ops("narrow_copy"))
def _narrow_copy(ctx: LoweringContext, x: Value, dim: int, start: int, length: int) -> Value:
    dim = _axis(x, dim)
    start = int(start)
    if start < 0:
        start += int(x.shape[dim])
    return ctx.op("slice", x, dim=dim, start=start, end=start + int(length), step=1)


# --------------------------------------------------------------------- segment_reduce
_SEGMENT_REDUCES = ("sum", "mean", "max", "min", "prod")


_PASS_THROUGH = ("lift_fresh_copy", "detach", "detach_", "clone", "alias", "_to_copy")


def _is_constant_node(x: Any) -> bool:
    if not isinstance(x, torch.fx.Node):
        return x is None
    while x.op == "call_function" and str(x.target).split(".")[1] in _PASS_THROUGH and x.args:
        x = x.args[0]
    if x.op == "get_attr":
        return True
    return x.op == "placeholder" and (x.name.startswith("c_") or "constant" in x.name)


def _segment_check(node: torch.fx.Node, data: Any, reduce: str, lengths: Any = None, indices: Any = None,
                   offsets: Any = None, axis: int = 0, unsafe: bool = False, initial: Any = None) -> str | None:
    if reduce not in _SEGMENT_REDUCES:
        return f"segment_reduce reduce={reduce!r} is not one of {', '.join(_SEGMENT_REDUCES)}"
    if indices is not None:
        return "segment_reduce with indices= is not supported; give lengths= or offsets="
    given = lengths if lengths is not None else offsets
    if given is None:
        return "segment_reduce needs lengths= or offsets="
    if not _is_constant_node(given):
        which = "lengths" if lengths is not None else "offsets"
        return (f"segment_reduce's {which} is a tensor computed or passed at run time, so the "
                f"segments' sizes are data; kiln compiles static shapes: make {which} a constant "
                "of the program (torch.tensor([...]) of python numbers inside forward), "
                "or leave strict=False so that this op runs in PyTorch")
    return None


@lowers(*optional_ops("segment_reduce"), check=_segment_check)
def _segment_reduce(ctx: LoweringContext, data: Value, reduce: str, lengths: Value | None = None,
                    indices: Value | None = None, offsets: Value | None = None, axis: int = 0,
                    unsafe: bool = False, initial: Any = None) -> Value:
    given = lengths if lengths is not None else offsets
    if not given.is_const:
        raise KilnError(f"segment_reduce({data.type}): its lengths/offsets {given.type} are not a "
                        "constant; kiln compiles static segments only (leave strict=False to run it "
                        "in PyTorch)")
    table = np.asarray(given.data).astype(np.int64)
    if lengths is None:
        table = np.diff(table, axis=-1)
    if table.ndim != 1 or data.type.rank == 0:
        raise KilnError(f"segment_reduce({data.type}, lengths {list(table.shape)}): kiln supports "
                        "1-d lengths/offsets only")
    axis = _axis(data, axis)
    n = int(data.shape[axis])
    seg = np.repeat(np.arange(len(table)), table)
    if len(seg) != n:
        raise KilnError(f"segment_reduce({data.type}): the lengths sum to {len(seg)}, not to the "
                        f"size {n} of axis {axis}")
    kind = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin", "prod": "prod"}[reduce]
    shape = tuple(int(d) for d in data.shape)
    out_shape = tuple(len(table) if a == axis else shape[a] for a in range(len(shape)))
    if initial is not None:
        fill = float(initial)
    else:
        fill = {"sum": 0.0, "mean": float("nan"), "max": float("-inf"), "min": float("inf"), "prod": 1.0}[reduce]
    if n == 0:
        return ctx.op("full", shape=out_shape, value=fill, dtype=data.dtype)
    index = ctx.const(seg.reshape(tuple(n if a == axis else 1 for a in range(len(shape)))), I64)
    index = ctx.op("expand", index, shape=shape) if tuple(index.shape) != shape else index
    base = ctx.op("full", shape=out_shape, value=fill, dtype=data.dtype)
    include = initial is not None and reduce != "mean"
    out = ctx.op("scatter_reduce", base, index, data, dim=axis, reduce=kind, include_self=include)
    empty = (table == 0).reshape(tuple(len(table) if a == axis else 1 for a in range(len(shape))))
    if empty.any():
        out = ctx.op("where", ctx.const(empty, DType.bool), ctx.const(fill, data.dtype), out)
    return out


@lowers(aten.take.default)
def _take(ctx: LoweringContext, x: Value, index: Value) -> Value:
    """``x.flatten()[index]`` (negative positions count from the end), shaped as ``index``."""
    numel = int(np.prod(x.shape, dtype=np.int64))
    shape = tuple(int(d) for d in index.shape)
    if int(np.prod(shape, dtype=np.int64)) == 0:
        return ctx.op("full", shape=shape, value=_extreme(x.dtype, False) * 0, dtype=x.dtype) \
            if x.dtype != DType.bool else ctx.op("full", shape=shape, value=False, dtype=x.dtype)
    idx = _flat(ctx, ctx.cast(index, I64))
    idx = ctx.op("where", ctx.op("lt", idx, ctx.const(0, I64)), ctx.op("add", idx, ctx.const(numel, I64)), idx)
    return ctx.reshape(ctx.op("index_select", _flat(ctx, x), idx, dim=0), shape)


@lowers(*optional_ops("nonzero_static"))
def _nonzero_static(ctx: LoweringContext, x: Value, size: int, fill_value: int = -1) -> Value:
    """The coordinates of the first ``size`` non-zero elements (row-major), rows past their
    count filled with ``fill_value``: element ``j`` is row ``k`` when it is non-zero and
    ``k`` non-zero elements precede it (a running count), so each row is a masked sum over a
    constant table of coordinates."""
    size = int(size)
    rank = x.type.rank
    shape = tuple(int(d) for d in x.shape)
    numel = int(np.prod(shape, dtype=np.int64))
    if size == 0 or numel == 0 or rank == 0:
        if rank == 0:  # a 0-d tensor: one row of no coordinates per non-zero element
            return ctx.op("full", shape=(size, 0), value=0, dtype=I64)
        return ctx.op("full", shape=(size, rank), value=int(fill_value), dtype=I64)
    flat = _flat(ctx, x)
    nonzero = ctx.op("ne", flat, ctx.const(0, x.dtype)) if x.dtype != DType.bool else flat
    before = ctx.op("sub", ctx.op("cumsum", nonzero, dim=0), ctx.const(1, I64))  # [numel]
    rows = ctx.const(np.arange(size, dtype=np.int64).reshape(size, 1), I64)
    picked = ctx.op("logical_and", ctx.reshape(nonzero, (1, numel)),
                    ctx.op("eq", ctx.reshape(before, (1, numel)), rows))  # [size, numel]
    table = np.stack(np.unravel_index(np.arange(numel), shape), axis=-1).astype(np.int64)  # [numel, rank]
    spread = ctx.op("where", ctx.reshape(picked, (size, numel, 1)), ctx.const(table, I64), ctx.const(0, I64))
    coords = ctx.op("sum", spread, dims=(1,), dtype=I64)  # [size, rank]
    found = ctx.op("any", picked, dims=(1,), keepdim=True)
    return ctx.op("where", found, coords, ctx.const(int(fill_value), I64))


# ------------------------------------------------------------------------ histogramdd
def _columns(ctx: LoweringContext, x: Value) -> list[Value]:
    """The coordinates of ``x`` ``[.., D]`` as ``D`` flat columns."""
    dims = int(x.shape[-1])
    flat = ctx.reshape(x, (int(np.prod(x.shape[:-1], dtype=np.int64)), dims))
    return [ctx.reshape(ctx.op("slice", flat, dim=1, start=d, end=d + 1), (int(flat.shape[0]),))
            for d in range(dims)]


def _dd_edges(ctx: LoweringContext, x: Value, bins: Sequence[int], range: Sequence[float] | None) -> list[Value]:
    edges = []
    for d, col in enumerate(_columns(ctx, x)):
        if range is not None:
            lo, hi = float(range[2 * d]), float(range[2 * d + 1])
            if lo == hi:
                lo, hi = lo - 0.5, hi + 0.5
            lo_v, hi_v = ctx.const(lo, x.dtype), ctx.const(hi, x.dtype)
        else:
            lo_v, hi_v = _data_range(ctx, col, 0.5)
        edges.append(_linspace(ctx, lo_v, hi_v, int(bins[d]) + 1, x.dtype))
    return edges


def _dd_hist(ctx: LoweringContext, x: Value, edges: Sequence[Value], weight: Value | None,
             density: bool) -> Value:
    """Counts of the points of ``x`` in the grid of bins between ``edges`` (per axis as in
    :func:`_histogram_of`), flattened row-major into one ``scatter_add``."""
    counts = [int(e.shape[0]) - 1 for e in edges]
    linear = valid = None
    for d, (col, e) in enumerate(zip(_columns(ctx, x), edges)):
        b = counts[d]
        found = ctx.op("searchsorted", e, col, right=True)
        pos = ctx.op("minimum", ctx.op("sub", found, ctx.const(1, I64)), ctx.const(b - 1, I64))
        inside = ctx.op("logical_and", ctx.op("ge", col, ctx.op("slice", e, dim=0, start=0, end=1)),
                        ctx.op("le", col, ctx.op("slice", e, dim=0, start=b, end=b + 1)))
        stride = int(np.prod(counts[d + 1:], dtype=np.int64))
        term = ctx.op("mul", pos, ctx.const(stride, I64)) if stride != 1 else pos
        linear = term if linear is None else ctx.op("add", linear, term)
        valid = inside if valid is None else ctx.op("logical_and", valid, inside)
    w = None if weight is None else _flat(ctx, weight)
    hist = ctx.reshape(_bin_counts(ctx, linear, valid, w, int(np.prod(counts, dtype=np.int64)), x.dtype),
                       tuple(counts))
    if density:
        hist = ctx.op("div", hist, ctx.op("sum", hist))
        for d, e in enumerate(edges):
            b = counts[d]
            width = ctx.op("sub", ctx.op("slice", e, dim=0, start=1, end=b + 1), ctx.op("slice", e, dim=0, start=0, end=b))
            hist = ctx.op("div", hist, ctx.reshape(width, tuple(b if a == d else 1 for a in range(len(counts)))))
    return hist


def _dd_check(node: torch.fx.Node, x: Any, bins: Any, *_: Any, **__: Any) -> str | None:
    m = meta(x)
    if isinstance(m, torch.Tensor) and m.dim() < 1:
        return f"histogramdd needs an input of shape [.., D], got {list(m.shape)}"
    return _float_input(node, x, "histogramdd")


@lowers(*optional_ops("_histogramdd_bin_edges"), check=_dd_check)
def _histogramdd_bin_edges(ctx: LoweringContext, x: Value, bins: Sequence[int], range: Sequence[float] | None = None,
                           weight: Value | None = None, density: bool = False) -> list:
    return _dd_edges(ctx, x, bins, range)


@lowers(*optional_ops("_histogramdd_from_bin_cts"), check=_dd_check)
def _histogramdd_from_bin_cts(ctx: LoweringContext, x: Value, bins: Sequence[int],
                              range: Sequence[float] | None = None, weight: Value | None = None,
                              density: bool = False) -> Value:
    return _dd_hist(ctx, x, _dd_edges(ctx, x, bins, range), weight, bool(density))


@lowers(*optional_ops("_histogramdd_from_bin_tensors"), check=_dd_check)
def _histogramdd_from_bin_tensors(ctx: LoweringContext, x: Value, bins: Sequence[Value],
                                  weight: Value | None = None, density: bool = False) -> Value:
    return _dd_hist(ctx, x, [ctx.cast(b, x.dtype) for b in bins], weight, bool(density))
