"""Creation ops: tensors made from attributes alone (no operands), ``arange`` and ``full``.

Both follow torch: ``arange`` has ``ceil((end - start) / step)`` elements and, for integer
dtypes, truncates ``start``/``end``/``step`` to integers first; ``full`` converts ``value``
to ``dtype`` (floats toward zero for integers) and rejects values the dtype cannot hold.
"""

from __future__ import annotations

import math

import numpy as np

from ..registry import Attr, defop
from ..types import DType, SymDim, TensorType
from ._infer import fmt_shape
from .compute import const, convert, defcompute, size_value
from .vjp import defvjp, nondifferentiable


def _arange_bounds(start, end, step, dtype: DType) -> tuple[float, float, int]:
    """``(start, step, length)`` of ``arange`` in the arithmetic torch uses for ``dtype``."""
    if dtype == DType.bool:
        raise TypeError("arange does not produce bool; use an integer or floating dtype")
    if any(isinstance(v, SymDim) for v in (start, end, step)):
        return _symbolic_bounds(start, end, step)
    if dtype.is_integer:
        start, end, step = int(start), int(end), int(step)
    if not all(math.isfinite(v) for v in (start, end, step)):
        raise ValueError(f"arange bounds must be finite, got start={start} end={end} step={step}")
    if step == 0:
        raise ValueError("arange step must be nonzero")
    if (end - start) * step < 0:
        raise ValueError(f"arange from {start} to {end} never ends with step {step} "
                         "(the step's sign points away from end)")
    return start, step, max(math.ceil((end - start) / step), 0)


def _symbolic_bounds(start, end, step):
    """``arange`` bounds where some are symbolic sizes: all must be integers, and the
    direction must be decided for every value of the sizes."""
    for name, v in (("start", start), ("end", end), ("step", step)):
        if not isinstance(v, (int, SymDim)) or isinstance(v, bool):
            raise ValueError(f"arange with a symbolic bound needs integer bounds, got {name}={v!r}")
    if isinstance(step, SymDim):
        raise ValueError(f"arange step must be a static integer, got {step}")
    if step == 0:
        raise ValueError("arange step must be nonzero")
    span = end - start
    if (span < 0) if step > 0 else (span > 0):
        raise ValueError(f"arange from {start} to {end} never ends with step {step}")
    length = span if step == 1 else (span + step - 1) // step if step > 0 else (span + step + 1) // step
    return start, step, length


def _arange_infer(types, *, start=0, end, step=1, dtype):
    return TensorType((_arange_bounds(start, end, step, dtype)[2],), dtype)


@defop("arange", infer=_arange_infer, num_inputs=0, traits=("creation",), attrs={
    "start": Attr("scalar", 0), "end": Attr("scalar"), "step": Attr("scalar", 1),
    "dtype": Attr("dtype")})
def arange(*, start=0, end, step=1, dtype):
    """``[start, start + step, ...]`` up to, not including, ``end``."""
    first, step, length = _arange_bounds(start, end, step, dtype)
    if dtype.is_integer:
        return (first + step * np.arange(length, dtype=np.int64)).astype(dtype.numpy)
    return (first + step * np.arange(length, dtype=np.float64)).astype(dtype.numpy)


defvjp("arange")(nondifferentiable)


def _fill_value(value, dtype: DType):
    """``value`` converted to ``dtype`` as torch converts a fill value."""
    if dtype == DType.bool:
        return bool(value)
    if not dtype.is_integer:
        return float(value)
    if not math.isfinite(value):
        raise ValueError(f"value {value} cannot be stored in {dtype.short}")
    info = np.iinfo(dtype.numpy)
    if not info.min <= int(value) <= info.max:
        raise ValueError(f"value {value} overflows {dtype.short} (range {info.min}..{info.max})")
    return int(value)


def _full_infer(types, *, shape, value, dtype):
    if any(isinstance(d, int) and d < 0 for d in shape):
        raise ValueError(f"shape {fmt_shape(shape)} has a negative size")
    if isinstance(value, SymDim):  # a size as a value (a mean's count): numeric dtypes only
        if dtype == DType.bool:
            raise ValueError(f"a symbolic size ({value}) cannot fill a bool tensor")
    else:
        _fill_value(value, dtype)
    return TensorType(tuple(shape), dtype)


@defop("full", infer=_full_infer, num_inputs=0, traits=("creation",), attrs={
    "shape": Attr("ints"), "value": Attr("scalar"), "dtype": Attr("dtype")})
def full(*, shape, value, dtype):
    """A tensor of ``shape`` with every element ``value``."""
    return np.full(tuple(shape), _fill_value(value, dtype), dtype=dtype.numpy)


defvjp("full")(nondifferentiable)


# --------------------------------------------------------------- compute rules (lowering)
@defcompute("arange")
def _arange_compute(ctx, *, start=0, end, step=1, dtype):
    """``start + step * i`` in int64 for integer dtypes, float64 otherwise (as the reference)."""
    first, step, _ = _arange_bounds(start, end, step, dtype)
    t = DType.int64 if dtype.is_integer else DType.float64
    return ctx.tensor(ctx.out_shape, dtype,
                      lambda i: const(first, t) + const(step, t) * convert(i[0], DType.int64, t))


@defcompute("full")
def _full_compute(ctx, *, shape, value, dtype):
    literal = size_value(value, dtype) if isinstance(value, SymDim) else const(_fill_value(value, dtype), dtype)
    return ctx.tensor(ctx.out_shape, dtype, lambda i: literal)
