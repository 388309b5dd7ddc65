"""ATen -> kiln rules for grid sampling, pairwise distances, multilinear products and bags of
embeddings, each a composition of kiln ops (so their gradients come from those ops').

* ``grid_sampler_2d`` / ``grid_sampler_3d``: the input flattened per channel, one ``gather``
  per tap (1 for nearest, 2^d for (tri)linear, 16 for bicubic) at the tap's linear position,
  weighted by coefficients computed from the grid; taps outside the input read 0 (``zeros``
  padding) and the coordinates are clipped (``border``) or reflected (``reflection``) first, as
  PyTorch's CPU kernel does.
* ``_pdist_forward``: the rows of every pair ``i < j`` picked by two constant
  ``index_select`` and reduced to their p-norm distance.
* ``_trilinear`` (``nn.functional.bilinear``): the three operands broadcast over the expanded
  axes, multiplied and summed over ``sumdim``.
* ``_embedding_bag``: the bag of each index from the offsets (a static comparison), rows summed,
  averaged or maximized per bag by one ``scatter_add`` / ``scatter_reduce``.
* ``_upsample_bilinear2d_aa`` / ``_upsample_bicubic2d_aa``: the antialiasing filter weights
  depend on the shapes only, so they are two constant matrices applied with ``matmul``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, Value

from .aten import (
    LoweringContext,
    aten,
    lowers,
    meta,
    only_first_result_used,
    optional_ops,
)

I64 = DType.int64


# ------------------------------------------------------------------------ grid sampling
class _Coords:
    """Arithmetic on float tensors of one dtype, for the sampler's coordinate formulas."""

    def __init__(self, ctx: LoweringContext, dtype: DType):
        self.ctx, self.dtype = ctx, dtype

    def c(self, v: Any) -> Value:
        return self.ctx.const(float(v), self.dtype)

    def __getattr__(self, name: str):
        ctx = self.ctx

        def op(*args: Any, **attrs: Any) -> Value:
            vals = [a if isinstance(a, Value) else self.c(a) for a in args]
            return ctx.op(name, *vals, **attrs)

        return op


def _unnormalize(f: _Coords, g: Value, size: int, align: bool) -> Value:
    if align:
        return f.mul(f.add(g, 1.0), (size - 1) / 2.0)
    return f.div(f.sub(f.mul(f.add(g, 1.0), float(size)), 1.0), 2.0)


def _reflect(f: _Coords, c: Value, twice_low: int, twice_high: int) -> Value:
    if twice_low == twice_high:
        return f.mul(c, 0.0)
    low = twice_low / 2.0
    span = (twice_high - twice_low) / 2.0
    a = f.abs(f.sub(c, low))
    extra = f.fmod(a, span)
    flips = f.floor(f.div(a, span))
    even = f.eq(f.fmod(flips, 2.0), 0.0)
    return f.where(even, f.add(extra, low), f.add(f.sub(span, extra), low))


def _padded(f: _Coords, c: Value, size: int, padding: int, align: bool) -> Value:
    """The coordinate after ``border`` (1) or ``reflection`` (2) padding; ``zeros`` (0) keeps it."""
    if padding == 0:
        return c
    if padding == 2:
        c = _reflect(f, c, 0, 2 * (size - 1)) if align else _reflect(f, c, -1, 2 * size - 1)
    return f.clamp(c, min=0.0, max=float(size - 1))


def _cubic_weights(f: _Coords, t: Value) -> list[Value]:
    a = -0.75

    def near(x: Value) -> Value:  # |x| <= 1
        return f.add(f.mul(f.mul(f.sub(f.mul(x, a + 2), a + 3), x), x), 1.0)

    def far(x: Value) -> Value:  # 1 < |x| < 2
        return f.sub(f.mul(f.add(f.mul(f.sub(f.mul(x, a), 5 * a), x), 8 * a), x), 4 * a)

    return [far(f.add(t, 1.0)), near(t), near(f.sub(1.0, t)), far(f.sub(2.0, t))]


def _grid_check(node: torch.fx.Node, x: Any, grid: Any, interpolation: int, padding: int,
                align_corners: bool) -> str | None:
    spatial = meta(x).dim() - 2 if isinstance(meta(x), torch.Tensor) else 0
    if interpolation not in (0, 1, 2):
        return f"grid_sampler interpolation_mode={interpolation} is not 0 (bilinear), 1 (nearest) or 2 (bicubic)"
    if interpolation == 2 and spatial != 2:
        return "grid_sampler: bicubic interpolation is defined for 4-d inputs only"
    if padding not in (0, 1, 2):
        return f"grid_sampler padding_mode={padding} is not 0 (zeros), 1 (border) or 2 (reflection)"
    return None


@lowers(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default,
        *optional_ops("grid_sampler.default"), check=_grid_check)
def _grid_sampler(ctx: LoweringContext, x: Value, grid: Value, interpolation: int, padding: int,
                  align_corners: bool) -> Value:
    f = _Coords(ctx, x.dtype)
    align = bool(align_corners)
    n, ch = int(x.shape[0]), int(x.shape[1])
    sizes = [int(d) for d in x.shape[2:]]  # (D,) H, W
    d = len(sizes)
    out_sp = tuple(int(s) for s in grid.shape[1:-1])
    points = int(np.prod(out_sp, dtype=np.int64))
    total = int(np.prod(sizes, dtype=np.int64))
    if n == 0 or ch == 0 or points == 0 or total == 0:
        return ctx.op("full", shape=tuple(ctx.out.shape), value=0.0, dtype=x.dtype)
    flat_x = ctx.reshape(x, (n, ch, total))
    g = ctx.reshape(ctx.cast(grid, x.dtype), (n, points, d))
    # grid[..., 0] indexes the last axis (W), grid[..., 1] the one before, ...
    coords = []
    for k in range(d):
        axis = d - 1 - k
        gk = ctx.reshape(ctx.op("slice", g, dim=2, start=k, end=k + 1), (n, points))
        coords.append((axis, _unnormalize(f, gk, sizes[axis], align)))
    coords.sort(key=lambda item: item[0])
    strides = [int(np.prod(sizes[a + 1:], dtype=np.int64)) for a in range(d)]

    def tap(positions: Sequence[Value], pad_each: bool) -> Value:
        """Input values at integer-valued float positions (one per axis), 0 outside."""
        valid = None
        linear = None
        for a, p in enumerate(positions):
            if pad_each:
                p = _padded(f, p, sizes[a], int(padding), align)
            inside = ctx.op("logical_and", f.ge(p, 0.0), f.le(p, float(sizes[a] - 1)))
            valid = inside if valid is None else ctx.op("logical_and", valid, inside)
            ip = ctx.cast(f.clamp(p, min=0.0, max=float(sizes[a] - 1)), I64)
            term = ctx.op("mul", ip, ctx.const(strides[a], I64)) if strides[a] != 1 else ip
            linear = term if linear is None else ctx.op("add", linear, term)
        index = ctx.op("expand", ctx.reshape(linear, (n, 1, points)), shape=(n, ch, points))
        picked = ctx.op("gather", flat_x, index, dim=2)
        return ctx.op("where", ctx.reshape(valid, (n, 1, points)), picked, f.c(0.0))

    def weighted(value: Value, weight: Value) -> Value:
        return ctx.op("mul", value, ctx.reshape(weight, (n, 1, points)))

    if interpolation == 2:  # bicubic: 4x4 taps around floor(coordinate), each padded on its own
        (_, cy), (_, cx) = coords
        fy, fx = f.floor(cy), f.floor(cx)
        wy, wx = _cubic_weights(f, f.sub(cy, fy)), _cubic_weights(f, f.sub(cx, fx))
        out = None
        for i in range(4):
            py = f.add(fy, float(i - 1))
            for j in range(4):
                px = f.add(fx, float(j - 1))
                term = weighted(tap([py, px], True), f.mul(wy[i], wx[j]))
                out = term if out is None else ctx.op("add", out, term)
    else:
        padded = [_padded(f, c, sizes[a], int(padding), align) for a, c in coords]
        if interpolation == 1:  # nearest: round half to even
            out = tap([f.round(c) for c in padded], False)
        else:
            lows = [f.floor(c) for c in padded]
            fracs = [f.sub(c, lo) for c, lo in zip(padded, lows)]
            out = None
            for corner in range(2 ** d):
                bits = [(corner >> (d - 1 - a)) & 1 for a in range(d)]
                pos = [f.add(lo, 1.0) if b else lo for lo, b in zip(lows, bits)]
                weight = None
                for fr, b in zip(fracs, bits):
                    w = fr if b else f.sub(1.0, fr)
                    weight = w if weight is None else f.mul(weight, w)
                term = weighted(tap(pos, False), weight)
                out = term if out is None else ctx.op("add", out, term)
    return ctx.reshape(out, (n, ch, *out_sp))


# ------------------------------------------------------------------------------- pdist
@lowers(aten._pdist_forward.default)
def _pdist(ctx: LoweringContext, x: Value, p: float = 2.0) -> Value:
    n, m = int(x.shape[0]), int(x.shape[1])
    i, j = np.triu_indices(n, k=1)
    if len(i) == 0 or m == 0:
        return ctx.op("full", shape=(len(i),), value=0.0, dtype=x.dtype)
    f = _Coords(ctx, x.dtype)
    left = ctx.op("index_select", x, ctx.const(i.astype(np.int64), I64), dim=0)
    right = ctx.op("index_select", x, ctx.const(j.astype(np.int64), I64), dim=0)
    diff = f.abs(f.sub(left, right))
    p = float(p)
    if p == 0:
        return ctx.op("sum", ctx.cast(f.ne(diff, 0.0), x.dtype), dims=(1,))
    if math.isinf(p):
        return ctx.op("amax", diff, dims=(1,))
    if p == 1:
        return ctx.op("sum", diff, dims=(1,))
    if p == 2:
        return f.sqrt(ctx.op("sum", f.mul(diff, diff), dims=(1,)))
    return f.pow(ctx.op("sum", f.pow(diff, p), dims=(1,)), 1.0 / p)


# -------------------------------------------------------------------------- _trilinear
@lowers(aten._trilinear.default)
def _trilinear(ctx: LoweringContext, i1: Value, i2: Value, i3: Value, expand1: Sequence[int],
               expand2: Sequence[int], expand3: Sequence[int], sumdim: Sequence[int],
               unroll_dim: int = 1) -> Value:
    """``sum(unsqueeze(i1, expand1) * unsqueeze(i2, expand2) * unsqueeze(i3, expand3), sumdim)``."""

    def spread(v: Value, axes: Sequence[int]) -> Value:
        shape = [int(s) for s in v.shape]
        for a in sorted(int(a) for a in axes):
            shape.insert(a, 1)
        return ctx.reshape(v, tuple(shape))

    a, b, c = spread(i1, expand1), spread(i2, expand2), spread(i3, expand3)
    prod = ctx.op("mul", ctx.op("mul", a, ctx.cast(b, a.dtype)), ctx.cast(c, a.dtype))
    if sumdim:
        prod = ctx.op("sum", prod, dims=tuple(int(s) for s in sumdim), keepdim=True)
    out = tuple(int(s) for s in ctx.out.shape)
    if tuple(prod.shape) != out and int(np.prod(prod.shape)) == int(np.prod(out)):
        return ctx.reshape(prod, out)
    return ctx.op("expand", prod, shape=out) if tuple(prod.shape) != out else prod


# ----------------------------------------------------------------------- embedding_bag
def _bag_check(node: torch.fx.Node, weight: Any, indices: Any, offsets: Any, scale_grad_by_freq: bool = False,
               mode: int = 0, sparse: bool = False, per_sample_weights: Any = None,
               include_last_offset: bool = False, padding_idx: int | None = -1) -> str | None:
    if mode not in (0, 1, 2):
        return f"embedding_bag mode={mode} is not 0 (sum), 1 (mean) or 2 (max)"
    if meta(indices) is not None and meta(indices).dim() != 1:
        return f"embedding_bag needs 1-d indices at the ATen level, got {tuple(meta(indices).shape)}"
    return only_first_result_used(node)


@lowers(aten._embedding_bag.default, aten._embedding_bag_forward_only.default,
        *optional_ops("embedding_bag.padding_idx", "embedding_bag.default"), check=_bag_check)
def _embedding_bag(ctx: LoweringContext, weight: Value, indices: Value, offsets: Value,
                   scale_grad_by_freq: bool = False, mode: int = 0, sparse: bool = False,
                   per_sample_weights: Value | None = None, include_last_offset: bool = False,
                   padding_idx: int | None = -1) -> tuple:
    dtype = weight.dtype
    f = _Coords(ctx, dtype)
    dim = int(weight.shape[1])
    count_idx = int(indices.shape[0])
    starts = ctx.cast(offsets, I64)
    bags = int(offsets.shape[0]) - (1 if include_last_offset else 0)
    out_shape = (bags, dim)

    def result() -> Value:
        if bags <= 0 or count_idx == 0:
            return ctx.op("full", shape=out_shape, value=0.0, dtype=dtype)
        used = ctx.op("slice", starts, dim=0, start=0, end=bags) if include_last_offset else starts
        k = ctx.const(np.arange(count_idx, dtype=np.int64).reshape(count_idx, 1), I64)
        bag = ctx.op("sub", ctx.op("sum", ctx.op("le", ctx.reshape(used, (1, bags)), k), dims=(1,), dtype=I64),
                     ctx.const(1, I64))  # [count_idx]
        idx = ctx.cast(indices, I64)
        keep = ctx.op("ge", bag, ctx.const(0, I64))
        if include_last_offset:
            last = ctx.op("slice", starts, dim=0, start=bags, end=bags + 1)
            keep = ctx.op("logical_and", keep, ctx.op("lt", ctx.const(np.arange(count_idx), I64), last))
        if padding_idx is not None and int(padding_idx) >= 0:
            keep = ctx.op("logical_and", keep, ctx.op("ne", idx, ctx.const(int(padding_idx), I64)))
        bag = ctx.op("where", keep, bag, ctx.const(0, I64))
        rows = ctx.op("index_select", weight, ctx.op("where", keep, idx, ctx.const(0, I64)), dim=0)
        spread = ctx.op("expand", ctx.reshape(bag, (count_idx, 1)), shape=(count_idx, dim))
        keep2 = ctx.reshape(keep, (count_idx, 1))
        zeros = ctx.op("full", shape=out_shape, value=0.0, dtype=dtype)
        if mode == 2:
            src = ctx.op("where", keep2, rows, f.c(float("-inf")))
            out = ctx.op("scatter_reduce", zeros, spread, src, dim=0, reduce="amax", include_self=False)
            counts = ctx.op("scatter_add", ctx.op("full", shape=(bags,), value=0.0, dtype=dtype), bag,
                            ctx.cast(keep, dtype), dim=0)
            return ctx.op("where", ctx.reshape(f.gt(counts, 0.0), (bags, 1)), out, f.c(0.0))
        if per_sample_weights is not None:
            rows = ctx.op("mul", rows, ctx.reshape(ctx.cast(per_sample_weights, dtype), (count_idx, 1)))
        src = ctx.op("where", keep2, rows, f.c(0.0))
        out = ctx.op("scatter_add", zeros, spread, src, dim=0)
        if mode == 1:
            counts = ctx.op("scatter_add", ctx.op("full", shape=(bags,), value=0.0, dtype=dtype), bag,
                            ctx.cast(keep, dtype), dim=0)
            out = ctx.op("div", out, ctx.reshape(ctx.op("maximum", counts, f.c(1.0)), (bags, 1)))
        return out

    def unused() -> Value:  # never built: the check refuses programs reading results 1-3
        raise AssertionError("embedding_bag: only result 0 is lowered")

    return (result, unused, unused, unused)


# --------------------------------------------------------------- antialiased upsampling
def _aa_filter(x: np.ndarray, cubic: bool) -> np.ndarray:
    x = np.abs(x)
    if not cubic:
        return np.maximum(0.0, 1.0 - x)
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _aa_weights(size_in: int, size_out: int, align: bool, scale: float | None, cubic: bool) -> np.ndarray:
    """``[size_out, size_in]``: row ``i`` is the normalized filter of output position ``i``
    (the filter stretched by the scale when downsampling, as PyTorch's antialiasing does)."""
    if align:
        s = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    else:
        s = 1.0 / scale if scale is not None and scale > 0 else size_in / size_out
    half = 2.0 if cubic else 1.0
    support = half * s if s >= 1.0 else half
    inv = 1.0 / s if s >= 1.0 else 1.0
    weights = np.zeros((size_out, size_in))
    for i in range(size_out):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), size_in)
        taps = np.arange(lo, hi)
        w = _aa_filter((taps - center + 0.5) * inv, cubic)
        total = w.sum()
        weights[i, lo:hi] = w / total if total != 0 else w
    return weights


def _aa(cubic: bool):
    def lower(ctx: LoweringContext, x: Value, output_size: Sequence[int], align_corners: bool,
              scales_h: float | None = None, scales_w: float | None = None) -> Value:
        h, w = int(x.shape[-2]), int(x.shape[-1])
        ho, wo = (int(s) for s in output_size)
        wh = _aa_weights(h, ho, bool(align_corners), scales_h, cubic)
        ww = _aa_weights(w, wo, bool(align_corners), scales_w, cubic)
        rows = ctx.op("matmul", ctx.const(wh, x.dtype), x)  # [.., ho, w]
        return ctx.op("matmul", rows, ctx.const(np.ascontiguousarray(ww.T), x.dtype))  # [.., ho, wo]

    return lower


lowers(aten._upsample_bilinear2d_aa.default)(_aa(False))
lowers(aten._upsample_bicubic2d_aa.default)(_aa(True))
