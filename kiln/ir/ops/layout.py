"""Layout ops that copy: cat, pad, flip, tril/triu and repeat.

(The view ops -- reshape, permute, expand, slice, select -- are in :mod:`.views`; gathers
and advanced indexing in :mod:`.indexing`; scatters in :mod:`.scatter`.)  Shapes are
static, except that flip and tril/triu carry symbolic sizes through.  Every rule follows
torch: negative axes count from the end, ``pad`` lists (before, after) pairs starting at the
last axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce

import numpy as np

from ..registry import Attr, defop
from ..types import Dim, DType, TensorType, normalize_dim, promote
from ._infer import fmt_shape, static_dims, unique_axes
from .compute import Select, all_of, cmp, const, defcompute, floormod, simplify_index
from .views import _view_rule
from .vjp import deflinear, defvjp


# -------------------------------------------------------------------------------- cat
def _cat_parts(shapes: Sequence[tuple]) -> list[int]:
    """Positions of the operands cat joins: 1-d empty operands are skipped, as in torch."""
    kept = [i for i, s in enumerate(shapes) if tuple(s) != (0,)]
    return kept or list(range(len(shapes)))


def _cat_infer(types, *, dim):
    parts = _cat_parts([t.shape for t in types])
    first = types[parts[0]]
    if first.rank == 0:
        raise ValueError("cannot concatenate 0-d tensors; reshape them to 1-d first")
    axis = normalize_dim(dim, first.rank)
    total = 0
    for i in parts:
        t = types[i]
        rest = t.shape[:axis] + t.shape[axis + 1:]
        if t.rank != first.rank or rest != first.shape[:axis] + first.shape[axis + 1:]:
            raise ValueError(f"operand {i} has shape {fmt_shape(t.shape)} but operand {parts[0]} has "
                             f"{fmt_shape(first.shape)}; only axis {axis} may differ")
        total = total + t.shape[axis]
    dtype = reduce(promote, (t.dtype for t in types))
    return TensorType(first.shape[:axis] + (total,) + first.shape[axis + 1:], dtype)


@defop("cat", infer=_cat_infer, num_inputs=(1, None), attrs={"dim": Attr("int", axes="axis")},
       traits=("copy",))
def cat(*xs, dim):
    """Concatenate along ``dim``; dtypes promote as in arithmetic."""
    dtype = reduce(promote, (DType.from_numpy(x.dtype) for x in xs)).numpy
    parts = [xs[i].astype(dtype, copy=False) for i in _cat_parts([x.shape for x in xs])]
    return np.concatenate(parts, axis=normalize_dim(dim, parts[0].ndim))


@defvjp("cat")
def _cat_vjp(b, inputs, outputs, cotangents, attrs):
    """Each operand gets its slice of the cotangent (cast back to its dtype)."""
    g = cotangents[0]
    axis = normalize_dim(attrs["dim"], g.type.rank)
    grads: list = [None] * len(inputs)
    offset = 0
    for i in _cat_parts([v.shape for v in inputs]):
        x = inputs[i]
        length = x.shape[axis]
        if x.dtype.is_floating and b.wants(i):
            part = b.op("slice", g, dim=axis, start=offset, end=offset + length)
            grads[i] = b.cast(part, x.dtype)
        offset += length
    return grads


# -------------------------------------------------------------------------------- pad
def _pad_pairs(shape: Sequence[Dim], pads: Sequence[int]) -> list[tuple[int, int]]:
    """Per-axis (before, after) amounts, first axis first, from torch's last-axis-first list."""
    rank = len(shape)
    if len(pads) % 2 or len(pads) > 2 * rank:
        raise ValueError(f"pads {list(pads)} must be (before, after) pairs for at most {rank} "
                         f"axes (rank {rank})")
    pairs = [(0, 0)] * rank
    for k in range(len(pads) // 2):
        axis = rank - 1 - k
        before, after = pads[2 * k], pads[2 * k + 1]
        size = shape[axis]
        if (before or after) and not isinstance(size, int):
            raise ValueError(f"cannot pad symbolic axis {axis} of {fmt_shape(shape)}")
        if (before or after) and size + min(before, 0) + min(after, 0) < 0:
            raise ValueError(f"pads ({before}, {after}) crop more than the {size} elements of "
                             f"axis {axis}")
        pairs[axis] = (before, after)
    return pairs


def _pad_infer(types, *, pads, value=0.0):
    t = types[0]
    if not t.dtype.is_floating and not math.isfinite(value):
        raise ValueError(f"pad value {value} cannot be stored in {t.dtype.short}")
    pairs = _pad_pairs(t.shape, pads)
    return t.with_shape(tuple(d if p == (0, 0) else d + p[0] + p[1] for d, p in zip(t.shape, pairs)))


@defop("pad", infer=_pad_infer, attrs={"pads": Attr("ints"), "value": Attr("float", 0.0)}, traits=("copy",))
def pad(x, *, pads, value=0.0):
    """Constant padding (torch constant_pad_nd order); negative amounts crop."""
    pairs = _pad_pairs(x.shape, pads)
    crop = tuple(slice(max(-b, 0), d - max(-a, 0)) for d, (b, a) in zip(x.shape, pairs))
    widths = [(max(b, 0), max(a, 0)) for b, a in pairs]
    fill = np.asarray(np.trunc(value) if x.dtype.kind in "iu" else value).astype(x.dtype)
    return np.pad(x[crop], widths, constant_values=fill)


@defvjp("pad")
@deflinear
def _pad_transpose(b, g, x, y, attrs):
    """Pad by the negated amounts: crops what was padded, zero-fills what was cropped."""
    return b.op("pad", g, pads=tuple(-p for p in attrs["pads"]))


# ------------------------------------------------------------------------------- flip
def _flip_infer(types, *, dims):
    t = types[0]
    unique_axes(dims, t.rank)
    return t


@defop("flip", infer=_flip_infer, attrs={"dims": Attr("ints", axes="set")}, traits=("copy",))
def flip(x, *, dims):
    """Reverse the order of elements along each of ``dims``."""
    return np.flip(x, axis=unique_axes(dims, x.ndim)) if dims else x


defvjp("flip")(deflinear(lambda b, g, x, y, attrs: b.op("flip", g, dims=attrs["dims"])))


# --------------------------------------------------------------------- triangles, tiles
def _triangle_infer(types, *, diagonal=0):
    t = types[0]
    if t.rank < 2:
        raise ValueError(f"input must be at least 2-d, got {fmt_shape(t.shape)}")
    return t


@defop("tril", infer=_triangle_infer, attrs={"diagonal": Attr("int", 0)}, traits=("copy",))
def tril(x, *, diagonal=0):
    """Zero the elements above diagonal ``diagonal`` of the last two axes."""
    return np.tril(x, k=diagonal)


@defop("triu", infer=_triangle_infer, attrs={"diagonal": Attr("int", 0)}, traits=("copy",))
def triu(x, *, diagonal=0):
    """Zero the elements below diagonal ``diagonal`` of the last two axes."""
    return np.triu(x, k=diagonal)


@defvjp("tril", "triu")
@deflinear
def _triangle_transpose(b, g, x, y, attrs):
    """Keep the same triangle of the cotangent."""
    return b.op(y.producer.op_name, g, diagonal=attrs["diagonal"])


def _repeat_infer(types, *, repeats):
    t = types[0]
    if len(repeats) < t.rank:
        raise ValueError(f"repeats {list(repeats)} has fewer entries than the input's rank {t.rank}")
    if any(r < 0 for r in repeats):
        raise ValueError(f"repeats {list(repeats)} must be non-negative")
    src = (1,) * (len(repeats) - t.rank) + static_dims(t.shape, "repeat")
    return t.with_shape(tuple(s * r for s, r in zip(src, repeats)))


@defop("repeat", infer=_repeat_infer, attrs={"repeats": Attr("ints")}, traits=("copy",))
def repeat(x, *, repeats):
    """Tile ``x`` ``repeats[i]`` times along axis ``i`` (torch.Tensor.repeat)."""
    return np.tile(x, repeats)


@defvjp("repeat")
def _repeat_vjp(b, inputs, outputs, cotangents, attrs):
    """Sum the tiles: view the cotangent as ``[r0, s0, r1, s1, ...]`` and sum the ``r`` axes."""
    x = inputs[0]
    if not x.dtype.is_floating:
        return [None]
    repeats = attrs["repeats"]
    src = (1,) * (len(repeats) - x.type.rank) + tuple(x.shape)
    tiles = b.reshape(cotangents[0], tuple(d for pair in zip(repeats, src) for d in pair))
    total = b.sum(tiles, tuple(range(0, 2 * len(repeats), 2)))
    return [b.reshape(total, x.shape)]


# --------------------------------------------------------------- compute rules (lowering)
def _flip_source(i, x, ctx, *, dims):
    axes = unique_axes(dims, x.rank)
    return tuple(simplify_index(x.shape[d] - 1 - e) if d in axes else e for d, e in enumerate(i))


def _repeat_source(i, x, ctx, *, repeats):
    lead = len(repeats) - x.rank
    return tuple(e if r == 1 else floormod(e, n)
                 for e, n, r in zip(i[lead:], x.shape, repeats[lead:]))


defcompute("flip")(_view_rule(_flip_source))
defcompute("repeat")(_view_rule(_repeat_source))


@defcompute("cat")
def _cat_compute(ctx, *xs, dim):
    """``out[.., j, ..]`` reads the operand whose range along ``dim`` holds ``j``."""
    out = ctx.out.dtype
    parts = [xs[k] for k in _cat_parts([x.shape for x in xs])]
    axis = normalize_dim(dim, parts[0].rank)
    offsets = np.cumsum([0] + [p.shape[axis] for p in parts]).tolist()

    def element(i):
        def read(k):
            src = (*i[:axis], simplify_index(i[axis] - offsets[k]), *i[axis + 1:])
            return parts[k].at(src, out)

        value = read(len(parts) - 1)
        for k in range(len(parts) - 2, -1, -1):
            value = Select(cmp("<", i[axis], offsets[k + 1]), read(k), value)
        return value

    return ctx.tensor(ctx.out_shape, out, element)


@defcompute("pad")
def _pad_compute(ctx, x, *, pads, value=0.0):
    """``out[i] = x[i - before]`` where that is inside ``x``, else ``value``."""
    pairs = _pad_pairs(x.shape, pads)
    fill = const(np.trunc(value) if x.dtype.is_integer else value, x.dtype)

    def element(i):
        src, conds = [], []
        for e, n, (before, after) in zip(i, x.shape, pairs):
            s = simplify_index(e - before)
            src.append(s)
            conds += ([cmp(">=", s, 0)] if before > 0 else []) + ([cmp("<", s, n)] if after > 0 else [])
        guard = all_of(conds)
        return x[tuple(src)] if guard is None else Select(guard, x[tuple(src)], fill)

    return ctx.tensor(ctx.out_shape, x.dtype, element)


def _triangle_rule(keep_op: str):
    """tril keeps ``col - row <= diagonal``, triu keeps ``col - row >= diagonal``."""

    def rule(ctx, x, *, diagonal=0):
        zero = const(0, x.dtype)
        return ctx.tensor(x.shape, x.dtype, lambda i: Select(
            cmp(keep_op, simplify_index(i[-1] - i[-2]), diagonal), x[i], zero))

    return rule


defcompute("tril")(_triangle_rule("<="))
defcompute("triu")(_triangle_rule(">="))
