"""Unary elementwise ops: math functions, activations (relu, sigmoid, silu, gelu, ...),
rounding, predicates (logical_not, isnan, isinf) and stop_gradient; with the helpers the
other elementwise families (:mod:`.arithmetic`, :mod:`.special`) declare through.

Floating-point math on integer inputs yields float32.  float16/bfloat16 are computed in
float32 and rounded once, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special

from ..builder import GraphBuilder
from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import same_as_first, unary_float
from .compute import (
    Unary,
    call,
    cmp,
    compute_dtype,
    const,
    defcompute,
    float_compute_dtype,
    maximum,
    select,
)
from .cost import per_element
from .vjp import GradBuilder, deflinear, defvjp, elementwise, nondifferentiable, zero_gradient

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


# name: (numpy function, FLOPs per element)
_UNARY_FLOAT = {
    "exp": (np.exp, 4),
    "log": (np.log, 4),
    "log2": (np.log2, 4),
    "log1p": (np.log1p, 4),
    "expm1": (np.expm1, 4),
    "sqrt": (np.sqrt, 2),
    "rsqrt": (lambda x: 1.0 / np.sqrt(x), 2),
    "reciprocal": (lambda x: 1.0 / x, 2),
    "sigmoid": (_sigmoid, 5),
    "tanh": (np.tanh, 6),
    "sin": (np.sin, 6),
    "cos": (np.cos, 6),
    "tan": (np.tan, 8),
    "atan": (np.arctan, 8),
    "erf": (scipy.special.erf, 6),
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
# trait "nonnegative": every floating-point result element is >= 0 or NaN.
_NONNEGATIVE = {"exp", "sqrt", "sigmoid", "abs", "relu"}  # not rsqrt: rsqrt(-0.0) is -inf


def _decompose_silu(b: GraphBuilder, node):
    """``x * sigmoid(x)``."""
    x = node.inputs[0]
    return [b.mul(x, b.op("sigmoid", x))]


for _name, (_fn, _flops) in _UNARY_FLOAT.items():
    _unary(_name, _fn, amp="float32" if _name in _AMP_FLOAT32 else None, cost=per_element(_flops),
           traits=("elementwise", "nonnegative") if _name in _NONNEGATIVE else ("elementwise",))
_unary("silu", lambda x: x * _sigmoid(x), decompose=_decompose_silu, cost=per_element(6))
for _name, _fn in _UNARY_SAME.items():
    _unary(_name, _fn, infer=same_as_first,
           traits=("elementwise", "nonnegative") if _name in _NONNEGATIVE else ("elementwise",))


def _decompose_gelu(b: GraphBuilder, node):
    """``0.5 * x * (1 + erf(x * (1/sqrt 2)))``, or the ``tanh`` form
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``."""
    x = node.inputs[0]
    if node.attrs["approximate"] == "tanh":
        cube = b.mul(b.mul(x, x), x)
        inner = b.add(x, b.mul(cube, b.const(0.044715, x)))
        t = b.op("tanh", b.mul(inner, b.const(math.sqrt(2.0 / math.pi), x)))
    else:
        t = b.op("erf", b.mul(x, b.const(1.0 / math.sqrt(2.0), x)))
    return [b.mul(b.mul(x, b.const(0.5, x)), b.add(t, b.const(1.0, x)))]


defop("gelu", infer=unary_float, traits=("elementwise",), attrs={"approximate": Attr("str", "none")},
      decompose=_decompose_gelu, cost=per_element(10))(_gelu_ref)


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


# ------------------------------------------------------------------------ stop_gradient
@defop("stop_gradient", infer=same_as_first, traits=("elementwise",), amp="follow", vjp=nondifferentiable)
def stop_gradient(x):
    """``x`` itself, through which no gradient flows (``Tensor.detach``)."""
    return x.copy()


@defcompute("stop_gradient")
def _stop_gradient_compute(ctx, x):
    return ctx.tensor(x.shape, x.dtype, lambda i: x.at(i, x.dtype))
