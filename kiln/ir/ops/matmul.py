"""``matmul`` with numpy/torch semantics.

Both operands have one dtype (kiln inserts no implicit casts around a contraction).  A 1-d
left operand is treated as a row vector and a 1-d right operand as a column vector, the
added axis being dropped from the result; batch axes (all but the last two) broadcast.
"""

from __future__ import annotations

import numpy as np

from ..registry import defop
from ..types import DType, TensorType, broadcast_shapes
from ._infer import fmt_shape, same_dtypes, upcast_half
from .compute import broadcast_index, compute_dtype, defcompute
from .cost import numel
from .vjp import GradBuilder, defvjp, unbroadcast


def _matmul_infer(types, **_) -> TensorType:
    a, b = types
    dtype = same_dtypes(types, ["a", "b"])
    if dtype == DType.bool:
        raise TypeError("matmul is not defined on bool; cast the operands to a numeric dtype")
    if a.rank == 0 or b.rank == 0:
        raise ValueError(f"both operands must be at least 1-d, got {fmt_shape(a.shape)} "
                         f"and {fmt_shape(b.shape)}")
    a_shape = (1, *a.shape) if a.rank == 1 else a.shape
    b_shape = (*b.shape, 1) if b.rank == 1 else b.shape
    if a_shape[-1] != b_shape[-2]:
        raise ValueError(f"contraction sizes differ: a {fmt_shape(a.shape)} has {a_shape[-1]} "
                         f"columns but b {fmt_shape(b.shape)} has {b_shape[-2]} rows")
    try:
        batch = broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        raise ValueError(f"batch axes {fmt_shape(a_shape[:-2])} of a and {fmt_shape(b_shape[:-2])} "
                         "of b do not broadcast") from None
    rows = () if a.rank == 1 else (a_shape[-2],)
    cols = () if b.rank == 1 else (b_shape[-1],)
    return TensorType((*batch, *rows, *cols), dtype)


def _matmul_cost(input_types, output_types, **_) -> float:
    """A multiply-add per result element and step of the contraction (``2 M N K``)."""
    a = input_types[0]
    k = a.shape[-1] if a.rank and isinstance(a.shape[-1], int) else 1
    return 2.0 * sum(numel(t) for t in output_types) * k


@defop("matmul", infer=_matmul_infer, num_inputs=2, traits=("matmul",), amp="low", cost=_matmul_cost)
def matmul(a, b):
    """Matrix product with numpy/torch semantics (1-d operands, broadcast batch axes)."""
    return np.asarray(np.matmul(upcast_half(a), upcast_half(b))).astype(a.dtype, copy=False)


@defvjp("matmul")
def _matmul_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``da = g @ b^T`` and ``db = a^T @ g``, summed over broadcast batch axes.

    1-d operands are first viewed as a row (``a``) or column (``b``) matrix.  When ``b`` is a
    matrix and ``a`` has batch axes (a linear layer), ``db`` is one matmul over the
    flattened batch instead of a batched product summed afterwards.
    """
    x, w = inputs
    if not x.dtype.is_floating:
        return [None, None]
    x2 = x if x.type.rank > 1 else b.reshape(x, (1, x.shape[0]))
    w2 = w if w.type.rank > 1 else b.reshape(w, (w.shape[0], 1))
    g = cotangents[0]
    batch = g.shape[: max(x2.type.rank, w2.type.rank) - 2]
    g2 = b.reshape(g, (*batch, x2.shape[-2], w2.shape[-1]))
    dx = dw = None
    if b.wants(0):
        dx = b.reshape(unbroadcast(b, b.op("matmul", g2, b.transpose(w2)), x2), x.shape)
    if b.wants(1):
        if w2.type.rank == 2 and x2.type.rank > 2:
            rows = b.reshape(x2, (-1, x2.shape[-1]))
            dw2 = b.op("matmul", b.transpose(rows), b.reshape(g2, (-1, g2.shape[-1])))
        else:
            dw2 = unbroadcast(b, b.op("matmul", b.transpose(x2), g2), w2)
        dw = b.reshape(dw2, w.shape)
    return [dx, dw]


# --------------------------------------------------------------- compute rule (lowering)
@defcompute("matmul")
def _matmul_compute(ctx, a, b):
    """``out[batch, m, n] = sum_k a[bcast(batch), m, k] * b[bcast(batch), k, n]`` (1-d
    operands lose their row or column axis); accumulates in the compute dtype."""
    out = ctx.out.dtype
    t = compute_dtype(out)
    a, b = ctx.operand(a, "a"), ctx.operand(b, "b")
    nb = len(ctx.out_shape) - (a.rank > 1) - (b.rank > 1)

    def body(i, r):
        batch, (k,) = i[:nb], r
        a_index = (*broadcast_index(batch, a.shape[:-2]), i[nb], k) if a.rank > 1 else (k,)
        b_index = (*broadcast_index(batch, b.shape[:-2]), k, i[-1]) if b.rank > 1 else (k,)
        return a.at(a_index, t) * b.at(b_index, t)

    return ctx.convert(ctx.reduce(ctx.out_shape, t, "+", [a.shape[-1]], body, "acc"), out)
