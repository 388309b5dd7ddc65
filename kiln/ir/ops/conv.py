"""Convolution ops: ``conv`` and ``conv_transpose`` (1-, 2- and 3-d, grouped, dilated).

Layouts are torch's: channels at axis 1 (``N, C, *spatial``), weights ``[Cout, Cin / groups,
*kernel]`` (``[Cin, Cout / groups, *kernel]`` for the transpose).  References are vectorized
numpy; float16/bfloat16 are computed in float32 and rounded once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import TensorType
from ._infer import fmt_shape, require_float, same_dtypes, static_dims, upcast_half
from ._nn_common import cast_like, inside_bounds, sliding_windows, window_position
from .compute import (
    Const,
    all_of,
    cmp,
    compute_dtype,
    const,
    defcompute,
    floordiv,
    floormod,
    select,
    simplify_index,
)
from .cost import numel
from .vjp import GradBuilder, defvjp


# ---------------------------------------------------------------------------- conv
def _conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _conv_infer(types, *, stride, padding, dilation, groups=1):
    x, w = types[0], types[1]
    dtype = same_dtypes(types, ["input", "weight", "bias"][: len(types)])
    require_float(x)
    n = len(stride)
    if n == 0 or x.rank != n + 2 or w.rank != n + 2:
        raise ValueError(f"a {n}-d conv (len(stride) = {n}) needs input and weight of rank {n + 2}, "
                         f"got {fmt_shape(x.shape)} and {fmt_shape(w.shape)}")
    if len(padding) != n or len(dilation) != n:
        raise ValueError(f"stride {list(stride)}, padding {list(padding)} and dilation "
                         f"{list(dilation)} must all have {n} entries")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or groups < 1:
        raise ValueError("stride, dilation and groups must be positive and padding non-negative")
    cout, cin_per_group = w.shape[:2]
    if x.shape[1] != cin_per_group * groups:
        raise ValueError(f"input has {x.shape[1]} channels but weight expects {cin_per_group} "
                         f"x groups {groups}")
    if not isinstance(cout, int) or cout % groups:
        raise ValueError(f"weight's {cout} output channels do not split into {groups} groups")
    if len(types) == 3 and types[2].shape != (cout,):
        raise ValueError(f"bias has shape {fmt_shape(types[2].shape)}, expected [{cout}]")
    size = static_dims(x.shape[2:], "conv (spatial axes)")
    kernel = static_dims(w.shape[2:], "conv (kernel axes)")
    out = tuple(_conv_out(*a) for a in zip(size, kernel, stride, padding, dilation))
    if min(out) < 1:
        raise ValueError(f"output spatial size {list(out)} is empty: input {list(size)} padded by "
                         f"{list(padding)} is smaller than the dilated kernel {list(kernel)}")
    return TensorType((x.shape[0], cout, *out), dtype)


def _conv_cost(input_types, output_types, **_) -> float:
    """A multiply-add per result element and weight element of one output channel
    (``2 * out * Cin / groups * prod(kernel)``)."""
    per_output = math.prod(d for d in input_types[1].shape[1:] if isinstance(d, int))
    return 2.0 * sum(numel(t) for t in output_types) * per_output


@defop("conv", infer=_conv_infer, num_inputs=(2, 3), traits=("conv",), amp="low", cost=_conv_cost, attrs={
    "stride": Attr("ints"), "padding": Attr("ints"), "dilation": Attr("ints"),
    "groups": Attr("int", 1)})
def conv(x, w, bias=None, *, stride, padding, dilation, groups=1):
    """N-d cross-correlation (torch convolution): im2col windows times the weight matrix."""
    xf, wf = upcast_half(x), upcast_half(w)
    n = len(stride)
    batch, channels = x.shape[:2]
    cout, kernel = w.shape[0], w.shape[2:]
    out = [_conv_out(*a) for a in zip(x.shape[2:], kernel, stride, padding, dilation)]
    xp = np.pad(xf, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    win = sliding_windows(xp, kernel, stride, dilation, out)  # [N, C, *out, *k]
    win = win.reshape(batch, groups, channels // groups, *out, *kernel)
    order = [0, 1, *range(3, 3 + n), 2, *range(3 + n, 3 + 2 * n)]
    cols = win.transpose(order).reshape(batch, groups, math.prod(out), -1)
    wmat = wf.reshape(groups, cout // groups, -1)
    y = np.matmul(cols, wmat.transpose(0, 2, 1))  # [N, G, P, Cout/G]
    y = y.transpose(0, 1, 3, 2).reshape(batch, cout, *out)
    if bias is not None:
        y = y + upcast_half(bias).reshape(cout, *(1,) * n)
    return cast_like(y, x)


def _conv_weight_grad(b: GradBuilder, x, g, kernel: Sequence[int], *, stride, padding, dilation,
                      groups):
    """``dW[o, c, k] = sum_{n, p} g[n, o, p] * x[n, c, p * stride + k * dilation - padding]``
    as one grouped ``conv``: channels of ``x`` become its batch, the batch its channels, and
    stride and dilation swap roles.  Returns ``[Cout, Cin / groups, *kernel]``."""
    n = len(stride)
    batch, channels = x.shape[:2]
    per_group, out_per_group = channels // groups, g.shape[1] // groups
    spatial = tuple(range(3, 3 + n))
    xr = b.reshape(x, (batch, groups, per_group, *x.shape[2:]))
    xr = b.reshape(b.permute(xr, (2, 1, 0, *spatial)), (per_group, groups * batch, *x.shape[2:]))
    gr = b.reshape(g, (batch, groups, out_per_group, *g.shape[2:]))
    gr = b.reshape(b.permute(gr, (1, 2, 0, *spatial)), (groups * out_per_group, batch, *g.shape[2:]))
    r = b.op("conv", xr, gr, stride=tuple(dilation), padding=tuple(padding),
             dilation=tuple(stride), groups=groups)
    for axis, k in enumerate(kernel):
        if r.shape[2 + axis] != k:
            r = b.op("slice", r, dim=2 + axis, start=0, end=k)
    return b.permute(r, (1, 0, *range(2, 2 + n)))


@defvjp("conv")
def _conv_vjp(b, inputs, outputs, cotangents, attrs):
    """Input: ``conv_transpose`` of the cotangent; weight: :func:`_conv_weight_grad`; bias:
    the cotangent summed over batch and spatial axes."""
    x, w = inputs[:2]
    g = cotangents[0]
    geometry = {k: attrs[k] for k in ("stride", "padding", "dilation", "groups")}
    kernel = w.shape[2:]
    grads: list = [None] * len(inputs)
    if b.wants(0):
        extra = tuple(size + 2 * p - ((o - 1) * s + d * (k - 1) + 1) for size, o, k, s, p, d in zip(
            x.shape[2:], g.shape[2:], kernel, attrs["stride"], attrs["padding"], attrs["dilation"]))
        grads[0] = b.op("conv_transpose", g, w, output_padding=extra, **geometry)
    if b.wants(1):
        grads[1] = _conv_weight_grad(b, x, g, kernel, **geometry)
    if len(inputs) == 3 and b.wants(2):
        grads[2] = b.sum(g, (0, *range(2, g.type.rank)))
    return grads


def _conv_transpose_out(size: int, k: int, s: int, p: int, d: int, extra: int) -> int:
    return (size - 1) * s - 2 * p + d * (k - 1) + extra + 1


def _conv_transpose_infer(types, *, stride, padding, dilation, groups=1, output_padding=()):
    x, w = types[0], types[1]
    dtype = same_dtypes(types, ["input", "weight", "bias"][: len(types)])
    require_float(x)
    n = len(stride)
    if n == 0 or x.rank != n + 2 or w.rank != n + 2:
        raise ValueError(f"a {n}-d transposed conv (len(stride) = {n}) needs input and weight of "
                         f"rank {n + 2}, got {fmt_shape(x.shape)} and {fmt_shape(w.shape)}")
    extra = tuple(output_padding) or (0,) * n
    if len(padding) != n or len(dilation) != n or len(extra) != n:
        raise ValueError(f"stride {list(stride)}, padding {list(padding)}, dilation "
                         f"{list(dilation)} and output_padding {list(extra)} must all have {n} entries")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(extra) < 0 or groups < 1:
        raise ValueError("stride, dilation and groups must be positive, padding and "
                         "output_padding non-negative")
    if any(e >= max(s, d) for e, s, d in zip(extra, stride, dilation)):
        raise ValueError(f"output_padding {list(extra)} must be smaller than stride or dilation")
    cin, out_per_group = w.shape[:2]
    if x.shape[1] != cin:
        raise ValueError(f"input has {x.shape[1]} channels but weight (shape [Cin, Cout / groups, "
                         f"*kernel]) expects {cin}")
    if not isinstance(cin, int) or cin % groups:
        raise ValueError(f"weight's {cin} input channels do not split into {groups} groups")
    cout = out_per_group * groups
    if len(types) == 3 and types[2].shape != (cout,):
        raise ValueError(f"bias has shape {fmt_shape(types[2].shape)}, expected [{cout}]")
    size = static_dims(x.shape[2:], "conv_transpose (spatial axes)")
    kernel = static_dims(w.shape[2:], "conv_transpose (kernel axes)")
    out = tuple(_conv_transpose_out(*a) for a in zip(size, kernel, stride, padding, dilation, extra))
    if min(out) < 1:
        raise ValueError(f"output spatial size {list(out)} is empty")
    return TensorType((x.shape[0], cout, *out), dtype)


@defop("conv_transpose", infer=_conv_transpose_infer, num_inputs=(2, 3), traits=("conv",), amp="low",
       cost=_conv_cost, attrs={
    "stride": Attr("ints"), "padding": Attr("ints"), "dilation": Attr("ints"),
    "groups": Attr("int", 1), "output_padding": Attr("ints", ())})
def conv_transpose(x, w, bias=None, *, stride, padding, dilation, groups=1, output_padding=()):
    """Transposed convolution (torch conv_transpose{1,2,3}d), the adjoint of ``conv`` in its
    input; weight ``[Cin, Cout / groups, *kernel]``.  Each kernel tap scatters a matmul."""
    xf, wf = upcast_half(x), upcast_half(w)
    n = len(stride)
    extra = tuple(output_padding) or (0,) * n
    batch, cin = x.shape[:2]
    size, kernel, out_per_group = x.shape[2:], w.shape[2:], w.shape[1]
    full = [(si - 1) * s + d * (k - 1) + 1 + e
            for si, k, s, d, e in zip(size, kernel, stride, dilation, extra)]
    y = np.zeros((batch, groups, out_per_group, *full), xf.dtype)
    cols = xf.reshape(batch, groups, cin // groups, -1)
    taps = wf.reshape(groups, cin // groups, out_per_group, *kernel)
    for tap in itertools.product(*(range(k) for k in kernel)):
        part = np.matmul(taps[(slice(None),) * 3 + tap].transpose(0, 2, 1), cols)
        window = tuple(slice(t * d, t * d + (si - 1) * s + 1, s)
                       for t, d, si, s in zip(tap, dilation, size, stride))
        y[(slice(None),) * 3 + window] += part.reshape(batch, groups, out_per_group, *size)
    crop = tuple(slice(p, f - p) for p, f in zip(padding, full))
    y = y[(slice(None),) * 3 + crop].reshape(batch, groups * out_per_group, *(f - 2 * p for p, f in
                                                                           zip(padding, full)))
    if bias is not None:
        y = y + upcast_half(bias).reshape(-1, *(1,) * n)
    return cast_like(y, x)


@defvjp("conv_transpose")
def _conv_transpose_vjp(b, inputs, outputs, cotangents, attrs):
    """Input: ``conv`` of the cotangent (the adjoint's adjoint); weight: the conv weight
    gradient with the cotangent as input and the input as output gradient."""
    x, w = inputs[:2]
    g = cotangents[0]
    geometry = {k: attrs[k] for k in ("stride", "padding", "dilation", "groups")}
    grads: list = [None] * len(inputs)
    if b.wants(0):
        dx = b.op("conv", g, w, **geometry)
        for axis, size in enumerate(x.shape[2:]):
            if dx.shape[2 + axis] != size:  # output_padding >= stride adds unused rows
                dx = b.op("slice", dx, dim=2 + axis, start=0, end=size)
        grads[0] = dx
    if b.wants(1):
        grads[1] = _conv_weight_grad(b, g, x, w.shape[2:], **geometry)
    if len(inputs) == 3 and b.wants(2):
        grads[2] = b.sum(g, (0, *range(2, g.type.rank)))
    return grads




# --------------------------------------------------------------- compute rules (lowering)
@defcompute("conv")
def _conv_compute(ctx, x, w, bias=None, *, stride, padding, dilation, groups=1):
    """``out[n, co, o...] = sum over (ci, k...) of x[n, g * cin_g + ci, o * s - p + k * d] *
    w[co, ci, k...]`` with ``g = co // cout_g``, zero outside the input; then ``+ bias[co]``."""
    out = ctx.out.dtype
    t = compute_dtype(out)
    x, w = ctx.operand(x, "x"), ctx.operand(w, "w")
    cout, cin_g, kernel = w.shape[0], w.shape[1], w.shape[2:]
    cout_g = cout // groups
    sizes = x.shape[2:]
    spatial = ctx.out_shape[2:]

    def body(i, r):
        n, co, o = i[0], i[1], i[2:]
        group = floordiv(co, cout_g) if groups > 1 else Const(0)
        pos, conds = [], []
        for d, size in enumerate(sizes):
            p = window_position(o[d], r[1 + d], stride[d], padding[d], dilation[d])
            reach = (spatial[d] - 1) * stride[d] - padding[d] + (kernel[d] - 1) * dilation[d]
            pos.append(p)
            conds += inside_bounds(p, size, padding[d] > 0, reach >= size)
        value = x.at((n, group * cin_g + r[0], *pos), t) * w.at((co, r[0], *r[1:]), t)
        guard = all_of(conds)
        return value if guard is None else select(guard, value, const(0, t))

    acc = ctx.reduce(ctx.out_shape, t, "+", [cin_g, *kernel], body, "acc")
    if bias is None:
        return ctx.convert(acc, out)
    return ctx.tensor(ctx.out_shape, out, lambda i: acc[i] + bias.at((i[1],), t))


@defcompute("conv_transpose")
def _conv_transpose_compute(ctx, x, w, bias=None, *, stride, padding, dilation, groups=1, output_padding=()):
    """``out[n, co, o...] = sum over (ci, k...) of x[n, ci', q / s] * w[ci', co % cout_g, k...]``
    with ``ci' = g * cin_g + ci``, ``g = co // cout_g`` and ``q = o + p - k * d``, where ``q``
    is a multiple of the stride inside the input; then ``+ bias[co]``."""
    out = ctx.out.dtype
    t = compute_dtype(out)
    x, w = ctx.operand(x, "x"), ctx.operand(w, "w")
    cin_g, cout_g, kernel = w.shape[0] // groups, w.shape[1], w.shape[2:]
    sizes, spatial = x.shape[2:], ctx.out_shape[2:]

    def body(i, r):
        n, co, o = i[0], i[1], i[2:]
        group = floordiv(co, cout_g) if groups > 1 else Const(0)
        ci = simplify_index(group * cin_g + r[0])
        pos, conds = [], []
        for d, size in enumerate(sizes):
            s, p, dil = stride[d], padding[d], dilation[d]
            q = simplify_index(o[d] + p - r[1 + d] * dil)
            src = q if s == 1 else floordiv(q, s)
            conds += [cmp("==", floormod(q, s), 0)] if s > 1 else []
            conds += inside_bounds(q, size * s, p - (kernel[d] - 1) * dil < 0, (spatial[d] - 1 + p) // s >= size)
            pos.append(src)
        value = x.at((n, ci, *pos), t) * w.at((ci, floormod(co, cout_g) if groups > 1 else co, *r[1:]), t)
        guard = all_of(conds)
        return value if guard is None else select(guard, value, const(0, t))

    acc = ctx.reduce(ctx.out_shape, t, "+", [cin_g, *kernel], body, "acc")
    if bias is None:
        return ctx.convert(acc, out)
    return ctx.tensor(ctx.out_shape, out, lambda i: acc[i] + bias.at((i[1],), t))
