"""ATen -> kiln rules for linear algebra, convolution, pooling, upsampling and embedding.

See :mod:`kiln.frontends.torch.aten` for how rules are declared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, Value

from .aten import (
    LoweringContext,
    aten,
    lowers,
    meta,
    optional_ops,
)


def _ints(value: int | Sequence[int], n: int, default: Sequence[int] | None = None) -> tuple[int, ...]:
    """An ATen ``int[n]`` argument as exactly ``n`` ints (a single int or 1-list repeats)."""
    if isinstance(value, int):
        return (value,) * n
    value = tuple(int(v) for v in value)
    if not value and default is not None:
        return tuple(default)
    if len(value) == 1:
        return value * n
    return value


# -------------------------------------------------------------------- linalg
@lowers(aten.matmul.default, keep=True, fresh=True)
@lowers(aten.mm.default, aten.bmm.default, aten.dot.default, fresh=True)
def _matmul(ctx: LoweringContext, a: Value, b: Value) -> Value:
    return ctx.op("matmul", a, b)


def _transpose_last2(ctx: LoweringContext, w: Value) -> Value:
    if w.type.rank < 2:
        return w
    dims = list(range(w.type.rank))
    dims[-2], dims[-1] = dims[-1], dims[-2]
    return ctx.op("permute", w, dims=tuple(dims))


def _scale(ctx: LoweringContext, x: Value, factor: Any) -> Value:
    if factor == 1:
        return x
    return ctx.op("mul", x, ctx.scalar(factor, x.dtype))


@lowers(aten.addmm.default, aten.baddbmm.default, fresh=True)
def _addmm(ctx: LoweringContext, bias: Value, a: Value, b: Value, beta: Any = 1,
           alpha: Any = 1) -> Value:
    product = _scale(ctx, ctx.op("matmul", a, b), alpha)
    if beta == 0:  # torch ignores the bias entirely (even NaNs) when beta is 0
        return product
    return ctx.op("add", _scale(ctx, bias, beta), product)


@lowers(aten.linear.default, keep=True, fresh=True)
def _linear(ctx: LoweringContext, x: Value, weight: Value, bias: Value | None = None) -> Value:
    y = ctx.op("matmul", x, _transpose_last2(ctx, weight))
    return y if bias is None else ctx.op("add", y, bias)


# ---------------------------------------------------------------- convolution
def _conv_check(node: torch.fx.Node, x: Any, w: Any, *args: Any) -> str | None:
    rank, wrank = meta(x).dim(), meta(w).dim()
    if wrank not in (3, 4, 5) or rank not in (wrank, wrank - 1):
        return (f"a {wrank - 2}-d convolution needs a {wrank - 1}-d (unbatched) or {wrank}-d input, "
                f"got {list(meta(x).shape)} with weight {list(meta(w).shape)}")
    return None


_PADDING_MODES = tuple(optional_ops("conv1d.padding", "conv2d.padding", "conv3d.padding"))


def _unbatched(ctx: LoweringContext, x: Value, spatial: int, build: Any) -> Value:
    """``build(x)`` on an ``(N, C, *spatial)`` input, adding and removing a batch dim when
    ``x`` is unbatched ``(C, *spatial)``."""
    if x.type.rank == spatial + 2:
        return build(x)
    y = build(ctx.reshape(x, (1, *x.shape)))
    return ctx.reshape(y, y.shape[1:])


@lowers(aten.convolution.default, check=_conv_check, fresh=True)
def _convolution(ctx: LoweringContext, x: Value, w: Value, bias: Value | None, stride: Any,
                 padding: Any, dilation: Any, transposed: bool, output_padding: Any,
                 groups: int) -> Value:
    if transposed:
        return _conv_transpose(ctx, x, w, bias, stride, padding, output_padding, groups, dilation)
    return _conv(ctx, x, w, bias, stride, padding, dilation, groups)


@lowers(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, check=_conv_check, fresh=True)
def _convnd(ctx: LoweringContext, x: Value, w: Value, bias: Value | None = None,
            stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Value:
    return _conv(ctx, x, w, bias, stride, padding, dilation, groups)


@lowers(*_PADDING_MODES, check=_conv_check, fresh=True)
def _convnd_padding_mode(ctx: LoweringContext, x: Value, w: Value, bias: Value | None = None,
                         stride: Any = 1, padding: str = "valid", dilation: Any = 1,
                         groups: int = 1) -> Value:
    """``padding='valid'`` is no padding; ``'same'`` (stride 1, as torch requires) pads
    ``dilation * (k - 1)`` per axis, the odd element after (as torch does), with an explicit
    pad when it is uneven."""
    n = w.type.rank - 2
    if padding == "valid":
        return _conv(ctx, x, w, bias, stride, 0, dilation, groups)
    dil = _ints(dilation, n)
    total = [d * (k - 1) for d, k in zip(dil, w.shape[2:])]
    before = [t // 2 for t in total]
    if all(t % 2 == 0 for t in total):
        return _conv(ctx, x, w, bias, stride, before, dilation, groups)
    pads: list[int] = []
    for t, b in reversed(list(zip(total, before))):  # torch's pad order: last axis first
        pads += [0, t % 2]
    x = ctx.op("pad", x, pads=tuple(pads))
    return _conv(ctx, x, w, bias, stride, before, dilation, groups)


def _conv(ctx: LoweringContext, x: Value, w: Value, bias: Value | None, stride: Any,
          padding: Any, dilation: Any, groups: int) -> Value:
    n = w.type.rank - 2
    attrs = {"stride": _ints(stride, n), "padding": _ints(padding, n),
                 "dilation": _ints(dilation, n), "groups": int(groups)}
    inputs = (w,) if bias is None else (w, bias)
    return _unbatched(ctx, x, n, lambda xb: ctx.op("conv", xb, *inputs, **attrs))


@lowers(*optional_ops("conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input"),
        check=_conv_check, fresh=True)
def _conv_transposend(ctx: LoweringContext, x: Value, w: Value, bias: Value | None = None,
                      stride: Any = 1, padding: Any = 0, output_padding: Any = 0, groups: int = 1,
                      dilation: Any = 1) -> Value:
    return _conv_transpose(ctx, x, w, bias, stride, padding, output_padding, groups, dilation)


def _conv_transpose(ctx: LoweringContext, x: Value, w: Value, bias: Value | None, stride: Any,
                    padding: Any, output_padding: Any, groups: int, dilation: Any) -> Value:
    n = w.type.rank - 2
    attrs = {"stride": _ints(stride, n), "padding": _ints(padding, n), "dilation": _ints(dilation, n),
                 "groups": int(groups), "output_padding": _ints(output_padding, n)}
    inputs = (w,) if bias is None else (w, bias)
    return _unbatched(ctx, x, n, lambda xb: ctx.op("conv_transpose", xb, *inputs, **attrs))


# --------------------------------------------------------------------- pooling
def _rank_check(x: Any, spatial: int, what: str) -> str | None:
    rank = meta(x).dim()
    if rank not in (spatial + 1, spatial + 2):
        return (f"{spatial}-d {what} expects a {spatial + 1}-d or {spatial + 2}-d input "
                f"(C or N, C, then {spatial} spatial axes), got shape {list(meta(x).shape)}")
    return None


def _spatial_of(node: torch.fx.Node) -> int:
    """1, 2 or 3: the spatial rank an ATen pooling/upsampling overload works on."""
    name = str(node.target)
    return 1 if "1d" in name else 3 if "3d" in name else 2


def _pool_check(node: torch.fx.Node, x: Any, *_: Any) -> str | None:
    return _rank_check(x, _spatial_of(node), "pooling")


def _batched(ctx: LoweringContext, x: Value, kiln_op: str, spatial: int = 2, **attrs: Any) -> Value:
    """Apply an ``(N, C, *spatial)`` op to ``x``, adding and removing a batch dim if x has none."""
    return _unbatched(ctx, x, spatial, lambda xb: ctx.op(kiln_op, xb, **attrs))


def _as_2d(ctx: LoweringContext, x: Value, build: Any) -> Value:
    """A 1-d op as the 2-d one on a unit height axis: ``(.., W)`` -> ``(.., 1, W)`` and back."""
    y = build(ctx.reshape(x, (*x.shape[:-1], 1, x.shape[-1])))
    return ctx.reshape(y, (*y.shape[:-2], y.shape[-1]))


def _max_pool(ctx: LoweringContext, x: Value, n: int, kernel_size: Any, stride: Any,
              padding: Any, dilation: Any, ceil_mode: bool, indices: bool = False) -> Value:
    """The window maxima, or with ``indices`` where they are (``max_pool{n}d_indices``: the
    row-major index into the input's spatial axes, torch's ``return_indices`` result)."""
    kernel = _ints(kernel_size, n)
    op = f"max_pool{n}d_indices" if indices else f"max_pool{n}d"
    return _batched(ctx, x, op, n, kernel=kernel, stride=_ints(stride, n, kernel),
                    padding=_ints(padding, n), dilation=_ints(dilation, n), ceil_mode=bool(ceil_mode))


@lowers(aten.max_pool2d.default, check=_pool_check, keep=True, fresh=True)
@lowers(aten.max_pool3d.default, check=_pool_check, fresh=True)
def _max_poolnd(ctx: LoweringContext, x: Value, kernel_size: Any, stride: Any = (),
                padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> Value:
    n = _spatial_of(ctx.aten_node)
    return _max_pool(ctx, x, n, kernel_size, stride, padding, dilation, ceil_mode)


@lowers(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default, check=_pool_check)
def _max_pool_with_indices(ctx: LoweringContext, x: Value, *args: Any) -> tuple:
    n = _spatial_of(ctx.aten_node)
    return (lambda: _max_pool(ctx, x, n, *args), lambda: _max_pool(ctx, x, n, *args, indices=True))


@lowers(aten.max_pool1d.default, *optional_ops("max_pool1d_with_indices.default"), check=_pool_check)
def _max_pool1d(ctx: LoweringContext, x: Value, kernel_size: Any, stride: Any = (),
                padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> Any:
    kernel = _ints(kernel_size, 1)
    stride = _ints(stride, 1, kernel)

    def pooled(indices: bool) -> Value:  # on a unit height axis the index is the column
        return _as_2d(ctx, x, lambda x2: _max_pool(ctx, x2, 2, (1, *kernel), (1, *stride),
                                                   (0, *_ints(padding, 1)), (1, *_ints(dilation, 1)),
                                                   ceil_mode, indices))

    if "with_indices" in str(ctx.aten_node.target):
        return (lambda: pooled(False), lambda: pooled(True))
    return pooled(False)


def _unpool_check(node: torch.fx.Node, x: Any, indices: Any, output_size: Any, *_: Any) -> str | None:
    n = _spatial_of(node)
    reason = _rank_check(x, n, "max unpooling")
    if reason:
        return reason
    shape, where = tuple(meta(x).shape), tuple(meta(indices).shape)
    if shape != where:
        return (f"max_unpool{n}d: indices {list(where)} must have the shape of the input "
                f"{list(shape)} (the indices result of max_pool{n}d)")
    if len(list(output_size)) != n:
        return f"max_unpool{n}d: output_size {list(output_size)} must have {n} entries"
    return None


@lowers(aten.max_unpool2d.default, aten.max_unpool3d.default, check=_unpool_check)
def _max_unpool(ctx: LoweringContext, x: Value, indices: Value, output_size: Any, *_: Any) -> Value:
    """Zeros of the output size with each input element written at its index (a row-major
    index into the output's spatial axes, per leading ``N, C`` position): a ``scatter``."""
    n = _spatial_of(ctx.aten_node)
    lead = tuple(x.shape[:-n])
    size = tuple(int(s) for s in output_size)
    count = 1
    for d in x.shape[-n:]:
        count *= int(d)
    total = 1
    for d in size:
        total *= d
    src = ctx.reshape(x, (*lead, count))
    where = ctx.reshape(ctx.cast(indices, DType.int64), (*lead, count))
    zeros = ctx.op("full", shape=(*lead, total), value=0.0 if x.dtype.is_floating else 0,
                   dtype=x.dtype)
    out = ctx.op("scatter", zeros, where, src, dim=len(lead))
    return ctx.reshape(out, (*lead, *size))


@lowers(aten.avg_pool2d.default, aten.avg_pool3d.default, check=_pool_check, fresh=True)
def _avg_poolnd(ctx: LoweringContext, x: Value, kernel_size: Any, stride: Any = (),
                padding: Any = 0, ceil_mode: bool = False, count_include_pad: bool = True,
                divisor_override: int | None = None) -> Value:
    n = _spatial_of(ctx.aten_node)
    kernel = _ints(kernel_size, n)
    return _batched(ctx, x, f"avg_pool{n}d", n, kernel=kernel, stride=_ints(stride, n, kernel),
                    padding=_ints(padding, n), ceil_mode=bool(ceil_mode),
                    count_include_pad=bool(count_include_pad), divisor_override=divisor_override)


@lowers(aten.avg_pool1d.default, check=_pool_check)
def _avg_pool1d(ctx: LoweringContext, x: Value, kernel_size: Any, stride: Any = (),
                padding: Any = 0, ceil_mode: bool = False, count_include_pad: bool = True) -> Value:
    kernel = _ints(kernel_size, 1)
    attrs = {"kernel": (1, *kernel), "stride": (1, *_ints(stride, 1, kernel)),
                 "padding": (0, *_ints(padding, 1)), "ceil_mode": bool(ceil_mode),
                 "count_include_pad": bool(count_include_pad)}
    return _as_2d(ctx, x, lambda x2: _batched(ctx, x2, "avg_pool2d", 2, **attrs))


@lowers(aten.adaptive_avg_pool2d.default, check=_pool_check, keep=True)
@lowers(aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d.default,
        check=_pool_check)
def _adaptive_avg_poolnd(ctx: LoweringContext, x: Value, output_size: Any) -> Value:
    n = _spatial_of(ctx.aten_node)
    return _batched(ctx, x, f"adaptive_avg_pool{n}d", n, output_size=tuple(ctx.out.shape[-n:]))


@lowers(aten.adaptive_avg_pool1d.default, check=_pool_check)
def _adaptive_avg_pool1d(ctx: LoweringContext, x: Value, output_size: Any) -> Value:
    size = (1, ctx.out.shape[-1])
    return _as_2d(ctx, x, lambda x2: _batched(ctx, x2, "adaptive_avg_pool2d", 2, output_size=size))


def _adaptive_max_check(node: torch.fx.Node, x: Any, output_size: Any) -> str | None:
    reason = _pool_check(node, x)
    if reason is not None:
        return reason
    n = _spatial_of(node)
    outs = [int(s) for s in meta(node)[0].shape[-n:]]
    if min(outs) < 1 or min(int(s) for s in meta(x).shape[-n:]) < 1:
        return (f"adaptive max pooling of input {list(meta(x).shape)} onto {outs} has empty "
                "windows; give a non-empty input and output size")
    return None


def adaptive_windows(size: int, out: int) -> np.ndarray:
    """``[out, K]``: per output position of one axis, the input positions of its window
    (torch's ``start = floor(i * size / out)``, ``end = ceil((i + 1) * size / out)``), the
    last one repeated up to the longest window's length ``K`` (a repeat never changes a
    maximum, nor which position is first to hold it)."""
    i = np.arange(out, dtype=np.int64)
    start = (i * size) // out
    end = -((-(i + 1) * size) // out)
    length = int((end - start).max())
    return np.minimum(start[:, None] + np.arange(length)[None, :], end[:, None] - 1)


def _adaptive_max_gathered(ctx: LoweringContext, x: Value, n: int, out: Sequence[int]) -> tuple:
    """Adaptive max pooling of windows of any lengths: every window gathered (flattened
    spatial index table), then its first maximum picked (``argmax``) and read back with
    ``gather`` (so the gradient goes to that element only, as in torch)."""
    lead, spatial = tuple(x.shape[:-n]), tuple(int(s) for s in x.shape[-n:])
    table = np.zeros((1,) * (2 * n), dtype=np.int64)
    for axis, (size, o) in enumerate(zip(spatial, out)):
        shape = [1] * (2 * n)
        shape[axis], shape[n + axis] = o, -1
        stride = int(np.prod(spatial[axis + 1:]))
        table = table + adaptive_windows(size, o).reshape(shape) * stride  # [*out, *K]
    count = int(np.prod(table.shape[n:]))
    table = table.reshape(*out, count)
    flat = ctx.reshape(x, (*lead, int(np.prod(spatial))))
    picked = ctx.op("index_select", flat, ctx.const(table.reshape(-1), DType.int64), dim=len(lead))
    picked = ctx.reshape(picked, (*lead, *out, count))
    first = ctx.op("argmax", picked, dim=-1, keepdim=True)

    def values() -> Value:
        return ctx.reshape(ctx.op("gather", picked, first, dim=-1), (*lead, *out))

    def indices() -> Value:
        positions = ctx.op("expand", ctx.const(table, DType.int64), shape=(*lead, *out, count))
        return ctx.reshape(ctx.op("gather", positions, first, dim=-1), (*lead, *out))

    return values, indices


@lowers(*optional_ops("adaptive_max_pool1d.default", "adaptive_max_pool2d.default",
                      "adaptive_max_pool3d.default"), check=_adaptive_max_check)
def _adaptive_max_poolnd(ctx: LoweringContext, x: Value, output_size: Any) -> tuple:
    """Windows that tile the input (``out`` divides ``in``) are a max pool with
    kernel = stride; other sizes use torch's overlapping windows, gathered."""
    n = _spatial_of(ctx.aten_node)
    out = tuple(int(s) for s in ctx.out.shape[-n:])
    if any(i % o for i, o in zip(x.shape[-n:], out)):
        values, indices = _adaptive_max_gathered(ctx, x, n, out)
        return (values, indices)
    kernel = tuple(i // o for i, o in zip(x.shape[-n:], out))

    def pooled(with_indices: bool) -> Value:
        if n == 1:
            return _as_2d(ctx, x, lambda x2: _max_pool(ctx, x2, 2, (1, *kernel), (1, *kernel), 0, 1,
                                                       False, with_indices))
        return _max_pool(ctx, x, n, kernel, kernel, 0, 1, False, with_indices)

    return (lambda: pooled(False), lambda: pooled(True))


# ------------------------------------------------------------------ upsampling
_NEAREST = ("upsample_nearest", "_upsample_nearest_exact")
_INTERP = {"upsample_linear1d": 1, "upsample_bilinear2d": 2, "upsample_bicubic2d": 2,
           "upsample_trilinear3d": 3}


def _upsample_ops(names: Sequence[str], overload: str) -> list[Any]:
    return optional_ops(*(f"{name}.{overload}" for name in names))


_NEAREST_NAMES = [f"{p}{k}d" for p in _NEAREST for k in (1, 2, 3)]


def _upsample_check(node: torch.fx.Node, x: Any, *_: Any) -> str | None:
    return _rank_check(x, _spatial_of(node), "upsampling")


def _scales(rest: Sequence[Any], n: int) -> tuple[float, ...]:
    """torch's scale factors of an upsampling call as ``n`` floats (0 = not given), or ``()``
    when none is: the ``.vec`` overloads pass one list, the others one optional per axis."""
    if len(rest) == 1 and (rest[0] is None or isinstance(rest[0], (list, tuple))):
        values = list(rest[0] or [])
    else:
        values = list(rest)
    values = [0.0 if v is None else float(v) for v in values]
    if not any(v > 0 for v in values):
        return ()
    return tuple(values) if len(values) == n else tuple(values[:1] * n)


def _resample(ctx: LoweringContext, x: Value, kiln_op: str, n: int, scales: tuple[float, ...],
              **attrs: Any) -> Value:
    """Resampling onto the call's output size; 1-d calls run the 2-d op on a unit axis."""
    if n == 1:
        size = (1, ctx.out.shape[-1])
        scales2 = (0.0, *scales) if scales else ()
        return _as_2d(ctx, x, lambda x2: _batched(ctx, x2, kiln_op, 2, output_size=size,
                                                  scales=scales2, **attrs))
    return _batched(ctx, x, kiln_op, n, output_size=tuple(ctx.out.shape[-n:]), scales=scales, **attrs)


# torch.export emits the ``.vec`` overloads (and ``upsample_nearest2d.default``): kept whole
@lowers(*_upsample_ops(_NEAREST_NAMES, "vec"), aten.upsample_nearest2d.default, check=_upsample_check,
        keep=True)
@lowers(*_upsample_ops([n for n in _NEAREST_NAMES if n != "upsample_nearest2d"], "default"),
        check=_upsample_check)
def _upsample_nearest(ctx: LoweringContext, x: Value, output_size: Any, *rest: Any) -> Value:
    n = _spatial_of(ctx.aten_node)
    exact = "exact" in str(ctx.aten_node.target)
    return _resample(ctx, x, f"upsample_nearest{max(n, 2)}d", n, _scales(rest, n), exact=exact)


@lowers(*_upsample_ops(list(_INTERP), "vec"), check=_upsample_check, keep=True)
@lowers(*_upsample_ops(list(_INTERP), "default"), check=_upsample_check)
def _upsample_interp(ctx: LoweringContext, x: Value, output_size: Any, align_corners: bool,
                     *rest: Any) -> Value:
    name = str(ctx.aten_node.target).split(".")[-2]
    n = _INTERP[name]
    kiln_op = "upsample_bilinear2d" if n == 1 else name
    return _resample(ctx, x, kiln_op, n, _scales(rest, n), align_corners=bool(align_corners))


# ------------------------------------------------------- embedding, attention
def _embedding_check(node: torch.fx.Node, weight: Any, indices: Any, padding_idx: int = -1,
                     scale_grad_by_freq: bool = False, sparse: bool = False) -> str | None:
    if sparse:
        return "embedding with sparse=True (sparse gradients) is not supported; use sparse=False"
    return None


@lowers(aten.embedding.default, check=_embedding_check, fresh=True)
def _embedding(ctx: LoweringContext, weight: Value, indices: Value, padding_idx: int = -1,
               scale_grad_by_freq: bool = False, sparse: bool = False) -> Value:
    rows = int(weight.shape[0])
    padding = int(padding_idx)
    if padding < -1:  # F.embedding passes a negative padding_idx already wrapped; be safe
        padding += rows
    return ctx.op("embedding", weight, indices, padding_idx=padding,
                  scale_grad_by_freq=bool(scale_grad_by_freq))
