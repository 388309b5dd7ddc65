"""Resampling ops over 2 or 3 trailing spatial axes: nearest (and nearest-exact),
bilinear/trilinear and bicubic upsampling.

Declared under torch's names: ``upsample_nearest2d`` / ``upsample_nearest3d`` (attribute
``exact`` for "nearest-exact"), ``upsample_bilinear2d`` / ``upsample_trilinear3d`` and
``upsample_bicubic2d`` (2-d only).  1-d resampling lowers to the 2-d ops with a unit height
axis.  Layouts are torch's (``N, C, *spatial``; the batch axis is optional); float16/bfloat16
are computed in float32.  Each op takes ``scales``: torch's per-axis scale factors (``0`` =
not given); a given scale ``s`` maps output ``o`` to source ``o / s`` instead of
``o * in / out``, as in torch.  Every op is a separable linear map (a matrix per axis), which
its reference and gradient apply.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import upcast_half
from ._nn_common import cast_like
from .compute import (Cast, as_expr, call, cmp, compute_dtype, const, convert, defcompute, floordiv,
                      maximum, minimum, simplify_index)
from .pool import SPATIAL_RANKS, _resample, _separable_vjp, _spatial_infer
from .vjp import defvjp


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


# ---------------------------------------------------------------------- declarations
for _n in SPATIAL_RANKS:
    _declare_upsample_nearest(_n)
_declare_upsample_interp("upsample_bilinear2d", 2, cubic=False)
_declare_upsample_interp("upsample_trilinear3d", 3, cubic=False)
_declare_upsample_interp("upsample_bicubic2d", 2, cubic=True)
del _n
