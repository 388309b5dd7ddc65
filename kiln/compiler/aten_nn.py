"""ATen -> kiln rules for linear algebra, convolution, pooling, upsampling and embedding.

See :mod:`kiln.compiler.aten` for how rules are declared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir import Value

from .aten import LoweringContext, aten, lowers, meta, only_first_result_used


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
@lowers(aten.mm.default, aten.bmm.default, aten.matmul.default, aten.dot.default)
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


@lowers(aten.addmm.default, aten.baddbmm.default)
def _addmm(ctx: LoweringContext, bias: Value, a: Value, b: Value, beta: Any = 1,
           alpha: Any = 1) -> Value:
    product = _scale(ctx, ctx.op("matmul", a, b), alpha)
    if beta == 0:  # torch ignores the bias entirely (even NaNs) when beta is 0
        return product
    return ctx.op("add", _scale(ctx, bias, beta), product)


@lowers(aten.linear.default)
def _linear(ctx: LoweringContext, x: Value, weight: Value, bias: Value | None = None) -> Value:
    y = ctx.op("matmul", x, _transpose_last2(ctx, weight))
    return y if bias is None else ctx.op("add", y, bias)


# ---------------------------------------------------------------- convolution
def _conv_check(node: torch.fx.Node, x: Any, w: Any, *args: Any) -> str | None:
    if node.target is aten.convolution.default and args[4]:
        return "transposed convolution is not supported yet"
    if node.target is aten.convolution.default and any(args[5]):
        return "convolution with output_padding is not supported"
    if meta(x).dim() != meta(w).dim():
        return "unbatched convolution input is not supported; add a batch dimension"
    return None


@lowers(aten.convolution.default, check=_conv_check)
def _convolution(ctx: LoweringContext, x: Value, w: Value, bias: Value | None, stride: Any,
                 padding: Any, dilation: Any, transposed: bool, output_padding: Any,
                 groups: int) -> Value:
    return _conv(ctx, x, w, bias, stride, padding, dilation, groups)


@lowers(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, check=_conv_check)
def _convnd(ctx: LoweringContext, x: Value, w: Value, bias: Value | None = None,
            stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1) -> Value:
    return _conv(ctx, x, w, bias, stride, padding, dilation, groups)


def _conv(ctx: LoweringContext, x: Value, w: Value, bias: Value | None, stride: Any,
          padding: Any, dilation: Any, groups: int) -> Value:
    n = w.type.rank - 2
    attrs = dict(stride=_ints(stride, n), padding=_ints(padding, n),
                 dilation=_ints(dilation, n), groups=int(groups))
    inputs = (x, w) if bias is None else (x, w, bias)
    return ctx.op("conv", *inputs, **attrs)


# --------------------------------------------------------------------- pooling
def _pool_check(node: torch.fx.Node, x: Any, *_: Any) -> str | None:
    if meta(x).dim() not in (3, 4):
        return f"2-d pooling expects a 3-d or 4-d input, got rank {meta(x).dim()}"
    if node.target is aten.max_pool2d_with_indices.default:
        return only_first_result_used(node)
    return None


def _batched(ctx: LoweringContext, x: Value, kiln_op: str, **attrs: Any) -> Value:
    """Apply a 4-d (N, C, H, W) op to ``x``, adding and removing a batch dim if x is 3-d."""
    if x.type.rank == 4:
        return ctx.op(kiln_op, x, **attrs)
    y = ctx.op(kiln_op, ctx.reshape(x, (1, *x.shape)), **attrs)
    return ctx.reshape(y, y.shape[1:])


@lowers(aten.max_pool2d.default, check=_pool_check)
def _max_pool2d(ctx: LoweringContext, x: Value, kernel_size: Any, stride: Any = (),
                padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> Value:
    kernel = _ints(kernel_size, 2)
    return _batched(ctx, x, "max_pool2d", kernel=kernel, stride=_ints(stride, 2, kernel),
                    padding=_ints(padding, 2), dilation=_ints(dilation, 2), ceil_mode=ceil_mode)


@lowers(aten.max_pool2d_with_indices.default, check=_pool_check)
def _max_pool2d_with_indices(ctx: LoweringContext, x: Value, *args: Any) -> tuple:
    return (_max_pool2d(ctx, x, *args),)


@lowers(aten.avg_pool2d.default, check=_pool_check)
def _avg_pool2d(ctx: LoweringContext, x: Value, kernel_size: Any, stride: Any = (),
                padding: Any = 0, ceil_mode: bool = False, count_include_pad: bool = True,
                divisor_override: int | None = None) -> Value:
    kernel = _ints(kernel_size, 2)
    return _batched(ctx, x, "avg_pool2d", kernel=kernel, stride=_ints(stride, 2, kernel),
                    padding=_ints(padding, 2), ceil_mode=ceil_mode,
                    count_include_pad=count_include_pad, divisor_override=divisor_override)


@lowers(aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default, check=_pool_check)
def _adaptive_avg_pool2d(ctx: LoweringContext, x: Value, output_size: Any) -> Value:
    return _batched(ctx, x, "adaptive_avg_pool2d", output_size=tuple(ctx.out.shape[-2:]))


# ------------------------------------------------------------------ upsampling
def _upsample_check(node: torch.fx.Node, x: Any, output_size: Any, *rest: Any) -> str | None:
    """kiln maps output index to input index by in/out; reject scales that torch uses
    differently (a scale factor whose reciprocal is not exactly in/out)."""
    if meta(x).dim() not in (3, 4):
        return f"2-d upsampling expects a 3-d or 4-d input, got rank {meta(x).dim()}"
    scales: list[Any]
    if node.target in (aten.upsample_nearest2d.vec, aten.upsample_bilinear2d.vec):
        scales = list(rest[-1] or [])
    else:
        scales = [s for s in rest[-2:]]
    align_corners = rest[0] if "bilinear" in str(node.target) else False
    if not scales or align_corners:
        return None
    in_hw = meta(x).shape[-2:]
    out_hw = meta(node).shape[-2:]
    for s, i, o in zip(scales, in_hw, out_hw):
        if s is not None and s > 0 and 1.0 / s != int(i) / int(o):
            return (f"scale factor {s} maps {int(i)} to {int(o)} pixels with a non-exact ratio; "
                    "pass size=... instead of scale_factor (or recompute_scale_factor=True)")
    return None


@lowers(aten.upsample_nearest2d.vec, aten.upsample_nearest2d.default, check=_upsample_check)
def _upsample_nearest2d(ctx: LoweringContext, x: Value, *_: Any) -> Value:
    return _batched(ctx, x, "upsample_nearest2d", output_size=tuple(ctx.out.shape[-2:]))


@lowers(aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default, check=_upsample_check)
def _upsample_bilinear2d(ctx: LoweringContext, x: Value, output_size: Any,
                         align_corners: bool, *_: Any) -> Value:
    return _batched(ctx, x, "upsample_bilinear2d", output_size=tuple(ctx.out.shape[-2:]),
                    align_corners=bool(align_corners))


# ------------------------------------------------------- embedding, attention
@lowers(aten.embedding.default)
def _embedding(ctx: LoweringContext, weight: Value, indices: Value, *_: Any) -> Value:
    return ctx.op("embedding", weight, indices)
