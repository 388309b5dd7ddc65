"""Reductions and scans: sum, mean, amax/amin, prod, var, any/all, argmax/argmin, cumsum,
softmax and log_softmax.

``dims`` lists the reduced axes (negative allowed, each at most once); empty means every
axis.  ``keepdim`` keeps each reduced axis as size 1.  As in torch, integer and bool inputs
to sum, prod and cumsum accumulate in int64 unless ``dtype`` says otherwise; mean, var and
the softmaxes require floating-point input.  float16/bfloat16 are computed in float32 and
rounded once, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import DType, TensorType, normalize_dim
from ._infer import fmt_shape, reduction_axes, require_float, upcast_half

_DIMS = {"dims": Attr("ints", ()), "keepdim": Attr("bool", False)}
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


@defop("sum", infer=_accumulate_infer, attrs={**_DIMS, "dtype": _OPT_DTYPE}, traits=("reduction",))
def sum_(x, *, dims=(), keepdim=False, dtype=None):
    """Sum over ``dims``; the input is converted to ``dtype`` first when it is given."""
    return _accumulate(np.sum, x, dims, keepdim, dtype)


@defop("prod", infer=_accumulate_infer, attrs={**_DIMS, "dtype": _OPT_DTYPE}, traits=("reduction",))
def prod(x, *, dims=(), keepdim=False, dtype=None):
    """Product over ``dims``; the input is converted to ``dtype`` first when it is given."""
    return _accumulate(np.prod, x, dims, keepdim, dtype)


@defop("mean", infer=_float_infer, attrs=_DIMS, traits=("reduction",))
def mean(x, *, dims=(), keepdim=False):
    """Arithmetic mean over ``dims`` (floating-point input only)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.mean(upcast_half(x), axis=_axes(x, dims), keepdims=keepdim)
    return _result(r, x.dtype)


@defop("var", infer=_float_infer, attrs={**_DIMS, "correction": Attr("float", 1.0)},
       traits=("reduction", "composite"))
def var(x, *, dims=(), keepdim=False, correction=1.0):
    """Variance over ``dims`` dividing by ``N - correction`` (1.0: unbiased, 0.0: biased)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.var(upcast_half(x), axis=_axes(x, dims), ddof=correction, keepdims=keepdim)
    return _result(r, x.dtype)


@defop("amax", infer=_extremum_infer, attrs=_DIMS, traits=("reduction",))
def amax(x, *, dims=(), keepdim=False):
    """Maximum over ``dims``; NaN propagates."""
    return _result(np.amax(upcast_half(x), axis=_axes(x, dims), keepdims=keepdim), x.dtype)


@defop("amin", infer=_extremum_infer, attrs=_DIMS, traits=("reduction",))
def amin(x, *, dims=(), keepdim=False):
    """Minimum over ``dims``; NaN propagates."""
    return _result(np.amin(upcast_half(x), axis=_axes(x, dims), keepdims=keepdim), x.dtype)


@defop("any", infer=_logical_infer, attrs=_DIMS, traits=("reduction",))
def any_(x, *, dims=(), keepdim=False):
    """True where some element over ``dims`` is nonzero."""
    return _result(np.any(upcast_half(x) != 0, axis=_axes(x, dims), keepdims=keepdim), np.bool_)


@defop("all", infer=_logical_infer, attrs=_DIMS, traits=("reduction",))
def all_(x, *, dims=(), keepdim=False):
    """True where every element over ``dims`` is nonzero."""
    return _result(np.all(upcast_half(x) != 0, axis=_axes(x, dims), keepdims=keepdim), np.bool_)


def _arg(fn, x: np.ndarray, dim: int | None, keepdim: bool) -> np.ndarray:
    if x.ndim == 0:
        return np.zeros((), np.int64)
    axis = None if dim is None else normalize_dim(dim, x.ndim)
    return _result(fn(upcast_half(x), axis=axis, keepdims=keepdim), np.int64)


_ARG_ATTRS = {"dim": Attr("int", None, optional=True), "keepdim": Attr("bool", False)}


@defop("argmax", infer=_arg_infer, attrs=_ARG_ATTRS, traits=("reduction",))
def argmax(x, *, dim=None, keepdim=False):
    """Index of the first maximum along ``dim`` (of the flattened input when ``dim`` is None)."""
    return _arg(np.argmax, x, dim, keepdim)


@defop("argmin", infer=_arg_infer, attrs=_ARG_ATTRS, traits=("reduction",))
def argmin(x, *, dim=None, keepdim=False):
    """Index of the first minimum along ``dim`` (of the flattened input when ``dim`` is None)."""
    return _arg(np.argmin, x, dim, keepdim)


@defop("cumsum", infer=_scan_infer, attrs={"dim": Attr("int"), "dtype": _OPT_DTYPE})
def cumsum(x, *, dim, dtype=None):
    """Inclusive prefix sum along ``dim``."""
    out = _accumulated(DType.from_numpy(x.dtype), dtype)
    src = upcast_half(x.astype(out.numpy, copy=False))
    if x.ndim == 0:
        return _result(src, out)
    return _result(np.cumsum(src, axis=normalize_dim(dim, x.ndim)), out)


def _shifted(x: np.ndarray, dim: int) -> tuple[np.ndarray, int]:
    """``x`` minus its maximum along ``dim`` (as at least 1-d), for stable exponentials."""
    z = upcast_half(x).reshape(x.shape or (1,))
    axis = normalize_dim(dim, z.ndim)
    with np.errstate(invalid="ignore"):
        return z - np.max(z, axis=axis, keepdims=True), axis


@defop("softmax", infer=_softmax_infer, attrs={"dim": Attr("int")},
       traits=("composite", "normalization"))
def softmax(x, *, dim):
    """``exp(x) / sum(exp(x))`` along ``dim``, computed after subtracting the maximum."""
    z, axis = _shifted(x, dim)
    e = np.exp(z)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = e / np.sum(e, axis=axis, keepdims=True)
    return _result(r.reshape(x.shape), x.dtype)


@defop("log_softmax", infer=_softmax_infer, attrs={"dim": Attr("int")},
       traits=("composite", "normalization"))
def log_softmax(x, *, dim):
    """``x - log(sum(exp(x)))`` along ``dim``, computed after subtracting the maximum."""
    z, axis = _shifted(x, dim)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))
    return _result(r.reshape(x.shape), x.dtype)
