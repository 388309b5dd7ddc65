"""Shared shape/dtype inference rules used by op declarations."""

from __future__ import annotations

from collections.abc import Sequence

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
