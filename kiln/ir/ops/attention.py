"""Attention: ``scaled_dot_product_attention`` with optional mask, causal flag and scale."""

from __future__ import annotations

import math

import numpy as np

from ..registry import Attr, defop
from ..types import DType, TensorType, broadcast_shapes
from ._infer import broadcasts_to, fmt_shape, require_float, same_dtypes, upcast_half
from ._nn_common import cast_like
from .compute import (
    broadcast_index,
    call,
    cmp,
    compute_dtype,
    const,
    defcompute,
    select,
)
from .cost import numel
from .vjp import defvjp, unbroadcast


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
        if not broadcasts_to(mask.shape, scores):
            raise ValueError(f"mask {fmt_shape(mask.shape)} does not broadcast to the attention "
                             f"scores {fmt_shape(scores)}")
    return TensorType((*batch, length, ev), dtype)


_SOFTMAX_FLOPS = 5  # per score, as the ``softmax`` op's cost


def _sdpa_cost(input_types, output_types, **_) -> float:
    """Both products (``2 E`` and ``2 Ev`` per score) and the softmax of the scores."""
    q, k, v = input_types[:3]
    rows = numel(q) // max(1, q.shape[-1])  # batch * heads * L
    keys = k.shape[-2] if isinstance(k.shape[-2], int) else 1
    return float(rows * keys * (2 * q.shape[-1] + 2 * v.shape[-1] + _SOFTMAX_FLOPS))


@defop("scaled_dot_product_attention", infer=_sdpa_infer, num_inputs=(3, 4),
       traits=("composite",), amp="low", cost=_sdpa_cost, attrs={
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
    return cast_like(np.matmul(p.astype(qf.dtype), vf), q)


_LOWEST = {DType.float16: -65504.0, DType.bfloat16: -3.0e38}


@defvjp("scaled_dot_product_attention")
def _sdpa_vjp(b, inputs, outputs, cotangents, attrs):
    """Recompute the attention weights ``p``, then ``dv = p^T g``, ``dp = g v^T``,
    ``ds = p * (dp - sum(dp * p))``, ``dq = ds k * scale``, ``dk = ds^T q * scale`` and, for
    an additive float mask, ``dmask = ds``; everything summed over broadcast batch axes.
    Masked-out scores (a false bool mask entry, the causal mask, or a score that a float
    mask made -inf) are replaced by the dtype's lowest finite value (not -inf) and ``p`` is
    zeroed there afterwards, so rows with every key masked out get zero gradients, as the
    forward gives zero outputs there."""
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
        keep = b.op("logical_not", b.op("isinf", scores))  # -inf in the mask: masked out
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
