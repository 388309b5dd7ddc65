"""Central finite differences, shared by the gradient-rule tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def central_differences(loss: Callable[[], float], arrays: Sequence[np.ndarray],
                        eps: float = 1e-6) -> list[np.ndarray]:
    """``d loss / d a`` for every floating array ``a`` of ``arrays`` (perturbed in place and
    restored; ``loss`` reads them), by central differences."""
    grads = []
    for a in arrays:
        if a.dtype.kind != "f":
            continue
        d = np.zeros_like(a)
        flat, out = a.reshape(-1), d.reshape(-1)
        for j in range(flat.size):
            saved = flat[j]
            flat[j] = saved + eps
            up = loss()
            flat[j] = saved - eps
            down = loss()
            flat[j] = saved
            out[j] = (up - down) / (2 * eps)
        grads.append(d)
    return grads
