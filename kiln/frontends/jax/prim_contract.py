"""Contractions: ``dot_general`` and ``conv_general_dilated``.

``dot_general`` with ``dimension_numbers=((lc, rc), (lb, rb))`` becomes one kiln ``matmul``:
the left operand is permuted to ``(batch, free, contract)`` and flattened to ``[*B, M, K]``,
the right one to ``(batch, contract, free)`` as ``[*B, K, N]``, and the product
``[*B, M, N]`` is reshaped to JAX's output order (batch, lhs free, rhs free).  Permutes and
reshapes that change nothing are not emitted, so ``x @ w`` is a bare ``matmul``.

``conv_general_dilated`` becomes kiln's ``conv`` (torch layout ``N, C, *spatial`` and
``O, I, *kernel``): operands are permuted into it by their dimension numbers and the result
back out; asymmetric padding (``"SAME"`` with an even kernel) is an explicit ``pad`` first.
Input dilation (``lhs_dilation``: a transposed convolution, as in the input gradient of a
strided convolution) is interior padding of the input first; ``batch_group_count > 1`` is
refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.ir import Value

from .prim_layout import pad_axes
from .rules import JaxContext, kiln_dtype, lowers


def _free(rank: int, *used: Sequence[int]) -> list[int]:
    taken = {int(a) for axes in used for a in axes}
    return [a for a in range(rank) if a not in taken]


@lowers("dot_general")
def _dot_general(ctx: JaxContext, lhs: Value, rhs: Value, *, dimension_numbers,
                 preferred_element_type=None, **_) -> Value:
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = ([int(a) for a in axes] for axes in (lc, rc, lb, rb))
    dtype = ctx.out.dtype if preferred_element_type is None else kiln_dtype(preferred_element_type)
    lhs, rhs = ctx.cast(lhs, dtype), ctx.cast(rhs, dtype)
    lf, rf = _free(lhs.type.rank, lc, lb), _free(rhs.type.rank, rc, rb)
    batch = [lhs.shape[a] for a in lb]
    m = [lhs.shape[a] for a in lf]
    n = [rhs.shape[a] for a in rf]
    k = math.prod(lhs.shape[a] for a in lc)
    a = ctx.reshape(ctx.permute(lhs, lb + lf + lc), (*batch, math.prod(m), k))
    b = ctx.reshape(ctx.permute(rhs, rb + rc + rf), (*batch, k, math.prod(n)))
    return ctx.reshape(ctx.op("matmul", a, b), (*batch, *m, *n))


def _conv_check(eqn) -> str | None:
    if int(eqn.params["batch_group_count"]) != 1:
        return "batch_group_count > 1 (a grouped weight-gradient convolution) is not supported"
    return None


@lowers("conv_general_dilated", check=_conv_check)
def _conv(ctx: JaxContext, lhs: Value, rhs: Value, *, window_strides, padding, lhs_dilation,
          rhs_dilation, dimension_numbers, feature_group_count, preferred_element_type=None,
          **_) -> Value:
    lhs_spec, rhs_spec, out_spec = (tuple(int(a) for a in s) for s in dimension_numbers)
    dtype = ctx.out.dtype if preferred_element_type is None else kiln_dtype(preferred_element_type)
    x = ctx.permute(ctx.cast(lhs, dtype), lhs_spec)
    w = ctx.permute(ctx.cast(rhs, dtype), rhs_spec)
    pairs = [(int(lo), int(hi)) for lo, hi in padding]
    dilated = any(int(d) != 1 for d in lhs_dilation)
    if all(lo == hi and lo >= 0 for lo, hi in pairs) and not dilated:
        symmetric = [lo for lo, _ in pairs]
    else:
        config = [(0, 0, 0), (0, 0, 0)] + [(lo, hi, int(d) - 1) for (lo, hi), d in zip(pairs, lhs_dilation)]
        x = pad_axes(ctx, x, config)
        symmetric = [0] * len(pairs)
    y = ctx.op("conv", x, w, stride=tuple(int(s) for s in window_strides), padding=tuple(symmetric),
               dilation=tuple(int(d) for d in rhs_dilation), groups=int(feature_group_count))
    inverse = sorted(range(len(out_spec)), key=lambda i: out_spec[i])
    return ctx.permute(y, inverse)
