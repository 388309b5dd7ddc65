"""ATen -> kiln rules for normalization: batch norm, layer norm, RMS norm.

See :mod:`kiln.compiler.aten` for how rules are declared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir import Value

from .aten import LoweringContext, aten, lowers, meta, only_first_result_used


# ------------------------------------------------------------------ batch norm
def _not_training(node: torch.fx.Node, *args: Any) -> str | None:
    schema_names = [a.name for a in node.target._schema.arguments]
    if "training" in schema_names and args[schema_names.index("training")]:
        return "batch norm in training mode updates running statistics; call model.eval()"
    if "running_mean" in schema_names and args[schema_names.index("running_mean")] is None:
        return "batch norm without running statistics is not supported"
    if node.target is aten.native_batch_norm.default:
        return only_first_result_used(node)
    return None


def _batch_norm(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
                mean: Value, var: Value, eps: float) -> Value:
    channels = (int(x.shape[1]),)
    if weight is None:
        weight = ctx.const(torch.ones(channels).numpy(), x.dtype)
    if bias is None:
        bias = ctx.const(torch.zeros(channels).numpy(), x.dtype)
    return ctx.op("batch_norm", x, weight, bias, mean, var, eps=float(eps))


@lowers(aten._native_batch_norm_legit_no_training.default, check=only_first_result_used)
def _bn_no_training(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
                    mean: Value, var: Value, momentum: float, eps: float) -> tuple:
    return (_batch_norm(ctx, x, weight, bias, mean, var, eps),)


@lowers(aten.native_batch_norm.default, check=_not_training)
def _native_bn(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
               mean: Value, var: Value, training: bool, momentum: float, eps: float) -> tuple:
    return (_batch_norm(ctx, x, weight, bias, mean, var, eps),)


@lowers(aten.batch_norm.default, check=_not_training)
def _bn(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
        mean: Value, var: Value, training: bool, momentum: float, eps: float, *_: Any) -> Value:
    return _batch_norm(ctx, x, weight, bias, mean, var, eps)


# ----------------------------------------------------------- layer / RMS norm
def _layer_norm_parts(ctx: LoweringContext, x: Value, weight: Value | None,
                      bias: Value | None) -> list[Value]:
    if bias is not None and weight is None:
        weight = ctx.const(torch.ones(bias.shape).numpy(), x.dtype)
    return [v for v in (x, weight, bias) if v is not None]


@lowers(aten.layer_norm.default)
def _layer_norm(ctx: LoweringContext, x: Value, normalized_shape: Sequence[int],
                weight: Value | None = None, bias: Value | None = None, eps: float = 1e-5,
                *_: Any) -> Value:
    rank = len(normalized_shape)
    return ctx.op("layer_norm", *_layer_norm_parts(ctx, x, weight, bias),
                  normalized_rank=rank, eps=float(eps))


@lowers(aten.native_layer_norm.default)
def _native_layer_norm(ctx: LoweringContext, x: Value, normalized_shape: Sequence[int],
                       weight: Value | None, bias: Value | None, eps: float) -> tuple:
    """``(y, mean, rstd)``; the statistics are built only when the program uses them."""
    rank = len(normalized_shape)
    dims = tuple(range(x.type.rank - rank, x.type.rank))

    def y() -> Value:
        return ctx.op("layer_norm", *_layer_norm_parts(ctx, x, weight, bias),
                      normalized_rank=rank, eps=float(eps))

    def mean() -> Value:
        return ctx.op("mean", x, dims=dims, keepdim=True)

    def rstd() -> Value:
        var = ctx.op("var", x, dims=dims, correction=0.0, keepdim=True)
        return ctx.op("rsqrt", ctx.op("add", var, ctx.scalar(float(eps), var.dtype)))

    return (y, mean, rstd)


@lowers(aten.rms_norm.default)
def _rms_norm(ctx: LoweringContext, x: Value, normalized_shape: Sequence[int],
              weight: Value | None = None, eps: float | None = None) -> Value:
    if eps is None:  # torch's default: the machine epsilon of the input dtype
        eps = float(torch.finfo(meta(ctx.node.args[0]).dtype).eps)
    inputs = (x,) if weight is None else (x, weight)
    return ctx.op("rms_norm", *inputs, normalized_rank=len(normalized_shape), eps=float(eps))
