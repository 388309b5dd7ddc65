"""Binary arithmetic with broadcasting (add, sub, mul, div, pow, maximum/minimum,
remainder, atan2), comparisons and logical ops, ``where``, ``cast`` and ``clamp``.

Binary ops broadcast like numpy and promote dtypes with :func:`kiln.ir.types.promote`.
float16/bfloat16 are computed in float32 and rounded once, as PyTorch's CPU kernels do.
"""

from __future__ import annotations

import numpy as np

from ..loops.expr import Const
from ..registry import Attr, defop
from ..types import DType, promote
from ._infer import broadcast, broadcast_bool, broadcast_float
from .compute import (broadcast_index, call, cmp, compute_dtype, const, convert, defcompute,
                      floordiv, floormod, maximum, minimum, select)
from .cost import per_element
from .elementwise import _as_inferred, _f32, _truthy
from .vjp import GradBuilder, defbilinear, defvjp, nondifferentiable, unbroadcast


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
_binary("div", _div, infer=_div_infer, attrs={"rounding_mode": Attr("str", None, optional=True)},
        cost=per_element(2))
_binary("pow", _pow, amp="float32", cost=per_element(6))
_binary("maximum", np.maximum, traits=("elementwise", "commutative"))
_binary("minimum", np.minimum, traits=("elementwise", "commutative"))
_binary("remainder", _remainder, cost=per_element(3))
_binary("atan2", np.arctan2, infer=broadcast_float, cost=per_element(10))
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


@defop("cast", infer=_cast_infer, attrs={"dtype": Attr("dtype")}, traits=("elementwise", "copy"))
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
