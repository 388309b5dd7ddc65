"""View ops: reshape, permute, expand, slice and select.

Each has the ``view`` trait: its result is its operand's elements re-indexed, so references
return numpy views (treat results as read-only) and backends may alias the operand's
memory.  Shapes are static, except that permute, slice of a whole axis, select and expand
with ``-1`` carry symbolic sizes through.  Every rule follows torch: negative axes count
from the end, slice bounds clamp like Python's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import Dim, SymDim, UndecidedSizeError, normalize_dim
from ._infer import fmt_shape
from .compute import as_expr, broadcast_index, defcompute, reshape_index, simplify_index
from .vjp import GradBuilder, deflinear, defvjp, unbroadcast


# ---------------------------------------------------------------------------- reshape
def _reshaped(src: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with its ``-1`` resolved so it holds as many elements as ``src``."""
    if any(d < -1 for d in shape):
        raise ValueError(f"shape {list(shape)} has a negative size; only -1 (inferred) is allowed")
    if shape.count(-1) > 1:
        raise ValueError(f"shape {list(shape)} has more than one -1")
    numel = math.prod(src)
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape and known and numel % known == 0:
        return tuple(numel // known if d == -1 else d for d in shape)
    if -1 not in shape and known == numel:
        return tuple(shape)
    raise ValueError(f"cannot reshape {fmt_shape(src)} ({numel} elements) into {list(shape)}")


def _reshape_infer(types, *, shape):
    t = types[0]
    return t.with_shape(_reshaped(t.shape, shape))


@defop("reshape", infer=_reshape_infer, attrs={"shape": Attr("ints")}, traits=("view", "whole_view"))
def reshape(x, *, shape):
    """Same elements in row-major order, new shape (one ``-1`` is inferred)."""
    return x.reshape(_reshaped(x.shape, shape))


defvjp("reshape")(deflinear(lambda b, g, x, y, attrs: b.reshape(g, x.shape)))


# ---------------------------------------------------------------------------- permute
def _permutation(dims: Sequence[int], rank: int) -> tuple[int, ...]:
    axes = tuple(d + rank if -rank <= d < 0 else d for d in dims)
    if sorted(axes) != list(range(rank)):
        raise ValueError(f"dims {list(dims)} is not a permutation of rank {rank}")
    return axes


def _permute_infer(types, *, dims):
    t = types[0]
    return t.with_shape(tuple(t.shape[a] for a in _permutation(dims, t.rank)))


@defop("permute", infer=_permute_infer, attrs={"dims": Attr("ints", axes="seq")}, traits=("view", "whole_view"))
def permute(x, *, dims):
    """Axis ``i`` of the result is axis ``dims[i]`` of the input."""
    return np.transpose(x, _permutation(dims, x.ndim))


@defvjp("permute")
@deflinear
def _permute_transpose(b, g, x, y, attrs):
    """Permute back with the inverse permutation."""
    axes = _permutation(attrs["dims"], x.type.rank)
    return b.permute(g, tuple(sorted(range(len(axes)), key=axes.__getitem__)))


# ----------------------------------------------------------------------------- expand
def _expanded(src: Sequence[Dim], shape: Sequence[int]) -> tuple[Dim, ...]:
    """torch.expand: new leading axes, size-1 axes stretched, ``-1`` keeps the size."""
    lead = len(shape) - len(src)
    if lead < 0:
        raise ValueError(f"cannot expand {fmt_shape(src)} to fewer axes {list(shape)}")
    out: list[Dim] = []
    for i, size in enumerate(shape):
        if i < lead:
            if size < 0:
                raise ValueError(f"new leading axis {i} of {list(shape)} needs a size, got {size}")
            out.append(size)
            continue
        have = src[i - lead]
        if size == -1 or size == have:
            out.append(have)
        elif have == 1 and size >= 0:
            out.append(size)
        else:
            raise ValueError(f"cannot expand {fmt_shape(src)} to {list(shape)}: axis {i - lead} "
                             f"has size {have}, which is neither 1 nor {size}")
    return tuple(out)


def _expand_infer(types, *, shape):
    t = types[0]
    return t.with_shape(_expanded(t.shape, shape))


@defop("expand", infer=_expand_infer, attrs={"shape": Attr("ints")}, traits=("view", "whole_view"))
def expand(x, *, shape):
    """Broadcast to ``shape`` without copying (a read-only view)."""
    return np.broadcast_to(x, _expanded(x.shape, shape))


@defvjp("expand")
def _expand_vjp(b, inputs, outputs, cotangents, attrs):
    """Sum over the new leading axes and the stretched size-1 axes."""
    x = inputs[0]
    return [unbroadcast(b, cotangents[0], x) if x.dtype.is_floating else None]


# ------------------------------------------------------------------------------ slice
_WHOLE = 2**62


def _slice_range(size: Dim, start: Dim, end: Dim, step: int) -> tuple[Dim, Dim, Dim]:
    """Clamped ``(start, end, length)`` of ``start:end:step`` on an axis of ``size``.

    With symbolic sizes or bounds, each clamp is decided for every value of the sizes; a
    bound whose clamp depends on the sizes' values (``end=seq`` on an axis of 320) is taken
    as it is, in range: capture checks that against the length PyTorch computed under its
    size ranges, and the compiled graph's range guard keeps the sizes there."""
    if isinstance(step, SymDim):
        raise ValueError(f"slice step must be a static integer, got the symbolic size {step}")
    if step <= 0:
        raise ValueError(f"slice step must be positive, got {step}")
    if isinstance(size, int) and isinstance(start, int) and isinstance(end, int):
        start, end = (v + size if v < 0 else v for v in (start, end))
        start = min(max(start, 0), size)
        end = min(max(end, start), size)
        return start, end, -(-(end - start) // step)
    if isinstance(end, int) and end >= _WHOLE:
        end = size
    start, end = (_from_end(v, size) for v in (start, end))
    start = _clamped(start, 0, size)
    end = _clamped(end, start, size)
    return start, end, end - start if step == 1 else (end - start + step - 1) // step


def _from_end(v: Dim, size: Dim) -> Dim:
    """A negative bound counts from the end; a symbolic bound must have a decided sign."""
    try:
        return v + size if v < 0 else v
    except UndecidedSizeError:
        raise ValueError(f"slice bound {v} may be negative or not depending on the sizes' values; "
                         "kiln needs its sign decided") from None


def _clamped(v: Dim, lo: Dim, hi: Dim) -> Dim:
    """``min(max(v, lo), hi)`` where decided for all sizes; ``v`` where it depends on them."""
    try:
        if v < lo:
            return lo
    except UndecidedSizeError:
        pass
    try:
        if v > hi:
            return hi
    except UndecidedSizeError:
        pass
    return v


def _slice_infer(types, *, dim, start, end, step=1):
    t = types[0]
    if t.rank == 0:
        raise ValueError("cannot slice a 0-d tensor")
    axis = normalize_dim(dim, t.rank)
    length = _slice_range(t.shape[axis], start, end, step)[2]
    return t.with_shape(t.shape[:axis] + (length,) + t.shape[axis + 1:])


@defop("slice", infer=_slice_infer, traits=("view",), attrs={
    "dim": Attr("int", axes="axis"), "start": Attr("int"), "end": Attr("int"), "step": Attr("int", 1)})
def slice_(x, *, dim, start, end, step=1):
    """``x[..., start:end:step, ...]`` on axis ``dim``; out-of-range bounds clamp."""
    axis = normalize_dim(dim, x.ndim)
    lo, hi, _ = _slice_range(x.shape[axis], start, end, step)
    return x[(slice(None),) * axis + (slice(lo, hi, step),)]


def _pad_axis(b: GradBuilder, g, axis: int, before: int, after: int):
    """``g`` zero-padded (negative amounts crop) on one axis."""
    if before == 0 and after == 0:
        return g
    pads = (0, 0) * (g.type.rank - 1 - axis) + (before, after)
    return b.op("pad", g, pads=pads)


# ----------------------------------------------------------------------------- select
def _select_infer(types, *, dim, index):
    t = types[0]
    if t.rank == 0:
        raise ValueError("cannot select from a 0-d tensor")
    axis = normalize_dim(dim, t.rank)
    size = t.shape[axis]
    if isinstance(size, int) and not -size <= index < size:
        raise ValueError(f"index {index} is out of range for axis {axis} of size {size}")
    return t.with_shape(t.shape[:axis] + t.shape[axis + 1:])


@defop("select", infer=_select_infer, attrs={"dim": Attr("int", axes="axis"), "index": Attr("int")},
       traits=("view",))
def select(x, *, dim, index):
    """``x[..., index, ...]`` on axis ``dim``, which is removed (negative index allowed)."""
    return np.asarray(x[(slice(None),) * normalize_dim(dim, x.ndim) + (index,)])


@defvjp("slice", "select")
def _slice_vjp(b, inputs, outputs, cotangents, attrs):
    """Put the cotangent back where the elements came from: zeros between strided elements,
    zero padding around (a ``select`` is a slice of one element whose axis is dropped)."""
    x, g = inputs[0], cotangents[0]
    if not x.dtype.is_floating:
        return [None]
    axis = normalize_dim(attrs["dim"], x.type.rank)
    size = x.shape[axis]
    if "index" in attrs:  # select
        index = attrs["index"]
        lo, length, step = (index + size if index < 0 else index), 1, 1
        g = b.reshape(g, (*x.shape[:axis], 1, *x.shape[axis + 1:]))
    else:
        lo, _, length = _slice_range(size, attrs["start"], attrs["end"], attrs["step"])
        if not isinstance(size, int):
            return [g]  # a whole symbolic axis
        step = attrs["step"]
    if step > 1:
        shape = list(g.shape)
        spread = b.reshape(g, (*shape[:axis + 1], 1, *shape[axis + 1:]))
        spread = _pad_axis(b, spread, axis + 1, 0, step - 1)
        g = b.reshape(spread, (*shape[:axis], length * step, *shape[axis + 1:]))
    return [_pad_axis(b, g, axis, lo, size - lo - length * step)]


# --------------------------------------------------------------- compute rules (lowering)
# Layout ops are index arithmetic: out[i] = x[source(i)]; consumers inline them.
def _view_rule(source):
    """``out[i] = x[source(i, x, ctx, attrs)]``."""

    def rule(ctx, x, **attrs):
        return ctx.tensor(ctx.out_shape, x.dtype, lambda i: x[source(i, x, ctx, **attrs)])

    return rule


def _reshape_source(i, x, ctx, *, shape):
    return reshape_index(i, ctx.out_shape, x.shape)


def _permute_source(i, x, ctx, *, dims):
    src = [None] * x.rank
    for k, a in enumerate(_permutation(dims, x.rank)):
        src[a] = i[k]
    return tuple(src)


def _slice_source(i, x, ctx, *, dim, start, end, step=1):
    axis = normalize_dim(dim, x.rank)
    lo = _slice_range(x.shape[axis], start, end, step)[0]
    return (*i[:axis], simplify_index(i[axis] * step + lo), *i[axis + 1:])


def _select_source(i, x, ctx, *, dim, index):
    axis = normalize_dim(dim, x.rank)
    return (*i[:axis], as_expr(index % x.shape[axis]), *i[axis:])


defcompute("reshape")(_view_rule(_reshape_source))
defcompute("permute")(_view_rule(_permute_source))
defcompute("expand")(_view_rule(lambda i, x, ctx, shape: broadcast_index(i, x.shape)))
defcompute("slice")(_view_rule(_slice_source))
defcompute("select")(_view_rule(_select_source))
