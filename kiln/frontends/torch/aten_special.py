"""ATen -> kiln rules for special functions, float manipulation, norms and small linear algebra.

Special functions (inverse trigonometric and hyperbolic functions, ``erfc``/``erfinv``,
gamma-family and Bessel functions, orthogonal polynomials), float manipulation (``fmod``,
``copysign``, ``nextafter``, ``ldexp``, ``frexp``, ``hypot``), the ``elu``/``celu``
activations, vector norms and distances (``linalg_vector_norm``, ``dist``, ``cdist``),
``addmv``/``addbmm``, and inverses, determinants and solves of square matrices
(factorizations are in :mod:`kiln.frontends.torch.aten_linalg`).  Elementwise arithmetic is
in :mod:`kiln.frontends.torch.aten_math`.  See :mod:`kiln.frontends.torch.aten` for how
rules are declared.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from kiln.ir import DType, Value

from .aten import (
    LoweringContext,
    aten,
    dims_arg,
    dtype_arg,
    lowers,
    meta,
    optional_ops,
)
from .aten_math import binary_rule, scaled, unary_rule


# ------------------------------------------------- special functions, float manipulation
_SPECIAL_UNARY = {
    "asin": "asin", "acos": "acos", "asinh": "asinh", "acosh": "acosh", "atanh": "atanh",
    "arcsin": "asin", "arccos": "acos", "arcsinh": "asinh", "arccosh": "acosh", "arctanh": "atanh",
    "arctan": "atan", "sinh": "sinh", "cosh": "cosh", "log10": "log10", "exp2": "exp2",
    "erfc": "erfc", "erfinv": "erfinv", "lgamma": "lgamma", "i0": "i0", "special_i0e": "i0e",
    "special_i1": "i1", "special_i1e": "i1e", "signbit": "signbit", "special_erfcx": "erfcx",
    "special_ndtri": "ndtri", "special_entr": "entr",
    **{f"special_{n}": n for n in (
        "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
        "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0",
        "scaled_modified_bessel_k1", "spherical_bessel_j0", "airy_ai")},
}
for _aten_name, _kiln_name in _SPECIAL_UNARY.items():
    if _kiln_name is not None:
        lowers(*optional_ops(_aten_name))(unary_rule(_kiln_name))


@lowers(aten.special_log_ndtr.default, keep=True)  # its decomposition has NaN gradients far in the lower tail
def _log_ndtr(ctx: LoweringContext, x: Value) -> Value:
    return ctx.op("log_ndtr", x)


@lowers(aten.digamma.default)
def _digamma(ctx: LoweringContext, x: Value) -> Value:
    return ctx.op("polygamma", x, n=0)


@lowers(aten.polygamma.default)
def _polygamma(ctx: LoweringContext, n: int, x: Value) -> Value:
    return ctx.op("polygamma", x, n=int(n))


_POLYNOMIALS = [f"{shift}{kind}" for kind in ("chebyshev_polynomial_t", "chebyshev_polynomial_u",
                                                "chebyshev_polynomial_v", "chebyshev_polynomial_w")
                for shift in ("", "shifted_")]
_POLYNOMIALS += ["hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
                 "legendre_polynomial_p"]
for _aten_name, _kiln_name in (("fmod", "fmod"), ("copysign", "copysign"), ("fmax", "fmax"),
                               ("fmin", "fmin"), ("nextafter", "nextafter"), ("special_zeta", "zeta"),
                               ("igamma", "igamma"), ("igammac", "igammac"),
                               *((f"special_{p}", p) for p in _POLYNOMIALS)):
    lowers(*optional_ops(*(f"{_aten_name}.{o}" for o in ("Tensor", "Scalar", "default", "self_scalar",
                                                          "other_scalar", "x_scalar", "n_scalar"))))(binary_rule(_kiln_name))


def _float_operands(ctx: LoweringContext, a: Any, b: Any) -> tuple[Value, Value]:
    """Both operands in the node's (floating-point) result dtype."""
    a, b = ctx.operands(a, b)
    dtype = ctx.out.dtype
    return ctx.cast(a, dtype), ctx.cast(b, dtype)


@lowers(aten.hypot.default)
def _hypot(ctx: LoweringContext, a: Any, b: Any) -> Value:
    a, b = _float_operands(ctx, a, b)
    return ctx.op("sqrt", ctx.op("add", ctx.op("mul", a, a), ctx.op("mul", b, b)))


@lowers(*optional_ops("ldexp.Tensor", "ldexp.default"))
def _ldexp(ctx: LoweringContext, x: Any, e: Any) -> Value:
    x, e = _float_operands(ctx, x, e)
    return ctx.op("mul", x, ctx.op("exp2", e))


@lowers(aten.elu.default)
def _elu(ctx: LoweringContext, x: Value, alpha: float = 1.0, scale: float = 1.0,
         input_scale: float = 1.0) -> Value:
    """``scale * x`` where ``x > 0``, else ``scale * alpha * expm1(input_scale * x)``."""
    positive = ctx.op("gt", x, ctx.scalar(0, x.dtype))
    pos = scaled(ctx, x, scale)
    neg = scaled(ctx, ctx.op("expm1", scaled(ctx, x, input_scale)), alpha * scale)
    return ctx.op("where", positive, pos, neg)


@lowers(aten.celu.default)
def _celu(ctx: LoweringContext, x: Value, alpha: float = 1.0) -> Value:
    positive = ctx.op("gt", x, ctx.scalar(0, x.dtype))
    neg = scaled(ctx, ctx.op("expm1", scaled(ctx, x, 1.0 / alpha)), alpha)
    return ctx.op("where", positive, x, neg)


def _vector_norm(ctx: LoweringContext, x: Value, ord: Any, dims: tuple[int, ...], keepdim: bool) -> Value:
    """``sum(|x|^ord)^(1/ord)`` over ``dims`` (all when empty); ``inf``/``-inf``: max/min of
    ``|x|``; ``0``: the count of non-zeros."""
    ord = float(ord)
    if ord == 2.0:
        return _root_at_zero(ctx, ctx.op("sum", ctx.op("mul", x, x), dims=dims, keepdim=keepdim),
                             lambda s: ctx.op("sqrt", s))
    a = ctx.op("abs", x)
    if ord == math.inf:
        return ctx.op("amax", a, dims=dims, keepdim=keepdim)
    if ord == -math.inf:
        return ctx.op("amin", a, dims=dims, keepdim=keepdim)
    if ord == 0.0:
        nonzero = ctx.cast(ctx.op("ne", x, ctx.scalar(0, x.dtype)), x.dtype)
        return ctx.op("sum", nonzero, dims=dims, keepdim=keepdim)
    if ord == 1.0:
        return ctx.op("sum", a, dims=dims, keepdim=keepdim)
    powered = ctx.op("pow", a, ctx.scalar(ord, x.dtype))
    return _root_at_zero(ctx, ctx.op("sum", powered, dims=dims, keepdim=keepdim),
                         lambda s: ctx.op("pow", s, ctx.scalar(1.0 / ord, x.dtype)))


def _root_at_zero(ctx: LoweringContext, total: Value, root: Any) -> Value:
    """``root(total)``, 0 where ``total`` is 0 with a zero gradient there (torch's subgradient
    of a norm at the zero vector), not the infinite slope of the root."""
    zero = ctx.op("eq", total, ctx.scalar(0, total.dtype))
    safe = ctx.op("where", zero, ctx.scalar(1, total.dtype), total)
    return ctx.op("where", zero, ctx.scalar(0, total.dtype), root(safe))


def _norm_dims(x: Value, dim: Any) -> tuple[int, ...]:
    return tuple(d % max(x.type.rank, 1) for d in dims_arg(dim))


@lowers(aten.linalg_vector_norm.default)
def _linalg_vector_norm(ctx: LoweringContext, x: Value, ord: Any = 2, dim: Any = None,
                        keepdim: bool = False, dtype: torch.dtype | None = None) -> Value:
    x = ctx.cast(x, dtype_arg(dtype))
    if x.type.rank == 0:  # the norm of a number: |x| (of the same 0-d shape)
        return ctx.reshape(_vector_norm(ctx, ctx.reshape(x, (1,)), ord, (), False), tuple(ctx.out.shape))
    return _vector_norm(ctx, x, ord, _norm_dims(x, dim), keepdim)


@lowers(aten.dist.default)
def _dist(ctx: LoweringContext, a: Value, b: Value, p: Any = 2) -> Value:
    d = ctx.op("sub", *_float_operands(ctx, a, b))
    return ctx.reshape(_vector_norm(ctx, ctx.reshape(d, (-1,)) if d.type.rank == 0 else d, p, (), False), ())


def _beta_alpha(ctx: LoweringContext, base: Value, product: Value, beta: Any, alpha: Any) -> Value:
    """``beta * base + alpha * product`` in the node's result shape; ``base`` is ignored when
    ``beta == 0`` (NaN and inf in it do not propagate, as torch)."""
    product = scaled(ctx, product, alpha)
    out = product if beta == 0 else ctx.op("add", scaled(ctx, base, beta), product)
    shape = tuple(ctx.out.shape)
    return out if tuple(out.shape) == shape else ctx.op("expand", out, shape=shape)


@lowers(aten.addmv.default)
def _addmv(ctx: LoweringContext, base: Value, mat: Value, vec: Value, beta: Any = 1, alpha: Any = 1) -> Value:
    return _beta_alpha(ctx, base, ctx.op("matmul", mat, vec), beta, alpha)


@lowers(aten.addbmm.default)
def _addbmm(ctx: LoweringContext, base: Value, b1: Value, b2: Value, beta: Any = 1, alpha: Any = 1) -> Value:
    product = ctx.op("sum", ctx.op("matmul", b1, b2), dims=(0,), keepdim=False)
    return _beta_alpha(ctx, base, product, beta, alpha)


# ------------------------------------------------------------------ linear algebra
def _square_float(node: torch.fx.Node, a: Any, *_: Any) -> str | None:
    m = meta(a)
    if not isinstance(m, torch.Tensor) or m.dim() < 2 or m.shape[-1] != m.shape[-2]:
        shape = list(m.shape) if isinstance(m, torch.Tensor) else m
        return f"needs square matrices in the last two axes, got shape {shape}"
    if not m.dtype.is_floating_point:
        return f"needs a floating-point matrix, got {m.dtype}"
    return None


@lowers(aten.linalg_inv.default, aten.inverse.default, check=_square_float)
def _linalg_inv(ctx: LoweringContext, a: Value) -> Value:
    return ctx.op("inv", a)


@lowers(aten.linalg_inv_ex.default, check=_square_float)
def _linalg_inv_ex(ctx: LoweringContext, a: Value, check_errors: bool = False) -> tuple:
    info = lambda: ctx.op("full", shape=tuple(a.shape[:-2]), value=0, dtype=DType.int32)
    return (lambda: ctx.op("inv", a), info)


@lowers(aten.linalg_det.default, aten.det.default, check=_square_float)
def _linalg_det(ctx: LoweringContext, a: Value) -> Value:
    return ctx.op("det", a)


def _solve_check(node: torch.fx.Node, a: Any, b: Any, *rest: Any) -> str | None:
    problem = _square_float(node, a)
    if problem is None and node.target is aten._linalg_solve_ex.default:
        problem = _results_unused(node, (1, 2), "LU factors and pivots")
    return problem


def _results_unused(node: torch.fx.Node, unused: tuple[int, ...], what: str) -> str | None:
    """Check that results ``unused`` of a multi-result op are not read (kiln does not make them)."""
    for user in node.users:
        if user.target is not operator.getitem:
            return f"{node.target} is used as a whole tuple; kiln computes only some of its results"
        if user.args[1] in unused and user.users:
            return f"result {user.args[1]} of {node.target} ({what}) is not supported"
    return None


def _is_vector_rhs(a: Value, b: Value) -> bool:
    """torch's rule: ``B`` is a (batch of) vector(s) when it is 1-d, or has one axis fewer
    than ``A`` and ``A``'s leading shape."""
    return b.type.rank == 1 or (b.type.rank == a.type.rank - 1 and tuple(b.shape) == tuple(a.shape[:-1]))


def _solve(ctx: LoweringContext, a: Value, b: Value, left: bool = True) -> Value:
    """``A^-1 B`` (``B A^-1`` when not ``left``) through the inverse."""
    a_inv = ctx.op("inv", a)
    if _is_vector_rhs(a, b):
        if left:
            product = ctx.op("matmul", a_inv, ctx.reshape(b, (*b.shape, 1)))
        else:
            product = ctx.op("matmul", ctx.reshape(b, (*b.shape[:-1], 1, b.shape[-1])), a_inv)
        return ctx.reshape(product, tuple(ctx.out.shape))
    return ctx.op("matmul", a_inv, b) if left else ctx.op("matmul", b, a_inv)


@lowers(aten.linalg_solve.default, check=_solve_check)
def _linalg_solve(ctx: LoweringContext, a: Value, b: Value, left: bool = True) -> Value:
    return _solve(ctx, a, b, left)


@lowers(*optional_ops("_linalg_solve_ex.default", "linalg_solve_ex.default"), check=_solve_check)
def _linalg_solve_ex(ctx: LoweringContext, a: Value, b: Value, left: bool = True,
                     check_errors: bool = False) -> tuple:
    """Result and info (0: kiln does not report singular matrices, which give inf/NaN)."""
    info = lambda: ctx.op("full", shape=tuple(a.shape[:-2]), value=0, dtype=DType.int32)
    if ctx.aten_node.target is aten._linalg_solve_ex.default:  # (result, LU, pivots, info)
        return (lambda: _solve(ctx, a, b, left), None, None, info)
    return (lambda: _solve(ctx, a, b, left), info)


def _det_check(node: torch.fx.Node, a: Any, *_: Any) -> str | None:
    problem = _square_float(node, a)
    if problem is None and node.target is aten._linalg_det.default:
        problem = _results_unused(node, (1, 2), "LU factors and pivots")
    if problem is None and node.target is aten._linalg_slogdet.default:
        problem = _results_unused(node, (2, 3), "LU factors and pivots")
    return problem


@lowers(aten._linalg_det.default, check=_det_check)
def _linalg_det_lu(ctx: LoweringContext, a: Value) -> tuple:
    return (lambda: ctx.op("det", a), None, None)


@lowers(aten._linalg_slogdet.default, aten.linalg_slogdet.default, aten.slogdet.default, check=_det_check)
def _linalg_slogdet(ctx: LoweringContext, a: Value) -> tuple:
    """``(sign(det A), log |det A|)`` from the determinant (which over- or underflows for
    large matrices far from unit scale)."""
    d = ctx.op("det", a)
    return (lambda: ctx.op("sign", d), lambda: ctx.op("log", ctx.op("abs", d)), None, None)


@lowers(aten.logdet.default, check=_square_float)
def _logdet(ctx: LoweringContext, a: Value) -> Value:
    """``log det A``: NaN for a negative determinant, as torch."""
    return ctx.op("log", ctx.op("det", a))


@lowers(aten.angle.default)
def _angle(ctx: LoweringContext, x: Value) -> Value:
    """The argument of a real number: pi for negatives, 0 otherwise, NaN kept."""
    dtype = ctx.out.dtype
    xf = ctx.cast(x, dtype)
    negative = ctx.op("lt", xf, ctx.scalar(0, dtype))
    arg = ctx.op("where", negative, ctx.scalar(math.pi, dtype), ctx.scalar(0.0, dtype))
    if not dtype.is_floating or not x.dtype.is_floating:
        return arg
    return ctx.op("where", ctx.op("isnan", xf), xf, arg)  # NaN stays NaN


@lowers(aten._cdist_forward.default, aten.cdist.default)
def _cdist(ctx: LoweringContext, x1: Value, x2: Value, p: float = 2.0, *_: Any) -> Value:
    """``|x1[..., i, :] - x2[..., j, :]|_p`` for every pair of rows, batch axes broadcast."""
    a = ctx.reshape(x1, (*x1.shape[:-1], 1, x1.shape[-1]))
    b = ctx.reshape(x2, (*x2.shape[:-2], 1, *x2.shape[-2:]))
    d = ctx.op("sub", a, b)
    out = _vector_norm(ctx, d, p, (d.type.rank - 1,), False)
    shape = tuple(ctx.out.shape)
    return out if tuple(out.shape) == shape else ctx.op("expand", out, shape=shape)



def _floating_only(node: torch.fx.Node, x: Any, *_: Any) -> str | None:
    m = meta(x)
    if isinstance(m, torch.Tensor) and not m.dtype.is_floating_point:
        return f"needs a floating-point tensor, got {m.dtype}"
    return None


@lowers(aten.frexp.Tensor, check=_floating_only)
def _frexp(ctx: LoweringContext, x: Value) -> tuple:
    """``(x / 2**e, e)``: the division by a power of two is exact."""
    exponent = ctx.op("frexp_exponent", x)
    mantissa = lambda: ctx.op("div", x, ctx.op("exp2", ctx.cast(exponent, x.dtype)))
    return (mantissa, lambda: exponent)
