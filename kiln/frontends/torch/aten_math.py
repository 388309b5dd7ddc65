"""ATen -> kiln rules for elementwise arithmetic, casts, identities, reductions and softmax.

Special functions, float manipulation, norms and small linear algebra are in
:mod:`kiln.frontends.torch.aten_special`.

Python scalars become 0-d constants typed as torch types them (see
:func:`kiln.frontends.torch.aten.scalar_dtype`).  See :mod:`kiln.frontends.torch.aten` for how rules are
declared.
"""

from __future__ import annotations

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
    "atan": "atan", "erf": "erf", "relu": "relu", "floor": "floor",
    "ceil": "ceil", "round": "round", "trunc": "trunc", "fix": "trunc", "sign": "sign",
    "sgn": "sign", "logical_not": "logical_not", "isnan": "isnan", "isinf": "isinf",
}


def unary_rule(kiln_op: str) -> LowerFn:
    def lower(ctx: LoweringContext, x: Value, *_: Any) -> Value:
        return ctx.op(kiln_op, x)

    return lower


for _aten_name, _kiln_name in _UNARY.items():
    lowers(*optional_ops(_aten_name), fresh=True)(unary_rule(_kiln_name))


@lowers(aten.silu.default, keep=True, fresh=True)
def _silu(ctx: LoweringContext, x: Value) -> Value:
    return ctx.op("silu", x)


@lowers(aten.gelu.default, fresh=True)
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


def binary_rule(kiln_op: str) -> LowerFn:
    def lower(ctx: LoweringContext, a: Any, b: Any, *_: Any) -> Value:
        return ctx.op(kiln_op, *ctx.operands(a, b))

    return lower


for _aten_name, _kiln_name in _BINARY.items():
    _overloads = ("other",) if _aten_name in ("max", "min") else _BINARY_OVERLOADS
    lowers(*optional_ops(*(f"{_aten_name}.{o}" for o in _overloads)), fresh=True)(binary_rule(_kiln_name))
for _aten_name, _kiln_name in (("bitwise_and", "logical_and"), ("bitwise_or", "logical_or"),
                               ("bitwise_xor", "logical_xor"), ("__and__", "logical_and"),
                               ("__or__", "logical_or"), ("__xor__", "logical_xor")):
    lowers(*optional_ops(f"{_aten_name}.Tensor", f"{_aten_name}.Scalar"),
           check=_bool_only)(binary_rule(_kiln_name))


def scaled(ctx: LoweringContext, x: Value, alpha: Any) -> Value:
    """``x * alpha`` (``x`` itself when ``alpha`` is 1): the ``alpha`` of ``add``/``sub``."""
    if alpha == 1:
        return x
    return ctx.op("mul", x, ctx.scalar(alpha, x.dtype))


@lowers(aten.add.Tensor, aten.add.Scalar, fresh=True)
def _add(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Value:
    a, b = ctx.operands(a, b)
    return ctx.op("add", a, scaled(ctx, b, alpha))


@lowers(aten.sub.Tensor, aten.sub.Scalar, fresh=True)
def _sub(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Value:
    a, b = ctx.operands(a, b)
    return ctx.op("sub", a, scaled(ctx, b, alpha))


@lowers(aten.rsub.Tensor, aten.rsub.Scalar, fresh=True)
def _rsub(ctx: LoweringContext, a: Any, b: Any, alpha: Any = 1) -> Value:
    a, b = ctx.operands(a, b)
    return ctx.op("sub", b, scaled(ctx, a, alpha))


@lowers(aten.div.Tensor_mode, aten.div.Scalar_mode, fresh=True)
def _div_mode(ctx: LoweringContext, a: Any, b: Any, rounding_mode: str | None = None) -> Value:
    return ctx.op("div", *ctx.operands(a, b), rounding_mode=rounding_mode)


@lowers(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(ctx: LoweringContext, a: Any, b: Any) -> Value:
    return ctx.op("div", *ctx.operands(a, b), rounding_mode="floor")


@lowers(aten.where.self, fresh=True)
def _where(ctx: LoweringContext, cond: Value, a: Value, b: Value) -> Value:
    return ctx.op("where", ctx.cast(cond, DType.bool), a, b)


@lowers(aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar, fresh=True)
def _where_scalar(ctx: LoweringContext, cond: Value, a: Any, b: Any) -> Value:
    if not isinstance(a, Value) and not isinstance(b, Value):
        dtype = ctx.out.dtype
        a, b = ctx.const(a, dtype), ctx.const(b, dtype)
    a, b = ctx.operands(a, b)
    return ctx.op("where", ctx.cast(cond, DType.bool), a, b)


@lowers(aten.masked_fill.Scalar, aten.masked_fill.Tensor, keep=True)
def _masked_fill(ctx: LoweringContext, x: Value, mask: Value, value: Any) -> Value:
    fill = ctx.cast(value, x.dtype) if isinstance(value, Value) else ctx.const(value, x.dtype)
    return ctx.op("where", ctx.cast(mask, DType.bool), fill, x)


@lowers(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
        aten.clamp_min.Tensor, aten.clamp_max.Tensor, aten.hardtanh.default, fresh=True)
def _clamp(ctx: LoweringContext, x: Value, *bounds: Any) -> Value:
    target = ctx.aten_node.target
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


@lowers(aten.leaky_relu.default, fresh=True)
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


lowers(aten.clone.default, fresh=True)(_identity)
lowers(aten.alias.default, aten.lift_fresh_copy.default, *optional_ops("contiguous", "alias_copy"))(_identity)


@lowers(aten.detach.default, keep=True)  # torch decomposes it to alias, losing the stop of the gradient
@lowers(*optional_ops("detach_copy"))
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
    if ctx.aten_node.target is aten.sum.default:
        return ctx.op("sum", x, dtype=dtype_arg(dtype))
    name = "mean" if ctx.aten_node.target is aten.mean.default else "prod"
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
    return ctx.op(_FULL_REDUCTIONS[ctx.aten_node.target], x)


@lowers(aten.max.dim, aten.min.dim)
def _max_dim(ctx: LoweringContext, x: Value, dim: int, keepdim: bool = False) -> tuple:
    values, index = ("amax", "argmax") if ctx.aten_node.target is aten.max.dim else ("amin", "argmin")
    return (lambda: ctx.op(values, x, dims=(dim,), keepdim=keepdim),
            lambda: ctx.op(index, x, dim=dim, keepdim=keepdim))


@lowers(aten.argmax.default, aten.argmin.default)
def _argmax(ctx: LoweringContext, x: Value, dim: int | None = None, keepdim: bool = False) -> Value:
    name = "argmax" if ctx.aten_node.target is aten.argmax.default else "argmin"
    return ctx.op(name, x, dim=dim, keepdim=keepdim)


def _correction(correction: Any, unbiased: bool | None = None) -> float:
    if correction is not None:
        return float(correction)
    return 0.0 if unbiased is False else 1.0


@lowers(aten.var.correction, aten.std.correction)
def _var(ctx: LoweringContext, x: Value, dim: Any = None, correction: Any = None,
         keepdim: bool = False) -> Value:
    v = ctx.op("var", x, dims=dims_arg(dim), correction=_correction(correction), keepdim=keepdim)
    return ctx.op("sqrt", v) if ctx.aten_node.target is aten.std.correction else v


@lowers(aten.var.dim, aten.std.dim)
def _var_dim(ctx: LoweringContext, x: Value, dim: Any, unbiased: bool = True,
             keepdim: bool = False) -> Value:
    v = ctx.op("var", x, dims=dims_arg(dim), correction=_correction(None, unbiased), keepdim=keepdim)
    return ctx.op("sqrt", v) if ctx.aten_node.target is aten.std.dim else v


@lowers(aten.var_mean.correction)
def _var_mean(ctx: LoweringContext, x: Value, dim: Any = None, correction: Any = None,
              keepdim: bool = False) -> tuple:
    dims = dims_arg(dim)
    return (lambda: ctx.op("var", x, dims=dims, correction=_correction(correction), keepdim=keepdim),
            lambda: ctx.op("mean", x, dims=dims, keepdim=keepdim))


@lowers(aten.cumsum.default)
def _cumsum(ctx: LoweringContext, x: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    return ctx.op("cumsum", x, dim=dim, dtype=dtype_arg(dtype))


@lowers(aten.softmax.int, aten.log_softmax.int, keep=True, fresh=True)
def _softmax(ctx: LoweringContext, x: Value, dim: int, dtype: torch.dtype | None = None) -> Value:
    name = "softmax" if ctx.aten_node.target is aten.softmax.int else "log_softmax"
    return ctx.op(name, ctx.cast(x, dtype_arg(dtype)), dim=dim)


@lowers(aten._softmax.default, aten._log_softmax.default)
def _softmax_internal(ctx: LoweringContext, x: Value, dim: int, half_to_float: bool) -> Value:
    name = "softmax" if ctx.aten_node.target is aten._softmax.default else "log_softmax"
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
