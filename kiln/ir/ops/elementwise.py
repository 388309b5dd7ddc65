"""Elementwise ops: unary math, binary arithmetic with broadcasting, comparisons, select, cast.

Binary ops broadcast like numpy and promote dtypes with :func:`kiln.ir.types.promote`.
Floating-point math on integer inputs yields float32.  float16/bfloat16 are computed in
float32 and rounded once, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special

from ..loops.expr import Const
from ..registry import Attr, defop
from ..types import DType, TensorType, promote
from ._infer import (
    broadcast,
    broadcast_bool,
    broadcast_float,
    float_result,
    same_as_first,
    unary_float,
)
from .compute import (
    Unary,
    broadcast_index,
    call,
    cmp,
    compute_dtype,
    const,
    convert,
    defcompute,
    float_compute_dtype,
    floordiv,
    floormod,
    maximum,
    minimum,
    select,
)
from .vjp import (
    GradBuilder,
    defbilinear,
    deflinear,
    defvjp,
    elementwise,
    nondifferentiable,
    unbroadcast,
    zero_gradient,
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
# amp policy "float32": functions that lose too much accuracy (or overflow) in half precision.
_AMP_FLOAT32 = {"exp", "log", "log2", "log1p", "expm1", "rsqrt", "reciprocal", "tan"}
for _name, _fn in _UNARY_FLOAT.items():
    _unary(_name, _fn, amp="float32" if _name in _AMP_FLOAT32 else None)
for _name, _fn in _UNARY_SAME.items():
    _unary(_name, _fn, infer=same_as_first)

defop("gelu", infer=unary_float, traits=("elementwise",),
      attrs={"approximate": Attr("str", "none")})(_gelu_ref)


# Gradient rules of the unary ops: dy/dx from the input x and the result y (kiln.ir.ops.vjp).
_UNARY_DERIVATIVES = {
    "exp": lambda b, x, y: y,
    "log": lambda b, x, y: b.op("reciprocal", x),
    "log2": lambda b, x, y: b.op("reciprocal", b.mul(x, b.const(math.log(2.0), x))),
    "log1p": lambda b, x, y: b.op("reciprocal", b.add(x, b.const(1.0, x))),
    "expm1": lambda b, x, y: b.add(y, b.const(1.0, y)),
    "sqrt": lambda b, x, y: b.div(b.const(0.5, y), y),
    "rsqrt": lambda b, x, y: b.mul(b.const(-0.5, y), b.div(y, x)),
    "reciprocal": lambda b, x, y: b.neg(b.mul(y, y)),
    "sigmoid": lambda b, x, y: b.mul(y, b.sub(b.const(1.0, y), y)),
    "tanh": lambda b, x, y: b.sub(b.const(1.0, y), b.mul(y, y)),
    "sin": lambda b, x, y: b.op("cos", x),
    "cos": lambda b, x, y: b.neg(b.op("sin", x)),
    "tan": lambda b, x, y: b.add(b.const(1.0, y), b.mul(y, y)),
    "atan": lambda b, x, y: b.op("reciprocal", b.add(b.const(1.0, x), b.mul(x, x))),
    "erf": lambda b, x, y: b.mul(b.const(2.0 / math.sqrt(math.pi), x),
                                 b.op("exp", b.neg(b.mul(x, x)))),
    "silu": lambda b, x, y: _silu_derivative(b, x),
    "abs": lambda b, x, y: b.op("sign", x),
}


def _silu_derivative(b: GradBuilder, x):
    """``sigmoid(x) * (1 + x * (1 - sigmoid(x)))``."""
    s = b.op("sigmoid", x)
    one = b.const(1.0, x)
    return b.mul(s, b.add(one, b.mul(x, b.sub(one, s))))


for _name, _derivative in _UNARY_DERIVATIVES.items():
    defvjp(_name)(elementwise(_derivative))
defvjp("floor", "ceil", "round", "trunc", "sign")(zero_gradient)


defvjp("neg")(deflinear(lambda b, g, x, y, attrs: b.neg(g)))


@defvjp("relu")
def _relu_vjp(b, inputs, outputs, cotangents, attrs):
    """Zero where the result is not positive (torch's threshold_backward: 0 at x = 0)."""
    y, g = outputs[0], cotangents[0]
    if not y.dtype.is_floating:
        return [None]
    return [b.where(b.op("gt", y, b.const(0, y)), g, b.const(0.0, g))]


@defvjp("gelu")
def _gelu_vjp(b, inputs, outputs, cotangents, attrs):
    x = inputs[0]
    if not x.dtype.is_floating:
        return [None]
    half, one = b.const(0.5, x), b.const(1.0, x)
    if attrs["approximate"] == "tanh":
        k, c = math.sqrt(2.0 / math.pi), 0.044715
        x2 = b.mul(x, x)
        inner = b.mul(b.const(k, x), b.add(x, b.mul(b.const(c, x), b.mul(x2, x))))
        t = b.op("tanh", inner)
        dinner = b.mul(b.const(k, x), b.add(one, b.mul(b.const(3 * c, x), x2)))
        dt = b.mul(b.sub(one, b.mul(t, t)), dinner)
        d = b.add(b.mul(half, b.add(one, t)), b.mul(b.mul(half, x), dt))
    else:
        cdf = b.mul(half, b.add(one, b.op("erf", b.mul(x, b.const(1.0 / math.sqrt(2.0), x)))))
        pdf = b.mul(b.const(1.0 / math.sqrt(2.0 * math.pi), x),
                    b.op("exp", b.mul(b.const(-0.5, x), b.mul(x, x))))
        d = b.add(cdf, b.mul(x, pdf))
    return [b.mul(cotangents[0], d)]


def _bool_unary(types, **_):
    return types[0].with_dtype(DType.bool)


defop("logical_not", infer=_bool_unary, traits=("elementwise",))(lambda x: np.logical_not(x))
defop("isnan", infer=_bool_unary, traits=("elementwise",))(lambda x: np.isnan(_f32(x)))
defop("isinf", infer=_bool_unary, traits=("elementwise",))(lambda x: np.isinf(_f32(x)))
defvjp("logical_not", "isnan", "isinf")(nondifferentiable)


def _binary(name, fn, infer=broadcast, traits=("elementwise",), attrs=None, **rules):
    def ref(a, b, **kw):
        return _as_inferred(fn(_f32(a), _f32(b), **kw), infer, a, b, **kw)

    ref.__doc__ = f"Elementwise {name} with broadcasting."
    defop(name, infer=infer, num_inputs=2, traits=traits, attrs=attrs, **rules)(ref)


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
_binary("pow", _pow, amp="float32")
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
    defvjp(_name)(nondifferentiable)


# Gradient rules of the binary ops.  Each cotangent is summed back over broadcast axes and
# cast to its operand's dtype; integer and bool operands get none.
def _to(b: GradBuilder, g, operand):
    return unbroadcast(b, g, operand) if operand.dtype.is_floating else None


@defvjp("add")
def _add_vjp(b, inputs, outputs, cotangents, attrs):
    g = cotangents[0]
    return [_to(b, g, inputs[0]), _to(b, g, inputs[1])]


@defvjp("sub")
def _sub_vjp(b, inputs, outputs, cotangents, attrs):
    g = cotangents[0]
    return [_to(b, g, inputs[0]), _to(b, b.neg(g), inputs[1]) if b.wants(1) else None]


defvjp("mul")(defbilinear(lambda b, g, x, y, attrs: _to(b, b.mul(g, y), x),
                          lambda b, g, x, y, attrs: _to(b, b.mul(g, x), y)))


@defvjp("div")
def _div_vjp(b, inputs, outputs, cotangents, attrs):
    """``d(x/y) = g/y, -g*(x/y)/y``; rounding divisions are piecewise constant (zero)."""
    (x, y), g = inputs, cotangents[0]
    if attrs["rounding_mode"] is not None:
        return [None, None]
    return [_to(b, b.div(g, y), x) if b.wants(0) else None,
            _to(b, b.neg(b.div(b.mul(g, outputs[0]), y)), y) if b.wants(1) else None]


@defvjp("pow")
def _pow_vjp(b, inputs, outputs, cotangents, attrs):
    """As torch: the base gets 0 where the exponent is 0; the exponent gets 0 where the base
    is 0 and the exponent non-negative."""
    (x, e), g = inputs, cotangents[0]
    dx = de = None
    if b.wants(0) and x.dtype.is_floating:
        d = b.mul(e, b.op("pow", x, b.sub(e, b.const(1, e))))
        d = b.where(b.op("eq", e, b.const(0, e)), b.const(0.0, d), d)
        dx = _to(b, b.mul(g, d), x)
    if b.wants(1) and e.dtype.is_floating:
        d = b.mul(outputs[0], b.op("log", x))
        base_zero = b.op("logical_and", b.op("eq", x, b.const(0, x)), b.op("ge", e, b.const(0, e)))
        d = b.where(base_zero, b.const(0.0, d), d)
        de = _to(b, b.mul(g, d), e)
    return [dx, de]


def _extremum_vjp(wins: str, loses: str):
    """maximum/minimum: the winner gets the cotangent; ties split it in half (as torch)."""

    def rule(b, inputs, outputs, cotangents, attrs):
        (x, y), g = inputs, cotangents[0]
        half = b.mul(g, b.const(0.5, g))
        zero = b.const(0.0, g)
        tie = b.op("eq", x, y)
        shared = b.where(tie, half, zero)
        return [_to(b, b.where(b.op(wins, x, y), g, shared), x) if b.wants(0) else None,
                _to(b, b.where(b.op(loses, x, y), g, shared), y) if b.wants(1) else None]

    return rule


defvjp("maximum")(_extremum_vjp("gt", "lt"))
defvjp("minimum")(_extremum_vjp("lt", "gt"))


@defvjp("remainder")
def _remainder_vjp(b, inputs, outputs, cotangents, attrs):
    """``x - floor(x / y) * y``: ``g`` and ``-g * floor(x / y)``."""
    (x, y), g = inputs, cotangents[0]
    quotient = b.op("div", x, y, rounding_mode="floor")
    return [_to(b, g, x), _to(b, b.neg(b.mul(g, quotient)), y) if b.wants(1) else None]


@defvjp("atan2")
def _atan2_vjp(b, inputs, outputs, cotangents, attrs):
    (x, y), g = inputs, cotangents[0]
    scale = b.div(g, b.add(b.mul(x, x), b.mul(y, y)))
    return [_to(b, b.mul(scale, y), x) if b.wants(0) else None,
            _to(b, b.neg(b.mul(scale, x)), y) if b.wants(1) else None]


def _where_infer(types, **_):
    cond, a, b = types
    if cond.dtype != DType.bool:
        raise ValueError(f"condition must be bool, got {cond.dtype.short}")
    return broadcast([a, b]).with_shape(broadcast([cond, a, b]).shape)


@defop("where", infer=_where_infer, num_inputs=3, traits=("elementwise",))
def where(cond, a, b):
    """``cond ? a : b`` elementwise, with broadcasting."""
    return _as_inferred(np.where(cond, a, b), _where_infer, cond, a, b)


@defvjp("where")
def _where_vjp(b, inputs, outputs, cotangents, attrs):
    """The condition gets no gradient; each branch gets the cotangent where it was chosen."""
    (cond, x, y), g = inputs, cotangents[0]
    zero = b.const(0.0, g)
    return [None, _to(b, b.where(cond, g, zero), x) if b.wants(1) else None,
            _to(b, b.where(cond, zero, g), y) if b.wants(2) else None]


def _cast_infer(types, *, dtype):
    return types[0].with_dtype(dtype)


@defop("cast", infer=_cast_infer, attrs={"dtype": Attr("dtype")}, traits=("elementwise",))
def cast(x, *, dtype):
    """Convert to ``dtype`` (float -> int truncates toward zero, as in torch)."""
    if dtype.is_integer and x.dtype.kind == "f":
        x = np.trunc(_f32(x))
    return x.astype(dtype.numpy)


@defvjp("cast")
def _cast_vjp(b, inputs, outputs, cotangents, attrs):
    """Cast the cotangent back (float -> float casts only; others get no gradient)."""
    x = inputs[0]
    return [b.cast(cotangents[0], x.dtype) if x.dtype.is_floating else None]


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


@defvjp("clamp")
def _clamp_vjp(b, inputs, outputs, cotangents, attrs):
    """The cotangent passes where ``min <= x <= max`` (bounds included, as torch)."""
    x, g = inputs[0], cotangents[0]
    if not x.dtype.is_floating:
        return [None]
    inside = None
    for op, bound in (("ge", attrs["min"]), ("le", attrs["max"])):
        if bound is None:
            continue
        test = b.op(op, x, b.const(bound, x))
        inside = test if inside is None else b.op("logical_and", inside, test)
    return [g if inside is None else b.where(inside, g, b.const(0.0, g))]


# --------------------------------------------------------------- compute rules (lowering)
# Element expressions for kiln.passes.lower (kiln.ir.ops.compute): each rule gives one
# result element from operand elements; half precision is computed in float32.
def _elementwise_rule(expr, compute=float_compute_dtype):
    """A rule ``out[i] = expr(x[i], t)`` computing in ``t = compute(result dtype)``."""

    def rule(ctx, x, **_):
        t = compute(ctx.out.dtype)
        return ctx.tensor(ctx.out_shape, ctx.out.dtype, lambda i: expr(x.at(i, t), t))

    return rule


def _log1p(x, t):
    """``log(u) * x / (u - 1)`` with ``u = 1 + x`` (accurate for tiny ``x``)."""
    u = const(1, t) + x
    one, inf = const(1, t), const(math.inf, t)
    return select(cmp("==", u, one), x, select(cmp("==", u, inf), u, call("log", u) * x / (u - one)))


def _expm1(x, t):
    """``(u - 1) * x / log(u)`` with ``u = exp(x)`` (accurate for tiny ``x``)."""
    u = call("exp", x)
    one = const(1, t)
    exact = select(cmp("==", u, const(math.inf, t)), u, (u - one) * x / call("log", u))
    return select(cmp("==", u, one), x, select(cmp("==", u - one, const(-1, t)), const(-1, t), exact))


def _sigmoid_expr(x, t):
    return const(1, t) / (const(1, t) + call("exp", -x))


def _integral(fn):
    """Rounding functions: the identity on integers."""
    return lambda x, t: x if not t.is_floating else fn(x, t)


def _round_half_even(x, t):
    f = call("floor", x)
    d = x - f
    half, one = const(0.5, t), const(1, t)
    tie = select(cmp("==", call("fmod", f, const(2, t)), const(0, t)), f, f + one)
    return select(cmp(">", d, half), f + one, select(cmp("<", d, half), f, tie))


_UNARY_EXPRS = {
    "exp": lambda x, t: call("exp", x),
    "log": lambda x, t: call("log", x),
    "log2": lambda x, t: call("log2", x),
    "log1p": _log1p,
    "expm1": _expm1,
    "sqrt": lambda x, t: call("sqrt", x),
    "rsqrt": lambda x, t: const(1, t) / call("sqrt", x),
    "reciprocal": lambda x, t: const(1, t) / x,
    "sigmoid": _sigmoid_expr,
    "tanh": lambda x, t: call("tanh", x),
    "sin": lambda x, t: call("sin", x),
    "cos": lambda x, t: call("cos", x),
    "tan": lambda x, t: call("tan", x),
    "atan": lambda x, t: call("atan", x),
    "erf": lambda x, t: call("erf", x),
    "silu": lambda x, t: x * _sigmoid_expr(x, t),
}
_SAME_EXPRS = {
    "neg": lambda x, t: -x,
    "abs": lambda x, t: call("abs", x),
    "relu": lambda x, t: maximum(x, const(0, t)),
    "floor": _integral(lambda x, t: call("floor", x)),
    "ceil": _integral(lambda x, t: call("ceil", x)),
    "round": _integral(_round_half_even),
    "trunc": _integral(lambda x, t: select(cmp("<", x, const(0, t)), call("ceil", x), call("floor", x))),
    "sign": lambda x, t: select(cmp(">", x, const(0, t)), const(1, t),
                                select(cmp("<", x, const(0, t)), const(-1, t), x)),
}
for _name, _expr in _UNARY_EXPRS.items():
    defcompute(_name)(_elementwise_rule(_expr))
for _name, _expr in _SAME_EXPRS.items():
    defcompute(_name)(_elementwise_rule(_expr, compute=compute_dtype))


@defcompute("gelu")
def _gelu_compute(ctx, x, *, approximate="none"):
    t = float_compute_dtype(ctx.out.dtype)

    def element(i):
        v = x.at(i, t)
        if approximate == "tanh":
            inner = const(math.sqrt(2.0 / math.pi), t) * (v + const(0.044715, t) * (v * v * v))
            return const(0.5, t) * v * (const(1, t) + call("tanh", inner))
        return const(0.5, t) * v * (const(1, t) + call("erf", v / const(math.sqrt(2.0), t)))

    return ctx.tensor(ctx.out_shape, ctx.out.dtype, element)


def _truthy(e, dtype):
    return e if dtype == DType.bool else cmp("!=", e, const(0, dtype))


def _predicate_rule(expr):
    """``out[i] = expr(x[i], t)`` (bool) with ``x`` in its own compute dtype ``t``."""

    def rule(ctx, x):
        t = compute_dtype(x.dtype)
        return ctx.tensor(ctx.out_shape, DType.bool, lambda i: expr(x.at(i, t), t))

    return rule


defcompute("logical_not")(_predicate_rule(lambda x, t: Unary("!", _truthy(x, t))))
defcompute("isnan")(_predicate_rule(
    lambda x, t: cmp("!=", x, x) if t.is_floating else const(False, DType.bool)))
defcompute("isinf")(_predicate_rule(
    lambda x, t: cmp("==", call("abs", x), const(math.inf, t)) if t.is_floating else const(False, DType.bool)))


def _binary_rule(expr, compute=None):
    """``out[i] = expr(a[bcast(i)], b[bcast(i)], t, attrs)``; ``t`` is the compute dtype of
    the result, or of the promoted operands for bool results."""

    def rule(ctx, a, b, **attrs):
        out = ctx.out.dtype
        t = compute(out) if compute else compute_dtype(promote(a.dtype, b.dtype) if out == DType.bool else out)
        return ctx.tensor(ctx.out_shape, out, lambda i: expr(
            a.at(broadcast_index(i, a.shape), t), b.at(broadcast_index(i, b.shape), t), t, **attrs))

    return rule


def _div_expr(a, b, t, rounding_mode=None):
    if rounding_mode is None:
        return a / b
    if rounding_mode == "floor":
        return floordiv(a, b)
    if t.is_integer:
        return a / b  # C division truncates toward zero
    q = a / b
    return select(cmp("<", q, const(0, t)), call("ceil", q), call("floor", q))


def _pow_expr(a, b, t):
    if t.is_floating and isinstance(b, Const):
        # constant exponents as PyTorch's CPU kernels compute them (x * x for 2, x * x * x
        # for 3, sqrt for 0.5...): as fast as a multiply and the same results as eager
        special = {1.0: lambda: a, 2.0: lambda: a * a, 3.0: lambda: a * a * a,
                   0.5: lambda: call("sqrt", a), -1.0: lambda: const(1, t) / a,
                   -2.0: lambda: const(1, t) / (a * a)}
        if float(b.value) in special:
            return special[float(b.value)]()
    if t.is_floating:
        return call("pow", a, b)
    return call("pow", a, maximum(b, const(0, t)))  # integer powers are exact in f64 up to 2**53


_BINARY_EXPRS = {
    "add": lambda a, b, t: a + b,
    "sub": lambda a, b, t: a - b,
    "mul": lambda a, b, t: a * b,
    "div": _div_expr,
    "pow": _pow_expr,
    "maximum": lambda a, b, t: maximum(a, b),
    "minimum": lambda a, b, t: minimum(a, b),
    "remainder": lambda a, b, t: floormod(a, b),
    "atan2": lambda a, b, t: call("atan2", a, b),
    "eq": lambda a, b, t: cmp("==", a, b),
    "ne": lambda a, b, t: cmp("!=", a, b),
    "lt": lambda a, b, t: cmp("<", a, b),
    "le": lambda a, b, t: cmp("<=", a, b),
    "gt": lambda a, b, t: cmp(">", a, b),
    "ge": lambda a, b, t: cmp(">=", a, b),
    "logical_and": lambda a, b, t: cmp("&&", _truthy(a, t), _truthy(b, t)),
    "logical_or": lambda a, b, t: cmp("||", _truthy(a, t), _truthy(b, t)),
    "logical_xor": lambda a, b, t: cmp("!=", _truthy(a, t), _truthy(b, t)),
}
for _name, _expr in _BINARY_EXPRS.items():
    defcompute(_name)(_binary_rule(_expr))


@defcompute("where")
def _where_compute(ctx, cond, a, b):
    out = ctx.out.dtype
    return ctx.tensor(ctx.out_shape, out, lambda i: select(
        cond[broadcast_index(i, cond.shape)], a.at(broadcast_index(i, a.shape), out),
        b.at(broadcast_index(i, b.shape), out)))


@defcompute("cast")
def _cast_compute(ctx, x, *, dtype):
    # float -> int truncates toward zero (C conversion); half precision goes through f32
    src = compute_dtype(x.dtype) if dtype.is_integer else x.dtype
    return ctx.tensor(x.shape, dtype, lambda i: convert(x.at(i, src), src, dtype))


@defcompute("clamp")
def _clamp_compute(ctx, x, *, min=None, max=None):
    t = compute_dtype(x.dtype)

    def bound(value):  # the bound as the reference sees it: converted to x's dtype first
        with np.errstate(all="ignore"):
            return const(np.asarray(value).astype(x.dtype.numpy).item(), t)

    def element(i):
        v = x.at(i, t)
        if min is not None:
            v = maximum(v, bound(min))
        if max is not None:
            v = minimum(v, bound(max))
        return v

    return ctx.tensor(x.shape, x.dtype, element)


# ------------------------------------------------------------------------ stop_gradient
@defop("stop_gradient", infer=same_as_first, traits=("elementwise",), amp="follow", vjp=nondifferentiable)
def stop_gradient(x):
    """``x`` itself, through which no gradient flows (``Tensor.detach``)."""
    return x.copy()


@defcompute("stop_gradient")
def _stop_gradient_compute(ctx, x):
    return ctx.tensor(x.shape, x.dtype, lambda i: x.at(i, x.dtype))


__all__ = ["float_result"]
