"""Linear algebra: ``matmul`` with numpy/torch semantics.

Both operands have one dtype (kiln inserts no implicit casts around a contraction).  A 1-d
left operand is treated as a row vector and a 1-d right operand as a column vector, the
added axis being dropped from the result; batch axes (all but the last two) broadcast.
"""

from __future__ import annotations

import numpy as np

from ..registry import defop
from ..types import DType, TensorType, broadcast_shapes
from ._infer import fmt_shape, same_dtypes, upcast_half


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


@defop("matmul", infer=_matmul_infer, num_inputs=2, traits=("matmul",))
def matmul(a, b):
    """Matrix product with numpy/torch semantics (1-d operands, broadcast batch axes)."""
    return np.asarray(np.matmul(upcast_half(a), upcast_half(b))).astype(a.dtype, copy=False)
