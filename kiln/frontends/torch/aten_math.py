"""ATen -> kiln rules for elementwise math, casts, identities and reductions.

Python scalars become 0-d constants typed as torch types them (see
:func:`kiln.frontends.torch.aten.scalar_dtype`).  See :mod:`kiln.frontends.torch.aten` for how rules are
declared.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from kiln.ir import DType, Value

from .aten import (
    IGNORED_OPS,
    LowerFn,
    LoweringContext,
    aten,
    dims_arg,
    dtype_arg,
    kiln_dtype,
    lowers,
    meta,
    optional_ops,
)

# ---------------------------------------------------------------- elementwise
_UNARY = {
    "abs": "abs", "neg": "neg", "exp": "exp", "log": "log", "log2": "log2", "log1p": "log1p",
    "expm1": "expm1", "sqrt": "sqrt", "rsqrt": "rsqrt", "reciprocal": "reciprocal",
    "sigmoid": "sigmoid", "tanh": "tanh", "sin": "sin", "cos": "cos", "tan": "tan",
    "atan": "atan", "erf": "erf", "silu": "silu", "relu": "relu", "floor": "floor",
    "ceil": "ceil", "round": "round", "trunc": "trunc", "fix": "trunc", "sign": "sign",
    "sgn": "sign", "logical_not": "logical_not", "isnan": "isnan", "isinf": "isinf",
}


def _unary_rule(kiln_op: str) -> LowerFn:
    def lower(ctx: LoweringContext, x: Value, *_: Any) -> Value:
        return ctx.op(kiln_op, x)

    return lower


for _aten_name, _kiln_name in _UNARY.items():
    lowers(*optional_ops(_aten_name))(_unary_rule(_kiln_name))


@lowers(aten.gelu.default)
def _gelu(ctx: LoweringContext, x: Value, approximate: str = "none") -> Value:
    return ctx.op("gelu", x, approximate=approximate)


@lowers(aten.round.decimals)
def _round_decimals(ctx: LoweringContext, x: Value, decimals: int) -> Value:
    if decimals == 0:
        return ctx.op("round", x)
    scale = ctx.scalar(10.0**decimals, x.dtype)
    return ctx.op("div", ctx.op("round", ctx.op("mul", x, scale)), scale)


def _bool_only(node: torch.fx.Node, *args: Any) -> str | None:
    for a in args:
        m = meta(a)
        if isinstance(m, torch.Tensor) and m.dtype != torch.bool:
            return f"bitwise ops are supported on bool tensors only, got {m.dtype}"
        if isinstance(a, int) and not isinstance(a, bool):
            return "bitwise ops with integer scalars are not supported"
    return None


@lowers(aten.bitwise_not.default, check=_bool_only)
def _bitwise_not(ctx: LoweringContext, x: Value) -> Value:
    return ctx.op("logical_not", x)


_BINARY = {
    "mul": "mul", "maximum": "maximum", "minimum": "minimum", "remainder": "remainder",
    "atan2": "atan2", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "logical_and": "logical_and", "logical_or": "logical_or", "logical_xor": "logical_xor",
    "pow": "pow", "div": "div", "max": "maximum", "min": "minimum",
}
_BINARY_OVERLOADS = ("Tensor", "Scalar", "default", "Tensor_Tensor", "Tensor_Scalar", "other")


def _binary_rule(kiln_op: str) -> LowerFn:
    def lower(ctx: LoweringContext, a: Any, b: Any, *_: Any) -> Value:
        return ctx.op(kiln_op, *ctx.operands(a, b))

    return lower


for _aten_name, _kiln_name in _BINARY.items():
    _overloads = ("other",) if _aten_name in ("max", "min") else _BINARY_OVERLOADS
    lowers(*optional_ops(*(f"{_aten_name}.{o}" for o in _overloads)))(_binary_rule(_kiln_name))
for _aten_name, _kiln_name in (("bitwise_and", "logical_and"), ("bitwise_or", "logical_or"),
                               ("bitwise_xor", "logical_xor"), ("__and__", "logical_and"),
                               ("__or__", "logical_or"), ("__xor__", "logical_xor")):
    lowers(*optional_ops(f"{_aten_name}.Tensor", f"{_aten_name}.Scalar"),
           check=_bool_only)(_binary_rule(_kiln_name))


def _scaled(ctx: LoweringContext, x: Value, alpha: Any) -> Value:
    if alpha == 1:
        return x
    return ctx.op("mul", x, ctx.scalar(alpha, x.dtype))


@lowers(aten.add.Tensor, aten.add.Scalar)
def _add(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Value:
    a, b = ctx.operands(a, b)
    return ctx.op("add", a, _scaled(ctx, b, alpha))


@lowers(aten.sub.Tensor, aten.sub.Scalar)
def _sub(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Value:
    a, b = ctx.operands(a, b)
    return ctx.op("sub", a, _scaled(ctx, b, alpha))


@lowers(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Value:
    a, b = ctx.operands(a, b)
    return ctx.op("sub", b, _scaled(ctx, a, alpha))


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(ctx: LoweringContext, a: Any, b: Any, rounding_mode: str | None = None) -> Value:
    return ctx.op("div", *ctx.operands(a, b), rounding_mode=rounding_mode)


@lowers(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(ctx: LoweringContext, a: Any, b: Any) -> Value:
    return ctx.op("div", *ctx.operands(a, b), rounding_mode="floor")


@lowers(aten.where.self)
def _where(ctx: LoweringContext, cond: Value, a: Value, b: Value) -> Value:
    return ctx.op("where", ctx.cast(cond, DType.bool), a, b)


@lowers(aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where_scalar(ctx: LoweringContext, cond: Value, a: Any, b: Any) -> Value:
    if not isinstance(a, Value) and not isinstance(b, Value):
        dtype = ctx.out.dtype
        a, b = ctx.const(a, dtype), ctx.const(b, dtype)
    a, b = ctx.operands(a, b)
    return ctx.op("where", ctx.cast(cond, DType.bool), a, b)


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(ctx: LoweringContext, x: Value, mask: Value, value: Any) -> Value:
    fill = ctx.cast(value, x.dtype) if isinstance(value, Value) else ctx.const(value, x.dtype)
    return ctx.op("where", ctx.cast(mask, DType.bool), fill, x)


@lowers(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
        aten.clamp_min.Tensor, aten.clamp_max.Tensor, aten.hardtanh.default)
def _clamp(ctx: LoweringContext, x: Value, *bounds: Any) -> Value:
    target = ctx.node.target
    low, high = bounds if len(bounds) == 2 else (None, None)
    if target in (aten.clamp_min.default, aten.clamp_min.Tensor):
        low = bounds[0]
    elif target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        high = bounds[0]
    elif target is aten.hardtanh.default:
        low, high = bounds
    tensors = isinstance(low, Value) or isinstance(high, Value)
    if x.dtype.is_floating and not tensors:
        return ctx.op("clamp", x, min=low, max=high)
    # Tensor bounds, or an integer tensor (whose result may promote): maximum/minimum.
    if low is not None:
        x = ctx.op("maximum", *ctx.operands(x, low))
    if high is not None:
        x = ctx.op("minimum", *ctx.operands(x, high))
    return x


@lowers(aten.leaky_relu.default)
def _leaky_relu(ctx: LoweringContext, x: Value, negative_slope: float = 0.01) -> Value:
    positive = ctx.op("gt", x, ctx.scalar(0, x.dtype))
    return ctx.op("where", positive, x, ctx.op("mul", x, ctx.scalar(negative_slope, x.dtype)))


@lowers(aten.diff.default)
def _diff(ctx: LoweringContext, x: Value, n: int = 1, dim: int = -1, prepend: Value | None = None,
          append: Value | None = None) -> Value:
    """``n``-th forward difference along ``dim`` (``!=`` for bool, as torch does)."""
    dim = dim % x.type.rank
    parts = [v for v in (prepend, x, append) if v is not None]
    if len(parts) > 1:
        dtype = ctx.out.dtype
        x = ctx.op("cat", *(ctx.cast(v, dtype) for v in parts), dim=dim)
    for _ in range(n):
        length = int(x.shape[dim])
        later = ctx.op("slice", x, dim=dim, start=1, end=length, step=1)
        earlier = ctx.op("slice", x, dim=dim, start=0, end=length - 1, step=1)
        x = ctx.op("ne" if x.dtype == DType.bool else "sub", later, earlier)
    return x


# ------------------------------------------------------------ casts, identities
def _strided_only(node: torch.fx.Node, *args: Any) -> str | None:
    layout = node.kwargs.get("layout")
    if layout is not None and layout != torch.strided:
        return f"layout {layout} is not supported (dense tensors only)"
    return None


@lowers(aten._to_copy.default, aten.to.dtype_layout, check=_strided_only)
def _to_copy(ctx: LoweringContext, x: Value, dtype: torch.dtype | None = None, *_: Any) -> Value:
    return ctx.cast(x, dtype_arg(dtype))


@lowers(aten.to.dtype, aten.to.device)
def _to(ctx: LoweringContext, x: Value, *args: Any) -> Value:
    return ctx.cast(x, ctx.out.dtype)


@lowers(aten.to.other, aten.type_as.default)
def _to_other(ctx: LoweringContext, x: Value, other: Value, *_: Any) -> Value:
    return ctx.cast(x, other.dtype)


@lowers(torch.ops.prims.convert_element_type.default)
def _convert_element_type(ctx: LoweringContext, x: Value, dtype: torch.dtype) -> Value:
    return ctx.cast(x, kiln_dtype(dtype))


def _identity(ctx: LoweringContext, x: Value, *_: Any) -> Value:
    return x


lowers(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default,
       *optional_ops("contiguous", "alias_copy"))(_identity)


@lowers(aten.detach.default, *optional_ops("detach_copy"))
def _detach(ctx: LoweringContext, x: Value) -> Value:
    """The same values, cut off from differentiation (kiln's autodiff must not see through
    it); floating-point tensors only, since nothing else has a gradient."""
    return ctx.op("stop_gradient", x) if x.dtype.is_floating else x


IGNORED_OPS.update(optional_ops("_assert_tensor_metadata", "_assert_scalar",
                                 "_assert_async.msg", "sym_constrain_range_for_size",
                                 "sym_constrain_range"))


# ----------------------------------------------------------------- reductions
def _reduce(kiln_op: str) -> LowerFn:
    def lower(ctx: LoweringContext, x: Value, dim: Any = None, keepdim: bool = False,
              dtype: torch.dtype | None = None) -> Value:
        return ctx.op(kiln_op, ctx.cast(x, dtype_arg(dtype)), dims=dims_arg(dim), keepdim=keepdim)

    return lower


@lowers(aten.sum.default, aten.mean.default, aten.prod.default)
def _reduce_all(ctx: LoweringContext, x: Value, dtype: torch.dtype | None = None) -> Value:
    if ctx.node.target is aten.sum.default:
        return ctx.op("sum", x, dtype=dtype_arg(dtype))
    name = "mean" if ctx.node.target is aten.mean.default else "prod"
    return ctx.op(name, ctx.cast(x, dtype_arg(dtype)))


@lowers(aten.sum.dim_IntList)
def _sum_dims(ctx: LoweringContext, x: Value, dim: Any, keepdim: bool = False,
              dtype: torch.dtype | None = None) -> Value:
    return ctx.op("sum", x, dims=dims_arg(dim), keepdim=keepdim, dtype=dtype_arg(dtype))


lowers(aten.mean.dim)(_reduce("mean"))
lowers(aten.prod.dim_int)(_reduce("prod"))
lowers(aten.amax.default)(_reduce("amax"))
lowers(aten.amin.default)(_reduce("amin"))
lowers(aten.any.dim, aten.any.dims)(_reduce("any"))
lowers(aten.all.dim, *optional_ops("all.dims"))(_reduce("all"))


_FULL_REDUCTIONS = {aten.max.default: "amax", aten.min.default: "amin", aten.any.default: "any",
                    aten.all.default: "all"}


@lowers(*_FULL_REDUCTIONS)
def _reduce_everything(ctx: LoweringContext, x: Value) -> Value:
    return ctx.op(_FULL_REDUCTIONS[ctx.node.target], x)


@lowers(aten.max.dim, aten.min.dim)
def _max_dim(ctx: LoweringContext, x: Value, dim: int, keepdim: bool = False) -> tuple:
    values, index = ("amax", "argmax") if ctx.node.target is aten.max.dim else ("amin", "argmin")
    return (lambda: ctx.op(values, x, dims=(dim,), keepdim=keepdim),
            lambda: ctx.op(index, x, dim=dim, keepdim=keepdim))


@lowers(aten.argmax.default, aten.argmin.default)
def _argmax(ctx: LoweringContext, x: Value, dim: int | None = None, keepdim: bool = False) -> Value:
    name = "argmax" if ctx.node.target is aten.argmax.default else "argmin"
    return ctx.op(name, x, dim=dim, keepdim=keepdim)


def _correction(correction: Any, unbiased: bool | None = None) -> float:
    if correction is not None:
        return float(correction)
    return 0.0 if unbiased is False else 1.0


@lowers(aten.var.correction, aten.std.correction)
def _var(ctx: LoweringContext, x: Value, dim: Any = None, correction: Any = None,
         keepdim: bool = False) -> Value:
    v = ctx.op("var", x, dims=dims_arg(dim), correction=_correction(correction), keepdim=keepdim)
    return ctx.op("sqrt", v) if ctx.node.target is aten.std.correction else v


@lowers(aten.var.dim, aten.std.dim)
def _var_dim(ctx: LoweringContext, x: Value, dim: Any, unbiased: bool = True,
             keepdim: bool = False) -> Value:
    v = ctx.op("var", x, dims=dims_arg(dim), correction=_correction(None, unbiased), keepdim=keepdim)
    return ctx.op("sqrt", v) if ctx.node.target is aten.std.dim else v


@lowers(aten.var_mean.correction)
def _var_mean(ctx: LoweringContext, x: Value, dim: Any = None, correction: Any = None,
              keepdim: bool = False) -> tuple:
    dims = dims_arg(dim)
    return (lambda: ctx.op("var", x, dims=dims, correction=_correction(correction), keepdim=keepdim),
            lambda: ctx.op("mean", x, dims=dims, keepdim=keepdim))


@lowers(aten.cumsum.default)
def _cumsum(ctx: LoweringContext, x: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    return ctx.op("cumsum", x, dim=dim, dtype=dtype_arg(dtype))


@lowers(aten.softmax.int, aten.log_softmax.int)
def _softmax(ctx: LoweringContext, x: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    name = "softmax" if ctx.node.target is aten.softmax.int else "log_softmax"
    return ctx.op(name, ctx.cast(x, dtype_arg(dtype)), dim=dim)


@lowers(aten._softmax.default, aten._log_softmax.default)
def _softmax_internal(ctx: LoweringContext, x: Value, dim: int, half_to_float: bool) -> Value:
    name = "softmax" if ctx.node.target is aten._softmax.default else "log_softmax"
    if half_to_float:
        x = ctx.cast(x, DType.float32)
    return ctx.op(name, x, dim=dim)


@lowers(aten._safe_softmax.default)
def _safe_softmax(ctx: LoweringContext, x: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    """Softmax whose fully masked rows (all -inf) are 0 instead of NaN."""
    x = ctx.cast(x, dtype_arg(dtype))
    masked = ctx.op("eq", x, ctx.scalar(float("-inf"), x.dtype))
    all_masked = ctx.op("all", masked, dims=(dim,), keepdim=True)
    zero = ctx.scalar(0.0, x.dtype)
    # masked rows are softmaxed as zeros, so neither the result nor its gradient is NaN there
    safe = ctx.op("where", all_masked, zero, x)
    return ctx.op("where", all_masked, zero, ctx.op("softmax", safe, dim=dim))


# ------------------------------------------------- special functions, float manipulation
_SPECIAL_UNARY = {
    "asin": "asin", "acos": "acos", "asinh": "asinh", "acosh": "acosh", "atanh": "atanh",
    "arcsin": "asin", "arccos": "acos", "arcsinh": "asinh", "arccosh": "acosh", "arctanh": "atanh",
    "arctan": "atan", "sinh": "sinh", "cosh": "cosh", "log10": "log10", "exp2": "exp2",
    "erfc": "erfc", "erfinv": "erfinv", "lgamma": "lgamma", "i0": "i0", "special_i0e": "i0e",
    "special_i1": "i1", "special_i1e": "i1e", "signbit": "signbit", "special_erfcx": "erfcx",
    "special_ndtri": "ndtri", "special_log_ndtr": "log_ndtr", "special_entr": "entr",
    **{f"special_{n}": n for n in (
        "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
        "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0",
        "scaled_modified_bessel_k1", "spherical_bessel_j0", "airy_ai")},
}
for _aten_name, _kiln_name in _SPECIAL_UNARY.items():
    if _kiln_name is not None:
        lowers(*optional_ops(_aten_name))(_unary_rule(_kiln_name))


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
                                                          "other_scalar", "x_scalar", "n_scalar"))))(_binary_rule(_kiln_name))


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
    pos = _scaled(ctx, x, scale)
    neg = _scaled(ctx, ctx.op("expm1", _scaled(ctx, x, input_scale)), alpha * scale)
    return ctx.op("where", positive, pos, neg)


@lowers(aten.celu.default)
def _celu(ctx: LoweringContext, x: Value, alpha: float = 1.0) -> Value:
    positive = ctx.op("gt", x, ctx.scalar(0, x.dtype))
    neg = _scaled(ctx, ctx.op("expm1", _scaled(ctx, x, 1.0 / alpha)), alpha)
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
    product = _scaled(ctx, product, alpha)
    out = product if beta == 0 else ctx.op("add", _scaled(ctx, base, beta), product)
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
    if ctx.node.target is aten._linalg_solve_ex.default:  # (result, LU, pivots, info)
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
