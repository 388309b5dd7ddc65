"""Zero-copy conversion between torch tensors and numpy arrays, and dtype mapping.

Guarantees:

* :func:`to_numpy` never copies a CPU tensor: the array shares the tensor's storage and
  strides (non-contiguous tensors give strided views).  bfloat16 travels as its bits
  (``view(torch.int16)``) and is reinterpreted as ``ml_dtypes.bfloat16``.
* :func:`from_numpy` shares the array's memory whenever torch can; it copies only arrays
  torch cannot wrap (read-only, negative strides, non-native byte order), so a caller can
  never write into a constant through the tensor it receives.

This module imports nothing from kiln but :mod:`kiln.ir`, so backends may use it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from kiln.ir import DType, TensorType

_TORCH_BY_KILN: dict[DType, torch.dtype] = {
    DType.float64: torch.float64,
    DType.float32: torch.float32,
    DType.float16: torch.float16,
    DType.bfloat16: torch.bfloat16,
    DType.int64: torch.int64,
    DType.int32: torch.int32,
    DType.int8: torch.int8,
    DType.uint8: torch.uint8,
    DType.bool: torch.bool,
}
_KILN_BY_TORCH = {v: k for k, v in _TORCH_BY_KILN.items()}
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype of a kiln dtype (every kiln dtype has one)."""
    return _TORCH_BY_KILN[dtype]


def kiln_dtype(dtype: torch.dtype) -> DType:
    """The kiln dtype of a torch dtype; raises ``TypeError`` naming the supported ones."""
    try:
        return _KILN_BY_TORCH[dtype]
    except KeyError:
        known = ", ".join(str(d) for d in _KILN_BY_TORCH)
        raise TypeError(f"kiln has no dtype for {dtype}; supported: {known}") from None


def tensor_type(tensor: torch.Tensor) -> TensorType:
    """The kiln :class:`TensorType` of a tensor (static shape)."""
    return TensorType(tuple(int(d) for d in tensor.shape), kiln_dtype(tensor.dtype))


def describe(value: object) -> str:
    """Short text for error messages: ``torch.int32 tensor of shape (1, 16)`` or the type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (int, float, bool)):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's memory (no copy). Raises ``ValueError`` off CPU."""
    if tensor.device.type != "cpu":
        raise ValueError(
            f"kiln: this backend runs on the CPU but got a tensor on {tensor.device}; "
            "move the inputs with .cpu() or choose a backend for that device"
        )
    t = tensor.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()  # lazy-bit tensors have no plain memory view
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BFLOAT16)
    return t.numpy()


def from_numpy(array: np.ndarray | np.generic) -> torch.Tensor:
    """A tensor sharing ``array``'s memory when torch can wrap it, else a private copy."""
    arr = np.asarray(array)
    if not _wrappable(arr):
        arr = np.array(arr, order="C", dtype=arr.dtype.newbyteorder("="), copy=True)
    if arr.dtype == _BFLOAT16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _wrappable(arr: np.ndarray) -> bool:
    """True when ``torch.from_numpy`` can share the array's memory safely."""
    if not arr.flags.writeable or not arr.dtype.isnative:
        return False
    return all(s >= 0 and s % arr.itemsize == 0 for s in arr.strides)


def _storage_users(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


try:
    _ALONE = _storage_users(torch.empty(1))
except (AttributeError, RuntimeError):  # no use count in this torch: nothing counts as alone
    _ALONE = -1


def sole_owner(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is contiguous over all of its storage and no other tensor (a view,
    ``.data``, ``.detach()``, a tensor autograd saved, a tied parameter) holds that storage:
    then its storage can be swapped (``set_``) without anyone else seeing the change."""
    return (_ALONE > 0 and tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
            and _storage_users(tensor) == _ALONE)
