"""Normalization ops: batch norm, group norm, layer norm, RMS norm.

Channels are at axis 1 for batch and group norm (group norm normalizes each of ``groups``
consecutive channel blocks of every sample over its channels and spatial axes); layer and
RMS norm normalize the trailing ``normalized_rank`` axes.  float16/bfloat16 are computed in float32 and rounded once.
"""

from __future__ import annotations

import math

import numpy as np

from ..builder import GraphBuilder
from ..registry import Attr, defop
from ._infer import fmt_shape, require_float, upcast_half
from ._nn_common import cast_like
from .compute import (
    call,
    compute_dtype,
    const,
    defcompute,
    drop_axes,
    floordiv,
)
from .cost import per_element, per_input_element
from .vjp import GradBuilder, defvjp


# ---------------------------------------------------------------------- normalization
def _batch_norm_infer(types, *, eps=1e-5):
    x = types[0]
    require_float(x)
    if x.rank < 2:
        raise ValueError(f"input must be at least 2-d (N, C, ...), got {fmt_shape(x.shape)}")
    for name, t in zip(("weight", "bias", "running_mean", "running_var"), types[1:]):
        require_float(t, name)
        if t.shape != (x.shape[1],):
            raise ValueError(f"{name} has shape {fmt_shape(t.shape)} but the input has "
                             f"{x.shape[1]} channels (axis 1)")
    return x


@defop("batch_norm", infer=_batch_norm_infer, num_inputs=5, traits=("composite", "pointwise"),
       attrs={"eps": Attr("float", 1e-5)}, amp="float32", cost=per_element(2))
def batch_norm(x, weight, bias, running_mean, running_var, *, eps=1e-5):
    """Inference batch norm: ``(x - mean) / sqrt(var + eps) * weight + bias`` per channel."""
    xf = upcast_half(x)
    shape = (x.shape[1],) + (1,) * (x.ndim - 2)
    mean, var, w, b = (upcast_half(p).astype(xf.dtype).reshape(shape)
                       for p in (running_mean, running_var, weight, bias))
    return cast_like((xf - mean) / np.sqrt(var + eps) * w + b, x)


@defvjp("batch_norm")
def _batch_norm_vjp(b, inputs, outputs, cotangents, attrs):
    """``y = (x - mean) * r * w + bias`` with ``r = rsqrt(var + eps)`` per channel: gradients
    for the input, weight and bias, and (mathematically, though torch treats them as
    buffers) for the running statistics."""
    x, g = inputs[0], cotangents[0]
    channel = (x.shape[1],) + (1,) * (x.type.rank - 2)
    others = (0, *range(2, x.type.rank))
    weight, _, mean, var = (b.cast(v, x.dtype) for v in inputs[1:])
    r = b.op("rsqrt", b.add(var, b.const(attrs["eps"], var)))
    rw = b.mul(r, weight)
    centered = b.sub(x, b.reshape(mean, channel))
    total = b.sum(g, others)
    grads = [
        b.mul(g, b.reshape(rw, channel)) if b.wants(0) else None,
        b.mul(b.sum(b.mul(g, centered), others), r) if b.wants(1) else None,
        total,
        b.neg(b.mul(total, rw)) if b.wants(3) else None,
        b.mul(b.sum(b.mul(g, centered), others),
              b.mul(rw, b.mul(b.mul(r, r), b.const(-0.5, x)))) if b.wants(4) else None,
    ]
    return [None if d is None else b.cast(d, v.dtype) for d, v in zip(grads, inputs)]


def _norm_infer(types, *, normalized_rank, eps=1e-5):
    x = types[0]
    require_float(x)
    if not 1 <= normalized_rank <= x.rank:
        raise ValueError(f"normalized_rank {normalized_rank} must be between 1 and the input's "
                         f"rank {x.rank}")
    trailing = x.shape[x.rank - normalized_rank:]
    for name, t in zip(("weight", "bias"), types[1:]):
        require_float(t, name)
        if t.shape != trailing:
            raise ValueError(f"{name} has shape {fmt_shape(t.shape)} but the normalized axes "
                             f"are {fmt_shape(trailing)}")
    return x


def _affine(y: np.ndarray, weight, bias) -> np.ndarray:
    if weight is not None:
        y = y * upcast_half(weight)
    if bias is not None:
        y = y + upcast_half(bias)
    return y


def _normalized_axes(x, normalized_rank: int) -> tuple[int, ...]:
    return tuple(range(x.type.rank - normalized_rank, x.type.rank))


def _scale_shift(b: GraphBuilder, y, params):
    """``y [* weight] [+ bias]`` for the parameters the node has."""
    for op, param in zip(("mul", "add"), params):
        y = b.op(op, y, param)
    return y


def _decompose_layer_norm(b: GraphBuilder, node):
    """``(x - mean(x)) * rsqrt(mean((x - mean(x))^2) + eps) [* w] [+ b]``."""
    x = node.inputs[0]
    axes = _normalized_axes(x, node.attrs["normalized_rank"])
    d = b.sub(x, b.op("mean", x, dims=axes, keepdim=True))
    var = b.op("mean", b.mul(d, d), dims=axes, keepdim=True)
    y = b.mul(d, b.op("rsqrt", b.add(var, b.const(node.attrs["eps"], x))))
    return [_scale_shift(b, y, node.inputs[1:])]


@defop("layer_norm", infer=_norm_infer, num_inputs=(1, 3), traits=("composite", "normalization"),
       attrs={"normalized_rank": Attr("int"), "eps": Attr("float", 1e-5)}, amp="float32",
       decompose=_decompose_layer_norm, cost=per_input_element(8))
def layer_norm(x, weight=None, bias=None, *, normalized_rank, eps=1e-5):
    """Normalize the last ``normalized_rank`` axes to zero mean and unit (biased) variance."""
    xf = upcast_half(x)
    axes = tuple(range(x.ndim - normalized_rank, x.ndim))
    centered = xf - np.mean(xf, axis=axes, keepdims=True)
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    return cast_like(_affine(centered / np.sqrt(var + eps), weight, bias), x)


def _norm_grads(b: GradBuilder, inputs, g, normalized_rank: int, eps: float, centered: bool):
    """Gradients of layer norm (``centered``) and RMS norm over the last ``normalized_rank``
    axes: ``dx = r * (gw - [mean(gw)] - xhat * mean(gw * xhat))`` with ``gw = g * weight``,
    ``dweight = sum(g * xhat)`` and ``dbias = sum(g)`` over the leading axes."""
    x = inputs[0]
    rank = x.type.rank
    axes = tuple(range(rank - normalized_rank, rank))
    leading = tuple(range(rank - normalized_rank))
    source = b.sub(x, b.op("mean", x, dims=axes, keepdim=True)) if centered else x
    r = b.op("rsqrt", b.add(b.op("mean", b.mul(source, source), dims=axes, keepdim=True),
                            b.const(eps, x)))
    xhat = b.mul(source, r)
    weight = b.cast(inputs[1], x.dtype) if len(inputs) > 1 else None
    gw = g if weight is None else b.mul(g, weight)
    inner = b.mul(xhat, b.op("mean", b.mul(gw, xhat), dims=axes, keepdim=True))
    if centered:
        inner = b.add(inner, b.op("mean", gw, dims=axes, keepdim=True))
    grads: list = [b.mul(r, b.sub(gw, inner)) if b.wants(0) else None]
    if len(inputs) > 1:
        grads.append(b.cast(b.sum(b.mul(g, xhat), leading), inputs[1].dtype) if b.wants(1) else None)
    if len(inputs) > 2:
        grads.append(b.cast(b.sum(g, leading), inputs[2].dtype) if b.wants(2) else None)
    return grads


@defvjp("layer_norm")
def _layer_norm_vjp(b, inputs, outputs, cotangents, attrs):
    return _norm_grads(b, inputs, cotangents[0], attrs["normalized_rank"], attrs["eps"], True)


def _decompose_rms_norm(b: GraphBuilder, node):
    """``x * rsqrt(mean(x * x) + eps) [* w]``."""
    x = node.inputs[0]
    axes = _normalized_axes(x, node.attrs["normalized_rank"])
    ms = b.op("mean", b.mul(x, x), dims=axes, keepdim=True)
    y = b.mul(x, b.op("rsqrt", b.add(ms, b.const(node.attrs["eps"], x))))
    return [_scale_shift(b, y, node.inputs[1:])]


@defop("rms_norm", infer=_norm_infer, num_inputs=(1, 2), traits=("composite", "normalization"),
       attrs={"normalized_rank": Attr("int"), "eps": Attr("float", 1e-6)}, amp="float32",
       decompose=_decompose_rms_norm, cost=per_input_element(5))
def rms_norm(x, weight=None, *, normalized_rank, eps=1e-6):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last ``normalized_rank`` axes."""
    xf = upcast_half(x)
    axes = tuple(range(x.ndim - normalized_rank, x.ndim))
    ms = np.mean(xf * xf, axis=axes, keepdims=True)
    return cast_like(_affine(xf / np.sqrt(ms + eps), weight, None), x)


@defvjp("rms_norm")
def _rms_norm_vjp(b, inputs, outputs, cotangents, attrs):
    return _norm_grads(b, inputs, cotangents[0], attrs["normalized_rank"], attrs["eps"], False)




# ------------------------------------------------------------------------ group norm
def _group_norm_infer(types, *, groups, eps=1e-5):
    x = types[0]
    require_float(x)
    if x.rank < 2:
        raise ValueError(f"input must be at least 2-d (N, C, ...), got {fmt_shape(x.shape)}")
    channels = x.shape[1]
    if groups < 1 or not isinstance(channels, int) or channels % groups:
        raise ValueError(f"{channels} channels (axis 1) cannot be split into {groups} groups")
    for name, t in zip(("weight", "bias"), types[1:]):
        require_float(t, name)
        if t.shape != (channels,):
            raise ValueError(f"{name} has shape {fmt_shape(t.shape)} but the input has "
                             f"{channels} channels (axis 1)")
    return x


@defop("group_norm", infer=_group_norm_infer, num_inputs=(1, 3),
       traits=("composite", "normalization"),
       attrs={"groups": Attr("int"), "eps": Attr("float", 1e-5)}, amp="float32")
def group_norm(x, weight=None, bias=None, *, groups, eps=1e-5):
    """Per sample, split the channels into ``groups`` blocks; normalize each block over its
    channels and spatial axes (biased variance), then ``* weight + bias`` per channel."""
    xf = upcast_half(x)
    grouped = xf.reshape(x.shape[0], groups, -1)
    centered = grouped - grouped.mean(axis=2, keepdims=True)
    var = np.mean(centered * centered, axis=2, keepdims=True)
    y = (centered / np.sqrt(var + eps)).reshape(x.shape)
    channel = (x.shape[1],) + (1,) * (x.ndim - 2)
    if weight is not None:
        y = y * upcast_half(weight).reshape(channel)
    if bias is not None:
        y = y + upcast_half(bias).reshape(channel)
    return cast_like(y, x)


@defvjp("group_norm")
def _group_norm_vjp(b, inputs, outputs, cotangents, attrs):
    """Layer norm's gradient over the last axis of ``x`` viewed as ``(N, groups, -1)``,
    with ``gw = g * weight`` per channel; ``dweight = sum(g * xhat)`` and ``dbias = sum(g)``
    over every axis but the channels."""
    x, g = inputs[0], cotangents[0]
    groups, eps = attrs["groups"], attrs["eps"]
    shape = tuple(x.shape)
    grouped = (shape[0], groups, math.prod(shape[1:]) // groups)
    channel = (shape[1],) + (1,) * (len(shape) - 2)
    others = (0, *range(2, len(shape)))
    weight = b.cast(inputs[1], x.dtype) if len(inputs) > 1 else None
    gw = g if weight is None else b.mul(g, b.reshape(weight, channel))
    x3, gw3 = b.reshape(x, grouped), b.reshape(gw, grouped)
    centered = b.sub(x3, b.op("mean", x3, dims=(2,), keepdim=True))
    r = b.op("rsqrt", b.add(b.op("mean", b.mul(centered, centered), dims=(2,), keepdim=True),
                            b.const(eps, x)))
    xhat3 = b.mul(centered, r)
    inner = b.add(b.mul(xhat3, b.op("mean", b.mul(gw3, xhat3), dims=(2,), keepdim=True)),
                  b.op("mean", gw3, dims=(2,), keepdim=True))
    grads: list = [b.reshape(b.mul(r, b.sub(gw3, inner)), shape) if b.wants(0) else None]
    if len(inputs) > 1:
        grads.append(b.cast(b.sum(b.mul(g, b.reshape(xhat3, shape)), others), inputs[1].dtype)
                     if b.wants(1) else None)
    if len(inputs) > 2:
        grads.append(b.cast(b.sum(g, others), inputs[2].dtype) if b.wants(2) else None)
    return grads


# --------------------------------------------------------------- compute rules (lowering)
@defcompute("batch_norm")
def _batch_norm_compute(ctx, x, weight, bias, running_mean, running_var, *, eps=1e-5):
    t = compute_dtype(x.dtype)

    def element(i):
        c = (i[1],)
        scale = call("sqrt", running_var.at(c, t) + const(eps, t))
        return (x.at(i, t) - running_mean.at(c, t)) / scale * weight.at(c, t) + bias.at(c, t)

    return ctx.tensor(x.shape, x.dtype, element)


def _trailing_mean(ctx, x, normalized_rank: int, t, value, suffix: str):
    """A stage averaging ``value(i)`` over the last ``normalized_rank`` axes; returns the
    mean for the row of a full index ``i``."""
    axes = tuple(range(x.rank - normalized_rank, x.rank))
    count = const(math.prod(x.shape[a] for a in axes), t)
    total = ctx.reduce_axes(x.shape, axes, False, "+", t, value, suffix)
    return lambda i: total[drop_axes(i, axes)] / count


@defcompute("layer_norm")
def _layer_norm_compute(ctx, x, weight=None, bias=None, *, normalized_rank, eps=1e-5):
    t = compute_dtype(x.dtype)
    mean = _trailing_mean(ctx, x, normalized_rank, t, lambda i: x.at(i, t), "sum")

    def centered(i):
        return x.at(i, t) - mean(i)

    var = _trailing_mean(ctx, x, normalized_rank, t, lambda i: centered(i) * centered(i), "sq")

    def element(i):
        y = centered(i) / call("sqrt", var(i) + const(eps, t))
        trailing = i[x.rank - normalized_rank:]
        if weight is not None:
            y = y * weight.at(trailing, t)
        if bias is not None:
            y = y + bias.at(trailing, t)
        return y

    return ctx.tensor(x.shape, x.dtype, element)


@defcompute("rms_norm")
def _rms_norm_compute(ctx, x, weight=None, *, normalized_rank, eps=1e-6):
    t = compute_dtype(x.dtype)
    meansq = _trailing_mean(ctx, x, normalized_rank, t, lambda i: x.at(i, t) * x.at(i, t), "sq")

    def element(i):
        y = x.at(i, t) / call("sqrt", meansq(i) + const(eps, t))
        return y if weight is None else y * weight.at(i[x.rank - normalized_rank:], t)

    return ctx.tensor(x.shape, x.dtype, element)


@defcompute("group_norm")
def _group_norm_compute(ctx, x, weight=None, bias=None, *, groups, eps=1e-5):
    t = compute_dtype(x.dtype)
    per_group = x.shape[1] // groups
    extents = [per_group, *x.shape[2:]]
    count = const(per_group * math.prod(x.shape[2:]), t)

    def member(i, r):  # element r of group i = (sample, group)
        return (i[0], i[1] * per_group + r[0], *r[1:])

    def group_of(i):
        return (i[0], floordiv(i[1], per_group))

    total = ctx.reduce((x.shape[0], groups), t, "+", extents,
                       lambda i, r: x.at(member(i, r), t), "sum")

    def centered(i):
        return x.at(i, t) - total[group_of(i)] / count

    def centered_member(i, r):
        return x.at(member(i, r), t) - total[i] / count

    squares = ctx.reduce((x.shape[0], groups), t, "+", extents,
                         lambda i, r: centered_member(i, r) * centered_member(i, r), "sq")

    def element(i):
        y = centered(i) / call("sqrt", squares[group_of(i)] / count + const(eps, t))
        if weight is not None:
            y = y * weight.at((i[1],), t)
        if bias is not None:
            y = y + bias.at((i[1],), t)
        return y

    return ctx.tensor(x.shape, x.dtype, element)
