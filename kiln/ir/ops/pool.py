"""Pooling and resampling ops over 2 or 3 trailing spatial axes: max/avg pooling, adaptive
average pooling, nearest (and nearest-exact), bilinear/trilinear and bicubic upsampling.

Each family is written once for ``n`` spatial axes and declared for ``n = 2`` and ``n = 3``
under torch's names (``max_pool2d`` / ``max_pool3d``, ``avg_pool2d`` / ``avg_pool3d``,
``adaptive_avg_pool2d`` / ``adaptive_avg_pool3d``, ``upsample_nearest2d`` /
``upsample_nearest3d``, ``upsample_bilinear2d`` / ``upsample_trilinear3d``; bicubic is
2-d only).  1-d pooling and resampling lower to the 2-d ops with a unit height axis.

Layouts are torch's (``N, C, *spatial``; the batch axis is optional).  References are
vectorized numpy (windows via stride tricks); float16/bfloat16 are computed in float32.
Resampling ops take ``scales``: torch's per-axis scale factors (``0`` = not given); a given
scale ``s`` maps output ``o`` to source ``o / s`` instead of ``o * in / out``, as in torch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import DType, TensorType
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
from .vjp import GradBuilder, defvjp, nondifferentiable

_AXIS_NAMES = {2: ("height", "width"), 3: ("depth", "height", "width")}
_AXIS_LETTERS = {2: "H, W", 3: "D, H, W"}
SPATIAL_RANKS = (2, 3)


# ------------------------------------------------------------------------- pooling
def _entries(values: Sequence[int], n: int, what: str) -> tuple[int, ...]:
    if len(values) != n:
        raise ValueError(f"{what} {list(values)} must have {n} entries ({', '.join(_AXIS_NAMES[n])})")
    return tuple(values)


def _check_rank(shape, n: int) -> None:
    if len(shape) not in (n + 1, n + 2):
        letters = _AXIS_LETTERS[n]
        raise ValueError(f"input must be {n + 1}-d (C, {letters}) or {n + 2}-d (N, C, {letters}), "
                         f"got {fmt_shape(shape)}")


def _pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape, including the ceil-mode rule that the last window must
    start inside the input or its left padding."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_geometry(shape, kernel, stride, padding, dilation, ceil_mode, n: int = 2) -> list[tuple]:
    """Per spatial axis ``(size, k, s, p, d, out)``, validated like torch's pool shape checks."""
    _check_rank(shape, n)
    stride = stride or kernel  # an empty stride means stride = kernel, as in ATen
    params = [_entries(kernel, n, "kernel"), _entries(stride, n, "stride"),
              _entries(padding, n, "padding"), _entries(dilation, n, "dilation")]
    if min(params[0] + params[1] + params[3]) < 1 or min(params[2]) < 0:
        raise ValueError("kernel, stride and dilation must be positive and padding non-negative")
    size = static_dims(shape[-n:], "pooling (spatial axes)")
    axes = []
    for i in range(n):
        k, s, p, d = (q[i] for q in params)
        if p > k // 2:
            raise ValueError(f"padding {p} is more than half the kernel size {k}")
        axes.append((size[i], k, s, p, d, _pool_out(size[i], k, s, p, d, ceil_mode)))
    out = [a[-1] for a in axes]
    if min(out) < 1:
        raise ValueError(f"output size {out} is empty for input {list(size)}")
    return axes


def _pool_pad(x: np.ndarray, axes: Sequence[tuple], fill) -> np.ndarray:
    """Pad the spatial axes: ``p`` before, and after as much as the last window reaches."""
    widths = [(0, 0)] * (x.ndim - len(axes))
    for size, k, s, p, d, out in axes:
        widths.append((p, max((out - 1) * s + d * (k - 1) + 1 - size - p, 0)))
    return np.pad(x, widths, constant_values=fill)


def _windows(x: np.ndarray, axes: Sequence[tuple], fill) -> np.ndarray:
    """``[..., *out, *kernel]``: every pooling window of ``x`` (padding holds ``fill``)."""
    return sliding_windows(_pool_pad(x, axes, fill), [a[1] for a in axes], [a[2] for a in axes],
                           [a[4] for a in axes], [a[5] for a in axes])


def _max_fill(x: np.ndarray):
    return -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min


_MAX_POOL_ATTRS = {
    2: {"kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", (0, 0)),
        "dilation": Attr("ints", (1, 1)), "ceil_mode": Attr("bool", False)},
    3: {"kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", (0, 0, 0)),
        "dilation": Attr("ints", (1, 1, 1)), "ceil_mode": Attr("bool", False)},
}


def _window_maxima(x: np.ndarray, axes: Sequence[tuple]) -> tuple[tuple, tuple]:
    """Per window of a max pool, flattened over the leading axes: the ``[L, *out]`` position
    (in padded coordinates) of its first maximum along each spatial axis (NaN counts as
    maximal), as torch's kernel picks it; and the padded spatial shape."""
    n = len(axes)
    xf = upcast_half(x)
    padded = _pool_pad(xf, axes, _max_fill(xf))
    kernel, out = [a[1] for a in axes], [a[5] for a in axes]
    win = sliding_windows(padded, kernel, [a[2] for a in axes], [a[4] for a in axes], out)
    first = np.argmax(win.reshape(*win.shape[:-n], math.prod(kernel)), axis=-1).reshape(-1, *out)
    taps = np.unravel_index(first, kernel)
    positions = []
    for a, (_, _, s, _, d, o) in enumerate(axes):
        start = np.arange(o).reshape((1,) * (1 + a) + (o,) + (1,) * (n - 1 - a)) * s
        positions.append(start + taps[a] * d)
    return tuple(positions), padded.shape[-n:]


def _crop(axes: Sequence[tuple]) -> tuple:
    return tuple(slice(p, p + size) for size, _, _, p, _, _ in axes)


def _leading(count: int, n: int) -> np.ndarray:
    return np.arange(count).reshape((count,) + (1,) * n)


def _declare_max_pool(n: int) -> None:
    name, backward, picker = f"max_pool{n}d", f"max_pool{n}d_backward", f"max_pool{n}d_select"
    attrs = _MAX_POOL_ATTRS[n]
    geometry = functools.partial(_pool_geometry, n=n)

    def infer(types, *, kernel, stride, padding=attrs["padding"].default,
              dilation=attrs["dilation"].default, ceil_mode=False):
        t = types[0]
        if t.dtype == DType.bool:
            raise TypeError(f"{name} is not defined on bool; cast the input first")
        out = [a[-1] for a in geometry(t.shape, kernel, stride, padding, dilation, ceil_mode)]
        return t.with_shape((*t.shape[:-n], *out))

    def reference(x, *, kernel, stride, padding=attrs["padding"].default,
                  dilation=attrs["dilation"].default, ceil_mode=False):
        axes = geometry(x.shape, kernel, stride, padding, dilation, ceil_mode)
        xf = upcast_half(x)
        win = _windows(xf, axes, _max_fill(xf))
        return cast_like(np.max(win, axis=tuple(range(-n, 0))), x)

    reference.__doc__ = (f"Window maxima over the last {n} axes; padding never wins (acts as "
                         "-inf); NaN wins.  An empty ``stride`` means ``stride = kernel``, as in ATen.")
    defop(name, infer=infer, attrs=attrs)(reference)

    def backward_infer(types, **kw):
        g, x = types
        pooled = infer([x], **kw)
        if g != pooled:
            raise ValueError(f"grad has type {g} but {name} of input {x} gives {pooled}")
        return x

    def backward_reference(g, x, **kw):
        axes = geometry(x.shape, **kw)
        positions, padded = _window_maxima(x, axes)
        gf = upcast_half(g).reshape(positions[0].shape[0], *(a[5] for a in axes))
        out = np.zeros((gf.shape[0], *padded), dtype=gf.dtype)
        np.add.at(out, (_leading(gf.shape[0], n), *positions), gf)
        return cast_like(out[(slice(None), *_crop(axes))].reshape(x.shape), g)

    backward_reference.__doc__ = (f"Gradient of ``{name}(x)`` given the output gradient ``g``: "
                                  "each window's gradient is added at the window's first maximum.")
    defop(backward, infer=backward_infer, num_inputs=2, attrs=attrs)(backward_reference)

    def select_infer(types, **kw):
        t, x = types
        if t != x:
            raise ValueError(f"source has type {t} but the pooled input is {x}")
        return infer([x], **kw)

    def select_reference(t, x, **kw):
        axes = geometry(x.shape, **kw)
        positions, padded = _window_maxima(x, axes)
        count = positions[0].shape[0]
        tp = np.zeros((count, *padded), dtype=upcast_half(t).dtype)
        tp[(slice(None), *_crop(axes))] = upcast_half(t).reshape(count, *x.shape[-n:])
        picked = tp[(_leading(count, n), *positions)]
        return cast_like(picked.reshape(*x.shape[:-n], *picked.shape[1:]), t)

    select_reference.__doc__ = (f"Per ``{name}`` window of ``x``: the element of ``t`` at the "
                                f"window's first maximum (the transpose of ``{backward}`` in its "
                                "gradient operand).")
    defop(picker, infer=select_infer, num_inputs=2, attrs=attrs)(select_reference)

    @defvjp(name)
    def _max_pool_vjp(b, inputs, outputs, cotangents, kw):
        """Each window's cotangent goes to its first maximal element."""
        x = inputs[0]
        if not x.dtype.is_floating:
            return [None]
        return [b.op(backward, cotangents[0], x, **kw)]

    @defvjp(backward)
    def _max_pool_backward_vjp(b, inputs, outputs, cotangents, kw):
        """Linear in the gradient operand (its transpose is the select op); the argmax
        positions are piecewise constant in ``x``, which gets no gradient."""
        return [b.op(picker, cotangents[0], inputs[1], **kw), None]

    @defvjp(picker)
    def _max_pool_select_vjp(b, inputs, outputs, cotangents, kw):
        return [b.op(backward, cotangents[0], inputs[1], **kw), None]

    indices = f"{name}_indices"

    def indices_infer(types, **kw):
        return infer(types, **kw).with_dtype(DType.int64)

    def indices_reference(x, **kw):
        axes = geometry(x.shape, **kw)
        positions, _ = _window_maxima(x, axes)
        flat = np.zeros(positions[0].shape, dtype=np.int64)
        for (size, _, _, p, _, _), q in zip(axes, positions):
            flat = flat * size + (q - p)
        return flat.reshape(*x.shape[:-n], *flat.shape[1:])

    indices_reference.__doc__ = (f"Per ``{name}`` window of ``x``: where its first maximum is, "
                                 f"as the row-major index into the {n} spatial axes of the "
                                 "unpadded input (torch's ``return_indices=True`` result).")
    defop(indices, infer=indices_infer, attrs=attrs, vjp=nondifferentiable)(indices_reference)

    defcompute(name)(functools.partial(_max_pool_compute, n=n))
    defcompute(indices)(functools.partial(_max_pool_indices_compute, n=n))
    defcompute(picker)(functools.partial(_max_pool_select_compute, n=n))
    defcompute(backward)(functools.partial(_max_pool_backward_compute, n=n))


def _avg_divisors(size: int, k: int, s: int, p: int, out: int, count_include_pad: bool) -> np.ndarray:
    """Per output position of one axis: window length clipped to the padded input (counting
    padding) or to the input itself (not counting it), torch's avg_pool divisor."""
    start = np.arange(out) * s - p
    end = np.minimum(start + k, size + p)
    if count_include_pad:
        return end - start
    return np.minimum(end, size) - np.maximum(start, 0)


def _window_matrix(size: int, k: int, s: int, p: int, out: int) -> np.ndarray:
    """``[out, size]``: 1 where input ``i`` lies in the (zero-padded) window of output ``o``."""
    start = np.arange(out)[:, None] * s - p
    i = np.arange(size)[None, :]
    return ((i >= start) & (i < start + k)).astype(np.float64)


def _declare_avg_pool(n: int) -> None:
    name = f"avg_pool{n}d"
    zeros, ones = (0,) * n, (1,) * n
    geometry = functools.partial(_pool_geometry, n=n)

    def infer(types, *, kernel, stride, padding=zeros, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
        t = types[0]
        if not (t.dtype.is_floating or t.dtype == DType.int64):
            raise TypeError(f"input must be floating-point or i64 (as in torch), got {t.dtype.short}")
        if divisor_override is not None and divisor_override == 0:
            raise ValueError("divisor_override must be nonzero")
        out = [a[-1] for a in geometry(t.shape, kernel, stride, padding, ones, ceil_mode)]
        return t.with_shape((*t.shape[:-n], *out))

    def reference(x, *, kernel, stride, padding=zeros, ceil_mode=False, count_include_pad=True,
                  divisor_override=None):
        axes = geometry(x.shape, kernel, stride, padding, ones, ceil_mode)
        xf = upcast_half(x)
        total = np.sum(_windows(xf, axes, 0), axis=tuple(range(-n, 0)))
        if divisor_override is not None:
            div = np.asarray(divisor_override)
        else:
            div = functools.reduce(np.multiply.outer, [
                _avg_divisors(size, k, s, p, out, count_include_pad) for size, k, s, p, _, out in axes])
        if x.dtype.kind in "iu":
            return cast_like(np.sign(total) * (np.abs(total) // div), x)
        return cast_like(total / div, x)

    reference.__doc__ = (f"Window averages over the last {n} axes (zero padding); i64 results "
                         "truncate toward zero.  An empty ``stride`` means ``stride = kernel``.")
    defop(name, infer=infer, attrs={
        "kernel": Attr("ints"), "stride": Attr("ints"), "padding": Attr("ints", zeros),
        "ceil_mode": Attr("bool", False), "count_include_pad": Attr("bool", True),
        "divisor_override": Attr("int", None, optional=True)})(reference)

    @defvjp(name)
    def _avg_pool_vjp(b, inputs, outputs, cotangents, attrs):
        x = inputs[0]
        if not x.dtype.is_floating:
            return [None]
        axes = geometry(x.shape, attrs["kernel"], attrs["stride"], attrs["padding"], ones,
                        attrs["ceil_mode"])
        mats = [_window_matrix(size, k, s, p, out) for size, k, s, p, _, out in axes]
        if attrs["divisor_override"] is not None:
            mats[-1] = mats[-1] / attrs["divisor_override"]
        else:
            include = attrs["count_include_pad"]
            mats = [m / _avg_divisors(size, k, s, p, out, include)[:, None]
                    for m, (size, k, s, p, _, out) in zip(mats, axes)]
        return [_separable_vjp(b, cotangents[0], x, mats)]

    defcompute(name)(functools.partial(_avg_pool_compute, n=n))


def _separable_vjp(b: GradBuilder, g, x, mats: Sequence[np.ndarray]):
    """Cotangent of ``y = x`` times ``mats[a]`` (``[out, in]``) along each spatial axis ``a``:
    ``mats[a]^T`` applied to ``g`` along every axis.  Average pooling and every resampling
    op here are such separable linear maps."""
    n = len(mats)
    rank = g.type.rank
    for a, m in enumerate(mats):
        axis = rank - n + a
        if a == n - 1:
            g = b.op("matmul", g, b.array(m, x.dtype))
            continue
        shape = tuple(g.shape)
        trailing = math.prod(shape[axis + 1:])
        gm = g if axis == rank - 2 else b.reshape(g, (*shape[:axis + 1], trailing))
        gm = b.op("matmul", b.array(m.T, x.dtype), gm)
        g = gm if axis == rank - 2 else b.reshape(gm, (*shape[:axis], m.shape[1], *shape[axis + 1:]))
    return g


def _resample(x: np.ndarray, mats: Sequence[np.ndarray]) -> np.ndarray:
    """``x`` times ``mats[a]`` (``[out, in]``) along each trailing spatial axis ``a``."""
    n = len(mats)
    src, dst = "pqr"[:n], "PQR"[:n]
    spec = ",".join([f"...{src}"] + [f"{dst[a]}{src[a]}" for a in range(n)]) + f"->...{dst}"
    return np.einsum(spec, x, *mats, optimize=True)


def _spatial_infer(types, *, output_size, n: int = 2, floats_only=True, scales=()):
    t = types[0]
    _check_rank(t.shape, n)
    if floats_only:
        require_float(t)
    size = _entries(output_size, n, "output_size")
    if min(size) < 1:
        raise ValueError(f"output_size {list(size)} must be positive")
    if scales and len(scales) != n:
        raise ValueError(f"scales {list(scales)} must be empty or have {n} entries")
    if 0 in static_dims(t.shape[-n:], "resampling (spatial axes)"):
        raise ValueError(f"input {fmt_shape(t.shape)} has an empty spatial axis")
    return t.with_shape((*t.shape[:-n], *size))


def _adaptive_matrix(n_in: int, n_out: int, dtype) -> np.ndarray:
    """Averaging matrix ``[n_out, n_in]``: output ``i`` averages inputs
    ``floor(i * n_in / n_out)`` up to ``ceil((i + 1) * n_in / n_out)`` (torch's formula)."""
    i = np.arange(n_out)[:, None]
    start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
    j = np.arange(n_in)[None, :]
    return (((j >= start) & (j < end)) / (end - start)).astype(dtype)


def _declare_adaptive_avg_pool(n: int) -> None:
    name = f"adaptive_avg_pool{n}d"

    def infer(types, *, output_size):
        return _spatial_infer(types, output_size=output_size, n=n)

    def reference(x, *, output_size):
        xf = upcast_half(x)
        mats = [_adaptive_matrix(i, o, xf.dtype) for i, o in zip(x.shape[-n:], output_size)]
        return cast_like(_resample(xf, mats), x)

    reference.__doc__ = ("Average pooling onto ``output_size`` (windows may overlap when sizes "
                         "do not divide).")
    defop(name, infer=infer, attrs={"output_size": Attr("ints")})(reference)

    @defvjp(name)
    def _adaptive_avg_pool_vjp(b, inputs, outputs, cotangents, attrs):
        x = inputs[0]
        mats = [_adaptive_matrix(i, o, np.float64) for i, o in zip(x.shape[-n:], attrs["output_size"])]
        return [_separable_vjp(b, cotangents[0], x, mats)]

    defcompute(name)(functools.partial(_adaptive_avg_pool_compute, n=n))


# ---------------------------------------------------------------------- resampling
def _given(scales: Sequence[float], axis: int) -> float | None:
    """torch's per-axis scale factor, when given (positive)."""
    return scales[axis] if scales and scales[axis] > 0 else None


def _scale_value(n_in: int, n_out: int, scale: float | None, dtype) -> np.generic:
    """torch's compute_scales_value: ``1 / scale`` when given, else ``n_in / n_out``."""
    dt = np.dtype(dtype).type
    return dt(1.0 / scale) if scale is not None else dt(n_in) / dt(n_out)


def _nearest_index(n_in: int, n_out: int, scale: float | None = None, exact: bool = False) -> np.ndarray:
    """torch 'nearest': ``min(floor(o * s), n_in - 1)`` with ``s`` in float32 (identity and
    halving shortcuts as torch's); 'nearest-exact': ``min(floor((o + 0.5) * s), n_in - 1)``."""
    o = np.arange(n_out)
    s = _scale_value(n_in, n_out, scale, np.float32)
    if exact:
        index = np.floor(((o + 0.5) * np.float64(s)).astype(np.float32)).astype(np.int64)
        return np.minimum(index, n_in - 1)
    if n_out == n_in:
        return o
    if n_out == 2 * n_in:
        return o >> 1
    index = np.floor(o.astype(np.float32) * s).astype(np.int64)
    return np.minimum(index, n_in - 1)


def _selection_matrix(index: np.ndarray, n_in: int) -> np.ndarray:
    """``[len(index), n_in]`` with a 1 at ``(o, index[o])``."""
    m = np.zeros((len(index), n_in))
    m[np.arange(len(index)), index] = 1.0
    return m


def _declare_upsample_nearest(n: int) -> None:
    name = f"upsample_nearest{n}d"

    def infer(types, *, output_size, exact=False, scales=()):
        return _spatial_infer(types, output_size=output_size, n=n, floats_only=False, scales=scales)

    def indices(shape, output_size, exact, scales):
        return [_nearest_index(i, o, _given(scales, a), exact)
                for a, (i, o) in enumerate(zip(shape[-n:], output_size))]

    def reference(x, *, output_size, exact=False, scales=()):
        index = indices(x.shape, output_size, exact, scales)
        grid = np.ix_(*index)
        return x[(Ellipsis, *grid)]

    reference.__doc__ = (f"Nearest-neighbour resize of the last {n} axes (any dtype); ``exact`` "
                         "selects torch's 'nearest-exact' (pixel centres) convention.")
    defop(name, infer=infer, attrs={"output_size": Attr("ints"), "exact": Attr("bool", False),
                                    "scales": Attr("floats", ())})(reference)

    @defvjp(name)
    def _upsample_nearest_vjp(b, inputs, outputs, cotangents, attrs):
        x = inputs[0]
        if not x.dtype.is_floating:
            return [None]
        index = indices(x.shape, attrs["output_size"], attrs["exact"], attrs["scales"])
        mats = [_selection_matrix(ix, i) for ix, i in zip(index, x.shape[-n:])]
        return [_separable_vjp(b, cotangents[0], x, mats)]

    defcompute(name)(functools.partial(_nearest_compute, n=n, indices=indices))


def _linear_matrix(n_in: int, n_out: int, align_corners: bool, dtype, scale: float | None = None) -> np.ndarray:
    """Interpolation matrix ``[n_out, n_in]`` of torch's linear upsampling along one axis
    (source index, clamping and weights computed in ``dtype`` as torch's kernel does)."""
    dtype = np.dtype(dtype)
    o = np.arange(n_out, dtype=dtype)
    if n_in == n_out:
        return np.eye(n_out, dtype=dtype)
    if align_corners:
        s = dtype.type(n_in - 1) / dtype.type(n_out - 1) if n_out > 1 else dtype.type(0)
        src = o * s
    else:
        s = _scale_value(n_in, n_out, scale, dtype)
        src = np.maximum(s * (o + dtype.type(0.5)) - dtype.type(0.5), dtype.type(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    i1 = i0 + (i0 < n_in - 1)
    lam1 = np.clip(src - i0.astype(dtype), 0, 1)
    m = np.zeros((n_out, n_in), dtype)
    np.add.at(m, (np.arange(n_out), i0), 1 - lam1)
    np.add.at(m, (np.arange(n_out), i1), lam1)
    return m


_CUBIC_A = -0.75


def _cubic_taps(n_in: int, n_out: int, align_corners: bool, dtype, scale: float | None = None):
    """Per output position: torch's four bicubic source indices (clamped into the input) and
    their weights (``[n_out, 4]`` each), computed in ``dtype`` with ``A = -0.75``."""
    dt = np.dtype(dtype).type
    o = np.arange(n_out).astype(dt)
    if align_corners:
        s = dt(n_in - 1) / dt(n_out - 1) if n_out > 1 else dt(0)
        src = o * s
    else:
        s = _scale_value(n_in, n_out, scale, dt)
        src = s * (o + dt(0.5)) - dt(0.5)
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    t = np.clip(src - i0.astype(dt), dt(0), dt(1)).astype(dt)
    a = dt(_CUBIC_A)

    def near(v):  # |v| <= 1
        return ((a + dt(2)) * v - (a + dt(3))) * v * v + dt(1)

    def far(v):  # 1 < |v| < 2
        return ((a * v - dt(5) * a) * v + dt(8) * a) * v - dt(4) * a

    weights = np.stack([far(t + dt(1)), near(t), near(dt(1) - t), far(dt(2) - t)], axis=-1).astype(dt)
    index = np.clip(i0[:, None] + np.arange(-1, 3)[None, :], 0, n_in - 1)
    return index, weights


def _cubic_matrix(n_in: int, n_out: int, align_corners: bool, dtype, scale: float | None = None) -> np.ndarray:
    index, weights = _cubic_taps(n_in, n_out, align_corners, dtype, scale)
    m = np.zeros((n_out, n_in), weights.dtype)
    np.add.at(m, (np.repeat(np.arange(n_out), 4), index.reshape(-1)), weights.reshape(-1))
    return m


def _declare_upsample_interp(name: str, n: int, cubic: bool) -> None:
    matrix = _cubic_matrix if cubic else _linear_matrix

    def infer(types, *, output_size, align_corners=False, scales=()):
        return _spatial_infer(types, output_size=output_size, n=n, scales=scales)

    def matrices(shape, output_size, align_corners, scales, dtype):
        return [matrix(i, o, align_corners, dtype, _given(scales, a))
                for a, (i, o) in enumerate(zip(shape[-n:], output_size))]

    def reference(x, *, output_size, align_corners=False, scales=()):
        xf = upcast_half(x)
        return cast_like(_resample(xf, matrices(x.shape, output_size, align_corners, scales, xf.dtype)), x)

    reference.__doc__ = (f"{'Bicubic (A = -0.75, clamped borders)' if cubic else 'Linear'} resize "
                         f"of the last {n} axes with torch's source-index convention.")
    defop(name, infer=infer, attrs={"output_size": Attr("ints"), "align_corners": Attr("bool", False),
                                    "scales": Attr("floats", ())})(reference)

    @defvjp(name)
    def _upsample_vjp(b, inputs, outputs, cotangents, attrs):
        """The interpolation weights are computed in the input's dtype, as the forward does."""
        x = inputs[0]
        dtype = upcast_half(np.zeros(0, x.dtype.numpy)).dtype
        mats = matrices(x.shape, attrs["output_size"], attrs["align_corners"], attrs["scales"], dtype)
        return [_separable_vjp(b, cotangents[0], x, mats)]

    rule = _bicubic_compute if cubic else _linear_compute
    defcompute(name)(functools.partial(rule, n=n))


# --------------------------------------------------------------- compute rules (lowering)
def _window_value(x, axes, i, r, t, fill):
    """Element ``r`` (kernel taps) of pooling window ``i`` of ``x``: ``fill`` where the
    window reaches outside the input (padding, ceil-mode overhang)."""
    n = len(axes)
    lead, conds, pos = i[:-n], [], []
    for a, (size, k, s, p, d, out) in enumerate(axes):
        q = window_position(i[len(lead) + a], r[a], s, p, d)
        pos.append(q)
        conds += inside_bounds(q, size, p > 0, (out - 1) * s - p + (k - 1) * d >= size)
    value = x.at((*lead, *pos), t)
    guard = all_of(conds)
    return value if guard is None else select(guard, value, fill)


def _pool_window(ctx, x, axes, combiner, t, fill, suffix, shape=None):
    """Combine ``x`` over each pooling window of the spatial axes (a stage over ``shape``,
    the node's result shape by default)."""
    def body(i, r):
        return _window_value(x, axes, i, r, t, fill)

    return ctx.reduce(shape or ctx.out_shape, t, combiner, [a[1] for a in axes], body, suffix)


def _max_pool_compute(ctx, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False, n=2):
    t = compute_dtype(x.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode, n)
    best = _pool_window(ctx, x, axes, "max", t, identity("max", t), "max")
    return ctx.convert(best, x.dtype)


def _avg_divisor(o, size: int, k: int, s: int, p: int, count_include_pad: bool):
    """torch's avg_pool divisor along one axis, as an index expression of ``o``."""
    start = o * s - p
    end = minimum(start + k, as_expr(size + p))
    if count_include_pad:
        return end - start
    return minimum(end, as_expr(size)) - maximum(start, as_expr(0))


def _avg_pool_compute(ctx, x, *, kernel, stride, padding=(0, 0), ceil_mode=False, count_include_pad=True,
                      divisor_override=None, n=2):
    t = compute_dtype(x.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, (1,) * n, ceil_mode, n)
    total = _pool_window(ctx, x, axes, "+", t, const(0, t), "sum")

    def divisor(i):
        if divisor_override is not None:
            return const(divisor_override, t)
        count = None
        for a, (size, k, s, p, _, _) in enumerate(axes):
            term = _avg_divisor(i[len(i) - n + a], size, k, s, p, count_include_pad)
            count = term if count is None else count * term
        return convert(simplify_index(count), DType.int64, t)

    # integer results divide with C semantics (toward zero), as the reference does
    return ctx.tensor(ctx.out_shape, x.dtype, lambda i: total[i] / divisor(i))


def _adaptive_avg_pool_compute(ctx, x, *, output_size, n=2):
    """Output ``o`` of an axis of ``n`` inputs averages ``[floor(o*n/m), ceil((o+1)*n/m))``:
    the reduction bounds depend on the output position."""
    t = compute_dtype(x.dtype)
    sizes = x.shape[-n:]

    def window(o, size, m):
        return floordiv(o * size, m), floordiv((o + 1) * size + m - 1, m)

    def bounds(i):
        return [window(i[len(i) - n + a], sizes[a], output_size[a]) for a in range(n)]

    def body(i, r):
        return x.at((*i[:-n], *r), t)

    total = ctx.reduce(ctx.out_shape, t, "+", bounds, body, "sum")

    def element(i):
        count = None
        for lo, hi in bounds(i):
            term = simplify_index(hi - lo)
            count = term if count is None else count * term
        return total[i] / convert(count, DType.int64, t)

    return ctx.tensor(ctx.out_shape, x.dtype, element)


def _table(ctx, values: np.ndarray, dtype: DType, suffix: str):
    """A per-output-position table (indices or weights) as a constant of the kernel."""
    return ctx.builder.constant(np.asarray(values), TensorType(tuple(values.shape), dtype),
                                f"{ctx.hint}_{suffix}")


def _nearest_source(ctx, n_in: int, n_out: int, index: np.ndarray, axis: int):
    """The nearest source index as a function of the output index: an exact integer formula
    when one agrees with torch's float32 rule at every position, else a table of it."""
    o = np.arange(n_out)
    if np.array_equal(index, o):
        return lambda e: e
    for num, den, off in ((n_in, n_out, 0), (2 * n_in, 2 * n_out, n_in)):
        if np.array_equal(index, (o * num + off) // den):
            return lambda e: simplify_index(floordiv(e * num + off, den))
    table = _table(ctx, index.astype(np.int64), DType.int64, f"index{axis}")
    return lambda e: table[(e,)]


def _nearest_compute(ctx, x, *, output_size, exact=False, scales=(), n=2, indices=None):
    sizes = x.shape[-n:]
    sources = [_nearest_source(ctx, sizes[a], output_size[a], ix, a)
               for a, ix in enumerate(indices(x.shape, output_size, exact, scales))]

    def element(i):
        return x[(*i[:-n], *(sources[a](i[len(i) - n + a]) for a in range(n)))]

    return ctx.tensor(ctx.out_shape, x.dtype, element)


def _linear_taps(o, n_in: int, n_out: int, align_corners: bool, t: DType, scale: float | None = None):
    """Per output position ``o`` the two source indices and their weights, computed in
    ``t`` exactly as torch's linear upsampling (and the reference's matrix) does."""
    if n_in == n_out:
        return [(o, const(1, t))]
    dt = t.numpy
    src_o = convert(o, DType.int64, t)
    if align_corners:
        s = dt.type(n_in - 1) / dt.type(n_out - 1) if n_out > 1 else dt.type(0)
        src = src_o * const(s, t)
    else:
        s = _scale_value(n_in, n_out, scale, dt)
        src = maximum(const(s, t) * (src_o + const(0.5, t)) - const(0.5, t), const(0, t))
    i0 = minimum(Cast(DType.int64, call("floor", src)), as_expr(n_in - 1))
    i1 = i0 + cmp("<", i0, n_in - 1)
    lam1 = minimum(maximum(src - convert(i0, DType.int64, t), const(0, t)), const(1, t))
    return [(i0, const(1, t) - lam1), (i1, lam1)]


def _interpolate(x, i, taps_per_axis, t):
    """``sum over taps of w_0 * (sum ... w_{n-1} * x[.., src_0, .., src_{n-1}])``."""
    n = len(taps_per_axis)

    def level(a, prefix):
        if a == n:
            return x.at((*i[:-n], *prefix), t)
        total = None
        for src, w in taps_per_axis[a]:
            term = w * level(a + 1, (*prefix, src))
            total = term if total is None else total + term
        return total

    return level(0, ())


def _linear_compute(ctx, x, *, output_size, align_corners=False, scales=(), n=2):
    t = compute_dtype(x.dtype)
    sizes = x.shape[-n:]

    def element(i):
        taps = [_linear_taps(i[len(i) - n + a], sizes[a], output_size[a], align_corners, t, _given(scales, a))
                for a in range(n)]
        return _interpolate(x, i, taps, t)

    return ctx.tensor(ctx.out_shape, x.dtype, element)


def _bicubic_compute(ctx, x, *, output_size, align_corners=False, scales=(), n=2):
    """Four taps per axis read from per-position tables of clamped source indices and
    weights (the reference's own numbers)."""
    t = compute_dtype(x.dtype)
    sizes = x.shape[-n:]
    tables = []
    for a in range(n):
        index, weights = _cubic_taps(sizes[a], output_size[a], align_corners, t.numpy, _given(scales, a))
        tables.append((_table(ctx, index.astype(np.int64), DType.int64, f"index{a}"),
                       _table(ctx, weights.astype(t.numpy), t, f"weight{a}")))

    def element(i):
        taps = []
        for a, (index, weights) in enumerate(tables):
            o = i[len(i) - n + a]
            taps.append([(index[(o, k)], weights[(o, k)])
                         for k in range(4)])
        return _interpolate(x, i, taps, t)

    return ctx.tensor(ctx.out_shape, x.dtype, element)


def _tap_radix(axes) -> list[int]:
    """Mixed-radix weights of the flattened kernel tap (C order over the kernel axes)."""
    kernel = [a[1] for a in axes]
    return [math.prod(kernel[a + 1:]) for a in range(len(kernel))]


def _first_maximum(ctx, x, axes, t):
    """Stages over the pooled shape: each window's maximum, then the first (flattened) tap
    holding it (padding holds -inf, as in the reference)."""
    n = len(axes)
    pooled = (*x.shape[:-n], *(a[5] for a in axes))
    fill = identity("max", t)
    best = _pool_window(ctx, x, axes, "max", t, fill, "max", pooled)
    radix = _tap_radix(axes)
    count = math.prod(a[1] for a in axes)

    def tap(i, r):
        value = _window_value(x, axes, i, r, t, fill)
        flat = None
        for a in range(n):
            term = r[a] * radix[a]
            flat = term if flat is None else flat + term
        return flat + cmp("!=", value, best[i]) * count

    return ctx.reduce(pooled, DType.int64, "min", [a[1] for a in axes], tap, "tap")


def _max_pool_select_compute(ctx, src, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False,
                             n=2):
    """``out[.., o...] = src`` at the first maximum of window ``o`` of ``x`` (0 in padding)."""
    t = compute_dtype(src.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode, n)
    first = _first_maximum(ctx, x, axes, compute_dtype(x.dtype))
    radix = _tap_radix(axes)

    def element(i):
        tap = first[i]
        pos, conds = [], []
        for a, (size, k, s, p, d, _) in enumerate(axes):
            digit = floordiv(tap, radix[a]) if radix[a] > 1 else tap
            digit = floormod(digit, k) if a > 0 else digit
            q = window_position(i[len(i) - n + a], digit, s, p, d)
            pos.append(q)
            conds += inside_bounds(q, size, True, True)
        return select(all_of(conds), src.at((*i[:-n], *pos), t), const(0, t))

    return ctx.tensor(ctx.out_shape, src.dtype, element)


def _max_pool_indices_compute(ctx, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False,
                              n=2):
    """``out[.., o...]`` = row-major spatial index (unpadded input) of window ``o``'s first
    maximum."""
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode, n)
    first = _first_maximum(ctx, x, axes, compute_dtype(x.dtype))
    radix = _tap_radix(axes)

    def element(i):
        tap = first[i]
        flat = None
        for a, (size, k, s, p, d, _) in enumerate(axes):
            digit = floordiv(tap, radix[a]) if radix[a] > 1 else tap
            digit = floormod(digit, k) if a > 0 else digit
            q = window_position(i[len(i) - n + a], digit, s, p, d)
            flat = q if flat is None else simplify_index(flat * size + q)
        return flat

    return ctx.tensor(ctx.out_shape, DType.int64, element)


def _max_pool_backward_compute(ctx, g, x, *, kernel, stride, padding=(0, 0), dilation=(1, 1), ceil_mode=False,
                               n=2):
    """``out[.., h...]`` sums ``g`` over the windows whose first maximum is at ``h``:
    window ``o = (h + p - k * d) / s`` for each tap ``k`` (taps in decreasing order, so
    windows are added in increasing order, as the reference adds them)."""
    t = compute_dtype(g.dtype)
    axes = _pool_geometry(x.shape, kernel, stride, padding, dilation, ceil_mode, n)
    first = _first_maximum(ctx, x, axes, compute_dtype(x.dtype))
    radix = _tap_radix(axes)

    def body(i, r):
        taps = [simplify_index(axes[a][1] - 1 - r[a]) for a in range(n)]
        windows, conds = [], []
        for a, (_, k, s, p, d, out) in enumerate(axes):
            q = simplify_index(i[len(i) - n + a] + p - taps[a] * d)
            windows.append(q if s == 1 else floordiv(q, s))
            conds += ([cmp("==", floormod(q, s), 0)] if s > 1 else []) + inside_bounds(q, out * s, True, True)
        window = (*i[:-n], *windows)
        flat = None
        for a in range(n):
            term = taps[a] * radix[a]
            flat = term if flat is None else flat + term
        conds.append(cmp("==", first[window], simplify_index(flat)))
        return select(all_of(conds), g.at(window, t), const(0, t))

    total = ctx.reduce(x.shape, t, "+", [a[1] for a in axes], body, "sum")
    return ctx.convert(total, g.dtype)


# ---------------------------------------------------------------------- declarations
for _n in SPATIAL_RANKS:
    _declare_max_pool(_n)
    _declare_avg_pool(_n)
    _declare_adaptive_avg_pool(_n)
    _declare_upsample_nearest(_n)
_declare_upsample_interp("upsample_bilinear2d", 2, cubic=False)
_declare_upsample_interp("upsample_trilinear3d", 3, cubic=False)
_declare_upsample_interp("upsample_bicubic2d", 2, cubic=True)
del _n
