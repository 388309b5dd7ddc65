"""Element types, dimensions and tensor types of the graph IR.

A dimension is either a static ``int`` or a :class:`SymDim` (a named size such as a
sequence length).  Only static shapes execute today, but every shape-manipulating rule
works on ``Dim`` values so symbolic sizes can flow through later without a redesign.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    """Element types. The value is the short name used in the text form."""

    float64 = "f64"
    float32 = "f32"
    float16 = "f16"
    bfloat16 = "bf16"
    int64 = "i64"
    int32 = "i32"
    int8 = "i8"
    uint8 = "u8"
    bool = "bool"

    @property
    def short(self) -> str:
        return self.value

    @property
    def is_floating(self) -> bool:
        return self in _FLOATS

    @property
    def is_integer(self) -> bool:
        return self in _INTS

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY[self]

    @staticmethod
    def parse(text: str) -> DType:
        try:
            return _BY_SHORT[text]
        except KeyError:
            raise ValueError(f"unknown dtype {text!r}; known: {', '.join(_BY_SHORT)}") from None

    @staticmethod
    def from_numpy(dt: np.dtype) -> DType:
        try:
            return _BY_NUMPY[np.dtype(dt)]
        except KeyError:
            raise ValueError(f"numpy dtype {dt} has no kiln dtype") from None

    def __repr__(self) -> str:
        return f"DType.{self.name}"


_FLOATS = frozenset({DType.float64, DType.float32, DType.float16, DType.bfloat16})
_INTS = frozenset({DType.int64, DType.int32, DType.int8, DType.uint8})
_NUMPY = {
    DType.float64: np.dtype(np.float64),
    DType.float32: np.dtype(np.float32),
    DType.float16: np.dtype(np.float16),
    DType.bfloat16: np.dtype(ml_dtypes.bfloat16),
    DType.int64: np.dtype(np.int64),
    DType.int32: np.dtype(np.int32),
    DType.int8: np.dtype(np.int8),
    DType.uint8: np.dtype(np.uint8),
    DType.bool: np.dtype(np.bool_),
}
_BY_SHORT = {d.value: d for d in DType}
_BY_NUMPY = {v: k for k, v in _NUMPY.items()}

# Type promotion follows torch's categories: bool < integer < floating.
_RANK = {
    DType.bool: 0,
    DType.uint8: 1,
    DType.int8: 2,
    DType.int32: 3,
    DType.int64: 4,
    DType.float16: 5,
    DType.bfloat16: 5,
    DType.float32: 6,
    DType.float64: 7,
}


def promote(a: DType, b: DType) -> DType:
    """The result dtype of a binary arithmetic op on tensors of dtypes ``a`` and ``b``."""
    if a == b:
        return a
    if {a, b} == {DType.float16, DType.bfloat16}:
        return DType.float32
    if {a, b} == {DType.uint8, DType.int8}:
        return DType.int32
    return a if _RANK[a] > _RANK[b] else b


@dataclass(frozen=True)
class SymDim:
    """A named symbolic dimension, e.g. ``SymDim("seq")``; printed as its bare name."""

    name: str

    def __str__(self) -> str:
        return self.name


Dim = Union[int, SymDim]


@dataclass(frozen=True)
class TensorType:
    """Shape and element type of a tensor value. A rank-0 shape ``()`` is a scalar."""

    shape: tuple[Dim, ...]
    dtype: DType

    def __post_init__(self) -> None:
        for d in self.shape:
            if isinstance(d, bool) or not isinstance(d, (int, SymDim)):
                raise TypeError(f"dimension {d!r} is neither an int nor a SymDim")
            if isinstance(d, int) and d < 0:
                raise ValueError(f"negative dimension {d} in shape {self.shape}")
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype {self.dtype!r} is not a kiln DType")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def numel(self) -> int:
        """Number of elements; only defined for static shapes."""
        n = 1
        for d in self.shape:
            if not isinstance(d, int):
                raise ValueError(f"numel of symbolic shape {self}")
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def with_shape(self, shape: tuple[Dim, ...]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(self.shape, dtype)

    def __str__(self) -> str:
        return f"{self.dtype.short}[{', '.join(str(d) for d in self.shape)}]"


def broadcast_shapes(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Numpy broadcasting over ``Dim`` values; raises ``ValueError`` when incompatible."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dim: Dim = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if d == 1:
                continue
            if dim == 1:
                dim = d
            elif dim != d:
                raise ValueError(f"shapes {', '.join(map(_fmt_shape, shapes))} do not broadcast")
        out.append(dim)
    return tuple(out)


def _fmt_shape(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def normalize_dim(dim: int, rank: int) -> int:
    """Map a possibly negative axis into ``[0, rank)``; raises ``ValueError`` if out of range."""
    r = max(rank, 1)
    if not -r <= dim < r:
        raise ValueError(f"dimension {dim} is out of range for rank {rank}")
    return dim % r
