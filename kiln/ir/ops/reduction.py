"""Reductions and scans: sum, mean, amax/amin, prod, var, any/all, argmax/argmin, cumsum,
softmax and log_softmax.

``dims`` lists the reduced axes (negative allowed, each at most once); empty means every
axis.  ``keepdim`` keeps each reduced axis as size 1.  As in torch, integer and bool inputs
to sum, prod and cumsum accumulate in int64 unless ``dtype`` says otherwise; mean, var and
the softmaxes require floating-point input.  float16/bfloat16 are computed in float32 and
rounded once, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..builder import GraphBuilder
from ..registry import Attr, defop
from ..types import DType, TensorType, normalize_dim
from ._infer import fmt_shape, reduction_axes, require_float, upcast_half
from .compute import (
    size_value,
    call,
    cmp,
    compute_dtype,
    const,
    convert,
    defcompute,
    drop_axes,
    linear_index,
)
from .cost import per_input_element
from .vjp import GradBuilder, defvjp, expand_reduced, nondifferentiable

_DIMS = {"dims": Attr("ints", (), axes="set"), "keepdim": Attr("bool", False)}
_OPT_DTYPE = Attr("dtype", None, optional=True)


# ------------------------------------------------------------------------------ inference
def _reduced(t: TensorType, dims: Sequence[int], keepdim: bool, dtype: DType) -> TensorType:
    axes = set(reduction_axes(dims, t.rank))
    if keepdim:
        shape = tuple(1 if i in axes else d for i, d in enumerate(t.shape))
    else:
        shape = tuple(d for i, d in enumerate(t.shape) if i not in axes)
    return TensorType(shape, dtype)


def _require_nonempty(t: TensorType, axes: Sequence[int]) -> None:
    """min/max/arg-reductions have no identity, so an empty reduced axis is an error."""
    for a in axes:
        if t.shape[a] == 0:
            raise ValueError(f"cannot reduce over axis {a}, which has size 0 in {fmt_shape(t.shape)}")


def _accumulated(dtype: DType, override: DType | None) -> DType:
    """Result dtype of sum/prod/cumsum: ``override``, else int64 for integer and bool input."""
    if override is not None:
        return override
    return dtype if dtype.is_floating else DType.int64


def _accumulate_infer(types, *, dims=(), keepdim=False, dtype=None):
    t = types[0]
    return _reduced(t, dims, keepdim, _accumulated(t.dtype, dtype))


def _float_infer(types, *, dims=(), keepdim=False, **_):
    t = types[0]
    require_float(t)
    return _reduced(t, dims, keepdim, t.dtype)


def _extremum_infer(types, *, dims=(), keepdim=False):
    t = types[0]
    _require_nonempty(t, reduction_axes(dims, t.rank))
    return _reduced(t, dims, keepdim, t.dtype)


def _logical_infer(types, *, dims=(), keepdim=False):
    return _reduced(types[0], dims, keepdim, DType.bool)


def _arg_infer(types, *, dim=None, keepdim=False):
    t = types[0]
    if dim is None:
        _require_nonempty(t, range(t.rank))
        return TensorType((1,) * t.rank if keepdim else (), DType.int64)
    axis = normalize_dim(dim, t.rank)
    if t.rank:
        _require_nonempty(t, [axis])
    return _reduced(t, [axis] if t.rank else [], keepdim, DType.int64)


def _scan_infer(types, *, dim, dtype=None):
    t = types[0]
    normalize_dim(dim, t.rank)
    return t.with_dtype(_accumulated(t.dtype, dtype))


def _softmax_infer(types, *, dim):
    t = types[0]
    require_float(t)
    normalize_dim(dim, t.rank)
    return t


# ----------------------------------------------------------------------------- references
def _result(r, dtype: DType | np.dtype) -> np.ndarray:
    """``r`` as an ndarray of exactly ``dtype`` (numpy reductions may return scalars)."""
    return np.asarray(r).astype(dtype.numpy if isinstance(dtype, DType) else dtype, copy=False)


def _axes(x: np.ndarray, dims: Sequence[int]) -> tuple[int, ...]:
    return reduction_axes(dims, x.ndim)


def _accumulate(fn, x: np.ndarray, dims, keepdim: bool, dtype: DType | None) -> np.ndarray:
    out = _accumulated(DType.from_numpy(x.dtype), dtype)
    r = fn(upcast_half(x.astype(out.numpy, copy=False)), axis=_axes(x, dims), keepdims=keepdim)
    return _result(r, out)


@defop("sum", infer=_accumulate_infer, attrs={**_DIMS, "dtype": _OPT_DTYPE}, traits=("reduction",),
       amp="float32")
def sum_(x, *, dims=(), keepdim=False, dtype=None):
    """Sum over ``dims``; the input is converted to ``dtype`` first when it is given."""
    return _accumulate(np.sum, x, dims, keepdim, dtype)


def _spread(b: GradBuilder, g, x, attrs):
    """The cotangent of a reduction of ``x`` over ``attrs['dims']``, in ``x``'s dtype and
    broadcast back to ``x``'s shape."""
    axes = reduction_axes(attrs["dims"], x.type.rank)
    return expand_reduced(b, b.cast(g, x.dtype), x, axes, attrs["keepdim"])


def _count(x, dims):
    """Number of elements a reduction over ``dims`` combines (a symbolic size when an axis is)."""
    n = 1
    for a in reduction_axes(dims, x.type.rank):
        n = n * x.shape[a]
    return n


@defvjp("sum")
def _sum_vjp(b, inputs, outputs, cotangents, attrs):
    x = inputs[0]
    return [_spread(b, cotangents[0], x, attrs) if x.dtype.is_floating else None]


@defop("prod", infer=_accumulate_infer, attrs={**_DIMS, "dtype": _OPT_DTYPE}, traits=("reduction",),
       amp="float32")
def prod(x, *, dims=(), keepdim=False, dtype=None):
    """Product over ``dims``; the input is converted to ``dtype`` first when it is given."""
    return _accumulate(np.prod, x, dims, keepdim, dtype)


@defvjp("prod")
def _prod_vjp(b, inputs, outputs, cotangents, attrs):
    """``prod / x`` computed without dividing by zero: with no zero in the reduced group each
    element gets the product of the others; with exactly one zero only the zero element gets
    a gradient (the product of the nonzero ones); with more, nothing does (as torch)."""
    x = inputs[0]
    if not x.dtype.is_floating:
        return [None]
    axes = reduction_axes(attrs["dims"], x.type.rank)
    zero, one = b.const(0.0, x), b.const(1.0, x)
    is_zero = b.op("eq", x, zero)
    nonzero = b.where(is_zero, one, x)
    product = b.op("prod", nonzero, dims=axes, keepdim=True)
    zeros = b.op("sum", b.cast(is_zero, x.dtype), dims=axes, keepdim=True)
    at_nonzero = b.where(b.op("eq", zeros, zero), b.div(product, nonzero), zero)
    at_zero = b.where(b.op("eq", zeros, one), product, zero)
    return [b.mul(_spread(b, cotangents[0], x, attrs), b.where(is_zero, at_zero, at_nonzero))]


@defop("mean", infer=_float_infer, attrs=_DIMS, traits=("reduction",), amp="float32")
def mean(x, *, dims=(), keepdim=False):
    """Arithmetic mean over ``dims`` (floating-point input only)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.mean(upcast_half(x), axis=_axes(x, dims), keepdims=keepdim)
    return _result(r, x.dtype)


@defvjp("mean")
def _mean_vjp(b, inputs, outputs, cotangents, attrs):
    x = inputs[0]
    return [b.div(_spread(b, cotangents[0], x, attrs), b.size(_count(x, attrs["dims"]), x))]


@defop("var", infer=_float_infer, attrs={**_DIMS, "correction": Attr("float", 1.0)},
       traits=("reduction", "composite"), amp="float32", cost=per_input_element(3))
def var(x, *, dims=(), keepdim=False, correction=1.0):
    """Variance over ``dims`` dividing by ``N - correction`` (1.0: unbiased, 0.0: biased)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.var(upcast_half(x), axis=_axes(x, dims), ddof=correction, keepdims=keepdim)
    return _result(r, x.dtype)


@defvjp("var")
def _var_vjp(b, inputs, outputs, cotangents, attrs):
    """``2 (x - mean) / (N - correction)`` times the cotangent."""
    x = inputs[0]
    axes = reduction_axes(attrs["dims"], x.type.rank)
    centered = b.sub(x, b.op("mean", x, dims=axes, keepdim=True))
    count = _count(x, attrs["dims"])
    if isinstance(count, int):
        scale = b.const(2.0 / (count - attrs["correction"]), x)
    else:
        scale = b.div(b.const(2.0, x), b.sub(b.size(count, x), b.const(attrs["correction"], x)))
    return [b.mul(_spread(b, cotangents[0], x, attrs), b.mul(centered, scale))]


@defop("amax", infer=_extremum_infer, attrs=_DIMS, traits=("reduction",))
def amax(x, *, dims=(), keepdim=False):
    """Maximum over ``dims``; NaN propagates."""
    return _result(np.amax(upcast_half(x), axis=_axes(x, dims), keepdims=keepdim), x.dtype)


@defop("amin", infer=_extremum_infer, attrs=_DIMS, traits=("reduction",))
def amin(x, *, dims=(), keepdim=False):
    """Minimum over ``dims``; NaN propagates."""
    return _result(np.amin(upcast_half(x), axis=_axes(x, dims), keepdims=keepdim), x.dtype)


@defvjp("amax", "amin")
def _extremum_vjp(b, inputs, outputs, cotangents, attrs):
    """The cotangent is shared equally by the elements equal to the extremum (as torch)."""
    x, y = inputs[0], outputs[0]
    if not x.dtype.is_floating:
        return [None]
    axes = reduction_axes(attrs["dims"], x.type.rank)
    hit = b.op("eq", x, expand_reduced(b, y, x, axes, attrs["keepdim"]))
    count = b.op("sum", b.cast(hit, x.dtype), dims=axes, keepdim=True)
    share = b.div(_spread(b, cotangents[0], x, attrs), count)
    return [b.where(hit, share, b.const(0.0, x))]


@defop("any", infer=_logical_infer, attrs=_DIMS, traits=("reduction",))
def any_(x, *, dims=(), keepdim=False):
    """True where some element over ``dims`` is nonzero."""
    return _result(np.any(upcast_half(x) != 0, axis=_axes(x, dims), keepdims=keepdim), np.bool_)


@defop("all", infer=_logical_infer, attrs=_DIMS, traits=("reduction",))
def all_(x, *, dims=(), keepdim=False):
    """True where every element over ``dims`` is nonzero."""
    return _result(np.all(upcast_half(x) != 0, axis=_axes(x, dims), keepdims=keepdim), np.bool_)


defvjp("any", "all")(nondifferentiable)


def _arg(fn, x: np.ndarray, dim: int | None, keepdim: bool) -> np.ndarray:
    if x.ndim == 0:
        return np.zeros((), np.int64)
    axis = None if dim is None else normalize_dim(dim, x.ndim)
    return _result(fn(upcast_half(x), axis=axis, keepdims=keepdim), np.int64)


_ARG_ATTRS = {"dim": Attr("int", None, optional=True, axes="axis"), "keepdim": Attr("bool", False)}


@defop("argmax", infer=_arg_infer, attrs=_ARG_ATTRS, traits=("reduction",))
def argmax(x, *, dim=None, keepdim=False):
    """Index of the first maximum along ``dim`` (of the flattened input when ``dim`` is None)."""
    return _arg(np.argmax, x, dim, keepdim)


@defop("argmin", infer=_arg_infer, attrs=_ARG_ATTRS, traits=("reduction",))
def argmin(x, *, dim=None, keepdim=False):
    """Index of the first minimum along ``dim`` (of the flattened input when ``dim`` is None)."""
    return _arg(np.argmin, x, dim, keepdim)


defvjp("argmax", "argmin")(nondifferentiable)


@defop("cumsum", infer=_scan_infer, attrs={"dim": Attr("int", axes="axis"), "dtype": _OPT_DTYPE}, amp="float32",
       cost=per_input_element(1))
def cumsum(x, *, dim, dtype=None):
    """Inclusive prefix sum along ``dim``."""
    out = _accumulated(DType.from_numpy(x.dtype), dtype)
    src = upcast_half(x.astype(out.numpy, copy=False))
    if x.ndim == 0:
        return _result(src, out)
    return _result(np.cumsum(src, axis=normalize_dim(dim, x.ndim)), out)


@defvjp("cumsum")
def _cumsum_vjp(b, inputs, outputs, cotangents, attrs):
    """Reverse cumulative sum of the cotangent."""
    x = inputs[0]
    if not x.dtype.is_floating:
        return [None]
    g = b.cast(cotangents[0], x.dtype)
    if x.type.rank == 0:
        return [g]
    dims = (normalize_dim(attrs["dim"], x.type.rank),)
    flipped = b.op("cumsum", b.op("flip", g, dims=dims), dim=dims[0])
    return [b.op("flip", flipped, dims=dims)]


def _shifted(x: np.ndarray, dim: int) -> tuple[np.ndarray, int]:
    """``x`` minus its maximum along ``dim`` (as at least 1-d), for stable exponentials."""
    z = upcast_half(x).reshape(x.shape or (1,))
    axis = normalize_dim(dim, z.ndim)
    with np.errstate(invalid="ignore"):
        return z - np.max(z, axis=axis, keepdims=True), axis


def _minus_max(b: GraphBuilder, x, dim: int):
    """``x - amax(x)`` along ``dim`` (kept), the stable argument of the exponentials."""
    return b.sub(x, b.op("amax", x, dims=(dim,), keepdim=True))


def _decompose_softmax(b: GraphBuilder, node):
    """``exp(x - amax(x)) / sum(exp(x - amax(x)))``."""
    dim = node.attrs["dim"]
    e = b.op("exp", _minus_max(b, node.inputs[0], dim))
    return [b.div(e, b.op("sum", e, dims=(dim,), keepdim=True))]


def _decompose_log_softmax(b: GraphBuilder, node):
    """``(x - amax(x)) - log(sum(exp(x - amax(x))))``."""
    dim = node.attrs["dim"]
    z = _minus_max(b, node.inputs[0], dim)
    total = b.op("sum", b.op("exp", z), dims=(dim,), keepdim=True)
    return [b.sub(z, b.op("log", total))]


@defop("softmax", infer=_softmax_infer, attrs={"dim": Attr("int", axes="axis")},
       traits=("composite", "normalization", "nonnegative"), amp="float32",
       decompose=_decompose_softmax, cost=per_input_element(5))
def softmax(x, *, dim):
    """``exp(x) / sum(exp(x))`` along ``dim``, computed after subtracting the maximum."""
    z, axis = _shifted(x, dim)
    e = np.exp(z)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = e / np.sum(e, axis=axis, keepdims=True)
    return _result(r.reshape(x.shape), x.dtype)


@defvjp("softmax")
def _softmax_vjp(b, inputs, outputs, cotangents, attrs):
    """``y * (g - sum(g * y))`` along ``dim``; rows that are all -inf (every key masked out,
    ``y`` is NaN there) get zero gradients, as torch's safe softmax gives."""
    y, g = outputs[0], cotangents[0]
    y = b.where(b.op("isnan", y), b.const(0.0, y), y)
    dot = b.op("sum", b.mul(g, y), dims=(attrs["dim"],), keepdim=True)
    return [b.mul(y, b.sub(g, dot))]


@defop("log_softmax", infer=_softmax_infer, attrs={"dim": Attr("int", axes="axis")},
       traits=("composite", "normalization"), amp="float32",
       decompose=_decompose_log_softmax, cost=per_input_element(6))
def log_softmax(x, *, dim):
    """``x - log(sum(exp(x)))`` along ``dim``, computed after subtracting the maximum."""
    z, axis = _shifted(x, dim)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))
    return _result(r.reshape(x.shape), x.dtype)


@defvjp("log_softmax")
def _log_softmax_vjp(b, inputs, outputs, cotangents, attrs):
    """``g - exp(y) * sum(g)`` along ``dim``."""
    y, g = outputs[0], cotangents[0]
    total = b.op("sum", g, dims=(attrs["dim"],), keepdim=True)
    return [b.sub(g, b.mul(b.op("exp", y), total))]


# --------------------------------------------------------------- compute rules (lowering)
# Reductions become stages (kiln.ir.ops.compute): a local accumulator per result element,
# initialized with the combiner's identity, the reduced axes looped innermost in order.
def _accumulate_compute(combiner: str):
    def rule(ctx, x, *, dims=(), keepdim=False, dtype=None):
        out = ctx.out.dtype
        acc = compute_dtype(out)
        axes = reduction_axes(dims, x.rank)
        total = ctx.reduce_axes(x.shape, axes, keepdim, combiner, acc,
                                lambda i: convert(x.at(i, out), out, acc), _combiner_name(combiner))
        return ctx.convert(total, out)

    return rule


def _combiner_name(combiner: str) -> str:
    return {"+": "sum", "*": "prod", "max": "max", "min": "min"}[combiner]


defcompute("sum")(_accumulate_compute("+"))
defcompute("prod")(_accumulate_compute("*"))


def _mean_of(ctx, x, axes, keepdim, t, value, suffix):
    """``sum(value) / count`` over ``axes`` in dtype ``t`` (a lazy division of a stage)."""
    count = size_value(math.prod(x.shape[a] for a in axes), t)
    total = ctx.reduce_axes(x.shape, axes, keepdim, "+", t, value, suffix)
    return ctx.tensor(total.shape, t, lambda i: total[i] / count)


@defcompute("mean")
def _mean_compute(ctx, x, *, dims=(), keepdim=False):
    t = compute_dtype(x.dtype)
    axes = reduction_axes(dims, x.rank)
    return ctx.convert(_mean_of(ctx, x, axes, keepdim, t, lambda i: x.at(i, t), "sum"), x.dtype)


@defcompute("var")
def _var_compute(ctx, x, *, dims=(), keepdim=False, correction=1.0):
    t = compute_dtype(x.dtype)
    axes = reduction_axes(dims, x.rank)
    mean = _mean_of(ctx, x, axes, False, t, lambda i: x.at(i, t), "sum")

    def square(i):
        d = x.at(i, t) - mean[drop_axes(i, axes)]
        return d * d

    total = ctx.reduce_axes(x.shape, axes, keepdim, "+", t, square, "sq")
    count = const(max(math.prod(x.shape[a] for a in axes) - correction, 0.0), t)
    return ctx.tensor(total.shape, x.dtype, lambda i: total[i] / count)


def _extremum_compute(combiner: str):
    def rule(ctx, x, *, dims=(), keepdim=False):
        t = compute_dtype(x.dtype)
        axes = reduction_axes(dims, x.rank)
        return ctx.convert(ctx.reduce_axes(x.shape, axes, keepdim, combiner, t, lambda i: x.at(i, t),
                                           _combiner_name(combiner)), x.dtype)

    return rule


defcompute("amax")(_extremum_compute("max"))
defcompute("amin")(_extremum_compute("min"))


def _logical_compute(combiner: str):
    """any: ``max`` of ``x != 0``; all: ``min`` (empty reductions give false / true)."""

    def rule(ctx, x, *, dims=(), keepdim=False):
        t = compute_dtype(x.dtype)
        axes = reduction_axes(dims, x.rank)

        def truthy(i):
            v = x.at(i, t)
            return v if t == DType.bool else cmp("!=", v, const(0, t))

        return ctx.reduce_axes(x.shape, axes, keepdim, combiner, DType.bool, truthy, "any" if combiner == "max" else "all")

    return rule


defcompute("any")(_logical_compute("max"))
defcompute("all")(_logical_compute("min"))


def _arg_compute(combiner: str):
    """The best value over the axis (stage 1), then the smallest position holding it
    (stage 2: ``min`` of ``position + count * (x != best)``)."""

    def rule(ctx, x, *, dim=None, keepdim=False):
        if x.rank == 0:
            return ctx.tensor(ctx.out_shape, DType.int64, lambda i: const(0, DType.int64))
        t = compute_dtype(x.dtype)
        axes = tuple(range(x.rank)) if dim is None else (normalize_dim(dim, x.rank),)
        best = ctx.reduce_axes(x.shape, axes, False, combiner, t, lambda i: x.at(i, t), "best")
        extents = [x.shape[a] for a in axes]
        count = math.prod(extents)

        def position(i):
            other = cmp("!=", x.at(i, t), best[drop_axes(i, axes)])
            return linear_index(tuple(i[a] for a in axes), extents) + other * count

        return ctx.reduce_axes(x.shape, axes, keepdim, "min", DType.int64, position, "index")

    return rule


defcompute("argmax")(_arg_compute("max"))
defcompute("argmin")(_arg_compute("min"))


def scan_compute(combiner: str, name: str):
    """Compute rule of an inclusive scan (``cumsum``: ``+``, ``cumprod``: ``*``) along ``dim``:
    ``out[.., i, ..] = x[.., 0, ..] op ... op x[.., i, ..]``, each prefix a reduction with a
    triangular domain, combined in order as the reference does."""

    def rule(ctx, x, *, dim, dtype=None):
        out = ctx.out.dtype
        acc = compute_dtype(out)
        if x.rank == 0:
            return ctx.tensor((), out, lambda i: convert(x.at(i, out), out, acc))
        axis = normalize_dim(dim, x.rank)

        def body(i, r):
            src = list(i)
            src[axis] = r[0]
            return convert(x.at(src, out), out, acc)

        total = ctx.reduce(x.shape, acc, combiner, lambda i: [(0, i[axis] + 1)], body, name)
        return ctx.convert(total, out)

    rule.__doc__ = scan_compute.__doc__
    return rule


defcompute("cumsum")(scan_compute("+", "cumsum"))


def _softmax_stages(ctx, x, dim):
    """Stage 1: the maximum along ``dim``; stage 2: the sum of ``exp(x - max)``.  Returns
    the compute dtype, ``z(i) = x[i] - max`` and ``total(i)`` (the sum for ``i``'s row)."""
    t = compute_dtype(x.dtype)
    axes = (normalize_dim(dim, x.rank),) if x.rank else ()
    peak = ctx.reduce_axes(x.shape, axes, False, "max", t, lambda i: x.at(i, t), "max")

    def z(i):
        return x.at(i, t) - peak[drop_axes(i, axes)]

    total = ctx.reduce_axes(x.shape, axes, False, "+", t, lambda i: call("exp", z(i)), "sum")
    return t, z, lambda i: total[drop_axes(i, axes)]


@defcompute("softmax")
def _softmax_compute(ctx, x, *, dim):
    _, z, total = _softmax_stages(ctx, x, dim)
    return ctx.tensor(x.shape, x.dtype, lambda i: call("exp", z(i)) / total(i))


@defcompute("log_softmax")
def _log_softmax_compute(ctx, x, *, dim):
    _, z, total = _softmax_stages(ctx, x, dim)
    return ctx.tensor(x.shape, x.dtype, lambda i: z(i) - call("log", total(i)))
