"""Neural-network ops: convolution, pooling, resampling, normalization, embedding, attention.

Layouts and index formulas are torch's: channels at axis 1 (``N, C, *spatial``), conv
weights ``[Cout, Cin / groups, *kernel]``, pooling and resampling on the last two axes of a
3-d or 4-d input.  References are vectorized numpy (windows via stride tricks, contractions
via BLAS); float16/bfloat16 are computed in float32 and rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..registry import Attr, defop
from ..types import DType, TensorType, broadcast_shapes
from ._infer import fmt_shape, require_float, require_int, same_dtypes, static_dims, upcast_half


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


@defop("conv", infer=_conv_infer, num_inputs=(2, 3), traits=("conv",), attrs={
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
       attrs={"eps": Attr("float", 1e-5)})
def batch_norm(x, weight, bias, running_mean, running_var, *, eps=1e-5):
    """Inference batch norm: ``(x - mean) / sqrt(var + eps) * weight + bias`` per channel."""
    xf = upcast_half(x)
    shape = (x.shape[1],) + (1,) * (x.ndim - 2)
    mean, var, w, b = (upcast_half(p).astype(xf.dtype).reshape(shape)
                       for p in (running_mean, running_var, weight, bias))
    return _result((xf - mean) / np.sqrt(var + eps) * w + b, x)


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
       attrs={"normalized_rank": Attr("int"), "eps": Attr("float", 1e-5)})
def layer_norm(x, weight=None, bias=None, *, normalized_rank, eps=1e-5):
    """Normalize the last ``normalized_rank`` axes to zero mean and unit (biased) variance."""
    xf = upcast_half(x)
    axes = tuple(range(x.ndim - normalized_rank, x.ndim))
    centered = xf - np.mean(xf, axis=axes, keepdims=True)
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    return _result(_affine(centered / np.sqrt(var + eps), weight, bias), x)


@defop("rms_norm", infer=_norm_infer, num_inputs=(1, 2), traits=("composite", "normalization"),
       attrs={"normalized_rank": Attr("int"), "eps": Attr("float", 1e-6)})
def rms_norm(x, weight=None, *, normalized_rank, eps=1e-6):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last ``normalized_rank`` axes."""
    xf = upcast_half(x)
    axes = tuple(range(x.ndim - normalized_rank, x.ndim))
    ms = np.mean(xf * xf, axis=axes, keepdims=True)
    return _result(_affine(xf / np.sqrt(ms + eps), weight, None), x)


# -------------------------------------------------------------------------- embedding
def _embedding_infer(types, **_):
    weight, indices = types
    require_int(indices)
    if weight.rank != 2:
        raise ValueError(f"weight must be 2-d [num_embeddings, dim], got {fmt_shape(weight.shape)}")
    return TensorType((*indices.shape, weight.shape[1]), weight.dtype)


@defop("embedding", infer=_embedding_infer, num_inputs=2)
def embedding(weight, indices):
    """Rows of ``weight`` picked by ``indices`` (any rank, each in ``[0, num_embeddings)``)."""
    if indices.size and (indices.min() < 0 or indices.max() >= weight.shape[0]):
        bad = indices.min() if indices.min() < 0 else indices.max()
        raise IndexError(f"embedding: index {bad} is out of range for {weight.shape[0]} embeddings")
    return np.take(weight, indices.astype(np.int64), axis=0)


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
       traits=("composite",), attrs={
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
