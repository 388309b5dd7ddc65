"""Arrays across the JAX <-> kiln boundary, without copies where DLPack allows.

kiln's executables take and return torch tensors (:mod:`kiln.backends.base`).  Inputs:

* a ``jax.Array`` on the CPU is wrapped with ``torch.from_dlpack`` (same memory);
* a numpy array is wrapped with ``torch.from_numpy`` (same memory when it is aligned and in
  native byte order, :func:`kiln.runtime.tensors.from_numpy`);
* a Python or numpy scalar becomes a 0-d tensor of the dtype JAX traced it with.

Outputs are ``jax.Array``s made with ``jax.dlpack.from_dlpack`` (same memory: kiln's
outputs are fresh tensors every call, so nothing writes them later), or with
``outputs="numpy"`` numpy arrays viewing the tensor's memory.  A strided output (a view
DLPack cannot describe compactly) is copied once into a contiguous tensor first.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from kiln.ir import KilnError, TensorType
from kiln.runtime.tensors import from_numpy, to_numpy

OUTPUT_KINDS = ("jax", "numpy")


def leaf_signature(x: Any) -> tuple:
    """What a compiled function is specialized on for one input leaf: shape, dtype and JAX's
    weak-type flag (Python scalars are weakly typed)."""
    if isinstance(x, (bool, int, float)):
        return ("python", type(x).__name__)
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"kiln.jax: an argument leaf of type {type(x).__name__} is not an array; pass "
                        "arrays or scalars, or mark the argument static (static_argnums=...)")
    return (tuple(shape), dtype, getattr(x, "weak_type", False))


def to_torch(x: Any, kind: TensorType) -> torch.Tensor:
    """One input leaf as a tensor of ``kind`` (see the module docstring)."""
    if isinstance(x, jax.Array):
        try:
            return torch.from_dlpack(x)
        except (RuntimeError, TypeError, BufferError) as e:
            raise KilnError(f"kiln.jax: cannot read a {x.dtype}{list(x.shape)} jax.Array on "
                            f"{x.devices()} ({e}); kiln's CPU backends read CPU arrays: "
                            "jax.device_put(x, jax.devices('cpu')[0])") from e
    arr = np.asarray(x)
    if arr.dtype != kind.dtype.numpy:
        arr = arr.astype(kind.dtype.numpy)
    return from_numpy(arr)


def from_torch(t: torch.Tensor, outputs: str) -> Any:
    """One output tensor as a ``jax.Array`` (``outputs="jax"``) or numpy array."""
    if outputs == "numpy":
        return to_numpy(t)
    if not t.is_contiguous():
        t = t.contiguous()
    return jax.dlpack.from_dlpack(t)
