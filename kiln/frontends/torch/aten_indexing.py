"""ATen -> kiln rules for sorting, scans, scatters, index writes, search and roll/unfold.

Two-result ATen ops (``sort``, ``topk``, ``kthvalue``, ``median.dim``, ``cummax``,
``cummin``) return lazily built results: the indices come from one kiln index op
(``argsort``, ``argtopk``, ``cumarg``), the values from ``gather`` at those indices, so the values'
gradient is the cotangent scattered back to the selected positions.  Ops whose result shape
depends on the data (``nonzero``, ``masked_select``, reading ``x[mask]``) are refused with
the way around them.  See :mod:`kiln.frontends.torch.aten` for how rules are declared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, Value

from .aten import LoweringContext, aten, dtype_arg, lowers, meta, optional_ops

_DATA_DEPENDENT = ("kiln compiles static shapes, and the size of this result depends on "
                   "tensor values. Rewrite it with a static shape -- torch.where(mask, x, "
                   "other) or x.masked_fill(~mask, 0) instead of x[mask], a fixed-size topk instead "
                   "of nonzero -- or leave strict=False so that this op runs in PyTorch")


def _axis(x: Value, dim: int) -> int:
    rank = x.type.rank
    return dim % rank if rank else 0


def _gathered(ctx: LoweringContext, x: Value, index: Value, dim: int) -> Value:
    return ctx.op("gather", x, index, dim=dim) if x.type.rank else x


# ---------------------------------------------------------------------------- sorting
def _sort_results(ctx: LoweringContext, x: Value, dim: int, descending: bool) -> tuple:
    dim = _axis(x, dim)
    state: dict[str, Value] = {}

    def indices() -> Value:
        if "i" not in state:
            state["i"] = ctx.op("argsort", x, dim=dim, descending=bool(descending))
        return state["i"]

    return (lambda: _gathered(ctx, x, indices(), dim), indices)


@lowers(aten.sort.default)
def _sort(ctx: LoweringContext, x: Value, dim: int = -1, descending: bool = False) -> tuple:
    return _sort_results(ctx, x, dim, descending)


@lowers(aten.sort.stable)
def _sort_stable(ctx: LoweringContext, x: Value, stable: bool | None, dim: int = -1,
                 descending: bool = False) -> tuple:
    return _sort_results(ctx, x, dim, descending)  # kiln's sort is always stable


@lowers(aten.argsort.default)
def _argsort(ctx: LoweringContext, x: Value, dim: int = -1, descending: bool = False) -> Value:
    return ctx.op("argsort", x, dim=_axis(x, dim), descending=bool(descending))


@lowers(*optional_ops("argsort.stable"))
def _argsort_stable(ctx: LoweringContext, x: Value, stable: bool, dim: int = -1,
                    descending: bool = False) -> Value:
    return _argsort(ctx, x, dim, descending)


@lowers(*optional_ops("msort"))
def _msort(ctx: LoweringContext, x: Value) -> Value:
    return _sort_results(ctx, x, 0, False)[0]()


@lowers(aten.topk.default)
def _topk(ctx: LoweringContext, x: Value, k: int, dim: int = -1, largest: bool = True,
          sorted: bool = True) -> tuple:
    """The first ``k`` of a stable sort (unsorted topk returns them sorted too): a partial
    selection (``argtopk``) when ``k`` is less than the axis, else the whole ``argsort``."""
    dim = _axis(x, dim)
    n = int(x.shape[dim]) if x.type.rank else 1
    state: dict[str, Value] = {}

    def indices() -> Value:
        if "i" not in state:
            if int(k) == n or x.type.rank == 0:  # 0-d: torch's k=0 and k=1 both give the 0-d result
                state["i"] = ctx.op("argsort", x, dim=dim, descending=bool(largest))
            else:
                state["i"] = ctx.op("argtopk", x, k=int(k), dim=dim, largest=bool(largest))
        return state["i"]

    return (lambda: _gathered(ctx, x, indices(), dim), indices)


def _kth_results(ctx: LoweringContext, x: Value, position: Any, dim: int, keepdim: bool) -> tuple:
    """Value and index at ``position`` (an int, or an int64 tensor with the reduced axis
    kept as 1) of the stable ascending order along ``dim``."""
    dim = _axis(x, dim)
    state: dict[str, Value] = {}

    def picked() -> Value:  # indices, the reduced axis kept as size 1
        if "i" not in state:
            order = ctx.op("argsort", x, dim=dim)
            if isinstance(position, int):
                state["i"] = ctx.op("slice", order, dim=dim, start=position, end=position + 1)
            else:
                state["i"] = ctx.op("gather", order, position(), dim=dim)
        return state["i"]

    def shaped(v: Value) -> Value:
        return v if keepdim else ctx.reshape(v, ctx.out.shape)

    if x.type.rank == 0:
        return (lambda: x, lambda: ctx.const(0, DType.int64))
    return (lambda: shaped(ctx.op("gather", x, picked(), dim=dim)), lambda: shaped(picked()))


@lowers(aten.kthvalue.default)
def _kthvalue(ctx: LoweringContext, x: Value, k: int, dim: int = -1, keepdim: bool = False) -> tuple:
    return _kth_results(ctx, x, int(k) - 1, dim, keepdim)


def _median_position(ctx: LoweringContext, x: Value, dim: int):
    """The lower median's position in the ascending order, or, in a row holding NaN, the
    position of its first NaN (torch propagates NaN): a function building it lazily."""
    n = int(x.shape[dim])
    k = (n - 1) // 2
    if not x.dtype.is_floating:
        return k

    def position() -> Value:
        nans = ctx.op("sum", ctx.op("isnan", x), dims=(dim,), keepdim=True, dtype=DType.int64)
        has_nan = ctx.op("gt", nans, ctx.const(0, DType.int64))
        first_nan = ctx.op("sub", ctx.const(n, DType.int64), nans)  # NaNs sort last, in order
        return ctx.op("where", has_nan, first_nan, ctx.const(k, DType.int64))

    return position


@lowers(aten.median.dim)
def _median_dim(ctx: LoweringContext, x: Value, dim: int, keepdim: bool = False) -> tuple:
    dim = _axis(x, dim)
    if x.type.rank == 0:
        return _kth_results(ctx, x, 0, dim, keepdim)
    return _kth_results(ctx, x, _median_position(ctx, x, dim), dim, keepdim)


@lowers(aten.median.default)
def _median(ctx: LoweringContext, x: Value) -> Value:
    flat = ctx.reshape(x, (int(np.prod(x.shape)),))
    value = _kth_results(ctx, flat, _median_position(ctx, flat, 0), 0, True)[0]()
    return ctx.reshape(value, ())


# ------------------------------------------------------------------------------ scans
@lowers(aten.cumprod.default)
def _cumprod(ctx: LoweringContext, x: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    x = ctx.cast(x, dtype_arg(dtype))
    return ctx.op("cumprod", x, dim=_axis(x, dim))


def _cum_extreme(mode: str):
    def lower(ctx: LoweringContext, x: Value, dim: int) -> tuple:
        dim = _axis(x, dim)
        state: dict[str, Value] = {}

        def indices() -> Value:
            if "i" not in state:
                state["i"] = ctx.op("cumarg", x, dim=dim, mode=mode)
            return state["i"]

        return (lambda: _gathered(ctx, x, indices(), dim), indices)

    return lower


lowers(aten.cummax.default)(_cum_extreme("max"))
lowers(aten.cummin.default)(_cum_extreme("min"))


# --------------------------------------------------------------------------- scatters
def _scatter_src(ctx: LoweringContext, x: Value, index: Value, src: Any) -> Value:
    if isinstance(src, Value):
        return ctx.cast(src, x.dtype)
    return ctx.op("full", shape=tuple(index.shape), value=_fill_value(src, x.dtype), dtype=x.dtype)


def _fill_value(value: Any, dtype: DType) -> Any:
    if dtype == DType.bool:
        return bool(value)
    return int(value) if dtype.is_integer else float(value)


_OLD_REDUCE = {"add": "sum", "multiply": "prod"}


def _scatter_reduce_op(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Value,
                       reduce: str, include_self: bool) -> Value:
    dim = _axis(x, dim)
    if reduce == "sum" and include_self:
        return ctx.op("scatter_add", x, index, src, dim=dim)
    return ctx.op("scatter_reduce", x, index, src, dim=dim, reduce=reduce, include_self=include_self)


@lowers(aten.scatter.src, aten.scatter.value)
def _scatter(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Any) -> Value:
    return ctx.op("scatter", x, index, _scatter_src(ctx, x, index, src), dim=_axis(x, dim))


def _old_reduce_check(node: torch.fx.Node, x: Any, dim: int, index: Any, src: Any,
                      reduce: str) -> str | None:
    if reduce not in _OLD_REDUCE:
        return f"scatter reduce={reduce!r} is not one of 'add', 'multiply'"
    return None


@lowers(aten.scatter.reduce, aten.scatter.value_reduce, check=_old_reduce_check)
def _scatter_old_reduce(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Any,
                        reduce: str) -> Value:
    return _scatter_reduce_op(ctx, x, dim, index, _scatter_src(ctx, x, index, src),
                              _OLD_REDUCE[reduce], True)


@lowers(aten.scatter_add.default)
def _scatter_add(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Value) -> Value:
    return _scatter_reduce_op(ctx, x, dim, index, ctx.cast(src, x.dtype), "sum", True)


def _scatter_reduce_check(node: torch.fx.Node, x: Any, dim: int, index: Any, src: Any,
                          reduce: str, include_self: bool = True) -> str | None:
    if reduce not in ("sum", "prod", "mean", "amax", "amin"):
        return f"scatter_reduce reduce={reduce!r} is not one of sum, prod, mean, amax, amin"
    return None


@lowers(aten.scatter_reduce.two, check=_scatter_reduce_check)
def _scatter_reduce(ctx: LoweringContext, x: Value, dim: int, index: Value, src: Value,
                    reduce: str, include_self: bool = True) -> Value:
    return _scatter_reduce_op(ctx, x, dim, index, ctx.cast(src, x.dtype), reduce, bool(include_self))


# ----------------------------------------------------------------------- index writes
def _is_mask(x: Any) -> bool:
    m = meta(x)
    return isinstance(m, torch.Tensor) and m.dtype in (torch.bool, torch.uint8)


def _mask_layout(x_shape: Sequence[int], indices: Sequence[Any]) -> tuple[int, int]:
    """(first axis, rank) of the one bool mask among ``indices``."""
    for start, idx in enumerate(indices):
        if idx is not None and _is_mask(idx):
            return start, len(meta(idx).shape)
    raise AssertionError("no mask")


def _mask_values_shape(x_shape: Sequence[int], start: int, rank: int,
                       values_shape: Sequence[int]) -> tuple[int, ...] | None:
    """Shape to which ``values`` broadcast against ``x`` in ``x[mask] = values`` (the mask's
    axes of size 1), or ``None`` when they run along the selected elements (``nnz``)."""
    before, after = list(x_shape[:start]), list(x_shape[start + rank:])
    target = before + [None] + after  # None: the nnz axis
    v = list(values_shape)
    if len(v) > len(target):
        return None
    aligned = [1] * (len(target) - len(v)) + v
    nnz_size = aligned[len(before)]
    if nnz_size != 1:
        return None
    return (*aligned[:len(before)], *([1] * rank), *aligned[len(before) + 1:])


def _index_put_check(node: torch.fx.Node, x: Any, indices: Sequence[Any], values: Any,
                     accumulate: bool = False) -> str | None:
    given = [i for i in indices if i is not None]
    masks = [i for i in given if _is_mask(i)]
    if not masks:
        return None
    if len(given) > 1:
        return ("index_put with a bool mask together with other index tensors writes a "
                "data-dependent set of positions; " + _DATA_DEPENDENT)
    x_shape, v_shape = tuple(meta(x).shape), tuple(meta(values).shape)
    start, rank = _mask_layout(x_shape, indices)
    if _mask_values_shape(x_shape, start, rank, v_shape) is None:
        return (f"x[mask] = values with values of shape {list(v_shape)}, one per selected "
                "element, is data-dependent (how many elements the mask selects); " + _DATA_DEPENDENT)
    return None


@lowers(aten.index_put.default, check=_index_put_check)
def _index_put(ctx: LoweringContext, x: Value, indices: Sequence[Value | None], values: Value,
               accumulate: bool = False) -> Value:
    values = ctx.cast(values, x.dtype)
    given = [i for i in indices if i is not None]
    if given and given[0].dtype in (DType.bool, DType.uint8):
        start = next(k for k, i in enumerate(indices) if i is not None)
        mask = given[0]
        rank = mask.type.rank
        if mask.dtype != DType.bool:
            mask = ctx.op("ne", mask, ctx.const(0, mask.dtype))
        mask = ctx.reshape(mask, (*([1] * start), *mask.shape, *([1] * (x.type.rank - start - rank))))
        shape = _mask_values_shape(tuple(x.shape), start, rank, tuple(values.shape))
        values = ctx.reshape(values, shape)
        if accumulate:
            return ctx.op("add", x, ctx.op("where", mask, values, ctx.const(0, x.dtype)))
        return ctx.op("where", mask, values, x)
    dims = tuple(k for k, i in enumerate(indices) if i is not None)
    return ctx.op("index_put", x, values, *given, dims=dims, accumulate=bool(accumulate))


@lowers(aten.masked_scatter.default)
def _masked_scatter(ctx: LoweringContext, x: Value, mask: Value, source: Value) -> Value:
    """The k-th true position of the mask (row-major) takes ``source``'s k-th element: its
    number is the running count of true positions, a static-shape ``cumsum``."""
    shape = tuple(x.shape)
    numel = int(np.prod(shape))
    mask = ctx.reshape(mask, (1,) * (len(shape) - mask.type.rank) + tuple(mask.shape))
    if tuple(mask.shape) != shape:
        mask = ctx.op("expand", mask, shape=shape)
    flat_mask = ctx.reshape(mask, (numel,))
    count = ctx.op("cumsum", flat_mask, dim=0)  # int64
    src_numel = int(np.prod(source.shape))
    position = ctx.op("minimum", ctx.op("maximum", ctx.op("sub", count, ctx.const(1, DType.int64)),
                                        ctx.const(0, DType.int64)),
                      ctx.const(max(src_numel - 1, 0), DType.int64))
    flat_src = ctx.reshape(ctx.cast(source, x.dtype), (src_numel,))
    picked = ctx.reshape(ctx.op("index_select", flat_src, position, dim=0), shape)
    return ctx.op("where", mask, picked, x)


def _index_1d(ctx: LoweringContext, index: Value) -> Value:
    return ctx.reshape(index, (1,)) if index.type.rank == 0 else index


@lowers(aten.index_add.default)
def _index_add(ctx: LoweringContext, x: Value, dim: int, index: Value, source: Value,
               alpha: Any = 1) -> Value:
    source = ctx.cast(source, x.dtype)
    if alpha != 1:
        source = ctx.op("mul", source, ctx.const(alpha, x.dtype))
    dim = _axis(x, dim)
    source = ctx.reshape(source, (*x.shape[:dim], int(np.prod(index.shape)), *x.shape[dim + 1:]))
    return ctx.op("index_put", x, source, _index_1d(ctx, index), dims=(dim,), accumulate=True)


@lowers(aten.index_copy.default)
def _index_copy(ctx: LoweringContext, x: Value, dim: int, index: Value, source: Value) -> Value:
    dim = _axis(x, dim)
    source = ctx.reshape(ctx.cast(source, x.dtype),
                         (*x.shape[:dim], int(np.prod(index.shape)), *x.shape[dim + 1:]))
    return ctx.op("index_put", x, source, _index_1d(ctx, index), dims=(dim,))


@lowers(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def _index_fill(ctx: LoweringContext, x: Value, dim: int, index: Value, value: Any) -> Value:
    fill = ctx.cast(value, x.dtype) if isinstance(value, Value) else ctx.const(_fill_value(value, x.dtype), x.dtype)
    return ctx.op("index_put", x, ctx.reshape(fill, ()), _index_1d(ctx, index), dims=(_axis(x, dim),))


# --------------------------------------------------------------- diagonals and scatters
@lowers(aten.diagonal.default, keep=True)
@lowers(*optional_ops("diagonal_copy"))
def _diagonal(ctx: LoweringContext, x: Value, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Value:
    """Axes ``dim1, dim2`` moved last and flattened: the diagonal is a strided slice."""
    rank = x.type.rank
    d1, d2 = dim1 % rank, dim2 % rank
    order = [a for a in range(rank) if a not in (d1, d2)] + [d1, d2]
    moved = ctx.op("permute", x, dims=tuple(order)) if order != list(range(rank)) else x
    n, m = int(x.shape[d1]), int(x.shape[d2])
    lead = tuple(int(moved.shape[a]) for a in range(rank - 2))
    length = int(ctx.out.shape[-1])
    flat = ctx.reshape(moved, (*lead, n * m))
    if length == 0:
        return ctx.op("slice", flat, dim=-1, start=0, end=0)
    start = offset if offset >= 0 else -offset * m
    diag = ctx.op("slice", flat, dim=-1, start=start, end=start + (length - 1) * (m + 1) + 1, step=m + 1)
    return diag


def _slice_bounds(size: int, start: int | None, end: int | None, step: int) -> range:
    return range(size)[slice(start, end, step)]


@lowers(aten.slice_scatter.default)
def _slice_scatter(ctx: LoweringContext, x: Value, src: Value, dim: int = 0, start: int | None = None,
                   end: int | None = None, step: int = 1) -> Value:
    dim = _axis(x, dim)
    size = int(x.shape[dim])
    covered = _slice_bounds(size, start, end, step)
    src = ctx.cast(src, x.dtype)
    if len(covered) == 0:
        return x
    if step == 1:
        lo, hi = covered.start, covered.stop
        parts = ([ctx.op("slice", x, dim=dim, start=0, end=lo)] if lo > 0 else []) + [src] + \
                ([ctx.op("slice", x, dim=dim, start=hi, end=size)] if hi < size else [])
        return parts[0] if len(parts) == 1 else ctx.op("cat", *parts, dim=dim)
    index = ctx.const(np.asarray(list(covered), np.int64), DType.int64)
    return ctx.op("index_put", x, src, index, dims=(dim,))


@lowers(aten.select_scatter.default)
def _select_scatter(ctx: LoweringContext, x: Value, src: Value, dim: int, index: int) -> Value:
    dim = _axis(x, dim)
    i = int(index) % int(x.shape[dim])
    row = ctx.reshape(ctx.cast(src, x.dtype), (*x.shape[:dim], 1, *x.shape[dim + 1:]))
    return _slice_scatter(ctx, x, row, dim, i, i + 1, 1)


# ------------------------------------------------------------------------ roll, unfold
def roll_axis(ctx: LoweringContext, x: Value, shift: int, dim: int) -> Value:
    """``x`` rolled by ``shift`` along ``dim``: the last ``shift`` entries, then the rest."""
    n = int(x.shape[dim])
    s = shift % n if n else 0
    if s == 0:
        return x
    tail = ctx.op("slice", x, dim=dim, start=n - s, end=n)
    head = ctx.op("slice", x, dim=dim, start=0, end=n - s)
    return ctx.op("cat", tail, head, dim=dim)


@lowers(aten.roll.default, keep=True)
def _roll(ctx: LoweringContext, x: Value, shifts: Sequence[int], dims: Sequence[int] = ()) -> Value:
    shifts = [int(s) for s in shifts]
    if not dims:
        flat = ctx.reshape(x, (int(np.prod(x.shape)),))
        return ctx.reshape(roll_axis(ctx, flat, sum(shifts), 0), tuple(x.shape))
    for s, d in zip(shifts, dims):
        x = roll_axis(ctx, x, s, _axis(x, d))
    return x


@lowers(aten.unfold.default, keep=True)
@lowers(*optional_ops("unfold_copy"))
def _unfold(ctx: LoweringContext, x: Value, dimension: int, size: int, step: int) -> Value:
    """Windows as one ``index_select`` of the window positions, the window axis moved last."""
    if x.type.rank == 0:
        return ctx.reshape(x, tuple(ctx.out.shape))
    d = _axis(x, dimension)
    n = int(x.shape[d])
    windows = (n - size) // step + 1
    positions = (np.arange(windows)[:, None] * step + np.arange(size)[None, :]).reshape(-1)
    picked = ctx.op("index_select", x, ctx.const(positions.astype(np.int64), DType.int64), dim=d)
    split = ctx.reshape(picked, (*x.shape[:d], windows, size, *x.shape[d + 1:]))
    rank = split.type.rank
    order = [a for a in range(rank) if a != d + 1] + [d + 1]
    return ctx.op("permute", split, dims=tuple(order)) if d + 1 != rank - 1 else split


# ---------------------------------------------------------------------------- search
def _sorter_check(node: torch.fx.Node, seq: Any, values: Any, out_int32: bool = False,
                  right: bool = False, side: str | None = None, sorter: Any = None) -> str | None:
    if side is not None and right and side == "left":
        return "searchsorted got side='left' with right=True"
    return None


@lowers(aten.searchsorted.Tensor, aten.searchsorted.Scalar, check=_sorter_check)
def _searchsorted(ctx: LoweringContext, seq: Value, values: Any, out_int32: bool = False,
                  right: bool = False, side: str | None = None, sorter: Any = None) -> Value:
    if not isinstance(values, Value):
        values = ctx.scalar(values, seq.dtype)
    right = bool(right) or side == "right"
    if sorter is not None:  # positions in sorted order: search the sequence permuted by sorter
        seq = ctx.op("gather", seq, ctx.cast(sorter, DType.int64), dim=seq.type.rank - 1)
    return ctx.op("searchsorted", seq, values, right=right, out_int32=bool(out_int32))


@lowers(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(ctx: LoweringContext, values: Any, boundaries: Value, out_int32: bool = False,
               right: bool = False) -> Value:
    if not isinstance(values, Value):
        values = ctx.scalar(values, boundaries.dtype)
    return ctx.op("searchsorted", boundaries, values, right=bool(right), out_int32=bool(out_int32))


# ------------------------------------------------------------------ data-dependent shapes
def _refuse(what: str):
    def check(node: torch.fx.Node, *_: Any) -> str:
        return f"{what} has a data-dependent result shape; " + _DATA_DEPENDENT

    def lower(ctx: LoweringContext, *_: Any) -> Value:  # never reached: check refuses
        raise AssertionError(what)

    return check, lower


for _name, _what in (("nonzero", "nonzero"), ("masked_select", "masked_select (x[mask])"),
                     ("argwhere", "argwhere")):
    _check, _lower = _refuse(_what)
    lowers(*optional_ops(_name), check=_check)(_lower)


# --------------------------------------------------- ops the export IR keeps composite
@lowers(aten.rot90.default, keep=True)
def _rot90(ctx: LoweringContext, x: Value, k: int = 1, dims: Sequence[int] = (0, 1)) -> Value:
    """``k`` quarter turns from ``dims[0]`` towards ``dims[1]``: flips and one transpose."""
    a, b = (d % x.type.rank for d in dims)
    k %= 4
    swap = list(range(x.type.rank))
    swap[a], swap[b] = swap[b], swap[a]
    if k == 0:
        return x
    if k == 2:
        return ctx.op("flip", x, dims=(a, b))
    if k == 1:
        return ctx.op("permute", ctx.op("flip", x, dims=(b,)), dims=tuple(swap))
    return ctx.op("flip", ctx.op("permute", x, dims=tuple(swap)), dims=(b,))


def _embed_last(ctx: LoweringContext, v: Value, offset: int) -> Value:
    """``[.., n] -> [.., N, N]`` (``N = n + |offset|``) with ``v`` on diagonal ``offset``."""
    n = int(v.shape[-1])
    size = n + abs(offset)
    lead = tuple(int(d) for d in v.shape[:-1])
    grown = ctx.op("pad", v, pads=(0, abs(offset))) if offset else v
    rows = np.arange(size).reshape(size, 1)
    cols = np.arange(size).reshape(1, size)
    mask = ctx.const(cols - rows == offset, DType.bool)
    # offset >= 0: row i holds v[i]; offset < 0: column j holds v[j]
    spread = ctx.reshape(grown, (*lead, size, 1) if offset >= 0 else (*lead, 1, size))
    return ctx.op("where", mask, spread, ctx.const(0, v.dtype))


@lowers(aten.diag.default, keep=True)
def _diag(ctx: LoweringContext, x: Value, diagonal: int = 0) -> Value:
    if x.type.rank == 1:
        return _embed_last(ctx, x, int(diagonal))
    return _diagonal(ctx, x, int(diagonal), 0, 1)


@lowers(aten.diag_embed.default, keep=True)
def _diag_embed(ctx: LoweringContext, x: Value, offset: int = 0, dim1: int = -2, dim2: int = -1) -> Value:
    out = _embed_last(ctx, x, int(offset))  # the new axes are the last two
    rank = out.type.rank
    d1, d2 = dim1 % rank, dim2 % rank
    rest = iter(range(rank - 2))
    order = [rank - 2 if a == d1 else rank - 1 if a == d2 else next(rest) for a in range(rank)]
    return out if order == list(range(rank)) else ctx.op("permute", out, dims=tuple(order))


@lowers(aten.repeat_interleave.self_int)
def _repeat_interleave(ctx: LoweringContext, x: Value, repeats: int, dim: int | None = None,
                       output_size: int | None = None) -> Value:
    if dim is None:
        x, dim = ctx.reshape(x, (int(np.prod(x.shape)),)), 0
    dim = _axis(x, dim)
    shape = tuple(int(d) for d in x.shape)
    spread = ctx.reshape(x, (*shape[:dim + 1], 1, *shape[dim + 1:]))
    spread = ctx.op("expand", spread, shape=(*shape[:dim + 1], int(repeats), *shape[dim + 1:]))
    return ctx.reshape(spread, tuple(ctx.out.shape))


@lowers(aten.take_along_dim.default, keep=True)
def _take_along_dim(ctx: LoweringContext, x: Value, indices: Value, dim: int | None = None) -> Value:
    if dim is None:
        flat = ctx.reshape(x, (int(np.prod(x.shape)),))
        return ctx.op("gather", flat, ctx.reshape(indices, (int(np.prod(indices.shape)),)), dim=0)
    dim = _axis(x, dim)
    out = tuple(int(d) for d in ctx.out.shape)
    x_shape = tuple(out[a] if a != dim else int(x.shape[a]) for a in range(len(out)))
    i_shape = tuple(out[a] if a != dim else int(indices.shape[a]) for a in range(len(out)))

    def grown(v: Value, shape: tuple) -> Value:
        v = ctx.reshape(v, (1,) * (len(shape) - v.type.rank) + tuple(v.shape))
        return v if tuple(v.shape) == shape else ctx.op("expand", v, shape=shape)

    return ctx.op("gather", grown(x, x_shape), grown(indices, i_shape), dim=dim)
