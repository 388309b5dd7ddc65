"""ATen -> kiln rules for attention: ``scaled_dot_product_attention`` and the fused CPU
variants torch.compile hands a backend.

See :mod:`kiln.compiler.aten` for how rules are declared.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.ir import Value

from .aten import LoweringContext, aten, lowers, meta, only_first_result_used


def _sdpa_check(node: torch.fx.Node, q: Any, k: Any, v: Any, *args: Any) -> str | None:
    if node.target is aten.scaled_dot_product_attention.default:
        _mask, dropout_p, _causal, _scale, enable_gqa = args[:5]
    else:
        dropout_p, enable_gqa = args[0], False
        reason = only_first_result_used(node)
        if reason:
            return reason
    if dropout_p:
        return "attention dropout is random; use dropout_p=0.0 (model.eval())"
    if enable_gqa and meta(q).shape[-3] != meta(k).shape[-3]:
        return "grouped-query attention (enable_gqa=True with fewer key heads) is not supported"
    return None


@lowers(aten.scaled_dot_product_attention.default, check=_sdpa_check)
def _sdpa(ctx: LoweringContext, q: Value, k: Value, v: Value, attn_mask: Value | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          *_: Any) -> Value:
    inputs = (q, k, v) if attn_mask is None else (q, k, v, attn_mask)
    return ctx.op("scaled_dot_product_attention", *inputs, is_causal=bool(is_causal),
                  scale=None if scale is None else float(scale))


@lowers(aten._scaled_dot_product_flash_attention_for_cpu.default, check=_sdpa_check)
def _sdpa_flash_cpu(ctx: LoweringContext, q: Value, k: Value, v: Value, dropout_p: float = 0.0,
                    is_causal: bool = False, attn_mask: Value | None = None,
                    scale: float | None = None) -> tuple:
    return (_sdpa(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale),)
