"""ATen -> kiln rules for attention: ``scaled_dot_product_attention`` and the fused variants
torch hands a backend (``_scaled_dot_product_flash_attention_for_cpu``,
``_scaled_dot_product_efficient_attention``, ``_scaled_dot_product_attention_math``).

All of them become kiln's ``scaled_dot_product_attention`` op.  Grouped-query attention
(``enable_gqa=True``, or the math variant's implicit one: fewer key/value heads than query
heads) repeats each key/value head for its group of query heads first (``reshape`` +
``expand`` + ``reshape``, as ``repeat_interleave`` on the head axis), so gradients sum over
the group.  The extra results are computed when used:

* the log-sum-exp of the flash and efficient variants (``logsumexp(scores, -1)`` of the
  scaled, masked scores; 0 for a row whose keys are all masked out, as torch gives).  PyTorch
  does not differentiate it and kiln would, so a call whose log-sum-exp is used is lowered
  under ``torch.no_grad()`` only, and refused otherwise (it runs in PyTorch unless
  ``strict=True``);
* the attention weights of the math variant (``softmax`` of the same scores; 0 in rows whose
  keys are all masked out), differentiable as in PyTorch.  Like PyTorch, this private
  variant adds a bool mask as 0/1 (the public ``scaled_dot_product_attention`` turns a bool
  mask into -inf/0 before calling it).

Attention dropout (``dropout_p > 0``) is lowered for ``aten.scaled_dot_product_attention`` (the
weights times a ``dropout_mask``).  Refused with the reason: dropout in the fused variants,
an explicit ``dropout_mask``, the efficient variant's random-number state results
(``philox_seed``/``philox_offset``) and its padded log-sum-exp (query length not a multiple
of 32).

See :mod:`kiln.frontends.torch.aten` for how rules are declared.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, Value

from .aten import LoweringContext, aten, lowers, meta
from .aten_norm import dropout_parts

_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_EFFICIENT = aten._scaled_dot_product_efficient_attention.default
_MATH = aten._scaled_dot_product_attention_math.default


def _used_results(node: torch.fx.Node) -> set[int] | None:
    """Indices of the results a multi-result node's (live) getitems read; ``None`` when the
    tuple itself is used."""
    used: set[int] = set()
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        if user.users:
            used.add(int(user.args[1]))
    return used


def _heads_reason(q: Any, k: Any, v: Any, gqa: bool) -> str | None:
    qs, ks, vs = meta(q).shape, meta(k).shape, meta(v).shape
    shapes = f"q {tuple(qs)}, k {tuple(ks)}, v {tuple(vs)}"
    if gqa and (len(qs) < 3 or ks[-3] != vs[-3] or qs[-3] % ks[-3]):
        return (f"grouped-query attention needs the query heads (axis -3) to be a multiple of "
                f"the key/value heads, and k and v to have as many heads; got {shapes}")
    return None


def _sdpa_check(node: torch.fx.Node, q: Any, k: Any, v: Any, *args: Any) -> str | None:
    if node.target is aten.scaled_dot_product_attention.default:
        _mask, dropout_p, _causal, _scale, enable_gqa = args[:5]
        if not 0.0 <= float(dropout_p) <= 1.0:
            return f"attention dropout probability has to be between 0 and 1, but got {dropout_p}"
        return _heads_reason(q, k, v, bool(enable_gqa))
    used = _used_results(node)
    if used is None:
        return f"{node.target}: the result tuple itself is used; kiln lowers its getitems only"
    if node.target is _MATH:
        _mask, dropout_p, _causal, dropout_mask = args[:4]
        if dropout_mask is not None:
            return "an explicit dropout_mask is not supported; use dropout_p=0.0 without one"
        gqa = meta(q).dim() >= 3 and meta(q).shape[-3] != meta(k).shape[-3]
        return _dropout_reason(dropout_p) or _heads_reason(q, k, v, gqa)
    dropout_p = args[0] if node.target is _FLASH else args[2]
    gqa = meta(q).dim() >= 3 and meta(q).shape[-3] != meta(k).shape[-3]
    reason = _dropout_reason(dropout_p) or _heads_reason(q, k, v, gqa)
    if reason:
        return reason
    if used & {2, 3}:
        return (f"{node.target}: the random-number state results (philox_seed, philox_offset) "
                f"are not supported; only the output and the log-sum-exp are")
    if 1 in used:
        vals = node.meta.get("val")
        lse = vals[1] if isinstance(vals, (tuple, list)) else None
        want = (*meta(q).shape[:-1],)
        if lse is None or tuple(lse.shape) != want:
            got = None if lse is None else tuple(lse.shape)
            return (f"{node.target}: the log-sum-exp has shape {got}, padded beyond the query "
                    f"length (q {tuple(meta(q).shape)}); kiln computes it unpadded only")
        if torch.is_grad_enabled():
            return (f"{node.target}: its log-sum-exp result is used with gradients enabled; "
                    f"PyTorch does not differentiate the log-sum-exp and kiln would, so kiln "
                    f"lowers it under torch.no_grad() only (or compute it separately, e.g. "
                    f"torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1))")
    return None


def _dropout_reason(dropout_p: Any) -> str | None:
    if dropout_p:
        return ("attention dropout is supported through aten.scaled_dot_product_attention only, "
                "not this fused variant; use F.scaled_dot_product_attention(..., dropout_p=p)")
    return None


def _repeat_heads(ctx: LoweringContext, x: Value, heads: int) -> Value:
    """``x.repeat_interleave(heads // x.shape[-3], dim=-3)`` from reshape and expand."""
    n = x.shape[-3]
    if n == heads:
        return x
    group = heads // n
    lead, tail = tuple(x.shape[:-3]), tuple(x.shape[-2:])
    x = ctx.reshape(x, (*lead, n, 1, *tail))
    x = ctx.op("expand", x, shape=(*lead, n, group, *tail))
    return ctx.reshape(x, (*lead, heads, *tail))


def _attention(ctx: LoweringContext, q: Value, k: Value, v: Value, mask: Value | None,
               is_causal: bool, scale: float | None, gqa: bool) -> Value:
    if gqa and len(q.shape) >= 3:
        k, v = _repeat_heads(ctx, k, q.shape[-3]), _repeat_heads(ctx, v, q.shape[-3])
    inputs = (q, k, v) if mask is None else (q, k, v, mask)
    return ctx.op("scaled_dot_product_attention", *inputs, is_causal=bool(is_causal),
                  scale=None if scale is None else float(scale))


def _scores(ctx: LoweringContext, q: Value, k: Value, mask: Value | None, is_causal: bool,
            scale: float | None, gqa: bool) -> tuple[Value, Value | None]:
    """The scaled scores ``q k^T * scale`` (plus a float mask) and where keys are kept
    (``None``: everywhere), as the attention op computes them."""
    if gqa and len(q.shape) >= 3:
        k = _repeat_heads(ctx, k, q.shape[-3])
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    perm = (*range(len(k.shape) - 2), len(k.shape) - 1, len(k.shape) - 2)
    s = ctx.op("matmul", q, ctx.op("permute", k, dims=perm))
    s = ctx.op("mul", s, ctx.const(factor, s.dtype))
    keep = None
    if is_causal:
        length, keys = s.shape[-2:]
        keep = ctx.const(np.tril(np.ones((length, keys), bool)), DType.bool)
    elif mask is not None and mask.dtype == DType.bool:
        keep = mask
    elif mask is not None:
        s = ctx.op("add", s, ctx.cast(mask, s.dtype))
    return s, keep


def _lowest(dtype: DType) -> float:
    return {DType.float16: -65504.0, DType.bfloat16: -3.0e38}.get(dtype) or float(
        np.finfo(dtype.numpy).min)


def _logsumexp(ctx: LoweringContext, q: Value, k: Value, mask: Value | None, is_causal: bool,
               scale: float | None, gqa: bool) -> Value:
    """``logsumexp`` of each query row's scores; 0 where every key is masked out."""
    s, keep = _scores(ctx, q, k, mask, is_causal, scale, gqa)
    if keep is not None:
        s = ctx.op("where", keep, s, ctx.const(-math.inf, s.dtype))
    peak = ctx.op("amax", s, dims=(-1,), keepdim=True)
    finite = ctx.op("logical_not", ctx.op("isinf", peak))  # all -inf: no key (or -inf mask)
    peak = ctx.op("where", finite, peak, ctx.const(0.0, s.dtype))
    total = ctx.op("sum", ctx.op("exp", ctx.op("sub", s, peak)), dims=(-1,), keepdim=True)
    lse = ctx.op("add", ctx.op("log", total), peak)
    lse = ctx.op("where", finite, lse, ctx.const(0.0, s.dtype))
    return ctx.reshape(lse, lse.shape[:-1])


def _weights(ctx: LoweringContext, q: Value, k: Value, mask: Value | None, is_causal: bool,
             scale: float | None, gqa: bool) -> Value:
    """The attention weights ``softmax(scores)``; 0 where a key is masked out."""
    s, keep = _scores(ctx, q, k, mask, is_causal, scale, gqa)
    if keep is None:
        return ctx.op("softmax", s, dim=-1)
    p = ctx.op("softmax", ctx.op("where", keep, s, ctx.const(_lowest(s.dtype), s.dtype)), dim=-1)
    return ctx.op("where", keep, p, ctx.const(0.0, p.dtype))


@lowers(aten.scaled_dot_product_attention.default, check=_sdpa_check, keep=True, fresh=True)
def _sdpa(ctx: LoweringContext, q: Value, k: Value, v: Value, attn_mask: Value | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> Value:
    if not dropout_p:
        return _attention(ctx, q, k, v, attn_mask, is_causal, scale, bool(enable_gqa))
    # Training-time attention dropout, as eager computes it: the weights (0 where every key is
    # masked) times a fresh dropout mask, scaled by 1 / (1 - p), then times v.
    gqa = bool(enable_gqa)
    weights = dropout_parts(ctx, _weights(ctx, q, k, attn_mask, is_causal, scale, gqa), float(dropout_p))[0]
    if gqa and len(q.shape) >= 3:
        v = _repeat_heads(ctx, v, q.shape[-3])
    return ctx.op("matmul", weights, v)


@lowers(_FLASH, check=_sdpa_check, keep=True)
def _sdpa_flash_cpu(ctx: LoweringContext, q: Value, k: Value, v: Value, dropout_p: float = 0.0,
                    is_causal: bool = False, attn_mask: Value | None = None,
                    scale: float | None = None) -> tuple:
    gqa = len(q.shape) >= 3 and q.shape[-3] != k.shape[-3]  # torch's dispatch passes GQA on
    return (_attention(ctx, q, k, v, attn_mask, is_causal, scale, gqa),
            lambda: _logsumexp(ctx, q, k, attn_mask, is_causal, scale, gqa))


@lowers(_EFFICIENT, check=_sdpa_check)
def _sdpa_efficient(ctx: LoweringContext, q: Value, k: Value, v: Value, attn_bias: Value | None,
                    compute_log_sumexp: bool, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None) -> tuple:
    gqa = len(q.shape) >= 3 and q.shape[-3] != k.shape[-3]
    return (_attention(ctx, q, k, v, attn_bias, is_causal, scale, gqa),
            lambda: _logsumexp(ctx, q, k, attn_bias, is_causal, scale, gqa))


@lowers(_MATH, check=_sdpa_check)
def _sdpa_math(ctx: LoweringContext, q: Value, k: Value, v: Value, attn_mask: Value | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, dropout_mask: Value | None = None,
               scale: float | None = None, enable_gqa: bool = False) -> tuple:
    gqa = len(q.shape) >= 3 and q.shape[-3] != k.shape[-3]
    if attn_mask is not None and attn_mask.dtype == DType.bool:
        attn_mask = ctx.cast(attn_mask, q.dtype)  # this private variant adds a bool mask (0/1)
    return (_attention(ctx, q, k, v, attn_mask, is_causal, scale, gqa),
            lambda: _weights(ctx, q, k, attn_mask, is_causal, scale, gqa))
