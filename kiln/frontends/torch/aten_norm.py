"""ATen -> kiln rules for normalization and training-mode ops: batch norm (inference and
training statistics with the running-buffer update), group and instance norm, layer norm,
RMS norm, and dropout (train mode draws its mask with kiln's ``dropout_mask`` op).

See :mod:`kiln.frontends.torch.aten` for how rules are declared.

Training-mode batch norm reaches kiln in functional form
(``_native_batch_norm_legit_functional``: ``torch.export``'s decomposition and the
functionalized ``torch.compile`` graph); its batch statistics are ``mean`` and biased
``var`` over every axis but the channels, its new running statistics
``(1 - momentum) * running + momentum * batch`` with the *unbiased* variance, as eager.
The in-place forms (``batch_norm(training=True)``, ``native_batch_norm``,
``_native_batch_norm_legit``) are refused so the program is functionalized first.

Dropout in train mode: ``x * mask * (1 / (1 - p))`` with ``mask = dropout_mask(seed)``;
the seed is the graph param ``rng.seed`` (:data:`kiln.ir.ops.random.RNG_SEED_PARAM`,
added on first use and refilled by the runtime before every call) and each dropout of a
graph gets its own counter range (``offset``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kiln.ir import DType, TensorType, Value
from kiln.ir.ops.random import RNG_SEED_PARAM

from .aten import (
    LoweringContext,
    aten,
    lowers,
    meta,
    only_first_result_used,
)


# ------------------------------------------------------------------ batch norm
def _not_training(node: torch.fx.Node, *args: Any) -> str | None:
    schema_names = [a.name for a in node.target._schema.arguments]
    if "training" in schema_names and args[schema_names.index("training")]:
        return ("batch norm in training mode updates its running statistics in place; kiln "
                "lowers its functional form (_native_batch_norm_legit_functional) after "
                "functionalization")
    if "running_mean" in schema_names and args[schema_names.index("running_mean")] is None:
        return "batch norm without running statistics is not supported"
    if node.target is aten.native_batch_norm.default:
        return only_first_result_used(node)
    return None


def _channel_stats(ctx: LoweringContext, x: Value) -> tuple[Value, Value, int]:
    """Per-channel batch mean and biased variance (shape ``(C,)``) and the count per channel."""
    others = (0, *range(2, x.type.rank))
    count = int(x.shape[0]) * int(torch.Size(x.shape[2:]).numel())
    mean = ctx.op("mean", x, dims=others, keepdim=False)
    var = ctx.op("var", x, dims=others, correction=0.0, keepdim=False)
    return mean, var, count


def _running_update(ctx: LoweringContext, running: Value, batch: Value, momentum: float) -> Value:
    """``(1 - momentum) * running + momentum * batch`` in the running buffer's dtype."""
    batch = ctx.cast(batch, running.dtype)
    kept = ctx.op("mul", running, ctx.scalar(1.0 - float(momentum), running.dtype))
    return ctx.op("add", kept, ctx.op("mul", batch, ctx.scalar(float(momentum), running.dtype)))


def _training_bn_check(node: torch.fx.Node, *args: Any) -> str | None:
    x = meta(args[0])
    if isinstance(x, torch.Tensor):
        count = x.numel() // max(int(x.shape[1]), 1) if x.dim() >= 2 else 0
        if args[5] and count <= 1:
            return (f"batch norm in training mode needs more than one value per channel, got "
                    f"input {list(x.shape)}; use a batch of at least 2 (as PyTorch requires)")
    return None


@lowers(aten._native_batch_norm_legit_functional.default, check=_training_bn_check)
def _bn_functional(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
                   running_mean: Value, running_var: Value, training: bool, momentum: float,
                   eps: float) -> tuple:
    """``(y, batch mean, batch rstd, new running mean, new running var)``."""
    if not training:
        rstd = lambda: ctx.op("rsqrt", ctx.op("add", running_var,
                                              ctx.scalar(float(eps), running_var.dtype)))
        return (_batch_norm(ctx, x, weight, bias, running_mean, running_var, eps),
                lambda: running_mean, rstd, running_mean, running_var)
    mean, var, count = _channel_stats(ctx, x)
    y = _batch_norm(ctx, x, weight, bias, mean, var, eps)
    def unbiased() -> Value:
        return ctx.op("mul", var, ctx.scalar(count / (count - 1), var.dtype))

    return (y, mean,
            lambda: ctx.op("rsqrt", ctx.op("add", var, ctx.scalar(float(eps), var.dtype))),
            lambda: _running_update(ctx, running_mean, mean, momentum),
            lambda: _running_update(ctx, running_var, unbiased(), momentum))


@lowers(aten._native_batch_norm_legit.no_stats, check=_training_bn_check)
def _bn_no_stats(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
                 training: bool, momentum: float, eps: float) -> tuple:
    """Batch norm without running statistics: always the batch's own (as eager)."""
    mean, var, _ = _channel_stats(ctx, x)
    return (_batch_norm(ctx, x, weight, bias, mean, var, eps), mean,
            lambda: ctx.op("rsqrt", ctx.op("add", var, ctx.scalar(float(eps), var.dtype))))


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


def _native_bn_check(node: torch.fx.Node, *args: Any) -> str | None:
    if args[5] and args[3] is None and args[4] is None:  # batch statistics, nothing updated
        return _training_bn_check(node, *args)
    return _not_training(node, *args)


@lowers(aten.native_batch_norm.default, check=_native_bn_check)
def _native_bn(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
               mean: Value | None, var: Value | None, training: bool, momentum: float,
               eps: float) -> tuple:
    if training:  # without running statistics (instance norm's form): the batch's own
        return _bn_no_stats(ctx, x, weight, bias, training, momentum, eps)
    return (_batch_norm(ctx, x, weight, bias, mean, var, eps),)


@lowers(aten.batch_norm.default, check=_not_training, fresh=True)
def _bn(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
        mean: Value, var: Value, training: bool, momentum: float, eps: float, *_: Any) -> Value:
    return _batch_norm(ctx, x, weight, bias, mean, var, eps)


# ------------------------------------------------------------ group / instance norm
def _group_norm(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
                groups: int, eps: float) -> Value:
    if bias is not None and weight is None:
        weight = ctx.const(torch.ones(bias.shape).numpy(), bias.dtype)
    inputs = [v for v in (x, weight, bias) if v is not None]
    return ctx.op("group_norm", *inputs, groups=int(groups), eps=float(eps))


def _group_check(node: torch.fx.Node, *args: Any) -> str | None:
    x = meta(args[0])
    groups = args[1] if node.target is aten.group_norm.default else args[6]
    if isinstance(x, torch.Tensor) and (x.dim() < 2 or int(x.shape[1]) % int(groups)):
        return (f"group norm of input {list(x.shape)} with {groups} groups: the channels (axis 1) "
                "must split evenly into the groups")
    return None


@lowers(aten.group_norm.default, check=_group_check, keep=True, fresh=True)
def _group_norm_rule(ctx: LoweringContext, x: Value, groups: int, weight: Value | None = None,
                     bias: Value | None = None, eps: float = 1e-5, *_: Any) -> Value:
    return _group_norm(ctx, x, weight, bias, groups, eps)


@lowers(aten.native_group_norm.default, check=_group_check, keep=True)
def _native_group_norm(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
                       n: int, c: int, hxw: int, groups: int, eps: float) -> tuple:
    """``(y, mean, rstd)``, the statistics of shape ``(N, groups)`` built only when used."""
    grouped = (int(x.shape[0]), int(groups), -1)

    def flat() -> Value:
        size = torch.Size(x.shape).numel() // (grouped[0] * grouped[1])
        return ctx.reshape(x, (grouped[0], grouped[1], size))

    def mean() -> Value:
        return ctx.op("mean", flat(), dims=(2,), keepdim=False)

    def rstd() -> Value:
        var = ctx.op("var", flat(), dims=(2,), correction=0.0, keepdim=False)
        return ctx.op("rsqrt", ctx.op("add", var, ctx.scalar(float(eps), var.dtype)))

    return (_group_norm(ctx, x, weight, bias, groups, eps), mean, rstd)


def _instance_check(node: torch.fx.Node, x: Any, weight: Any, bias: Any, running_mean: Any,
                    running_var: Any, use_input_stats: bool, *_: Any) -> str | None:
    if use_input_stats and running_mean is not None:
        return ("instance norm with track_running_stats=True in training mode updates running "
                "statistics in place; kiln lowers it after functionalization")
    if not use_input_stats and running_mean is None:
        return "instance norm without input statistics needs running statistics"
    return None


@lowers(aten.instance_norm.default, check=_instance_check)
def _instance_norm(ctx: LoweringContext, x: Value, weight: Value | None, bias: Value | None,
                   running_mean: Value | None, running_var: Value | None, use_input_stats: bool,
                   momentum: float, eps: float, *_: Any) -> Value:
    """Instance norm is group norm with one group per channel (or, with running statistics
    in eval mode, batch norm with them)."""
    if use_input_stats:
        return _group_norm(ctx, x, weight, bias, int(x.shape[1]), eps)
    return _batch_norm(ctx, x, weight, bias, running_mean, running_var, eps)


# ----------------------------------------------------------- layer / RMS norm
def _layer_norm_parts(ctx: LoweringContext, x: Value, weight: Value | None,
                      bias: Value | None) -> list[Value]:
    if bias is not None and weight is None:
        weight = ctx.const(torch.ones(bias.shape).numpy(), x.dtype)
    return [v for v in (x, weight, bias) if v is not None]


@lowers(aten.layer_norm.default, keep=True, fresh=True)
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

    # PyTorch's autograd treats the saved statistics as non-differentiable outputs (only the
    # gradient of y reaches the inputs), so kiln cuts them off the same way.
    def mean() -> Value:
        return ctx.op("stop_gradient", ctx.op("mean", x, dims=dims, keepdim=True))

    def rstd() -> Value:
        var = ctx.op("var", x, dims=dims, correction=0.0, keepdim=True)
        return ctx.op("stop_gradient", ctx.op("rsqrt", ctx.op("add", var, ctx.scalar(float(eps), var.dtype))))

    return (y, mean, rstd)


@lowers(aten.rms_norm.default, keep=True)
def _rms_norm(ctx: LoweringContext, x: Value, normalized_shape: Sequence[int],
              weight: Value | None = None, eps: float | None = None) -> Value:
    if eps is None:  # torch's default: the machine epsilon of the input dtype
        eps = float(torch.finfo(meta(ctx.aten_node.args[0]).dtype).eps)
    inputs = (x,) if weight is None else (x, weight)
    return ctx.op("rms_norm", *inputs, normalized_rank=len(normalized_shape), eps=float(eps))



# ------------------------------------------------------------------ dropout
def rng_seed(ctx: LoweringContext) -> Value:
    """The graph's ``int64[]`` seed param (:data:`RNG_SEED_PARAM`), added on first use."""
    for param in ctx.graph.params:
        if param.name == RNG_SEED_PARAM:
            return param
    return ctx.graph.add_param(RNG_SEED_PARAM, TensorType((), DType.int64))


def _next_offset(ctx: LoweringContext) -> int:
    """The first counter no earlier ``dropout_mask`` of the graph uses."""
    offset = 0  # symbolic when an earlier mask has a symbolic shape
    for n in ctx.graph.nodes:
        if n.op.name == "dropout_mask":
            offset = offset + n.outputs[0].type.size
    return offset


def dropout_parts(ctx: LoweringContext, x: Value, p: float) -> tuple[Value, Value]:
    """``(x * mask / (1 - p), mask)`` with a fresh mask of ``x``'s shape."""
    mask = ctx.op("dropout_mask", rng_seed(ctx), shape=tuple(x.shape),
                  p=float(p), offset=_next_offset(ctx))
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - float(p))
    kept = ctx.op("mul", x, ctx.cast(mask, x.dtype))
    return ctx.op("mul", kept, ctx.scalar(scale, x.dtype)), mask


def _dropout_check(node: torch.fx.Node, x: Any, p: float, train: bool | None, *_: Any) -> str | None:
    if not 0.0 <= float(p) <= 1.0:
        return f"dropout probability has to be between 0 and 1, but got {p}"
    val = meta(x)
    if isinstance(val, torch.Tensor) and not val.dtype.is_floating_point and train and p > 0:
        return f"dropout of a {val.dtype} tensor is not supported; dropout needs a floating-point input"
    return None


def _feature_check(node: torch.fx.Node, x: Any, p: float, train: bool | None, *_: Any) -> str | None:
    if train and p > 0:
        # capture then decomposes the program: torch's decomposition draws the masks with
        # bernoulli, which kiln lowers (kiln/frontends/torch/aten_random.py)
        return (f"{node.target} in training mode is lowered through its decomposition into "
                "bernoulli draws, not whole")
    return None


@lowers(aten.dropout.default, check=_dropout_check)
def _dropout(ctx: LoweringContext, x: Value, p: float, train: bool) -> Value:
    if not train or p == 0:
        return x
    return dropout_parts(ctx, x, p)[0]


@lowers(aten.native_dropout.default, check=_dropout_check, keep=True)
def _native_dropout(ctx: LoweringContext, x: Value, p: float, train: bool | None) -> tuple:
    """``(y, keep mask)``; ``train=None`` means training, as in ATen."""
    if train is False or p == 0:
        return (x, lambda: ctx.op("full", shape=tuple(x.shape), value=True, dtype=DType.bool))
    return dropout_parts(ctx, x, p)


@lowers(aten.feature_dropout.default, aten.alpha_dropout.default, check=_feature_check)
def _feature_dropout(ctx: LoweringContext, x: Value, *_: Any) -> Value:
    return x
