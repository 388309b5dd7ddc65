"""Elementwise math beyond the basic set: inverse trigonometric and hyperbolic functions,
base-10/base-2 exponentials and logarithms, the error and gamma families, modified Bessel
functions, and floating-point manipulation (``fmod``, ``copysign``, ``fmax``/``fmin``,
``nextafter``, ``signbit``).

Conventions are those of :mod:`kiln.ir.ops.elementwise` and :mod:`kiln.ir.ops.arithmetic`:
integer inputs to float math give float32, half precision computes in float32, binary ops
broadcast and promote.  Functions the C math library lacks (``lgamma``, ``polygamma``, the
Bessel functions, ``erfinv``, ...) have no compute definition: the cpu backend runs their
numpy (scipy) reference.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.special

from ..loops.expr import Binary
from ..registry import Attr, defop
from ..types import DType
from ._infer import broadcast, broadcast_float, unary_float
from .compute import call, cmp, compute_dtype, const, defcompute, select
from .arithmetic import _binary, _binary_rule, _to
from .elementwise import _as_inferred, _elementwise_rule, _f32, _log1p, _unary
from .vjp import GradBuilder, defvjp, elementwise, nondifferentiable

_LN2, _LN10 = math.log(2.0), math.log(10.0)


def _polygamma_np(n: int, x):
    if n == 0:
        return scipy.special.digamma(x)
    return scipy.special.polygamma(n, x)


_FLOAT_FUNCS = {
    "asin": np.arcsin, "acos": np.arccos, "asinh": np.arcsinh, "acosh": np.arccosh,
    "atanh": np.arctanh, "sinh": np.sinh, "cosh": np.cosh, "log10": np.log10, "exp2": np.exp2,
    "erfc": scipy.special.erfc, "erfinv": scipy.special.erfinv, "lgamma": scipy.special.gammaln,
    "i0": scipy.special.i0, "i0e": scipy.special.i0e, "i1": scipy.special.i1, "i1e": scipy.special.i1e,
}


def _quiet(fn):
    def run(x):
        with np.errstate(all="ignore"):
            return fn(x)
    return run


for _name, _fn in _FLOAT_FUNCS.items():
    _unary(_name, _quiet(_fn), amp="float32")


def _polygamma_ref(x, *, n: int):
    """The ``n``-th derivative of the digamma function (``n = 0``: digamma itself)."""
    with np.errstate(all="ignore"):
        return _as_inferred(_polygamma_np(n, _f32(x)), unary_float, x)


defop("polygamma", infer=unary_float, traits=("elementwise",), attrs={"n": Attr("int", 0)},
      amp="float32")(_polygamma_ref)


def _signbit_infer(types, **_):
    return types[0].with_dtype(DType.bool)


@defop("signbit", infer=_signbit_infer, traits=("elementwise",))
def signbit(x):
    """Whether the sign bit is set (true for -0.0 and negative numbers)."""
    return np.signbit(_f32(x).astype(np.int8) if x.dtype == np.bool_ else _f32(x))


defvjp("signbit")(nondifferentiable)


# --------------------------------------------------------------------------- binary
def _fmod(a, b):
    if a.dtype.kind in "iub" and b.dtype.kind in "iub":
        return np.fmod(a, b)
    with np.errstate(all="ignore"):
        return np.fmod(a, b)


def _nextafter(a, b):
    return np.nextafter(a, b)


_binary("fmod", _fmod, infer=broadcast)
_binary("copysign", np.copysign, infer=broadcast_float)
_binary("fmax", np.fmax, infer=broadcast, traits=("elementwise", "commutative"))
_binary("fmin", np.fmin, infer=broadcast, traits=("elementwise", "commutative"))
_binary("nextafter", _nextafter, infer=broadcast)


# --------------------------------------------------------------------------- gradient rules
def _one_minus_sq(b: GradBuilder, x):
    return b.sub(b.const(1.0, x), b.mul(x, x))


def _bessel1_over_x(b: GradBuilder, x, i1x):
    """``i1(x) / x``, with its limit 0.5 at ``x = 0``."""
    zero = b.op("eq", x, b.const(0.0, x))
    safe = b.where(zero, b.const(1.0, x), x)
    return b.where(zero, b.const(0.5, x), b.div(i1x, safe))


_DERIVATIVES = {
    "asin": lambda b, x, y: b.op("rsqrt", _one_minus_sq(b, x)),
    "acos": lambda b, x, y: b.neg(b.op("rsqrt", _one_minus_sq(b, x))),
    "asinh": lambda b, x, y: b.op("rsqrt", b.add(b.mul(x, x), b.const(1.0, x))),
    "acosh": lambda b, x, y: b.op("rsqrt", b.mul(b.sub(x, b.const(1.0, x)), b.add(x, b.const(1.0, x)))),
    "atanh": lambda b, x, y: b.op("reciprocal", _one_minus_sq(b, x)),
    "sinh": lambda b, x, y: b.op("cosh", x),
    "cosh": lambda b, x, y: b.op("sinh", x),
    "log10": lambda b, x, y: b.op("reciprocal", b.mul(x, b.const(_LN10, x))),
    "exp2": lambda b, x, y: b.mul(y, b.const(_LN2, y)),
    "erfc": lambda b, x, y: b.mul(b.const(-2.0 / math.sqrt(math.pi), x), b.op("exp", b.neg(b.mul(x, x)))),
    "erfinv": lambda b, x, y: b.mul(b.const(math.sqrt(math.pi) / 2.0, y), b.op("exp", b.mul(y, y))),
    "lgamma": lambda b, x, y: b.op("polygamma", x, n=0),
    "i0": lambda b, x, y: b.op("i1", x),
    "i1": lambda b, x, y: b.sub(b.op("i0", x), _bessel1_over_x(b, x, y)),
    "i0e": lambda b, x, y: b.sub(b.op("i1e", x), b.mul(b.op("sign", x), y)),
    "i1e": lambda b, x, y: b.sub(b.sub(b.op("i0e", x), b.mul(b.op("sign", x), y)),
                                 _bessel1_over_x(b, x, y)),
}
for _name, _derivative in _DERIVATIVES.items():
    defvjp(_name)(elementwise(_derivative))


@defvjp("polygamma")
def _polygamma_vjp(b, inputs, outputs, cotangents, attrs):
    x = inputs[0]
    if not x.dtype.is_floating:
        return [None]
    return [b.cast(b.mul(cotangents[0], b.op("polygamma", x, n=attrs["n"] + 1)), x.dtype)]


@defvjp("fmod")
def _fmod_vjp(b, inputs, outputs, cotangents, attrs):
    """``a - trunc(a / b) * b``: ``g`` and ``-g * trunc(a / b)``."""
    (x, y), g = inputs, cotangents[0]
    dy = None
    if b.wants(1) and y.dtype.is_floating:
        dy = _to(b, b.neg(b.mul(g, b.op("div", x, y, rounding_mode="trunc"))), y)
    return [_to(b, g, x) if b.wants(0) else None, dy]


@defvjp("copysign")
def _copysign_vjp(b, inputs, outputs, cotangents, attrs):
    """``|a| * sign(b)``: ``g * y / a`` for ``a``, 0 where ``a == 0`` (as torch); none for ``b``."""
    x, g = inputs[0], cotangents[0]
    if not (b.wants(0) and x.dtype.is_floating):
        return [None, None]
    out = outputs[0]
    zero = b.op("eq", x, b.const(0.0, x))
    ratio = b.div(out, b.where(zero, b.const(1.0, x), x))
    d = b.where(zero, b.const(0.0, out), ratio)
    return [_to(b, b.mul(g, d), x), None]


def _fextremum_vjp(wins: str):
    """fmax/fmin: ``a`` gets the cotangent where it wins or ties or ``b`` is NaN, else ``b``."""

    def rule(b, inputs, outputs, cotangents, attrs):
        (x, y), g = inputs, cotangents[0]
        a_chosen = b.op("logical_or", b.op(wins, x, y), b.op("isnan", y))
        zero = b.const(0.0, g)
        return [_to(b, b.where(a_chosen, g, zero), x) if b.wants(0) else None,
                _to(b, b.where(a_chosen, zero, g), y) if b.wants(1) else None]

    return rule


@defvjp("nextafter")
def _nextafter_vjp(b, inputs, outputs, cotangents, attrs):
    """As torch: the result moves by one ulp, so ``a`` gets ``g`` and the direction ``b`` none."""
    return [_to(b, cotangents[0], inputs[0]) if b.wants(0) else None, None]


defvjp("fmax")(_fextremum_vjp("ge"))
defvjp("fmin")(_fextremum_vjp("le"))


# --------------------------------------------------------------------------- compute rules
def _sqrt(x):
    return call("sqrt", x)


def _asinh(x, t):
    """``sign(x) * log1p(|x| + x^2 / (1 + sqrt(1 + x^2)))`` (accurate for tiny ``x``)."""
    a = call("abs", x)
    one = const(1, t)
    big = cmp(">", a, const(1e8 if t == DType.float32 else 1e150, t))
    r = select(big, call("log", a) + const(_LN2, t), _log1p(a + a * a / (one + _sqrt(one + a * a)), t))
    return select(cmp("<", x, const(0, t)), -r, r)


def _acosh(x, t):
    """``log1p((x - 1) + sqrt((x - 1) * (x + 1)))``; ``log(x) + log 2`` where ``x^2`` overflows."""
    one = const(1, t)
    big = cmp(">", x, const(1e8 if t == DType.float32 else 1e150, t))
    return select(big, call("log", x) + const(_LN2, t), _log1p((x - one) + _sqrt((x - one) * (x + one)), t))


def _atanh(x, t):
    """``0.5 * log1p(2x / (1 - x))``."""
    one = const(1, t)
    return const(0.5, t) * _log1p(const(2, t) * x / (one - x), t)


_EXPRS = {
    "asin": lambda x, t: call("asin", x),
    "acos": lambda x, t: call("acos", x),
    "sinh": lambda x, t: call("sinh", x),
    "cosh": lambda x, t: call("cosh", x),
    "log10": lambda x, t: call("log10", x),
    "exp2": lambda x, t: call("exp2", x),
    "asinh": _asinh,
    "acosh": _acosh,
    "atanh": _atanh,
}
for _name, _expr in _EXPRS.items():
    defcompute(_name)(_elementwise_rule(_expr))


@defcompute("signbit")
def _signbit_compute(ctx, x):
    t = compute_dtype(x.dtype)

    def element(i):
        v = x.at(i, t)
        if not t.is_floating:
            return cmp("<", v, const(0, t))
        # -0.0: 1 / x is -inf; NaN sign bits follow their payload, which kiln does not see
        negative_zero = cmp("&&", cmp("==", v, const(0, t)), cmp("<", const(1, t) / v, const(0, t)))
        return cmp("||", cmp("<", v, const(0, t)), negative_zero)

    return ctx.tensor(ctx.out_shape, DType.bool, element)


def _fmod_expr(a, b, t):
    if t.is_integer:
        return Binary("%", a, b)  # C's remainder truncates toward zero, as fmod
    return call("fmod", a, b)


def _copysign_expr(a, b, t):
    negative = cmp("||", cmp("<", b, const(0, t)),
                   cmp("&&", cmp("==", b, const(0, t)), cmp("<", const(1, t) / b, const(0, t))))
    m = call("abs", a)
    return select(negative, -m, m)


def _fmax_expr(pick: str):
    def expr(a, b, t):
        if not t.is_floating:
            return select(cmp(pick, a, b), a, b)
        return select(cmp("!=", a, a), b, select(cmp("!=", b, b), a, select(cmp(pick, a, b), a, b)))
    return expr


defcompute("fmod")(_binary_rule(_fmod_expr))
defcompute("copysign")(_binary_rule(_copysign_expr))
defcompute("fmax")(_binary_rule(_fmax_expr(">=")))
defcompute("fmin")(_binary_rule(_fmax_expr("<=")))


# ------------------------------------------------- torch.special: more special functions
def _spherical_j0(x):
    with np.errstate(all="ignore"):
        return np.where(x == 0, np.ones_like(x), np.sin(x) / np.where(x == 0, 1, x))


def _airy_ai(x):
    return scipy.special.airy(x)[0]


_SPECIAL_DIFFERENTIABLE = {
    "erfcx": scipy.special.erfcx, "ndtri": scipy.special.ndtri, "log_ndtr": scipy.special.log_ndtr,
    "entr": scipy.special.entr,
}
# torch defines no derivative for these: they are declared nondifferentiable.
_SPECIAL_CONSTANT = {
    "bessel_j0": scipy.special.j0, "bessel_j1": scipy.special.j1, "bessel_y0": scipy.special.y0,
    "bessel_y1": scipy.special.y1, "modified_bessel_i0": scipy.special.i0,
    "modified_bessel_i1": scipy.special.i1, "modified_bessel_k0": scipy.special.k0,
    "modified_bessel_k1": scipy.special.k1, "scaled_modified_bessel_k0": scipy.special.k0e,
    "scaled_modified_bessel_k1": scipy.special.k1e, "spherical_bessel_j0": _spherical_j0,
    "airy_ai": _airy_ai,
}
for _name, _fn in {**_SPECIAL_DIFFERENTIABLE, **_SPECIAL_CONSTANT}.items():
    _unary(_name, _quiet(_fn), amp="float32")
defvjp(*_SPECIAL_CONSTANT)(nondifferentiable)

_SQRT_2PI = math.sqrt(2.0 * math.pi)
_SPECIAL_DERIVATIVES = {
    # d erfcx = 2 x erfcx(x) - 2 / sqrt(pi)
    "erfcx": lambda b, x, y: b.sub(b.mul(b.const(2.0, x), b.mul(x, y)), b.const(2.0 / math.sqrt(math.pi), x)),
    # d ndtri = sqrt(2 pi) exp(y^2 / 2)
    "ndtri": lambda b, x, y: b.mul(b.const(_SQRT_2PI, y), b.op("exp", b.mul(b.const(0.5, y), b.mul(y, y)))),
    # d log_ndtr = exp(-x^2 / 2 - y) / sqrt(2 pi)
    "log_ndtr": lambda b, x, y: b.mul(b.const(1.0 / _SQRT_2PI, x),
                                      b.op("exp", b.sub(b.mul(b.const(-0.5, x), b.mul(x, x)), y))),
    # d entr = -(1 + log x)
    "entr": lambda b, x, y: b.neg(b.add(b.op("log", x), b.const(1.0, x))),
}
for _name, _derivative in _SPECIAL_DERIVATIVES.items():
    defvjp(_name)(elementwise(_derivative))


def _zeta(a, q):
    with np.errstate(all="ignore"):
        return scipy.special.zeta(a, q)


_binary("zeta", _zeta, infer=broadcast_float)


@defvjp("zeta")
def _zeta_vjp(b, inputs, outputs, cotangents, attrs):
    """Hurwitz zeta ``zeta(s, q)``: ``d/dq = -s * zeta(s + 1, q)``; ``s`` gets none (as torch)."""
    (s, q), g = inputs, cotangents[0]
    if not (b.wants(1) and q.dtype.is_floating):
        return [None, None]
    d = b.neg(b.mul(s, b.op("zeta", b.add(s, b.const(1.0, s)), q)))
    return [None, _to(b, b.mul(g, d), q)]


# ------------------------------------------------- orthogonal polynomials p_n(x)
# ``n`` is a tensor, truncated to an integer per element; negative ``n`` gives 0 (as torch).
def _chebyshev_v(n, x):
    return scipy.special.eval_chebyu(n, x) - np.where(n > 0, scipy.special.eval_chebyu(np.maximum(n - 1, 0), x), 0)


def _chebyshev_w(n, x):
    return scipy.special.eval_chebyu(n, x) + np.where(n > 0, scipy.special.eval_chebyu(np.maximum(n - 1, 0), x), 0)


_POLYNOMIALS = {
    "chebyshev_polynomial_t": scipy.special.eval_chebyt, "chebyshev_polynomial_u": scipy.special.eval_chebyu,
    "chebyshev_polynomial_v": _chebyshev_v, "chebyshev_polynomial_w": _chebyshev_w,
    "hermite_polynomial_h": scipy.special.eval_hermite, "hermite_polynomial_he": scipy.special.eval_hermitenorm,
    "laguerre_polynomial_l": scipy.special.eval_laguerre, "legendre_polynomial_p": scipy.special.eval_legendre,
}


def _polynomial(fn, shifted: bool):
    def evaluate(x, n):
        x64 = np.asarray(x, np.float64)
        if shifted:
            x64 = 2.0 * x64 - 1.0
        with np.errstate(all="ignore"):
            degree = np.trunc(np.asarray(n, np.float64))
            finite = np.isfinite(degree)
            k = np.where(finite & (degree > 0), degree, 0).astype(np.int64)
            value = np.asarray(fn(k, x64), np.float64)
        return np.where(finite & (degree >= 0), value, np.where(finite, 0.0, np.nan))
    return evaluate


for _name, _fn in _POLYNOMIALS.items():
    variants = [(_name, False)]
    if _name.startswith("chebyshev"):
        variants.append(("shifted_" + _name, True))
    for _variant, _shifted in variants:
        _binary(_variant, _polynomial(_fn, _shifted), infer=broadcast)
        defvjp(_variant)(nondifferentiable)


# ------------------------------------------------- frexp: x = mantissa * 2**exponent
def _frexp_exponent_infer(types, **_):
    if not types[0].dtype.is_floating:
        raise TypeError(f"frexp_exponent needs a floating-point tensor, got {types[0].dtype.short}")
    return types[0].with_dtype(DType.int32)


@defop("frexp_exponent", infer=_frexp_exponent_infer, traits=("elementwise",))
def frexp_exponent(x):
    """The exponent ``e`` of ``x = m * 2**e`` with ``0.5 <= |m| < 1`` (0 for 0, inf and NaN)."""
    return np.frexp(_f32(x))[1].astype(np.int32)


defvjp("frexp_exponent")(nondifferentiable)


# ------------------------------------------------- regularized incomplete gamma functions
def _gammainc(a, x):
    with np.errstate(all="ignore"):
        return scipy.special.gammainc(a, x)


def _gammaincc(a, x):
    with np.errstate(all="ignore"):
        return scipy.special.gammaincc(a, x)


_binary("igamma", _gammainc, infer=broadcast_float)
_binary("igammac", _gammaincc, infer=broadcast_float)


def _igamma_vjp(sign: float):
    """``d/dx P(a, x) = x^(a-1) e^-x / Gamma(a)`` (``-`` that for Q); ``a`` gets none, as torch."""

    def rule(b, inputs, outputs, cotangents, attrs):
        (a, x), g = inputs, cotangents[0]
        if not (b.wants(1) and x.dtype.is_floating):
            return [None, None]
        a = b.cast(a, x.dtype)
        one = b.const(1.0, x)
        log_density = b.sub(b.sub(b.mul(b.sub(a, one), b.op("log", x)), x), b.op("lgamma", a))
        d = b.mul(b.const(sign, x), b.op("exp", log_density))
        return [None, _to(b, b.mul(g, d), x)]

    return rule


defvjp("igamma")(_igamma_vjp(1.0))
defvjp("igammac")(_igamma_vjp(-1.0))
