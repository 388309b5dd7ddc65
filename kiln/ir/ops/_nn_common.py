"""Helpers shared by the neural-network op families (conv, pool, norm, attention)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .compute import (
    cmp,
    simplify_index,
)


def sliding_windows(x: np.ndarray, kernel: Sequence[int], stride: Sequence[int],
             dilation: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """View ``[..., *out, *kernel]`` of the (already padded) last ``len(kernel)`` axes of ``x``."""
    n = len(kernel)
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    view = sliding_window_view(x, span, axis=tuple(range(x.ndim - n, x.ndim)))
    lead = (slice(None),) * (x.ndim - n)
    starts = tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, stride))
    taps = tuple(slice(None, None, d) for d in dilation)
    return view[lead + starts + taps]


def cast_like(r: np.ndarray, like: np.ndarray) -> np.ndarray:
    return np.asarray(r).astype(like.dtype, copy=False)



# --------------------------------------------------------------- compute rules (lowering)
# Windows read their input through bound checks (select) where padding can reach outside.
def window_position(o, k, stride: int, pad: int, dilation: int):
    return simplify_index(o * stride - pad + k * dilation)


def inside_bounds(pos, size: int, low: bool, high: bool) -> list:
    """Conditions keeping ``pos`` inside ``[0, size)``: only the sides that can be crossed."""
    return ([cmp(">=", pos, 0)] if low else []) + ([cmp("<", pos, size)] if high else [])
