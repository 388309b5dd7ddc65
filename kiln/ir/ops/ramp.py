"""Constants that are ramps (``start + step * i`` along one axis) lower to index arithmetic.

``arange`` folds into a constant (``fold``), and a constant operand of a kernel is a buffer
it loads. A cross-entropy gradient's one-hot ``eq(target, arange(vocab))`` then reads an
int64 buffer of the vocabulary's size in every row, twice, where comparing the target with
the loop's own iterator reads nothing (GPT-2's 512 x 5000 loss gradient: 40 KB of
loads per row). :func:`ramp_of` recognizes such data and
:meth:`kiln.ir.ops.compute.KernelBuilder.constant` lowers it as ``start + step * i``.
"""

from __future__ import annotations

import numpy as np

from ..types import DType

MAX_EXACT = 1 << 24
"""Float ramps must stay integers below this magnitude (exact in float32, and in float64
whatever order the C compiler evaluates ``start + step * i`` in)."""


def ramp_of(data: np.ndarray, dtype: DType) -> tuple[int, int, int] | None:
    """``(axis, start, step)`` when ``data`` is ``start + step * i`` along its one axis of
    size > 1 (every other axis has size 1), for integer dtypes and for float32/float64 data
    of integers under :data:`MAX_EXACT`; else ``None``."""
    a = np.asarray(data)
    long = [k for k, n in enumerate(a.shape) if n > 1]
    if len(long) != 1 or not (dtype.is_integer or dtype in (DType.float32, DType.float64)) \
            or dtype == DType.bool:
        return None
    line = a.reshape(-1)
    if dtype.is_floating:
        if not np.all(np.isfinite(line)) or np.any(np.abs(line) >= MAX_EXACT) or np.any(line != np.round(line)):
            return None
    values = line.astype(np.int64)
    start, step = int(values[0]), int(values[1] - values[0])
    if not np.array_equal(values, start + step * np.arange(len(values), dtype=np.int64)):
        return None
    return long[0], start, step


__all__ = ["MAX_EXACT", "ramp_of"]
