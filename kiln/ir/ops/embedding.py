"""The embedding lookup: rows of a weight matrix gathered by integer indices."""

from __future__ import annotations

import numpy as np

from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import fmt_shape, require_int
from .compute import (
    defcompute,
)
from .vjp import defvjp


# -------------------------------------------------------------------------- embedding
def _embedding_infer(types, **_):
    weight, indices = types
    require_int(indices)
    if weight.rank != 2:
        raise ValueError(f"weight must be 2-d [num_embeddings, dim], got {fmt_shape(weight.shape)}")
    return TensorType((*indices.shape, weight.shape[1]), weight.dtype)


@defop("embedding", infer=_embedding_infer, num_inputs=2,
       attrs={"padding_idx": Attr("int", -1), "scale_grad_by_freq": Attr("bool", False)})
def embedding(weight, indices, *, padding_idx=-1, scale_grad_by_freq=False):
    """Rows of ``weight`` picked by ``indices`` (any rank, each in ``[0, num_embeddings)``).

    ``padding_idx`` (``-1``: none) and ``scale_grad_by_freq`` change only the gradient, as in
    ``torch.nn.functional.embedding``: the padding row gets none, and with
    ``scale_grad_by_freq`` each row's gradient is divided by how often it was looked up."""
    if indices.size and (indices.min() < 0 or indices.max() >= weight.shape[0]):
        bad = indices.min() if indices.min() < 0 else indices.max()
        raise IndexError(f"embedding: index {bad} is out of range for {weight.shape[0]} embeddings")
    return np.take(weight, indices.astype(np.int64), axis=0)


@defvjp("embedding")
def _embedding_vjp(b, inputs, outputs, cotangents, attrs):
    """Rows accumulate the cotangents of every lookup of them (``index_put``); lookups of
    ``padding_idx`` contribute nothing, and ``scale_grad_by_freq`` divides each lookup's
    cotangent by its row's lookup count."""
    weight, indices = inputs
    g = cotangents[0]
    if attrs.get("scale_grad_by_freq"):
        ones = b.full(indices.shape, 1.0, g.dtype)
        counts = b.op("index_put", b.zeros(TensorType((weight.shape[0],), g.dtype)), ones, indices,
                      dims=(0,), accumulate=True)
        per_lookup = b.op("embedding", b.reshape(counts, (weight.shape[0], 1)), indices)
        g = b.div(g, per_lookup)
    padding = attrs.get("padding_idx", -1)
    if padding is not None and padding >= 0:
        hit = b.op("eq", indices, b.const(padding, indices.dtype))
        hit = b.reshape(hit, (*indices.shape, 1))
        g = b.where(hit, b.const(0.0, g), g)
    grad = b.op("index_put", b.zeros(weight.type), g, indices, dims=(0,), accumulate=True)
    return [grad, None]


# --------------------------------------------------------------- compute rules (lowering)
@defcompute("embedding")
def _embedding_compute(ctx, weight, indices, *, padding_idx=-1, scale_grad_by_freq=False):
    """``out[i..., j] = weight[indices[i...], j]`` (indices are not range-checked)."""
    return ctx.tensor(ctx.out_shape, weight.dtype,
                      lambda i: weight[(indices.at(i[:-1], DType.int64), i[-1])])
