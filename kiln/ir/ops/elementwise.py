"""Elementwise ops: unary math, binary arithmetic with broadcasting, comparisons, select, cast.

Binary ops broadcast like numpy and promote dtypes with :func:`kiln.ir.types.promote`.
Floating-point math on integer inputs yields float32.  float16/bfloat16 are computed in
float32 and rounded once, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import numpy as np
import scipy.special

from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import (
    broadcast,
    broadcast_bool,
    broadcast_float,
    float_result,
    same_as_first,
    unary_float,
)

_LOWP = (np.float16, np.dtype("bfloat16"))


def _f32(x: np.ndarray) -> np.ndarray:
    """Upcast half-precision operands so numpy computes in float32."""
    return x.astype(np.float32) if x.dtype in _LOWP else x


def _as_inferred(result, infer, *arrays: np.ndarray, **attrs) -> np.ndarray:
    """``result`` in exactly the dtype ``infer`` gives for these operands (numpy would
    otherwise widen, e.g. int32 + float32 to float64, and half math stays in float32)."""
    out = infer([TensorType(np.shape(a), DType.from_numpy(a.dtype)) for a in arrays], **attrs)
    return np.asarray(result).astype(out.dtype.numpy, copy=False)


def _unary(name: str, fn, infer=unary_float, traits=("elementwise",), **rules):
    def ref(x):
        return _as_inferred(fn(_f32(x) if infer is not same_as_first else x), infer, x)

    ref.__doc__ = f"Elementwise {name}."
    defop(name, infer=infer, traits=traits, **rules)(ref)


def _gelu_ref(x, *, approximate: str = "none"):
    return _as_inferred(_gelu(x, approximate), unary_float, x)


def _gelu(x, approximate: str):
    x = _f32(x) if x.dtype in _LOWP else x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0)))


def _sigmoid(x):
    return scipy.special.expit(x)


_UNARY_FLOAT = {
    "exp": np.exp,
    "log": np.log,
    "log2": np.log2,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x,
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "atan": np.arctan,
    "erf": scipy.special.erf,
    "silu": lambda x: x * _sigmoid(x),
}
_UNARY_SAME = {
    "neg": np.negative,
    "abs": np.abs,
    "relu": lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "floor": np.floor,
    "ceil": np.ceil,
    "round": np.round,
    "trunc": np.trunc,
    "sign": np.sign,
}
for _name, _fn in _UNARY_FLOAT.items():
    _unary(_name, _fn)
for _name, _fn in _UNARY_SAME.items():
    _unary(_name, _fn, infer=same_as_first)

defop("gelu", infer=unary_float, traits=("elementwise",),
      attrs={"approximate": Attr("str", "none")})(_gelu_ref)


def _bool_unary(types, **_):
    return types[0].with_dtype(DType.bool)


defop("logical_not", infer=_bool_unary, traits=("elementwise",))(lambda x: np.logical_not(x))
defop("isnan", infer=_bool_unary, traits=("elementwise",))(lambda x: np.isnan(_f32(x)))
defop("isinf", infer=_bool_unary, traits=("elementwise",))(lambda x: np.isinf(_f32(x)))


def _binary(name, fn, infer=broadcast, traits=("elementwise",), attrs=None):
    def ref(a, b, **kw):
        return _as_inferred(fn(_f32(a), _f32(b), **kw), infer, a, b, **kw)

    ref.__doc__ = f"Elementwise {name} with broadcasting."
    defop(name, infer=infer, num_inputs=2, traits=traits, attrs=attrs)(ref)


def _div(a, b, *, rounding_mode=None):
    if rounding_mode is None:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.true_divide(a, b)
    if rounding_mode == "floor":
        return np.floor_divide(a, b)
    if rounding_mode == "trunc":
        if a.dtype.kind in "iu" and b.dtype.kind in "iu":
            q = np.abs(a) // np.abs(b)
            return q * np.sign(a) * np.sign(b)
        return np.trunc(a / b)
    raise ValueError(f"div: rounding_mode must be none, 'trunc' or 'floor', got {rounding_mode!r}")


def _div_infer(types, *, rounding_mode=None):
    return broadcast_float(types) if rounding_mode is None else broadcast(types)


def _pow(a, b):
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        return np.power(a, np.maximum(b, 0))
    return np.power(a, b)


def _remainder(a, b):
    return np.remainder(a, b)


_binary("add", np.add, traits=("elementwise", "commutative"))
_binary("sub", np.subtract)
_binary("mul", np.multiply, traits=("elementwise", "commutative"))
_binary("div", _div, infer=_div_infer, attrs={"rounding_mode": Attr("str", None, optional=True)})
_binary("pow", _pow)
_binary("maximum", np.maximum, traits=("elementwise", "commutative"))
_binary("minimum", np.minimum, traits=("elementwise", "commutative"))
_binary("remainder", _remainder)
_binary("atan2", np.arctan2, infer=broadcast_float)
for _name, _fn, _comm in [
    ("eq", np.equal, True),
    ("ne", np.not_equal, True),
    ("lt", np.less, False),
    ("le", np.less_equal, False),
    ("gt", np.greater, False),
    ("ge", np.greater_equal, False),
    ("logical_and", np.logical_and, True),
    ("logical_or", np.logical_or, True),
    ("logical_xor", np.logical_xor, True),
]:
    _binary(_name, _fn, infer=broadcast_bool,
            traits=("elementwise", "commutative") if _comm else ("elementwise",))


def _where_infer(types, **_):
    cond, a, b = types
    if cond.dtype != DType.bool:
        raise ValueError(f"condition must be bool, got {cond.dtype.short}")
    return broadcast([a, b]).with_shape(broadcast([cond, a, b]).shape)


@defop("where", infer=_where_infer, num_inputs=3, traits=("elementwise",))
def where(cond, a, b):
    """``cond ? a : b`` elementwise, with broadcasting."""
    return _as_inferred(np.where(cond, a, b), _where_infer, cond, a, b)


def _cast_infer(types, *, dtype):
    return types[0].with_dtype(dtype)


@defop("cast", infer=_cast_infer, attrs={"dtype": Attr("dtype")}, traits=("elementwise",))
def cast(x, *, dtype):
    """Convert to ``dtype`` (float -> int truncates toward zero, as in torch)."""
    if dtype.is_integer and x.dtype.kind == "f":
        x = np.trunc(_f32(x))
    return x.astype(dtype.numpy)


def _clamp_infer(types, *, min=None, max=None):
    return types[0]


@defop("clamp", infer=_clamp_infer, traits=("elementwise",),
       attrs={"min": Attr("float", None, optional=True), "max": Attr("float", None, optional=True)})
def clamp(x, *, min=None, max=None):
    """Clamp into ``[min, max]``; either bound may be absent."""
    y = x
    if min is not None:
        y = np.maximum(y, np.asarray(min).astype(x.dtype))
    if max is not None:
        y = np.minimum(y, np.asarray(max).astype(x.dtype))
    return y


__all__ = ["float_result"]
