"""ATen -> kiln rules for layout, indexing and tensor-creation ops.

Views (view/reshape/squeeze/unsqueeze/flatten/expand) take their target shape from the
shape PyTorch computed for the node, so ``-1`` and implicit dims are already resolved.
See :mod:`kiln.compiler.aten` for how rules are declared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir import DType, Value

from .aten import LoweringContext, optional_ops, aten, lowers, meta

_INT64_MAX = 2**63 - 1


# ------------------------------------------------------------------ reshapes
def _to_result_shape(ctx: LoweringContext, x: Value, *_: Any) -> Value:
    return ctx.reshape(x, ctx.out.shape)


lowers(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
       aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim,
       aten.unsqueeze.default, aten.view_as.default,
       *optional_ops("squeeze.dims", "view_copy", "squeeze_copy", "squeeze_copy.dim",
                      "squeeze_copy.dims", "unsqueeze_copy", "_reshape_copy"))(_to_result_shape)


@lowers(aten.expand.default, aten.expand_as.default, *optional_ops("expand_copy"))
def _expand(ctx: LoweringContext, x: Value, *_: Any) -> Value:
    shape = tuple(ctx.out.shape)
    if tuple(x.shape) == shape:
        return x
    return ctx.op("expand", x, shape=shape)


@lowers(aten.permute.default, *optional_ops("permute_copy"))
def _permute(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    dims = tuple(d % max(x.type.rank, 1) for d in dims)
    if dims == tuple(range(x.type.rank)):
        return x
    return ctx.op("permute", x, dims=dims)


@lowers(aten.transpose.int, *optional_ops("transpose_copy.int"))
def _transpose(ctx: LoweringContext, x: Value, dim0: int, dim1: int) -> Value:
    dims = list(range(x.type.rank))
    if dims:
        a, b = dim0 % len(dims), dim1 % len(dims)
        dims[a], dims[b] = dims[b], dims[a]
    return _permute(ctx, x, dims)


@lowers(aten.t.default, *optional_ops("t_copy", "numpy_T"))
def _t(ctx: LoweringContext, x: Value) -> Value:
    return _permute(ctx, x, list(reversed(range(x.type.rank))))


# ------------------------------------------------------------- slices, select
@lowers(aten.slice.Tensor, *optional_ops("slice_copy.Tensor"))
def _slice(ctx: LoweringContext, x: Value, dim: int = 0, start: int | None = None,
           end: int | None = None, step: int = 1) -> Value:
    start = 0 if start is None else int(start)
    end = _INT64_MAX if end is None else int(end)
    if start == 0 and step == 1 and tuple(ctx.out.shape) == tuple(x.shape):
        return x
    return ctx.op("slice", x, dim=dim, start=start, end=end, step=int(step))


@lowers(aten.narrow.default)
def _narrow(ctx: LoweringContext, x: Value, dim: int, start: int, length: int) -> Value:
    if start < 0:
        start += int(x.shape[dim])
    return ctx.op("slice", x, dim=dim, start=start, end=start + length, step=1)


@lowers(aten.select.int, *optional_ops("select_copy.int"))
def _select(ctx: LoweringContext, x: Value, dim: int, index: int) -> Value:
    return ctx.op("select", x, dim=dim, index=int(index))


def _split_pieces(ctx: LoweringContext, x: Value, dim: int) -> tuple:
    """One lazily built slice per result, sized as PyTorch computed them."""
    dim = dim % x.type.rank
    pieces = []
    offset = 0
    for out in ctx.outs:
        size = int(out.shape[dim])
        pieces.append(lambda s=offset, e=offset + size: ctx.op("slice", x, dim=dim, start=s, end=e))
        offset += size
    return tuple(pieces)


@lowers(aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
        aten.unsafe_split_with_sizes.default, *optional_ops("split_with_sizes_copy", "split_copy.Tensor"))
def _split(ctx: LoweringContext, x: Value, split: Any, dim: int = 0) -> tuple:
    return _split_pieces(ctx, x, dim)


@lowers(aten.chunk.default)
def _chunk(ctx: LoweringContext, x: Value, chunks: int, dim: int = 0) -> tuple:
    return _split_pieces(ctx, x, dim)


@lowers(aten.unbind.int, *optional_ops("unbind_copy.int"))
def _unbind(ctx: LoweringContext, x: Value, dim: int = 0) -> tuple:
    return tuple(lambda i=i: ctx.op("select", x, dim=dim, index=i) for i in range(int(x.shape[dim])))


# ---------------------------------------------------------------- joining
@lowers(aten.cat.default, *optional_ops("concat", "concatenate"))
def _cat(ctx: LoweringContext, xs: Sequence[Value], dim: int = 0) -> Value:
    # torch still accepts (and skips) legacy empty 1-d tensors next to tensors of other ranks
    kept = [x for x in xs if not (tuple(x.shape) == (0,) and ctx.out.rank != 1)]
    if len(kept) == 1:
        return ctx.cast(kept[0], ctx.out.dtype)
    return ctx.op("cat", *kept, dim=dim)


@lowers(aten.stack.default)
def _stack(ctx: LoweringContext, xs: Sequence[Value], dim: int = 0) -> Value:
    dim = dim % ctx.out.rank
    parts = [ctx.reshape(x, (*x.shape[:dim], 1, *x.shape[dim:])) for x in xs]
    return parts[0] if len(parts) == 1 else ctx.op("cat", *parts, dim=dim)


# ----------------------------------------------------------------- indexing
@lowers(aten.gather.default)
def _gather(ctx: LoweringContext, x: Value, dim: int, index: Value, *_: Any) -> Value:
    return ctx.op("gather", x, index, dim=dim)


@lowers(aten.index_select.default)
def _index_select(ctx: LoweringContext, x: Value, dim: int, index: Value) -> Value:
    return ctx.op("index_select", x, index, dim=dim)


def _index_check(node: torch.fx.Node, x: Any, indices: Sequence[Any]) -> str | None:
    for idx in indices:
        m = meta(idx)
        if isinstance(m, torch.Tensor) and m.dtype in (torch.bool, torch.uint8):
            return "boolean mask indexing has a data-dependent shape; use torch.where instead"
    return None


@lowers(aten.index.Tensor, aten._unsafe_index.Tensor, check=_index_check)
def _index(ctx: LoweringContext, x: Value, indices: Sequence[Value | None]) -> Value:
    dims = tuple(i for i, idx in enumerate(indices) if idx is not None)
    return ctx.op("index", x, *(idx for idx in indices if idx is not None), dims=dims)


# ---------------------------------------------------------- padding and co.
@lowers(aten.constant_pad_nd.default)
def _constant_pad(ctx: LoweringContext, x: Value, pad: Sequence[int], value: Any = 0) -> Value:
    return ctx.op("pad", x, pads=tuple(int(p) for p in pad), value=float(value))


def _pad_check(node: torch.fx.Node, x: Any, pad: Any, mode: str = "constant", *_: Any) -> str | None:
    if mode != "constant":
        return f"padding mode {mode!r} is not supported (only 'constant')"
    return None


@lowers(aten.pad.default, check=_pad_check)
def _pad(ctx: LoweringContext, x: Value, pad: Sequence[int], mode: str = "constant",
         value: float | None = None) -> Value:
    return _constant_pad(ctx, x, pad, 0.0 if value is None else value)


@lowers(aten.flip.default)
def _flip(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    return ctx.op("flip", x, dims=tuple(dims))


@lowers(aten.repeat.default)
def _repeat(ctx: LoweringContext, x: Value, repeats: Sequence[int]) -> Value:
    return ctx.op("repeat", x, repeats=tuple(int(r) for r in repeats))


@lowers(aten.tril.default, aten.triu.default)
def _triangle(ctx: LoweringContext, x: Value, diagonal: int = 0) -> Value:
    name = "tril" if ctx.node.target is aten.tril.default else "triu"
    return ctx.op(name, x, diagonal=int(diagonal))


@lowers(aten.copy.default)
def _copy(ctx: LoweringContext, dst: Value, src: Value, *_: Any) -> Value:
    """The functional copy: ``src``'s values, broadcast to ``dst``'s shape, in its dtype."""
    src = ctx.cast(src, dst.dtype)
    if tuple(src.shape) == tuple(dst.shape):
        return src
    return ctx.op("expand", src, shape=tuple(dst.shape))


# ------------------------------------------------------------------ creation
def _full_like_result(ctx: LoweringContext, value: Any) -> Value:
    out = ctx.out
    if out.dtype == DType.bool:
        value = bool(value)
    elif out.dtype.is_integer:
        value = int(value)
    else:
        value = float(value)
    return ctx.op("full", shape=tuple(out.shape), value=value, dtype=out.dtype)


@lowers(aten.full.default, aten.full_like.default)
def _full(ctx: LoweringContext, size_or_x: Any, fill_value: Any, *_: Any) -> Value:
    return _full_like_result(ctx, fill_value)


@lowers(aten.new_full.default)
def _new_full(ctx: LoweringContext, x: Value, size: Any, fill_value: Any, *_: Any) -> Value:
    return _full_like_result(ctx, fill_value)


@lowers(aten.fill.Scalar)
def _fill(ctx: LoweringContext, x: Value, value: Any) -> Value:
    return _full_like_result(ctx, value)


def _constant_fill(value: int) -> Any:
    def lower(ctx: LoweringContext, *_: Any) -> Value:
        return _full_like_result(ctx, value)

    return lower


# ``empty`` has unspecified contents; zeros are as good as any.
lowers(aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default,
       aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
       *optional_ops("empty_permuted"))(_constant_fill(0))
lowers(aten.ones.default, aten.ones_like.default, aten.new_ones.default)(_constant_fill(1))


@lowers(aten.scalar_tensor.default)
def _scalar_tensor(ctx: LoweringContext, value: Any, *_: Any) -> Value:
    return ctx.const(value, ctx.out.dtype)


@lowers(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(ctx: LoweringContext, *args: Any) -> Value:
    target = ctx.node.target
    if target is aten.arange.default:
        start, end, step = 0, args[0], 1
    elif target is aten.arange.start:
        start, end, step = args[0], args[1], 1
    else:
        start, end, step = args[0], args[1], args[2]
    return ctx.op("arange", start=start, end=end, step=step, dtype=ctx.out.dtype)
