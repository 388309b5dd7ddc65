"""Pooling and resampling ops: max/avg pooling, adaptive average pooling, nearest and
bilinear upsampling.

Layouts are torch's (``N, C, *spatial``), on the trailing spatial axes.  References are
vectorized numpy (windows via stride tricks); float16/bfloat16 are computed in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import DType
from ._infer import fmt_shape, require_float, static_dims, upcast_half
from ._nn_common import cast_like, inside_bounds, sliding_windows, window_position
from .compute import (
    Cast,
    all_of,
    as_expr,
    call,
    cmp,
    compute_dtype,
    const,
    convert,
    defcompute,
    floordiv,
    floormod,
    identity,
    maximum,
    minimum,
    select,
    simplify_index,
)
from .vjp import GradBuilder, defvjp


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
    win = sliding_windows(_pool_pad(xf, axes, fill), [a[1] for a in axes], [a[2] for a in axes],
                   [a[4] for a in axes], [a[5] for a in axes])
    return cast_like(np.max(win, axis=(-2, -1)), x)


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
    win = sliding_windows(padded, (kh, kw), (sh, sw), (dh, dw), (oh, ow))
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
    return cast_like(out[:, ph:ph + h, pw:pw + w].reshape(x.shape), g)


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
    return cast_like(picked.reshape(*x.shape[:-2], *rows.shape[1:]), t)


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
    win = sliding_windows(_pool_pad(xf, axes, 0), [a[1] for a in axes], [a[2] for a in axes],
                   (1, 1), [a[5] for a in axes])
    total = np.sum(win, axis=(-2, -1))
    if divisor_override is not None:
        div = np.asarray(divisor_override)
    else:
        (h, kh, sh, ph, _, oh), (w, kw, sw, pw, _, ow) = axes
        div = np.outer(_avg_divisors(h, kh, sh, ph, oh, count_include_pad),
                       _avg_divisors(w, kw, sw, pw, ow, count_include_pad))
    if x.dtype.kind in "iu":
        return cast_like(np.sign(total) * (np.abs(total) // div), x)
    return cast_like(total / div, x)


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
    return cast_like(_resample(xf, rows, cols), x)


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
    return cast_like(_resample(xf, rows, cols), x)


@defvjp("upsample_bilinear2d")
def _upsample_bilinear2d_vjp(b, inputs, outputs, cotangents, attrs):
    """The interpolation weights are computed in the input's dtype, as the forward does."""
    x, (oh, ow), corners = inputs[0], attrs["output_size"], attrs["align_corners"]
    dtype = upcast_half(np.zeros(0, x.dtype.numpy)).dtype
    rows = _linear_matrix(x.shape[-2], oh, corners, dtype)
    cols = _linear_matrix(x.shape[-1], ow, corners, dtype)
    return [_separable_vjp(b, cotangents[0], x, rows, cols)]




# --------------------------------------------------------------- compute rules (lowering)
def _window_value(x, axes, i, r, t, fill):
    """Element ``r`` (kernel taps) of pooling window ``i`` of ``x``: ``fill`` where the
    window reaches outside the input (padding, ceil-mode overhang)."""
    lead, conds, pos = i[:-2], [], []
    for a, (size, k, s, p, d, out) in enumerate(axes):
        q = window_position(i[len(lead) + a], r[a], s, p, d)
        pos.append(q)
        conds += inside_bounds(q, size, p > 0, (out - 1) * s - p + (k - 1) * d >= size)
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
        pos = [window_position(i[len(i) - 2 + a], taps[a], s, p, d) for a, (_, _, s, p, d, _) in enumerate(axes)]
        inside = all_of(inside_bounds(pos[0], axes[0][0], True, True) + inside_bounds(pos[1], axes[1][0], True, True))
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
            conds += ([cmp("==", floormod(q, s), 0)] if s > 1 else []) + inside_bounds(q, out * s, True, True)
        window = (*i[:-2], *windows)
        conds.append(cmp("==", first[window], simplify_index(taps[0] * kw_size + taps[1])))
        return select(all_of(conds), g.at(window, t), const(0, t))

    total = ctx.reduce(x.shape, t, "+", [axes[0][1], axes[1][1]], body, "sum")
    return ctx.convert(total, g.dtype)
