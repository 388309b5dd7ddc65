"""Neural-network ops: convolution, pooling, resampling, normalization, embedding, attention.

Layouts and index formulas are torch's: channels at axis 1 (``N, C, *spatial``), conv
weights ``[Cout, Cin / groups, *kernel]``, pooling and resampling on the last two axes of a
3-d or 4-d input.  References are vectorized numpy (windows via stride tricks, contractions
via BLAS); float16/bfloat16 are computed in float32 and rounded once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..registry import Attr, defop
from ..types import DType, TensorType, broadcast_shapes
from ._infer import fmt_shape, require_float, require_int, same_dtypes, static_dims, upcast_half
from .compute import (
    Cast, Const, all_of, as_expr, broadcast_index, call, cmp, compute_dtype, const, convert, defcompute, drop_axes,
    floordiv, floormod, identity, maximum, minimum, select, simplify_index,
)
from .vjp import GradBuilder, defvjp, unbroadcast


def _windows(x: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
             dilation: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """View ``[..., *out, *kernel]`` of the (already padded) last ``len(kernel)`` axes of ``x``."""
    n = len(kernel)
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    view = sliding_window_view(x, span, axis=tuple(range(x.ndim - n, x.ndim)))
    lead = (slice(None),) * (x.ndim - n)
    starts = tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, stride))
    taps = tuple(slice(None, None, d) for d in dilation)
    return view[lead + starts + taps]


def _result(r: np.ndarray, like: np.ndarray) -> np.ndarray:
    return np.asarray(r).astype(like.dtype, copy=False)


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


@defop("conv", infer=_conv_infer, num_inputs=(2, 3), traits=("conv",), amp="low",
       impls={"generated": True, "library": "conv"}, attrs={
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
    win = _windows(xp, kernel, stride, dilation, out)  # [N, C, *out, *k]
    win = win.reshape(batch, groups, channels // groups, *out, *kernel)
    order = [0, 1, *range(3, 3 + n), 2, *range(3 + n, 3 + 2 * n)]
    cols = win.transpose(order).reshape(batch, groups, math.prod(out), -1)
    wmat = wf.reshape(groups, cout // groups, -1)
    y = np.matmul(cols, wmat.transpose(0, 2, 1))  # [N, G, P, Cout/G]
    y = y.transpose(0, 1, 3, 2).reshape(batch, cout, *out)
    if bias is not None:
        y = y + upcast_half(bias).reshape(cout, *(1,) * n)
    return _result(y, x)


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


@defop("conv_transpose", infer=_conv_transpose_infer, num_inputs=(2, 3), traits=("conv",), attrs={
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
    return _result(y, x)


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


# ------------------------------------------------------------------------- pooling
def _pair(values: Sequence[int], what: str) -> tuple[int, int]:
    if len(values) != 2:
        raise ValueError(f"{what} {list(values)} must have 2 entries (height, width)")
    return values[0], values[1]


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape, including the ceil-mode rule that the last window must
    start inside the input or its left padding."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_geometry(shape, kernel, stride, padding, dilation, ceil_mode) -> list[tuple]:
    """Per spatial axis ``(size, k, s, p, d, out)``, validated like torch's pool2d_shape_check."""
    if len(shape) not in (3, 4):
        raise ValueError(f"input must be 3-d (C, H, W) or 4-d (N, C, H, W), got {fmt_shape(shape)}")
    stride = stride or kernel  # an empty stride means stride = kernel, as in ATen
    params = [_pair(kernel, "kernel"), _pair(stride, "stride"), _pair(padding, "padding"),
              _pair(dilation, "dilation")]
    if min(params[0] + params[1] + params[3]) < 1 or min(params[2]) < 0:
        raise ValueError("kernel, stride and dilation must be positive and padding non-negative")
    size = static_dims(shape[-2:], "pooling (spatial axes)")
    axes = []
    for i in range(2):
        k, s, p, d = (q[i] for q in params)
        if p > k // 2:
            raise ValueError(f"padding {p} is more than half the kernel size {k}")
        axes.append((size[i], k, s, p, d, _pool_out(size[i], k, s, p, d, ceil_mode)))
    out = [a[-1] for a in axes]
    if min(out) < 1:
        raise ValueError(f"output size {out} is empty for input {list(size)}")
    return axes


def _pool_pad(x: np.ndarray, axes: Sequence[tuple], fill) -> np.ndarray:
    """Pad the last two axes: ``p`` before, and after as much as the last window reaches."""
    widths = [(0, 0)] * (x.ndim - 2)
    for size, k, s, p, d, out in axes:
        widths.append((p, max((out - 1) * s + d * (k - 1) + 1 - size - p, 0)))
    return np.pad(x, widths, constant_values=fill)


def _max_pool_infer(types, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    t = types[0]
    if t.dtype == DType.bool:
        raise TypeError("max_pool2d is not defined on bool; cast the input first")
    out = [a[-1] for a in _pool_geometry(t.shape, kernel, stride, padding, dilation, ceil_mode)]
    return t.with_shape((*t.shape[:-2], *out))


@defop("max_pool2d", infer=_max_pool_infer, attrs={
    "kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", (0, 0)),
    "dilation": Attr("ints", (1, 1)), "ceil_mode": Attr("bool", False)})
def max_pool2d(x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    """Window maxima over the last two axes; padding never wins (acts as -inf); NaN wins.
    An empty ``stride`` means ``stride = kernel``, as in ATen."""
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    xf = upcast_half(x)
    fill = -np.inf if xf.dtype.kind == "f" else np.iinfo(xf.dtype).min
    win = _windows(_pool_pad(xf, axes, fill), [a[1] for a in axes], [a[2] for a in axes],
                   [a[4] for a in axes], [a[5] for a in axes])
    return _result(np.max(win, axis=(-2, -1)), x)


@defvjp("max_pool2d")
def _max_pool2d_vjp(b, inputs, outputs, cotangents, attrs):
    """Each window's cotangent goes to its first maximal element (``max_pool2d_backward``)."""
    x = inputs[0]
    if not x.dtype.is_floating:
        return [None]
    return [b.op("max_pool2d_backward", cotangents[0], x, **attrs)]


def _max_pool_backward_infer(types, **attrs):
    g, x = types
    pooled = _max_pool_infer([x], **attrs)
    if g != pooled:
        raise ValueError(f"grad has type {g} but max_pool2d of input {x} gives {pooled}")
    return x


_MAX_POOL_ATTRS = {
    "kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", (0, 0)),
    "dilation": Attr("ints", (1, 1)), "ceil_mode": Attr("bool", False)}


def _window_maxima(x: np.ndarray, axes: Sequence[tuple]) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Per window of ``max_pool2d``, flattened over the leading axes: the row and column (in
    padded coordinates) of its first maximum (NaN counts as maximal), as torch's kernel
    picks it; and the padded spatial shape."""
    xf = upcast_half(x)
    fill = -np.inf if xf.dtype.kind == "f" else np.iinfo(xf.dtype).min
    padded = _pool_pad(xf, axes, fill)
    (_, kh, sh, _, dh, oh), (_, kw, sw, _, dw, ow) = axes
    win = _windows(padded, (kh, kw), (sh, sw), (dh, dw), (oh, ow))
    first = np.argmax(win.reshape(*win.shape[:-2], kh * kw), axis=-1).reshape(-1, oh, ow)
    rows = np.arange(oh)[:, None] * sh + (first // kw) * dh
    cols = np.arange(ow)[None, :] * sw + (first % kw) * dw
    return rows, cols, padded.shape[-2:]


@defop("max_pool2d_backward", infer=_max_pool_backward_infer, num_inputs=2, attrs=_MAX_POOL_ATTRS)
def max_pool2d_backward(g, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    """Gradient of ``max_pool2d(x)`` given the output gradient ``g``: each window's gradient is
    added at the window's first maximum."""
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    rows, cols, padded = _window_maxima(x, axes)
    gf = upcast_half(g).reshape(rows.shape)
    out = np.zeros((rows.shape[0], *padded), dtype=gf.dtype)
    np.add.at(out, (np.arange(rows.shape[0])[:, None, None], rows, cols), gf)
    (h, _, _, ph, _, _), (w, _, _, pw, _, _) = axes
    return _result(out[:, ph:ph + h, pw:pw + w].reshape(x.shape), g)


def _max_pool_select_infer(types, **attrs):
    t, x = types
    if t != x:
        raise ValueError(f"source has type {t} but the pooled input is {x}")
    return _max_pool_infer([x], **attrs)


@defop("max_pool2d_select", infer=_max_pool_select_infer, num_inputs=2, attrs=_MAX_POOL_ATTRS)
def max_pool2d_select(t, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    """Per ``max_pool2d`` window of ``x``: the element of ``t`` at the window's first maximum
    (the transpose of ``max_pool2d_backward`` in its gradient operand)."""
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    rows, cols, padded = _window_maxima(x, axes)
    (_, _, _, ph, _, _), (_, _, _, pw, _, _) = axes
    tp = np.zeros((rows.shape[0], *padded), dtype=upcast_half(t).dtype)
    tp[:, ph:ph + x.shape[-2], pw:pw + x.shape[-1]] = upcast_half(t).reshape(-1, *x.shape[-2:])
    picked = tp[np.arange(rows.shape[0])[:, None, None], rows, cols]
    return _result(picked.reshape(*x.shape[:-2], *rows.shape[1:]), t)


@defvjp("max_pool2d_backward")
def _max_pool2d_backward_vjp(b, inputs, outputs, cotangents, attrs):
    """Linear in the gradient operand (its transpose is ``max_pool2d_select``); the argmax
    positions are piecewise constant in ``x``, which gets no gradient."""
    return [b.op("max_pool2d_select", cotangents[0], inputs[1], **attrs), None]


@defvjp("max_pool2d_select")
def _max_pool2d_select_vjp(b, inputs, outputs, cotangents, attrs):
    return [b.op("max_pool2d_backward", cotangents[0], inputs[1], **attrs), None]


def _avg_pool_infer(types, *, kernel, stride, padding=(0, 0), ceil_mode=False,
                    count_include_pad=True, divisor_override=None):
    t = types[0]
    if not (t.dtype.is_floating or t.dtype == DType.int64):
        raise TypeError(f"input must be floating-point or i64 (as in torch), got {t.dtype.short}")
    if divisor_override is not None and divisor_override == 0:
        raise ValueError("divisor_override must be nonzero")
    out = [a[-1] for a in _pool_geometry(t.shape, kernel, stride, padding, (1, 1), ceil_mode)]
    return t.with_shape((*t.shape[:-2], *out))


def _avg_divisors(size: int, k: int, s: int, p: int, out: int, count_include_pad: bool) -> np.ndarray:
    """Per output position of one axis: window length clipped to the padded input (counting
    padding) or to the input itself (not counting it), torch's avg_pool2d divisor."""
    start = np.arange(out) * s - p
    end = np.minimum(start + k, size + p)
    if count_include_pad:
        return end - start
    return np.minimum(end, size) - np.maximum(start, 0)


@defop("avg_pool2d", infer=_avg_pool_infer, attrs={
    "kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", (0, 0)),
    "ceil_mode": Attr("bool", False), "count_include_pad": Attr("bool", True),
    "divisor_override": Attr("int", None, optional=True)})
def avg_pool2d(x, *, kernel, stride, padding=(0, 0), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """Window averages over the last two axes (zero padding); i64 results truncate toward
    zero.  An empty ``stride`` means ``stride = kernel``, as in ATen."""
    axes = _pool_geometry(x.shape, kernel, stride, padding, (1, 1), ceil_mode)
    xf = upcast_half(x)
    win = _windows(_pool_pad(xf, axes, 0), [a[1] for a in axes], [a[2] for a in axes],
                   (1, 1), [a[5] for a in axes])
    total = np.sum(win, axis=(-2, -1))
    if divisor_override is not None:
        div = np.asarray(divisor_override)
    else:
        (h, kh, sh, ph, _, oh), (w, kw, sw, pw, _, ow) = axes
        div = np.outer(_avg_divisors(h, kh, sh, ph, oh, count_include_pad),
                       _avg_divisors(w, kw, sw, pw, ow, count_include_pad))
    if x.dtype.kind in "iu":
        return _result(np.sign(total) * (np.abs(total) // div), x)
    return _result(total / div, x)


def _separable_vjp(b: GradBuilder, g, x, rows: np.ndarray, cols: np.ndarray):
    """Cotangent of ``y = rows @ x @ cols^T`` (over the last two axes): ``rows^T @ g @ cols``.
    Average pooling and every resampling op here are such separable linear maps."""
    left = b.array(rows.T, x.dtype)
    right = b.array(cols, x.dtype)
    return b.op("matmul", b.op("matmul", left, g), right)


def _window_matrix(size: int, k: int, s: int, p: int, out: int) -> np.ndarray:
    """``[out, size]``: 1 where input ``i`` lies in the (zero-padded) window of output ``o``."""
    start = np.arange(out)[:, None] * s - p
    i = np.arange(size)[None, :]
    return ((i >= start) & (i < start + k)).astype(np.float64)


@defvjp("avg_pool2d")
def _avg_pool2d_vjp(b, inputs, outputs, cotangents, attrs):
    x = inputs[0]
    if not x.dtype.is_floating:
        return [None]
    axes = _pool_geometry(x.shape, attrs["kernel"], attrs["stride"], attrs["padding"], (1, 1),
                          attrs["ceil_mode"])
    (h, kh, sh, ph, _, oh), (w, kw, sw, pw, _, ow) = axes
    rows, cols = _window_matrix(h, kh, sh, ph, oh), _window_matrix(w, kw, sw, pw, ow)
    if attrs["divisor_override"] is not None:
        cols = cols / attrs["divisor_override"]
    else:
        include = attrs["count_include_pad"]
        rows = rows / _avg_divisors(h, kh, sh, ph, oh, include)[:, None]
        cols = cols / _avg_divisors(w, kw, sw, pw, ow, include)[:, None]
    return [_separable_vjp(b, cotangents[0], x, rows, cols)]


def _spatial_infer(types, *, output_size, align_corners=False, floats_only=True):
    t = types[0]
    if t.rank not in (3, 4):
        raise ValueError(f"input must be 3-d (C, H, W) or 4-d (N, C, H, W), got {fmt_shape(t.shape)}")
    if floats_only:
        require_float(t)
    size = _pair(output_size, "output_size")
    if min(size) < 1:
        raise ValueError(f"output_size {list(size)} must be positive")
    if 0 in static_dims(t.shape[-2:], "resampling (spatial axes)"):
        raise ValueError(f"input {fmt_shape(t.shape)} has an empty spatial axis")
    return t.with_shape((*t.shape[:-2], *size))


def _resample(x: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``rows @ x @ cols.T`` over the last two axes: separable resampling matrices."""
    return np.einsum("...hw,Hh,Ww->...HW", x, rows, cols, optimize=True)


def _adaptive_matrix(n_in: int, n_out: int, dtype) -> np.ndarray:
    """Averaging matrix ``[n_out, n_in]``: output ``i`` averages inputs
    ``floor(i * n_in / n_out)`` up to ``ceil((i + 1) * n_in / n_out)`` (torch's formula)."""
    i = np.arange(n_out)[:, None]
    start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
    j = np.arange(n_in)[None, :]
    return (((j >= start) & (j < end)) / (end - start)).astype(dtype)


@defop("adaptive_avg_pool2d", infer=_spatial_infer, attrs={"output_size": Attr("ints")})
def adaptive_avg_pool2d(x, *, output_size):
    """Average pooling onto ``output_size`` (windows may overlap when sizes do not divide)."""
    xf = upcast_half(x)
    rows = _adaptive_matrix(x.shape[-2], output_size[0], xf.dtype)
    cols = _adaptive_matrix(x.shape[-1], output_size[1], xf.dtype)
    return _result(_resample(xf, rows, cols), x)


@defvjp("adaptive_avg_pool2d")
def _adaptive_avg_pool2d_vjp(b, inputs, outputs, cotangents, attrs):
    x, (oh, ow) = inputs[0], attrs["output_size"]
    rows = _adaptive_matrix(x.shape[-2], oh, np.float64)
    cols = _adaptive_matrix(x.shape[-1], ow, np.float64)
    return [_separable_vjp(b, cotangents[0], x, rows, cols)]


def _nearest_infer(types, *, output_size):
    return _spatial_infer(types, output_size=output_size, floats_only=False)


def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    """torch 'nearest': ``min(floor(o * (n_in / n_out)), n_in - 1)`` in float32 arithmetic."""
    scale = np.float32(n_in) / np.float32(n_out)
    index = np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64)
    return np.minimum(index, n_in - 1)


@defop("upsample_nearest2d", infer=_nearest_infer, attrs={"output_size": Attr("ints")})
def upsample_nearest2d(x, *, output_size):
    """Nearest-neighbour resize of the last two axes (any dtype)."""
    rows = _nearest_index(x.shape[-2], output_size[0])
    cols = _nearest_index(x.shape[-1], output_size[1])
    return x[..., rows[:, None], cols[None, :]]


def _selection_matrix(index: np.ndarray, n_in: int) -> np.ndarray:
    """``[len(index), n_in]`` with a 1 at ``(o, index[o])``."""
    m = np.zeros((len(index), n_in))
    m[np.arange(len(index)), index] = 1.0
    return m


@defvjp("upsample_nearest2d")
def _upsample_nearest2d_vjp(b, inputs, outputs, cotangents, attrs):
    x, (oh, ow) = inputs[0], attrs["output_size"]
    if not x.dtype.is_floating:
        return [None]
    h, w = x.shape[-2:]
    rows = _selection_matrix(_nearest_index(h, oh), h)
    cols = _selection_matrix(_nearest_index(w, ow), w)
    return [_separable_vjp(b, cotangents[0], x, rows, cols)]


def _linear_matrix(n_in: int, n_out: int, align_corners: bool, dtype) -> np.ndarray:
    """Interpolation matrix ``[n_out, n_in]`` of torch's linear upsampling along one axis
    (source index, clamping and weights computed in ``dtype`` as torch's kernel does)."""
    o = np.arange(n_out, dtype=dtype)
    if n_in == n_out:
        return np.eye(n_out, dtype=dtype)
    if align_corners:
        scale = dtype.type(n_in - 1) / dtype.type(n_out - 1) if n_out > 1 else dtype.type(0)
        src = o * scale
    else:
        scale = dtype.type(n_in) / dtype.type(n_out)
        src = np.maximum(scale * (o + dtype.type(0.5)) - dtype.type(0.5), dtype.type(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = i0 + (i0 < n_in - 1)
    lam1 = np.clip(src - i0.astype(dtype), 0, 1)
    m = np.zeros((n_out, n_in), dtype)
    np.add.at(m, (np.arange(n_out), i0), 1 - lam1)
    np.add.at(m, (np.arange(n_out), i1), lam1)
    return m


@defop("upsample_bilinear2d", infer=_spatial_infer, attrs={
    "output_size": Attr("ints"), "align_corners": Attr("bool", False)})
def upsample_bilinear2d(x, *, output_size, align_corners=False):
    """Bilinear resize of the last two axes with torch's source-index convention."""
    xf = upcast_half(x)
    rows = _linear_matrix(x.shape[-2], output_size[0], align_corners, xf.dtype)
    cols = _linear_matrix(x.shape[-1], output_size[1], align_corners, xf.dtype)
    return _result(_resample(xf, rows, cols), x)


@defvjp("upsample_bilinear2d")
def _upsample_bilinear2d_vjp(b, inputs, outputs, cotangents, attrs):
    """The interpolation weights are computed in the input's dtype, as the forward does."""
    x, (oh, ow), corners = inputs[0], attrs["output_size"], attrs["align_corners"]
    dtype = upcast_half(np.zeros(0, x.dtype.numpy)).dtype
    rows = _linear_matrix(x.shape[-2], oh, corners, dtype)
    cols = _linear_matrix(x.shape[-1], ow, corners, dtype)
    return [_separable_vjp(b, cotangents[0], x, rows, cols)]


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
       attrs={"eps": Attr("float", 1e-5)}, amp="float32")
def batch_norm(x, weight, bias, running_mean, running_var, *, eps=1e-5):
    """Inference batch norm: ``(x - mean) / sqrt(var + eps) * weight + bias`` per channel."""
    xf = upcast_half(x)
    shape = (x.shape[1],) + (1,) * (x.ndim - 2)
    mean, var, w, b = (upcast_half(p).astype(xf.dtype).reshape(shape)
                       for p in (running_mean, running_var, weight, bias))
    return _result((xf - mean) / np.sqrt(var + eps) * w + b, x)


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


@defop("layer_norm", infer=_norm_infer, num_inputs=(1, 3), traits=("composite", "normalization"),
       attrs={"normalized_rank": Attr("int"), "eps": Attr("float", 1e-5)}, amp="float32")
def layer_norm(x, weight=None, bias=None, *, normalized_rank, eps=1e-5):
    """Normalize the last ``normalized_rank`` axes to zero mean and unit (biased) variance."""
    xf = upcast_half(x)
    axes = tuple(range(x.ndim - normalized_rank, x.ndim))
    centered = xf - np.mean(xf, axis=axes, keepdims=True)
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    return _result(_affine(centered / np.sqrt(var + eps), weight, bias), x)


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


@defop("rms_norm", infer=_norm_infer, num_inputs=(1, 2), traits=("composite", "normalization"),
       attrs={"normalized_rank": Attr("int"), "eps": Attr("float", 1e-6)}, amp="float32")
def rms_norm(x, weight=None, *, normalized_rank, eps=1e-6):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last ``normalized_rank`` axes."""
    xf = upcast_half(x)
    axes = tuple(range(x.ndim - normalized_rank, x.ndim))
    ms = np.mean(xf * xf, axis=axes, keepdims=True)
    return _result(_affine(xf / np.sqrt(ms + eps), weight, None), x)


@defvjp("rms_norm")
def _rms_norm_vjp(b, inputs, outputs, cotangents, attrs):
    return _norm_grads(b, inputs, cotangents[0], attrs["normalized_rank"], attrs["eps"], False)


# -------------------------------------------------------------------------- embedding
def _embedding_infer(types, **_):
    weight, indices = types
    require_int(indices)
    if weight.rank != 2:
        raise ValueError(f"weight must be 2-d [num_embeddings, dim], got {fmt_shape(weight.shape)}")
    return TensorType((*indices.shape, weight.shape[1]), weight.dtype)


@defop("embedding", infer=_embedding_infer, num_inputs=2,
       impls={"generated": True, "library": "embedding"})
def embedding(weight, indices):
    """Rows of ``weight`` picked by ``indices`` (any rank, each in ``[0, num_embeddings)``)."""
    if indices.size and (indices.min() < 0 or indices.max() >= weight.shape[0]):
        bad = indices.min() if indices.min() < 0 else indices.max()
        raise IndexError(f"embedding: index {bad} is out of range for {weight.shape[0]} embeddings")
    return np.take(weight, indices.astype(np.int64), axis=0)


@defvjp("embedding")
def _embedding_vjp(b, inputs, outputs, cotangents, attrs):
    """Rows accumulate the cotangents of every lookup of them (``index_put``)."""
    weight, indices = inputs
    grad = b.op("index_put", b.zeros(weight.type), cotangents[0], indices, dims=(0,),
                accumulate=True)
    return [grad, None]


# -------------------------------------------------------------------------- attention
def _sdpa_infer(types, *, is_causal=False, scale=None):
    q, k, v = types[:3]
    dtype = same_dtypes(types[:3], ["q", "k", "v"])
    require_float(q, "q")
    if min(q.rank, k.rank, v.rank) < 2:
        raise ValueError("q, k and v must be at least 2-d ([..., length, embedding])")
    (length, e), (keys, ek), (values, ev) = q.shape[-2:], k.shape[-2:], v.shape[-2:]
    if e != ek:
        raise ValueError(f"q has embedding size {e} but k has {ek}")
    if keys != values:
        raise ValueError(f"k has {keys} keys but v has {values} values")
    try:
        batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError("batch axes of q, k and v do not broadcast") from None
    if len(types) == 4:
        mask = types[3]
        if is_causal:
            raise ValueError("give either a mask or is_causal=true, not both")
        if mask.dtype != DType.bool and not mask.dtype.is_floating:
            raise TypeError(f"mask must be bool (keep where true) or floating (added), got "
                            f"{mask.dtype.short}")
        scores = (*batch, length, keys)
        try:
            fits = broadcast_shapes(mask.shape, scores) == scores
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"mask {fmt_shape(mask.shape)} does not broadcast to the attention "
                             f"scores {fmt_shape(scores)}")
    return TensorType((*batch, length, ev), dtype)


@defop("scaled_dot_product_attention", infer=_sdpa_infer, num_inputs=(3, 4),
       traits=("composite",), amp="low",
       impls={"generated": True, "library": "scaled_dot_product_attention"}, attrs={
           "is_causal": Attr("bool", False), "scale": Attr("float", None, optional=True)})
def scaled_dot_product_attention(q, k, v, mask=None, *, is_causal=False, scale=None):
    """``softmax(q @ k^T * scale + mask) @ v``; rows with every key masked out give 0."""
    qf, kf, vf = upcast_half(q), upcast_half(k), upcast_half(v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.matmul(qf, np.swapaxes(kf, -1, -2)) * qf.dtype.type(scale)
    keep = np.tril(np.ones(scores.shape[-2:], bool)) if is_causal else None
    if mask is not None and mask.dtype == np.bool_:
        keep = mask
    elif mask is not None:
        scores = scores + upcast_half(mask).astype(scores.dtype)
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True)
    peak = np.where(np.isneginf(peak), 0, peak)
    e = np.exp(scores - peak)
    total = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(total > 0, e / total, 0)
    return _result(np.matmul(p.astype(qf.dtype), vf), q)


_LOWEST = {DType.float16: -65504.0, DType.bfloat16: -3.0e38}


@defvjp("scaled_dot_product_attention")
def _sdpa_vjp(b, inputs, outputs, cotangents, attrs):
    """Recompute the attention weights ``p``, then ``dv = p^T g``, ``dp = g v^T``,
    ``ds = p * (dp - sum(dp * p))``, ``dq = ds k * scale``, ``dk = ds^T q * scale`` and, for
    an additive float mask, ``dmask = ds``; everything summed over broadcast batch axes.
    Masked-out scores are replaced by the dtype's lowest finite value (not -inf) and ``p``
    is zeroed there afterwards, so rows with every key masked out get zero gradients."""
    q, k, v = inputs[:3]
    mask = inputs[3] if len(inputs) == 4 else None
    g = cotangents[0]
    scale = attrs["scale"] if attrs["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = b.mul(b.op("matmul", q, b.transpose(k)), b.const(scale, q))
    keep = None
    if attrs["is_causal"]:
        length, keys = scores.shape[-2:]
        keep = b.array(np.tril(np.ones((length, keys), bool)), DType.bool)
    elif mask is not None and mask.dtype == DType.bool:
        keep = mask
    elif mask is not None:
        scores = b.add(scores, b.cast(mask, scores.dtype))
    if keep is None:
        p = b.op("softmax", scores, dim=-1)
    else:
        lowest = _LOWEST.get(q.dtype) or float(np.finfo(q.dtype.numpy).min)
        p = b.op("softmax", b.where(keep, scores, b.const(lowest, scores)), dim=-1)
        p = b.where(keep, p, b.const(0.0, p))
    dp = b.op("matmul", g, b.transpose(v))
    ds = b.mul(p, b.sub(dp, b.op("sum", b.mul(dp, p), dims=(-1,), keepdim=True)))
    grads: list = [None] * len(inputs)
    if b.wants(0):
        grads[0] = unbroadcast(b, b.mul(b.op("matmul", ds, k), b.const(scale, q)), q)
    if b.wants(1):
        grads[1] = unbroadcast(b, b.mul(b.op("matmul", b.transpose(ds), q), b.const(scale, q)), k)
    if b.wants(2):
        grads[2] = unbroadcast(b, b.op("matmul", b.transpose(p), g), v)
    if mask is not None and mask.dtype.is_floating and b.wants(3):
        grads[3] = unbroadcast(b, ds, mask)
    return grads


# --------------------------------------------------------------- compute rules (lowering)
# Windows read their input through bound checks (select) where padding can reach outside.
def _window_position(o, k, stride: int, pad: int, dilation: int):
    return simplify_index(o * stride - pad + k * dilation)


def _inside(pos, size: int, low: bool, high: bool) -> list:
    """Conditions keeping ``pos`` inside ``[0, size)``: only the sides that can be crossed."""
    return ([cmp(">=", pos, 0)] if low else []) + ([cmp("<", pos, size)] if high else [])


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
            p = _window_position(o[d], r[1 + d], stride[d], padding[d], dilation[d])
            reach = (spatial[d] - 1) * stride[d] - padding[d] + (kernel[d] - 1) * dilation[d]
            pos.append(p)
            conds += _inside(p, size, padding[d] > 0, reach >= size)
        value = x.at((n, group * cin_g + r[0], *pos), t) * w.at((co, r[0], *r[1:]), t)
        guard = all_of(conds)
        return value if guard is None else select(guard, value, const(0, t))

    acc = ctx.reduce(ctx.out_shape, t, "+", [cin_g, *kernel], body, "acc")
    if bias is None:
        return ctx.convert(acc, out)
    return ctx.tensor(ctx.out_shape, out, lambda i: acc[i] + bias.at((i[1],), t))


def _window_value(x, axes, i, r, t, fill):
    """Element ``r`` (kernel taps) of pooling window ``i`` of ``x``: ``fill`` where the
    window reaches outside the input (padding, ceil-mode overhang)."""
    lead, conds, pos = i[:-2], [], []
    for a, (size, k, s, p, d, out) in enumerate(axes):
        q = _window_position(i[len(lead) + a], r[a], s, p, d)
        pos.append(q)
        conds += _inside(q, size, p > 0, (out - 1) * s - p + (k - 1) * d >= size)
    value = x.at((*lead, *pos), t)
    guard = all_of(conds)
    return value if guard is None else select(guard, value, fill)


def _pool_window(ctx, x, axes, combiner, t, fill, suffix, shape=None):
    """Combine ``x`` over each pooling window of the last two axes (a stage over ``shape``,
    the node's result shape by default)."""
    def body(i, r):
        return _window_value(x, axes, i, r, t, fill)

    return ctx.reduce(shape or ctx.out_shape, t, combiner, [axes[0][1], axes[1][1]], body, suffix)


@defcompute("max_pool2d")
def _max_pool_compute(ctx, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    t = compute_dtype(x.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    best = _pool_window(ctx, x, axes, "max", t, identity("max", t), "max")
    return ctx.convert(best, x.dtype)


def _avg_divisor(o, size: int, k: int, s: int, p: int, count_include_pad: bool):
    """torch's avg_pool2d divisor along one axis, as an index expression of ``o``."""
    start = o * s - p
    end = minimum(start + k, as_expr(size + p))
    if count_include_pad:
        return end - start
    return minimum(end, as_expr(size)) - maximum(start, as_expr(0))


@defcompute("avg_pool2d")
def _avg_pool_compute(ctx, x, *, kernel, stride, padding=(0, 0), ceil_mode=False, count_include_pad=True,
                      divisor_override=None):
    t = compute_dtype(x.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, (1, 1), ceil_mode)
    total = _pool_window(ctx, x, axes, "+", t, const(0, t), "sum")

    def divisor(i):
        if divisor_override is not None:
            return const(divisor_override, t)
        (h, kh, sh, ph, _, _), (w, kw, sw, pw, _, _) = axes
        count = (_avg_divisor(i[-2], h, kh, sh, ph, count_include_pad)
                 * _avg_divisor(i[-1], w, kw, sw, pw, count_include_pad))
        return convert(simplify_index(count), DType.int64, t)

    # integer results divide with C semantics (toward zero), as the reference does
    return ctx.tensor(ctx.out_shape, x.dtype, lambda i: total[i] / divisor(i))


@defcompute("adaptive_avg_pool2d")
def _adaptive_avg_pool_compute(ctx, x, *, output_size):
    """Output ``o`` of an axis of ``n`` inputs averages ``[floor(o*n/m), ceil((o+1)*n/m))``:
    the reduction bounds depend on the output position."""
    t = compute_dtype(x.dtype)
    sizes = x.shape[-2:]

    def window(o, n, m):
        return floordiv(o * n, m), floordiv((o + 1) * n + m - 1, m)

    def bounds(i):
        return [window(i[-2], sizes[0], output_size[0]), window(i[-1], sizes[1], output_size[1])]

    def body(i, r):
        return x.at((*i[:-2], *r), t)

    total = ctx.reduce(ctx.out_shape, t, "+", bounds, body, "sum")

    def element(i):
        (lo_h, hi_h), (lo_w, hi_w) = bounds(i)
        count = simplify_index(hi_h - lo_h) * simplify_index(hi_w - lo_w)
        return total[i] / convert(count, DType.int64, t)

    return ctx.tensor(ctx.out_shape, x.dtype, element)


def _nearest_source(o, n_in: int, n_out: int):
    """torch 'nearest': ``min(floor(o * f32(n_in / n_out)), n_in - 1)``; an exact integer
    formula when it agrees with the float32 one at every position."""
    exact = (np.arange(n_out) * n_in) // n_out
    if np.array_equal(exact, _nearest_index(n_in, n_out)):
        return simplify_index(floordiv(o * n_in, n_out)) if n_in != n_out else o
    scale = np.float32(n_in) / np.float32(n_out)
    index = Cast(DType.int64, call("floor", convert(o, DType.int64, DType.float32) * const(scale, DType.float32)))
    return minimum(index, as_expr(n_in - 1))


@defcompute("upsample_nearest2d")
def _nearest_compute(ctx, x, *, output_size):
    (h, w), (oh, ow) = x.shape[-2:], output_size
    return ctx.tensor(ctx.out_shape, x.dtype, lambda i: x[(*i[:-2], _nearest_source(i[-2], h, oh),
                                                             _nearest_source(i[-1], w, ow))])


def _linear_taps(o, n_in: int, n_out: int, align_corners: bool, t: DType):
    """Per output position ``o`` the two source indices and their weights, computed in
    ``t`` exactly as torch's linear upsampling (and the reference's matrix) does."""
    if n_in == n_out:
        return [(o, const(1, t))]
    dt = t.numpy
    src_o = convert(o, DType.int64, t)
    if align_corners:
        scale = dt.type(n_in - 1) / dt.type(n_out - 1) if n_out > 1 else dt.type(0)
        src = src_o * const(scale, t)
    else:
        scale = dt.type(n_in) / dt.type(n_out)
        src = maximum(const(scale, t) * (src_o + const(0.5, t)) - const(0.5, t), const(0, t))
    i0 = minimum(Cast(DType.int64, call("floor", src)), as_expr(n_in - 1))
    i1 = i0 + cmp("<", i0, n_in - 1)
    lam1 = minimum(maximum(src - convert(i0, DType.int64, t), const(0, t)), const(1, t))
    return [(i0, const(1, t) - lam1), (i1, lam1)]


@defcompute("upsample_bilinear2d")
def _bilinear_compute(ctx, x, *, output_size, align_corners=False):
    t = compute_dtype(x.dtype)
    (h, w), (oh, ow) = x.shape[-2:], output_size

    def element(i):
        total = None
        for row, wr in _linear_taps(i[-2], h, oh, align_corners, t):
            line = None
            for col, wc in _linear_taps(i[-1], w, ow, align_corners, t):
                term = wc * x.at((*i[:-2], row, col), t)
                line = term if line is None else line + term
            total = wr * line if total is None else total + wr * line
        return total

    return ctx.tensor(ctx.out_shape, x.dtype, element)


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


@defcompute("embedding")
def _embedding_compute(ctx, weight, indices):
    """``out[i..., j] = weight[indices[i...], j]`` (indices are not range-checked)."""
    return ctx.tensor(ctx.out_shape, weight.dtype,
                      lambda i: weight[(indices.at(i[:-1], DType.int64), i[-1])])


@defcompute("scaled_dot_product_attention")
def _sdpa_compute(ctx, q, k, v, mask=None, *, is_causal=False, scale=None):
    """Stages per query row: scores ``q . k`` (a reduction over the embedding), their
    maximum, the sum of ``exp(score - max)``, then ``out = sum_s p[s] * v[s]`` with
    ``p = exp(score - max) / sum`` (0 for rows with every key masked out)."""
    out = ctx.out_shape
    t = compute_dtype(q.dtype)
    q, k, v = ctx.operand(q, "q"), ctx.operand(k, "k"), ctx.operand(v, "v")
    nb = len(out) - 2
    keys = k.shape[-2]
    factor = const(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, t)

    def qk(i, r):
        batch = i[:nb]
        return (q.at((*broadcast_index(batch, q.shape[:-2]), i[nb], r[0]), t)
                * k.at((*broadcast_index(batch, k.shape[:-2]), i[nb + 1], r[0]), t))

    raw = ctx.reduce((*out[:-1], keys), t, "+", [q.shape[-1]], qk, "scores")

    def score(i):  # i = (*batch, query, key)
        s = raw[i] * factor
        keep = cmp("<=", i[nb + 1], i[nb]) if is_causal else None
        if mask is not None and mask.dtype == DType.bool:
            keep = mask[broadcast_index(i, mask.shape)]
        elif mask is not None:
            s = s + mask.at(broadcast_index(i, mask.shape), t)
        return s if keep is None else select(keep, s, const(-math.inf, t))

    row = (nb + 1,)
    scores_shape = (*out[:-1], keys)
    peak = ctx.reduce_axes(scores_shape, row, False, "max", t, score, "max")

    def shifted(i):
        m = peak[i[:-1]]
        return call("exp", score(i) - select(cmp("==", m, const(-math.inf, t)), const(0, t), m))

    total = ctx.reduce_axes(scores_shape, row, False, "+", t, shifted, "sum")

    def weighted(i, r):
        z = total[i[:-1]]
        p = select(cmp(">", z, const(0, t)), shifted((*i[:-1], r[0])) / z, const(0, t))
        return p * v.at((*broadcast_index(i[:nb], v.shape[:-2]), r[0], i[-1]), t)

    return ctx.convert(ctx.reduce(out, t, "+", [keys], weighted, "out"), q.dtype)


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
            conds += _inside(q, size * s, p - (kernel[d] - 1) * dil < 0, (spatial[d] - 1 + p) // s >= size)
            pos.append(src)
        value = x.at((n, ci, *pos), t) * w.at((ci, floormod(co, cout_g) if groups > 1 else co, *r[1:]), t)
        guard = all_of(conds)
        return value if guard is None else select(guard, value, const(0, t))

    acc = ctx.reduce(ctx.out_shape, t, "+", [cin_g, *kernel], body, "acc")
    if bias is None:
        return ctx.convert(acc, out)
    return ctx.tensor(ctx.out_shape, out, lambda i: acc[i] + bias.at((i[1],), t))


def _first_maximum(ctx, x, axes, t):
    """Stages over the pooled shape: each window's maximum, then the first tap
    ``kh * kw_size + kw`` holding it (padding holds -inf, as in the reference)."""
    pooled = (*x.shape[:-2], axes[0][5], axes[1][5])
    fill = identity("max", t)
    best = _pool_window(ctx, x, axes, "max", t, fill, "max", pooled)
    kw_size = axes[1][1]
    count = axes[0][1] * kw_size

    def tap(i, r):
        value = _window_value(x, axes, i, r, t, fill)
        return r[0] * kw_size + r[1] + cmp("!=", value, best[i]) * count

    return ctx.reduce(pooled, DType.int64, "min", [axes[0][1], axes[1][1]], tap, "tap")


@defcompute("max_pool2d_select")
def _max_pool_select_compute(ctx, src, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    """``out[.., oh, ow] = src`` at the first maximum of window ``(oh, ow)`` of ``x`` (0 in padding)."""
    t = compute_dtype(src.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    first = _first_maximum(ctx, x, axes, compute_dtype(x.dtype))
    kw_size = axes[1][1]

    def element(i):
        tap = first[i]
        taps = (floordiv(tap, kw_size), floormod(tap, kw_size))
        pos = [_window_position(i[len(i) - 2 + a], taps[a], s, p, d) for a, (_, _, s, p, d, _) in enumerate(axes)]
        inside = all_of(_inside(pos[0], axes[0][0], True, True) + _inside(pos[1], axes[1][0], True, True))
        return select(inside, src.at((*i[:-2], *pos), t), const(0, t))

    return ctx.tensor(ctx.out_shape, src.dtype, element)


@defcompute("max_pool2d_backward")
def _max_pool_backward_compute(ctx, g, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    """``out[.., h, w]`` sums ``g`` over the windows whose first maximum is at ``(h, w)``:
    window ``oh = (h + p - kh * d) / s`` for each tap ``kh`` (taps in decreasing order, so
    windows are added in increasing order, as the reference adds them)."""
    t = compute_dtype(g.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
    first = _first_maximum(ctx, x, axes, compute_dtype(x.dtype))
    kw_size = axes[1][1]

    def body(i, r):
        taps = [simplify_index(axes[a][1] - 1 - r[a]) for a in range(2)]
        windows, conds = [], []
        for a, (_, k, s, p, d, out) in enumerate(axes):
            q = simplify_index(i[len(i) - 2 + a] + p - taps[a] * d)
            windows.append(q if s == 1 else floordiv(q, s))
            conds += ([cmp("==", floormod(q, s), 0)] if s > 1 else []) + _inside(q, out * s, True, True)
        window = (*i[:-2], *windows)
        conds.append(cmp("==", first[window], simplify_index(taps[0] * kw_size + taps[1])))
        return select(all_of(conds), g.at(window, t), const(0, t))

    total = ctx.reduce(x.shape, t, "+", [axes[0][1], axes[1][1]], body, "sum")
    return ctx.convert(total, g.dtype)
