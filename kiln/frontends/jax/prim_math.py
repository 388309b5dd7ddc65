"""Elementwise primitives: arithmetic, comparisons, logic, ``select_n``, casts, powers and
special functions.

Most map one to one onto a kiln op (the tables :data:`UNARY` and :data:`BINARY`); JAX's
binary primitives take operands of one shape (rank-0 literals aside), and kiln's ops
broadcast numpy-style, so both agree.  Integer ``div`` rounds toward zero and ``rem`` takes
the dividend's sign, as in XLA.
"""

from __future__ import annotations

from kiln.ir import DType, Value

from .rules import JaxContext, kiln_dtype, lowers

UNARY = {
    "neg": "neg", "abs": "abs", "sign": "sign", "floor": "floor", "ceil": "ceil",
    "exp": "exp", "exp2": "exp2", "log": "log", "log1p": "log1p", "expm1": "expm1",
    "tanh": "tanh", "sin": "sin", "cos": "cos", "tan": "tan", "asin": "asin", "acos": "acos",
    "atan": "atan", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh", "acosh": "acosh",
    "atanh": "atanh", "sqrt": "sqrt", "rsqrt": "rsqrt", "logistic": "sigmoid", "erf": "erf",
    "erf_inv": "erfinv", "lgamma": "lgamma", "not": "logical_not",
    "stop_gradient": "stop_gradient",
}
"""JAX primitive -> kiln op, for primitives of one operand and no params."""

BINARY = {
    "add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "max": "maximum", "min": "minimum",
    "pow": "pow", "atan2": "atan2", "nextafter": "nextafter",
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
}
"""JAX primitive -> kiln op, for primitives of two operands and no params."""

_LOGICAL = {"and": "logical_and", "or": "logical_or", "xor": "logical_xor"}


def _unary(op: str):
    def lower(ctx: JaxContext, x: Value, **_) -> Value:
        return ctx.op(op, x)
    return lower


def _binary(op: str):
    def lower(ctx: JaxContext, x: Value, y: Value, **_) -> Value:
        return ctx.op(op, x, y)
    return lower


for _name, _op in UNARY.items():
    lowers(_name)(_unary(_op))
for _name, _op in BINARY.items():
    lowers(_name)(_binary(_op))


def _bool_only(eqn) -> str | None:
    if any(str(v.aval.dtype) != "bool" for v in eqn.invars):
        return "kiln lowers and/or/xor of bool operands only (bitwise integer logic is not supported)"
    return None


for _name, _op in _LOGICAL.items():
    lowers(_name, check=_bool_only)(_binary(_op))


@lowers("div")
def _div(ctx: JaxContext, x: Value, y: Value, **_) -> Value:
    if x.dtype.is_floating:
        return ctx.div(x, y)
    return ctx.op("div", x, y, rounding_mode="trunc")


@lowers("rem")
def _rem(ctx: JaxContext, x: Value, y: Value, **_) -> Value:
    return ctx.op("fmod", x, y)


@lowers("round")
def _round(ctx: JaxContext, x: Value, *, rounding_method=0, **_) -> Value:
    if int(rounding_method) == 1:  # TO_NEAREST_EVEN
        return ctx.op("round", x)
    half = ctx.const(0.5, x)  # AWAY_FROM_ZERO
    return ctx.mul(ctx.op("sign", x), ctx.op("floor", ctx.add(ctx.op("abs", x), half)))


@lowers("erfc")
def _erfc(ctx: JaxContext, y: Value, **_) -> Value:
    """``erfc(-u) = 1 + erf(u)`` when the argument is a negation (``jax.nn.gelu``'s exact
    form ``0.5 x erfc(-x / sqrt(2))``): the form kiln's ``composites`` pass fuses into one
    ``gelu``.  Any other argument keeps ``erfc``, accurate in its tail."""
    u = _negated(ctx, y)
    if u is None:
        return ctx.op("erfc", y)
    return ctx.add(ctx.op("erf", u), ctx.const(1, y))


def _negated(ctx: JaxContext, y: Value) -> Value | None:
    """``u`` when ``y`` is ``neg(u)`` or ``neg(x) * c`` (then ``u = x * c``), else ``None``."""
    node = y.producer
    if node is None:
        return None
    if node.op_name == "neg":
        return node.inputs[0]
    if node.op_name != "mul":
        return None
    for negation, scale in (node.inputs, node.inputs[::-1]):
        inner = negation.producer
        if inner is not None and inner.op_name == "neg" and scale.is_const and scale.data.size == 1:
            return ctx.mul(inner.inputs[0], scale)
    return None


@lowers("square")
def _square(ctx: JaxContext, x: Value, **_) -> Value:
    return ctx.mul(x, x)


@lowers("is_finite")
def _is_finite(ctx: JaxContext, x: Value, **_) -> Value:
    bad = ctx.op("logical_or", ctx.op("isinf", x), ctx.op("isnan", x))
    return ctx.op("logical_not", bad)


@lowers("integer_pow")
def _integer_pow(ctx: JaxContext, x: Value, *, y: int, **_) -> Value:
    """Repeated squaring, as XLA computes it (exact for small exponents)."""
    n = abs(int(y))
    result: Value | None = None
    base = x
    while n:
        if n & 1:
            result = base if result is None else ctx.mul(result, base)
        n >>= 1
        if n:
            base = ctx.mul(base, base)
    if result is None:
        return ctx.op("full", shape=tuple(x.shape), value=1, dtype=x.dtype)
    return ctx.div(ctx.const(1, x), result) if int(y) < 0 else result


@lowers("select_n")
def _select_n(ctx: JaxContext, which: Value, *cases: Value, **_) -> Value:
    return ctx.where_index(which, cases)


@lowers("clamp")
def _clamp(ctx: JaxContext, low: Value, x: Value, high: Value, **_) -> Value:
    return ctx.op("minimum", ctx.op("maximum", x, low), high)


@lowers("convert_element_type")
def _convert(ctx: JaxContext, x: Value, *, new_dtype, **_) -> Value:
    dtype = kiln_dtype(new_dtype)
    if dtype == DType.bool and x.dtype != DType.bool:
        return ctx.op("ne", x, ctx.const(0, x))
    return ctx.cast(x, dtype)


@lowers("copy")
def _identity(ctx: JaxContext, x: Value, **_) -> Value:
    return x
