"""The embedding lookup: rows of a weight matrix gathered by integer indices."""

from __future__ import annotations

import numpy as np

from ..registry import defop
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




# --------------------------------------------------------------- compute rules (lowering)
@defcompute("embedding")
def _embedding_compute(ctx, weight, indices):
    """``out[i..., j] = weight[indices[i...], j]`` (indices are not range-checked)."""
    return ctx.tensor(ctx.out_shape, weight.dtype,
                      lambda i: weight[(indices.at(i[:-1], DType.int64), i[-1])])
