"""Pooling ops over 2 or 3 trailing spatial axes: max pooling (with its backward, window
selection and indices ops), average pooling and adaptive average pooling.

Each family is written once for ``n`` spatial axes and declared for ``n = 2`` and ``n = 3``
under torch's names (``max_pool2d`` / ``max_pool3d``, ``avg_pool2d`` / ``avg_pool3d``,
``adaptive_avg_pool2d`` / ``adaptive_avg_pool3d``).  1-d pooling lowers to the 2-d ops with
a unit height axis.  Resampling (upsampling) ops are in :mod:`.upsample`.

Layouts are torch's (``N, C, *spatial``; the batch axis is optional).  References are
vectorized numpy (windows via stride tricks); float16/bfloat16 are computed in float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import DType
from ._infer import fmt_shape, require_float, static_dims, upcast_half
from ._nn_common import cast_like, inside_bounds, sliding_windows, window_position
from .compute import (
    all_of,
    as_expr,
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
from .cost import per_input_element
from .vjp import GradBuilder, defvjp, nondifferentiable

_AXIS_NAMES = {2: ("height", "width"), 3: ("depth", "height", "width")}
_AXIS_LETTERS = {2: "H, W", 3: "D, H, W"}
SPATIAL_RANKS = (2, 3)
_POOL_COST = per_input_element(1)  # one operation per input element


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
    defop(name, infer=infer, attrs=attrs, cost=_POOL_COST)(reference)

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
        "divisor_override": Attr("int", None, optional=True)}, cost=_POOL_COST)(reference)

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
    ``mats[a]^T`` applied to ``g`` along every axis.  Average pooling, adaptive average pooling
    and every resampling op (:mod:`.upsample`) are such separable linear maps."""
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
    defop(name, infer=infer, attrs={"output_size": Attr("ints")}, cost=_POOL_COST)(reference)

    @defvjp(name)
    def _adaptive_avg_pool_vjp(b, inputs, outputs, cotangents, attrs):
        x = inputs[0]
        mats = [_adaptive_matrix(i, o, np.float64) for i, o in zip(x.shape[-n:], attrs["output_size"])]
        return [_separable_vjp(b, cotangents[0], x, mats)]

    defcompute(name)(functools.partial(_adaptive_avg_pool_compute, n=n))


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

    if all(s == k and p == 0 and d == 1 for _, k, s, p, d, _ in axes):
        def element(i):  # tiling windows: h is tap h % k of window h / k only, one select
            hs = i[len(i) - n:]
            conds = [cmp("<", h, a[5] * a[1]) for h, a in zip(hs, axes)]  # past the last window
            window = (*i[:-n], *(floordiv(h, a[1]) if a[1] > 1 else h for h, a in zip(hs, axes)))
            flat = sum(((floormod(h, a[1]) if a[1] > 1 else const(0, DType.int64)) * r
                        for h, a, r in zip(hs, axes, radix)), const(0, DType.int64))
            conds.append(cmp("==", first[window], simplify_index(flat)))
            return select(all_of(conds), g.at(window, t), const(0, t))
        return ctx.convert(ctx.tensor(x.shape, t, element), g.dtype)

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
del _n
