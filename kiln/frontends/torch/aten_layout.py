"""ATen -> kiln rules for layout, indexing and tensor-creation ops.

Views (view/reshape/squeeze/unsqueeze/flatten/expand) take their target shape from the
shape PyTorch computed for the node, so ``-1`` and implicit dims are already resolved.
See :mod:`kiln.frontends.torch.aten` for how rules are declared.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, Value

from .aten import LoweringContext, aten, lowers, meta, optional_ops
from .symbolic import to_dim

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
    start = 0 if start is None else _from_end(to_dim(start), x.shape[dim])
    end = _INT64_MAX if end is None else _from_end(to_dim(end), x.shape[dim])
    if start == 0 and step == 1 and tuple(ctx.out.shape) == tuple(x.shape):
        return x
    return ctx.op("slice", x, dim=dim, start=start, end=end, step=int(step))


def _from_end(bound: Any, size: Any) -> Any:
    """A symbolic slice bound that is negative for every size (``-seq``) counts from the end:
    kiln's attributes hold sizes, which are never negative."""
    if isinstance(bound, int) or not bound.expr.could_extract_minus_sign():
        return bound
    return bound + size


@lowers(aten.narrow.default)
def _narrow(ctx: LoweringContext, x: Value, dim: int, start: int, length: int) -> Value:
    start, length = to_dim(start), to_dim(length)
    if isinstance(start, int) and start < 0:
        start += x.shape[dim]
    return ctx.op("slice", x, dim=dim, start=start, end=start + length, step=1)


@lowers(aten.select.int, *optional_ops("select_copy.int"))
def _select(ctx: LoweringContext, x: Value, dim: int, index: int) -> Value:
    return ctx.op("select", x, dim=dim, index=to_dim(index))


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
@lowers(aten.cat.default, *optional_ops("concat", "concatenate"), fresh=True)
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
    if x.type.rank == 0:  # a 0-d input reads as 1-d of size 1; the result is 0-d again
        return ctx.reshape(ctx.op("index_select", ctx.reshape(x, (1,)), ctx.reshape(index, (1,)), dim=0), ())
    return ctx.op("index_select", x, index, dim=dim)


def _index_check(node: torch.fx.Node, x: Any, indices: Sequence[Any]) -> str | None:
    for idx in indices:
        m = meta(idx)
        if isinstance(m, torch.Tensor) and m.dtype in (torch.bool, torch.uint8):
            return ("reading x[mask] with a bool mask has a data-dependent shape (the number of "
                    "true elements); kiln compiles static shapes: use torch.where(mask, x, other) "
                    "or x.masked_fill(~mask, value) instead, or leave strict=False so that this "
                    "op runs in PyTorch")
    return None


@lowers(aten.index.Tensor, aten._unsafe_index.Tensor, check=_index_check)
def _index(ctx: LoweringContext, x: Value, indices: Sequence[Value | None]) -> Value:
    dims = tuple(i for i, idx in enumerate(indices) if idx is not None)
    return ctx.op("index", x, *(idx for idx in indices if idx is not None), dims=dims)


# ---------------------------------------------------------- padding and co.
@lowers(aten.constant_pad_nd.default)
def _constant_pad(ctx: LoweringContext, x: Value, pad: Sequence[int], value: Any = 0) -> Value:
    return ctx.op("pad", x, pads=tuple(int(p) for p in pad), value=float(value))


_PAD_MODES = ("constant", "reflect", "replicate", "circular")


def _pad_check(node: torch.fx.Node, x: Any, pad: Any, mode: str = "constant", *_: Any) -> str | None:
    if mode not in _PAD_MODES:
        return f"padding mode {mode!r} is not supported (kiln has {', '.join(_PAD_MODES)})"
    if mode == "constant":
        return None
    shape = tuple(meta(x).shape)
    if len(pad) % 2 or len(pad) // 2 > min(3, len(shape)):
        return (f"{mode} padding {list(pad)} of a {len(shape)}-d tensor: give (before, after) "
                "pairs for at most 3 trailing axes")
    for k in range(len(pad) // 2):
        size = shape[len(shape) - 1 - k]
        before, after = int(pad[2 * k]), int(pad[2 * k + 1])
        if mode == "reflect" and max(before, after) >= size:
            return (f"reflect padding ({before}, {after}) of axis {len(shape) - 1 - k} of size {size} "
                    "must be smaller than the axis")
        if mode == "circular" and max(before, after) > size:
            return (f"circular padding ({before}, {after}) of axis {len(shape) - 1 - k} of size "
                    f"{size} may not exceed the axis")
        if mode == "replicate" and size == 0:
            return f"replicate padding of an empty axis {len(shape) - 1 - k}"
    return None


def _pad_axis(ctx: LoweringContext, x: Value, axis: int, before: int, after: int, mode: str) -> Value:
    """One axis padded by ``mode``; negative amounts crop (first, as torch does)."""
    n = int(x.shape[axis])
    if before < 0 or after < 0:
        lo, hi = max(-before, 0), n - max(-after, 0)
        x = ctx.op("slice", x, dim=axis, start=lo, end=hi)
        if mode != "circular":
            n = hi - lo
    if mode == "circular":  # wrapped parts come from the uncropped axis, as in torch
        pieces_src = n
    parts = []
    if before > 0:
        if mode == "reflect":
            parts.append(ctx.op("flip", ctx.op("slice", x, dim=axis, start=1, end=before + 1), dims=(axis,)))
        elif mode == "replicate":
            edge = ctx.op("slice", x, dim=axis, start=0, end=1)
            shape = list(x.shape)
            shape[axis] = before
            parts.append(ctx.op("expand", edge, shape=tuple(shape)))
        else:
            parts.append(_slice_of(ctx, x, axis, pieces_src, before, after, True))
    parts.append(x)
    if after > 0:
        m = int(x.shape[axis])
        if mode == "reflect":
            parts.append(ctx.op("flip", ctx.op("slice", x, dim=axis, start=m - 1 - after, end=m - 1),
                                dims=(axis,)))
        elif mode == "replicate":
            edge = ctx.op("slice", x, dim=axis, start=m - 1, end=m)
            shape = list(x.shape)
            shape[axis] = after
            parts.append(ctx.op("expand", edge, shape=tuple(shape)))
        else:
            parts.append(_slice_of(ctx, x, axis, pieces_src, before, after, False))
    return parts[0] if len(parts) == 1 else ctx.op("cat", *parts, dim=axis)


def _slice_of(ctx: LoweringContext, x: Value, axis: int, n: int, before: int, after: int,
              leading: bool) -> Value:
    """Circular padding's wrapped part, read from the (possibly cropped) axis ``x``."""
    m = int(x.shape[axis])
    if leading:
        return ctx.op("slice", x, dim=axis, start=m - before, end=m)
    return ctx.op("slice", x, dim=axis, start=0, end=after)


def _mode_pad(ctx: LoweringContext, x: Value, pad: Sequence[int], mode: str) -> Value:
    rank = x.type.rank
    for k in range(len(pad) // 2):
        x = _pad_axis(ctx, x, rank - 1 - k, int(pad[2 * k]), int(pad[2 * k + 1]), mode)
    return x


@lowers(aten.pad.default, check=_pad_check)
def _pad(ctx: LoweringContext, x: Value, pad: Sequence[int], mode: str = "constant",
         value: float | None = None) -> Value:
    if mode != "constant":
        return _mode_pad(ctx, x, pad, mode)
    return _constant_pad(ctx, x, pad, 0.0 if value is None else value)


def _fixed_mode_pad(mode: str):
    def check(node: torch.fx.Node, x: Any, pad: Any) -> str | None:
        return _pad_check(node, x, pad, mode)

    def lower(ctx: LoweringContext, x: Value, pad: Sequence[int]) -> Value:
        return _mode_pad(ctx, x, pad, mode)

    return check, lower


for _mode, _names in (("reflect", ("reflection_pad1d", "reflection_pad2d", "reflection_pad3d")),
                      ("replicate", ("replication_pad1d", "replication_pad2d", "replication_pad3d")),
                      ("circular", ("_pad_circular",))):
    _check, _lower = _fixed_mode_pad(_mode)
    lowers(*optional_ops(*_names), check=_check)(_lower)


@lowers(aten.flip.default)
def _flip(ctx: LoweringContext, x: Value, dims: Sequence[int]) -> Value:
    return ctx.op("flip", x, dims=tuple(dims))


@lowers(aten.repeat.default)
def _repeat(ctx: LoweringContext, x: Value, repeats: Sequence[int]) -> Value:
    return ctx.op("repeat", x, repeats=tuple(int(r) for r in repeats))


@lowers(aten.tril.default, aten.triu.default, keep=True)
def _triangle(ctx: LoweringContext, x: Value, diagonal: int = 0) -> Value:
    name = "tril" if ctx.aten_node.target is aten.tril.default else "triu"
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
    target = ctx.aten_node.target
    if target is aten.arange.default:
        start, end, step = 0, args[0], 1
    elif target is aten.arange.start:
        start, end, step = args[0], args[1], 1
    else:
        start, end, step = args[0], args[1], args[2]
    return ctx.op("arange", start=start, end=end, step=step, dtype=ctx.out.dtype)


# ------------------------------------------------------------------ as_strided
# ``as_strided(x, size, stride, offset)`` addresses ``x``'s storage, not its logical
# elements.  kiln values have no storage, so the rule reads the layout torch recorded for
# ``x`` (its strides and storage offset, ``meta["val"]``) and maps every storage position the
# result reads back to the logical element of ``x`` stored there.  That is possible when no
# two elements of ``x`` share a position (no stride-0 / overlapping layout) and the result
# reads only positions ``x`` holds.  The mapped index tensor is a constant; when it is
# affine with nested strides (a reshape, permute, slice or broadcast of ``x``) the result is
# built from those view ops, otherwise it is a gather (``index``) from the flattened input.
def _positions(shape: Sequence[int], stride: Sequence[int], offset: int) -> Any:
    """The storage position of every element of a strided layout, in row-major order."""
    pos = np.full(tuple(int(n) for n in shape), int(offset), dtype=np.int64)
    for axis, (n, s) in enumerate(zip(shape, stride)):
        view = [1] * len(shape)
        view[axis] = int(n)
        pos = pos + (np.arange(int(n), dtype=np.int64) * int(s)).reshape(view)
    return pos


def _strided_index(x: Any, size: Sequence[int], stride: Sequence[int],
                   offset: int | None) -> tuple[Any, str | None]:
    """``(index, None)``: for every element of ``as_strided(x, size, stride, offset)``, the
    row-major logical index of the element of ``x`` it reads; or ``(None, reason)``."""
    t = meta(x)
    if not isinstance(t, torch.Tensor):
        return None, "its input has no recorded layout (meta['val'])"
    offset = t.storage_offset() if offset is None else int(offset)
    size = [int(n) for n in size]
    stride = [int(s) for s in stride]
    if len(size) != len(stride):
        return None, f"size {size} and stride {stride} have different lengths"
    if any(n < 0 for n in size) or any(s < 0 for s in stride) or offset < 0:
        return None, f"size {size}, stride {stride} or offset {offset} is negative"
    have = _positions(t.shape, t.stride(), t.storage_offset()).reshape(-1)
    order = np.argsort(have, kind="stable")
    sorted_pos = have[order]
    if sorted_pos.size > 1 and np.any(sorted_pos[1:] == sorted_pos[:-1]):
        return None, (f"its input {list(t.shape)} has an overlapping layout (strides "
                      f"{list(t.stride())}: several elements share storage), so storage positions "
                      "do not name elements; make the input contiguous first (.contiguous())")
    want = _positions(size, stride, offset)
    if want.size == 0:
        return want, None
    loc = np.searchsorted(sorted_pos, want.reshape(-1))
    inside = loc < sorted_pos.size
    hit = np.zeros(want.size, dtype=bool)
    hit[inside] = sorted_pos[loc[inside]] == want.reshape(-1)[inside]
    if not hit.all():
        bad = int(want.reshape(-1)[~hit][0])
        return None, (f"it reads storage position {bad}, which holds no element of its input "
                      f"{list(t.shape)} (strides {list(t.stride())}, storage offset "
                      f"{t.storage_offset()}): the result depends on memory outside the tensor")
    return order[loc].reshape(want.shape), None


def _as_strided_check(node: torch.fx.Node, x: Any, size: Any, stride: Any,
                      offset: Any = None) -> str | None:
    _, reason = _strided_index(x, size, stride, offset)
    if reason:
        return (f"as_strided(size={list(size)}, stride={list(stride)}, storage_offset={offset}) "
                f"cannot be mapped onto kiln's logical tensors: {reason}")
    return None


def _affine_view(ctx: LoweringContext, flat: Value, index: Any) -> Value | None:
    """``flat[index]`` built from slice/reshape/permute/expand, when ``index`` is affine with
    non-negative nested strides (``index = base + sum(i_k * t_k)``); ``None`` otherwise."""
    shape = tuple(index.shape)
    base = int(index.reshape(-1)[0])
    steps = {}
    expect = np.full(shape, base, dtype=np.int64)
    for k, n in enumerate(shape):
        if n > 1:
            unit = [0] * len(shape)
            unit[k] = 1
            steps[k] = int(index[tuple(unit)]) - base
            view = [1] * len(shape)
            view[k] = n
            expect = expect + (np.arange(n, dtype=np.int64) * steps[k]).reshape(view)
    if not np.array_equal(expect, index) or any(t < 0 for t in steps.values()):
        return None
    live = sorted((k for k, t in steps.items() if t > 0), key=lambda k: -steps[k])
    for outer, inner in itertools.pairwise(live):
        if steps[outer] % steps[inner] or shape[inner] * steps[inner] > steps[outer]:
            return None
    total = int(flat.shape[0])
    if not live:
        y = ctx.op("slice", flat, dim=0, start=base, end=base + 1, step=1)
    else:
        length = shape[live[0]] * steps[live[0]]
        if base + length > total:  # the last block's unread tail runs past the end
            flat = ctx.op("pad", flat, pads=(0, base + length - total), value=0.0)
            total = base + length
        y = flat
        if base or length != total:
            y = ctx.op("slice", flat, dim=0, start=base, end=base + length, step=1)
        blocks = [shape[live[0]]] + [steps[a] // steps[b] for a, b in itertools.pairwise(live)]
        blocks.append(steps[live[-1]])
        y = ctx.reshape(y, blocks)
        for axis, k in enumerate(live[1:], start=1):
            if blocks[axis] != shape[k]:
                y = ctx.op("slice", y, dim=axis, start=0, end=shape[k], step=1)
        if blocks[-1] != 1:
            y = ctx.op("slice", y, dim=len(blocks) - 1, start=0, end=1, step=1)
        y = ctx.reshape(y, [shape[k] for k in live])
        dims = [live.index(k) for k in sorted(live)]
        if dims != list(range(len(dims))):
            y = ctx.op("permute", y, dims=tuple(dims))
    y = ctx.reshape(y, [shape[k] if k in live else 1 for k in range(len(shape))])
    if tuple(y.shape) != shape:
        y = ctx.op("expand", y, shape=shape)
    return y


@lowers(aten.as_strided.default, *optional_ops("as_strided_copy"), check=_as_strided_check)
def _as_strided(ctx: LoweringContext, x: Value, size: Any, stride: Any, offset: Any = None) -> Value:
    index, _ = _strided_index(ctx.aten_node.args[0], size, stride, offset)
    out = ctx.out
    if index.size == 0:
        return ctx.op("full", shape=tuple(out.shape), value=0, dtype=out.dtype)
    flat = ctx.reshape(x, (int(np.prod(x.shape, dtype=np.int64)),))
    view = _affine_view(ctx, flat, index)
    if view is not None:
        return view
    return ctx.op("index", flat, ctx.const(index, DType.int64), dims=(0,))


def _as_strided_scatter_check(node: torch.fx.Node, x: Any, src: Any, size: Any, stride: Any,
                              offset: Any = None) -> str | None:
    index, reason = _strided_index(x, size, stride, offset)
    if reason is None and index.size and len(set(index.reshape(-1).tolist())) != index.size:
        reason = (f"the written view (size {list(size)}, stride {list(stride)}) overlaps itself, "
                  "so which source element lands where is undefined")
    if reason:
        return (f"as_strided_scatter(size={list(size)}, stride={list(stride)}, "
                f"storage_offset={offset}) cannot be mapped onto kiln's logical tensors: {reason}")
    return None


@lowers(aten.as_strided_scatter.default, check=_as_strided_scatter_check)
def _as_strided_scatter(ctx: LoweringContext, x: Value, src: Value, size: Any, stride: Any,
                        offset: Any = None) -> Value:
    """``x`` with the elements ``as_strided(x, size, stride, offset)`` reads set to ``src``."""
    index, _ = _strided_index(ctx.aten_node.args[0], size, stride, offset)
    src = ctx.cast(src, x.dtype)
    if index.size == 0:
        return x
    flat_index = index.reshape(-1)
    total = int(np.prod(x.shape, dtype=np.int64))
    values = ctx.reshape(src, (index.size,))
    if np.array_equal(flat_index, np.arange(total)):
        return ctx.reshape(values, tuple(x.shape))
    flat = ctx.reshape(x, (total,))
    out = ctx.op("index_put", flat, values, ctx.const(flat_index, DType.int64), dims=(0,))
    return ctx.reshape(out, tuple(x.shape))
