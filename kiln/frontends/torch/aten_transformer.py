"""ATen -> kiln rules for the fused transformer ops of ``torch.nn``'s inference fast path.

``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` (``batch_first=True``, eval
mode, under ``torch.no_grad()``) call ``aten._native_multi_head_attention`` and
``aten._transformer_encoder_layer_fwd`` instead of their Python code.  Both become kiln
ops (``matmul``, ``add``, ``scaled_dot_product_attention``, ``layer_norm``, ``gelu`` /
``relu``), following PyTorch's implementation of them:

* **attention** (``_native_multi_head_attention(q, k, v, E, H, W_qkv, b_qkv, W_o, b_o,
  mask, need_weights, average_attn_weights, mask_type)``; ``q``, ``k``, ``v`` of one shape
  ``(B, L, E)``): ``q``, ``k`` and ``v`` are projected with the three row blocks of
  ``W_qkv``/``b_qkv``, split into ``H`` heads of ``E / H``, attended with scale
  ``1 / sqrt(E / H)``, merged and projected with ``W_o``/``b_o``.  The mask is read as bool,
  as PyTorch's masked softmax reads it: a float mask is *masked where non-zero* (the module
  passes bool masks as 0/-inf floats, for which this is the slow path's answer), and a row
  whose keys are all masked out is NaN, as the fast path gives it (the slow path differs
  there).  ``mask_type`` says its shape:
  0 = ``(L, L)`` attention mask, 1 = ``(B, L)`` key padding mask, 2 = one entry per score
  ``(B, H, L, L)``.  The second result, when used and ``need_weights`` is set, is the
  attention weights, averaged over heads with ``average_attn_weights`` (``(B, L, L)``) or
  per head (``(B, H, L, L)``).
* **encoder layer** (``_transformer_encoder_layer_fwd``): ``x + attention(x)`` then
  ``x + ffn(x)`` with ``ffn = linear2(act(linear1(x)))`` (``act`` = exact GELU when
  ``use_gelu``, else ReLU), each sublayer post-normed (``norm_first=False``) or pre-normed
  (``norm_first=True``) with its layer norm (shared ``eps``).

See :mod:`kiln.frontends.torch.aten` for how rules are declared.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from kiln.ir import DType, Value

from .aten import LoweringContext, aten, lowers, meta

_MHA = aten._native_multi_head_attention.default
_ENCODER = aten._transformer_encoder_layer_fwd.default


def _shape(x: Any) -> tuple[int, ...] | None:
    m = meta(x)
    return tuple(int(d) for d in m.shape) if isinstance(m, torch.Tensor) else None


def _mask_reason(what: str, mask: Any, mask_type: Any, batch: int, heads: int,
                 length: int) -> str | None:
    """Why ``mask`` cannot be lowered for scores of shape ``(batch, heads, length, length)``."""
    if mask is None:
        return None
    shape = _shape(mask)
    scores = (batch, heads, length, length)
    if len(shape) == 2 and mask_type == 0 and shape == (length, length):
        return None
    if len(shape) == 2 and mask_type == 1 and shape == (batch, length):
        return None
    if mask_type in (0, 1, 2) and shape == scores:
        return None
    expected = {0: f"({length}, {length})", 1: f"({batch}, {length})"}.get(mask_type)
    want = f"{expected} or {scores}" if expected else f"{scores}"
    return (f"{what}: mask of shape {shape} with mask_type={mask_type} does not fit scores "
            f"{scores}; PyTorch expects {want} (mask_type 0 = attention mask (L, L), 1 = key "
            "padding mask (B, L), 2 = one entry per score (B, H, L, L))")


def _mha_check(node: torch.fx.Node, query: Any, key: Any, value: Any, embed_dim: int,
               num_head: int, qkv_weight: Any, qkv_bias: Any, proj_weight: Any, proj_bias: Any,
               mask: Any = None, need_weights: bool = True, average_attn_weights: bool = True,
               mask_type: Any = None) -> str | None:
    shapes = [_shape(query), _shape(key), _shape(value)]
    what = f"{node.target} (query {shapes[0]}, key {shapes[1]}, value {shapes[2]})"
    if any(len(s) != 3 for s in shapes) or len(set(shapes)) != 1:
        return (f"{what}: query, key and value must be batched (B, L, E) tensors of one shape, "
                "as PyTorch requires")
    batch, length, embed = shapes[0]
    if embed != embed_dim or embed_dim % num_head:
        return f"{what}: embed_dim {embed_dim} must be the last axis and divisible by {num_head} heads"
    for user in node.users:
        if user.target is not operator.getitem:
            return f"{what}: the result tuple itself is used; kiln lowers its getitems only"
    return _mask_reason(what, mask, mask_type, batch, num_head, length)


def _linear(ctx: LoweringContext, x: Value, weight: Value, bias: Value | None) -> Value:
    y = ctx.op("matmul", x, ctx.op("permute", weight, dims=(1, 0)))
    return y if bias is None else ctx.op("add", y, bias)


def _rows(ctx: LoweringContext, x: Value, block: int, size: int) -> Value:
    """Rows ``[block * size, (block + 1) * size)`` of ``x`` (axis 0)."""
    return ctx.op("slice", x, dim=0, start=block * size, end=(block + 1) * size, step=1)


def _keep_mask(ctx: LoweringContext, mask: Value | None, mask_type: Any, batch: int,
               length: int) -> Value | None:
    """Where keys are kept (bool, broadcasting to the scores), from a fast-path mask."""
    if mask is None:
        return None
    masked = mask if mask.dtype == DType.bool else ctx.op("ne", mask, ctx.const(0, mask.dtype))
    if len(mask.shape) == 2 and mask_type == 1:
        masked = ctx.reshape(masked, (batch, 1, 1, length))
    elif len(mask.shape) == 2:
        masked = ctx.reshape(masked, (1, 1, length, length))
    return ctx.op("logical_not", masked)


def _attention_parts(ctx: LoweringContext, query: Value, key: Value, value: Value,
                     embed_dim: int, heads: int, qkv_weight: Value, qkv_bias: Value | None,
                     mask: Value | None, mask_type: Any) -> tuple[Value, Value, Value, Value | None]:
    """Per-head ``q`` (scaled), ``k``, ``v`` as ``(B, H, L, E / H)`` and the keep mask."""
    batch, length, _ = query.shape
    head_dim = embed_dim // heads

    def project(x: Value, block: int) -> Value:
        bias = None if qkv_bias is None else _rows(ctx, qkv_bias, block, embed_dim)
        y = _linear(ctx, x, _rows(ctx, qkv_weight, block, embed_dim), bias)
        y = ctx.reshape(y, (batch, length, heads, head_dim))
        return ctx.op("permute", y, dims=(0, 2, 1, 3))

    q, k, v = project(query, 0), project(key, 1), project(value, 2)
    return q, k, v, _keep_mask(ctx, mask, mask_type, batch, length)


def _scores(ctx: LoweringContext, q: Value, k: Value, keep: Value | None) -> Value:
    """``q k^T / sqrt(d)`` with masked-out keys at -inf."""
    s = ctx.op("matmul", q, ctx.op("permute", k, dims=(0, 1, 3, 2)))
    s = ctx.op("mul", s, ctx.const(1.0 / math.sqrt(q.shape[-1]), s.dtype))
    if keep is not None:
        s = ctx.op("where", keep, s, ctx.const(-math.inf, s.dtype))
    return s


def _multi_head_attention(ctx: LoweringContext, query: Value, key: Value, value: Value,
                          embed_dim: int, heads: int, qkv_weight: Value, qkv_bias: Value | None,
                          proj_weight: Value, proj_bias: Value | None, mask: Value | None,
                          mask_type: Any) -> tuple[Value, Any]:
    """The projected attention output and a builder of the per-head weights."""
    batch, length, _ = query.shape
    q, k, v, keep = _attention_parts(ctx, query, key, value, embed_dim, heads, qkv_weight,
                                     qkv_bias, mask, mask_type)
    # PyTorch's masked softmax gives NaN in a row with every key masked out; kiln's softmax
    # and attention ops give 0 there, so masked attention is built from the weights, NaN
    # in such rows.
    weights = None
    if keep is None:
        attended = ctx.op("scaled_dot_product_attention", q, k, v)
    else:
        weights = ctx.op("softmax", _scores(ctx, q, k, keep), dim=-1)
        alive = ctx.op("any", keep, dims=(-1,), keepdim=True)
        weights = ctx.op("where", alive, weights, ctx.const(math.nan, weights.dtype))
        attended = ctx.op("matmul", weights, v)
    merged = ctx.reshape(ctx.op("permute", attended, dims=(0, 2, 1, 3)), (batch, length, embed_dim))
    out = _linear(ctx, merged, proj_weight, proj_bias)

    def probabilities() -> Value:
        return weights if weights is not None else ctx.op("softmax", _scores(ctx, q, k, None), dim=-1)

    return out, probabilities


@lowers(_MHA, check=_mha_check)
def _native_mha(ctx: LoweringContext, query: Value, key: Value, value: Value, embed_dim: int,
                num_head: int, qkv_weight: Value, qkv_bias: Value | None, proj_weight: Value,
                proj_bias: Value | None, mask: Value | None = None, need_weights: bool = True,
                average_attn_weights: bool = True, mask_type: Any = None) -> tuple:
    out, probabilities = _multi_head_attention(
        ctx, query, key, value, int(embed_dim), int(num_head), qkv_weight, qkv_bias,
        proj_weight, proj_bias, mask, mask_type)

    def weights() -> Value:
        if not need_weights:  # PyTorch returns no tensor; whatever reads it reads nothing
            kind = ctx.outs[1] if len(ctx.outs) > 1 and ctx.outs[1] is not None else None
            shape = tuple(kind.shape) if isinstance(kind, torch.Tensor) else (0,)
            return ctx.op("full", shape=shape, value=0.0, dtype=query.dtype)
        p = probabilities()
        return ctx.op("mean", p, dims=(1,), keepdim=False) if average_attn_weights else p

    return out, weights


def _encoder_check(node: torch.fx.Node, src: Any, embed_dim: int, num_heads: int,
                   *args: Any) -> str | None:
    shape = _shape(src)
    what = f"{node.target} (src {shape})"
    if shape is None or len(shape) != 3:
        return f"{what}: src must be a batched (B, L, E) tensor, as PyTorch's fast path requires"
    if shape[-1] != embed_dim or embed_dim % num_heads:
        return f"{what}: embed_dim {embed_dim} must be the last axis and divisible by {num_heads} heads"
    mask, mask_type = args[15], args[16]
    return _mask_reason(what, mask, mask_type, shape[0], int(num_heads), shape[1])


@lowers(_ENCODER, check=_encoder_check)
def _encoder_layer(ctx: LoweringContext, src: Value, embed_dim: int, num_heads: int,
                   qkv_weight: Value, qkv_bias: Value | None, proj_weight: Value,
                   proj_bias: Value | None, use_gelu: bool, norm_first: bool, eps: float,
                   norm_weight_1: Value, norm_bias_1: Value, norm_weight_2: Value,
                   norm_bias_2: Value, ffn_weight_1: Value, ffn_bias_1: Value | None,
                   ffn_weight_2: Value, ffn_bias_2: Value | None, mask: Value | None = None,
                   mask_type: Any = None) -> Value:
    def norm(x: Value, weight: Value, bias: Value) -> Value:
        return ctx.op("layer_norm", x, weight, bias, normalized_rank=1, eps=float(eps))

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x, _ = _multi_head_attention(ctx, x, x, x, int(embed_dim), int(num_heads), qkv_weight,
                                 qkv_bias, proj_weight, proj_bias, mask, mask_type)
    x = ctx.op("add", x, src)
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    hidden = _linear(ctx, x, ffn_weight_1, ffn_bias_1)
    hidden = ctx.op("gelu", hidden, approximate="none") if use_gelu else ctx.op("relu", hidden)
    x = ctx.op("add", _linear(ctx, hidden, ffn_weight_2, ffn_bias_2), residual)
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    return x
