"""Shared shape/dtype inference rules used by op declarations, and the dtype helper their
numpy references share."""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from ..types import DType, TensorType, broadcast_shapes, normalize_dim, promote


def same_as_first(types: Sequence[TensorType], **_) -> TensorType:
    return types[0]


def float_result(dtype: DType) -> DType:
    """Integer and bool inputs to floating-point math produce float32, as in torch."""
    return dtype if dtype.is_floating else DType.float32


def unary_float(types: Sequence[TensorType], **_) -> TensorType:
    return types[0].with_dtype(float_result(types[0].dtype))


def broadcast(types: Sequence[TensorType], **_) -> TensorType:
    shape = broadcast_shapes(*(t.shape for t in types))
    dtype = types[0].dtype
    for t in types[1:]:
        dtype = promote(dtype, t.dtype)
    return TensorType(shape, dtype)


def broadcast_float(types: Sequence[TensorType], **_) -> TensorType:
    t = broadcast(types)
    return t.with_dtype(float_result(t.dtype))


def broadcast_bool(types: Sequence[TensorType], **_) -> TensorType:
    return broadcast(types).with_dtype(DType.bool)


def broadcasts_to(shape: Sequence, target: Sequence) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (a mask to the scores, values to
    the indexed positions)."""
    try:
        return broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def reduced_shape(shape: tuple, dims: Sequence[int] | None, keepdim: bool) -> tuple:
    """Shape after reducing ``dims`` (all dims when ``None`` or empty)."""
    rank = len(shape)
    axes = set(range(rank)) if not dims else {normalize_dim(d, rank) for d in dims}
    if keepdim:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def norm_axes(dims: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    """Sorted, non-negative axes; ``None`` or empty means every axis."""
    if not dims:
        return tuple(range(rank))
    return tuple(sorted({normalize_dim(d, rank) for d in dims}))


def fmt_shape(shape: Sequence) -> str:
    """``[2, seq, 4]``: the form shapes take in error messages."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def unique_axes(dims: Sequence[int], rank: int, what: str = "dims") -> tuple[int, ...]:
    """Normalize ``dims`` (negative allowed) in the given order; repeats are an error."""
    axes = tuple(normalize_dim(d, rank) for d in dims)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{what} {list(dims)} name the same axis more than once (rank {rank})")
    return axes


def reduction_axes(dims: Sequence[int], rank: int) -> tuple[int, ...]:
    """Sorted axes a reduction runs over: ``dims`` normalized, or every axis when empty.

    A 0-d input has no axes; torch still accepts ``dims`` 0 or -1 for it.
    """
    axes = unique_axes(dims, rank)
    if not rank:
        return ()
    return tuple(sorted(axes)) if axes else tuple(range(rank))


def require_float(t: TensorType, what: str = "input") -> None:
    """Reject non-floating dtypes for ops torch only defines on floating-point tensors."""
    if not t.dtype.is_floating:
        raise TypeError(f"{what} must be floating-point, got {t.dtype.short}; cast it to f32 first")


def require_int(t: TensorType, what: str = "indices") -> None:
    if not t.dtype.is_integer:
        raise TypeError(f"{what} must have an integer dtype, got {t.dtype.short}")


def static_dims(shape: Sequence, what: str) -> tuple[int, ...]:
    """``shape`` as ints; a symbolic dimension is an error naming ``what`` needs static sizes."""
    if not all(isinstance(d, int) for d in shape):
        raise ValueError(f"{what} needs static sizes, got {fmt_shape(shape)}")
    return tuple(shape)


def same_dtypes(types: Sequence[TensorType], names: Sequence[str]) -> DType:
    """The common dtype of ``types``; differing dtypes are an error naming both operands."""
    first = types[0].dtype
    for t, name in zip(types[1:], names[1:]):
        if t.dtype != first:
            raise TypeError(f"{names[0]} is {first.short} but {name} is {t.dtype.short}; "
                            "cast them to one dtype first")
    return first


_HALF_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def upcast_half(x: np.ndarray) -> np.ndarray:
    """Reference helper: float16/bfloat16 arrays as float32, others unchanged.

    References compute half precision in float32 and round the result once, as PyTorch's
    CPU kernels do.
    """
    return x.astype(np.float32) if x.dtype in _HALF_DTYPES else x
