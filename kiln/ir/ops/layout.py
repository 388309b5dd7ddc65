"""Layout ops: reshape, permute, expand, slice, select, cat, pad, flip, gather, index_select,
index, tril/triu and repeat.

Shapes are static, except that permute, slice of a whole axis, select, flip, tril/triu and
expand with ``-1`` carry symbolic sizes through.  Every rule follows torch: negative axes
count from the end, slice bounds clamp like Python's, ``pad`` lists (before, after) pairs
starting at the last axis.  References may return views of their operands (reshape,
permute, expand, slice, select, the ops with the ``view`` trait); treat results as read-only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce

import numpy as np

from ..registry import Attr, defop
from ..types import (
    Dim,
    DType,
    SymDim,
    TensorType,
    broadcast_shapes,
    normalize_dim,
    promote,
)
from ._infer import fmt_shape, require_int, static_dims, unique_axes
from .compute import (
    Const,
    LoweringError,
    Select,
    all_of,
    as_expr,
    broadcast_index,
    cmp,
    const,
    defcompute,
    floordiv,
    floormod,
    linear_index,
    reshape_index,
    simplify_index,
)
from .vjp import GradBuilder, deflinear, defvjp, unbroadcast

NNZ = SymDim("nnz")
"""Size of the axis a bool mask index produces: its number of true elements, known at run time."""


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
    return t.with_shape(_reshaped(static_dims(t.shape, "reshape"), shape))


@defop("reshape", infer=_reshape_infer, attrs={"shape": Attr("ints")}, traits=("view",))
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


@defop("permute", infer=_permute_infer, attrs={"dims": Attr("ints")}, traits=("view",))
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


@defop("expand", infer=_expand_infer, attrs={"shape": Attr("ints")}, traits=("view",))
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


def _slice_range(size: Dim, start: int, end: int, step: int) -> tuple[int, int, Dim]:
    """Clamped ``(start, end, length)`` of ``start:end:step`` on an axis of ``size``."""
    if step <= 0:
        raise ValueError(f"slice step must be positive, got {step}")
    if not isinstance(size, int):
        if start == 0 and end >= _WHOLE and step == 1:
            return 0, end, size
        raise ValueError(f"slice {start}:{end}:{step} of symbolic axis size {size} needs a static size")
    start, end = (v + size if v < 0 else v for v in (start, end))
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, -(-(end - start) // step)


def _slice_infer(types, *, dim, start, end, step=1):
    t = types[0]
    if t.rank == 0:
        raise ValueError("cannot slice a 0-d tensor")
    axis = normalize_dim(dim, t.rank)
    length = _slice_range(t.shape[axis], start, end, step)[2]
    return t.with_shape(t.shape[:axis] + (length,) + t.shape[axis + 1:])


@defop("slice", infer=_slice_infer, traits=("view",), attrs={
    "dim": Attr("int"), "start": Attr("int"), "end": Attr("int"), "step": Attr("int", 1)})
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


@defvjp("slice")
def _slice_vjp(b, inputs, outputs, cotangents, attrs):
    """Scatter the cotangent back: zeros between strided elements, zero padding around."""
    x, g = inputs[0], cotangents[0]
    if not x.dtype.is_floating:
        return [None]
    axis = normalize_dim(attrs["dim"], x.type.rank)
    size = x.shape[axis]
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


@defop("select", infer=_select_infer, attrs={"dim": Attr("int"), "index": Attr("int")},
       traits=("view",))
def select(x, *, dim, index):
    """``x[..., index, ...]`` on axis ``dim``, which is removed (negative index allowed)."""
    return np.asarray(x[(slice(None),) * normalize_dim(dim, x.ndim) + (index,)])


@defvjp("select")
def _select_vjp(b, inputs, outputs, cotangents, attrs):
    x, g = inputs[0], cotangents[0]
    if not x.dtype.is_floating:
        return [None]
    axis = normalize_dim(attrs["dim"], x.type.rank)
    size = x.shape[axis]
    index = attrs["index"] + size if attrs["index"] < 0 else attrs["index"]
    g = b.reshape(g, (*x.shape[:axis], 1, *x.shape[axis + 1:]))
    return [_pad_axis(b, g, axis, index, size - index - 1)]


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
        total += static_dims([t.shape[axis]], "cat along a symbolic axis")[0]
    dtype = reduce(promote, (t.dtype for t in types))
    return TensorType(first.shape[:axis] + (total,) + first.shape[axis + 1:], dtype)


@defop("cat", infer=_cat_infer, num_inputs=(1, None), attrs={"dim": Attr("int")})
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


@defop("pad", infer=_pad_infer, attrs={"pads": Attr("ints"), "value": Attr("float", 0.0)})
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


@defop("flip", infer=_flip_infer, attrs={"dims": Attr("ints")})
def flip(x, *, dims):
    """Reverse the order of elements along each of ``dims``."""
    return np.flip(x, axis=unique_axes(dims, x.ndim)) if dims else x


defvjp("flip")(deflinear(lambda b, g, x, y, attrs: b.op("flip", g, dims=attrs["dims"])))


# ------------------------------------------------------------------- gather / selects
def _check_bounds(index: np.ndarray, size: int, what: str, negative_ok: bool = False) -> None:
    """Raise IndexError for indices torch would reject (numpy would wrap or raise vaguely)."""
    if index.size == 0:
        return
    lo, hi = int(index.min()), int(index.max())
    if hi >= size or lo < (-size if negative_ok else 0):
        bad = hi if hi >= size else lo
        raise IndexError(f"{what}: index {bad} is out of range for an axis of size {size}")


def _gather_infer(types, *, dim):
    x, index = types
    require_int(index, "index")
    if index.rank != x.rank:
        raise ValueError(f"index has rank {index.rank} but input has rank {x.rank}; they must match")
    axis = normalize_dim(dim, x.rank)
    for a, (i, s) in enumerate(zip(index.shape, x.shape)):
        if a != axis and isinstance(i, int) and isinstance(s, int) and i > s:
            raise ValueError(f"index {fmt_shape(index.shape)} is larger than input "
                             f"{fmt_shape(x.shape)} on axis {a}")
    return index.with_dtype(x.dtype)


@defop("gather", infer=_gather_infer, num_inputs=2, attrs={"dim": Attr("int")})
def gather(x, index, *, dim):
    """``out[i][j] = x[index[i][j]][j]`` for ``dim=0`` (torch.gather)."""
    if x.ndim == 0:
        _check_bounds(index, 1, "gather")
        return x.copy()
    axis = normalize_dim(dim, x.ndim)
    _check_bounds(index, x.shape[axis], "gather")
    window = tuple(slice(None) if a == axis else slice(0, n) for a, n in enumerate(index.shape))
    return np.take_along_axis(x[window], index.astype(np.int64), axis=axis)


@defvjp("gather")
def _gather_vjp(b, inputs, outputs, cotangents, attrs):
    """Scatter-add the cotangent into zeros at the gathered positions."""
    x, index = inputs
    if not x.dtype.is_floating:
        return [None, None]
    return [b.op("scatter_add", b.zeros(x.type), index, cotangents[0], dim=attrs["dim"]), None]


def scatter_infer(types, *, dim, **_):
    """Inference of the scatter family (``scatter_add`` here, ``scatter`` and
    ``scatter_reduce`` in :mod:`.indexing`): the input's type, after checking the operands."""
    x, index, src = types
    require_int(index, "index")
    if src.dtype != x.dtype:
        raise TypeError(f"src is {src.dtype.short} but input is {x.dtype.short}; cast src first")
    if not index.rank == src.rank == x.rank:
        raise ValueError(f"input, index and src must have one rank, got {fmt_shape(x.shape)}, "
                         f"{fmt_shape(index.shape)} and {fmt_shape(src.shape)}")
    axis = normalize_dim(dim, x.rank) if x.rank else 0
    for a, (i, s, d) in enumerate(zip(index.shape, src.shape, x.shape)):
        if i > s or (a != axis and i > d):
            raise ValueError(f"index {fmt_shape(index.shape)} is larger than src "
                             f"{fmt_shape(src.shape)} or input {fmt_shape(x.shape)} on axis {a}")
    return x


@defop("scatter_add", infer=scatter_infer, num_inputs=3, attrs={"dim": Attr("int")})
def scatter_add(x, index, src, *, dim):
    """``out = x; out[index[i][j]][j] += src[i][j]`` for ``dim=0`` (torch.scatter_add);
    repeated indices accumulate."""
    out = np.array(x, copy=True)
    if x.ndim == 0:
        _check_bounds(index, 1, "scatter_add")
        return out + (src.sum() if index.size else 0)
    axis = normalize_dim(dim, x.ndim)
    _check_bounds(index, x.shape[axis], "scatter_add")
    grid = list(np.indices(index.shape, sparse=True))
    grid[axis] = index.astype(np.int64)
    window = tuple(slice(0, n) for n in index.shape)
    np.add.at(out, tuple(grid), src[window])
    return out


@defvjp("scatter_add")
def _scatter_add_vjp(b, inputs, outputs, cotangents, attrs):
    """The input gets the cotangent; src gets it gathered back from where it was added."""
    x, index, src = inputs
    if not x.dtype.is_floating:
        return [None, None, None]
    g = cotangents[0]
    dsrc = None
    if b.wants(2):
        dsrc = b.op("gather", g, index, dim=attrs["dim"])
        if tuple(index.shape) != tuple(src.shape):
            dsrc = b.op("pad", dsrc, pads=_tail_pads(index.shape, src.shape))
    return [g, None, dsrc]


def _tail_pads(shape: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """``pad`` amounts (last axis first) growing ``shape`` to ``target`` at the end of each axis."""
    pads: list[int] = []
    for have, want in zip(reversed(shape), reversed(target)):
        pads += [0, want - have]
    return tuple(pads)


def _index_select_infer(types, *, dim):
    x, index = types
    require_int(index, "index")
    if index.rank > 1:
        raise ValueError(f"index must be 0-d or 1-d, got {fmt_shape(index.shape)}")
    if x.rank == 0:
        raise ValueError("input must be at least 1-d")
    axis = normalize_dim(dim, x.rank)
    count = index.shape[0] if index.rank else 1
    return x.with_shape(x.shape[:axis] + (count,) + x.shape[axis + 1:])


@defop("index_select", infer=_index_select_infer, num_inputs=2, attrs={"dim": Attr("int")})
def index_select(x, index, *, dim):
    """The entries ``index`` (0-d or 1-d, non-negative) of axis ``dim``, in that order."""
    axis = normalize_dim(dim, x.ndim)
    _check_bounds(index, x.shape[axis], "index_select")
    return np.take(x, index.reshape(-1).astype(np.int64), axis=axis)


@defvjp("index_select")
def _index_select_vjp(b, inputs, outputs, cotangents, attrs):
    """Accumulate the cotangent into zeros at the selected entries (``index_put``)."""
    x, index = inputs
    if not x.dtype.is_floating:
        return [None, None]
    flat = b.reshape(index, (index.shape[0] if index.type.rank else 1,))
    axis = normalize_dim(attrs["dim"], x.type.rank)
    grad = b.op("index_put", b.zeros(x.type), cotangents[0], flat, dims=(axis,), accumulate=True)
    return [grad, None]


# ------------------------------------------------------------------- advanced indexing
def _index_plan(rank: int, dims: Sequence[int], ranks: Sequence[int], masks: Sequence[bool]) -> list:
    """For each input axis, the position of the index tensor starting there, ``None`` for a
    full slice, or ``-1`` for an axis a bool mask starting earlier already covers."""
    if len(dims) != len(ranks):
        raise ValueError(f"dims {list(dims)} names {len(dims)} axes but {len(ranks)} index "
                         "tensors are given")
    plan: list = [None] * rank
    for i, d in enumerate(dims):
        start = normalize_dim(d, rank)
        width = ranks[i] if masks[i] else 1
        if masks[i] and width == 0:
            raise ValueError(f"index {i} is a 0-d bool mask; use where() instead")
        for a in range(start, start + width):
            if a >= rank or plan[a] is not None:
                raise ValueError(f"dims {list(dims)} with index ranks {list(ranks)} overlap or "
                                 f"run past rank {rank}")
            plan[a] = i if a == start else -1
    return plan


def _index_infer(types, *, dims):
    x, indices = types[0], types[1:]
    for i, t in enumerate(indices):
        if t.dtype != DType.bool:
            require_int(t, f"index {i}")
    masks = [t.dtype == DType.bool for t in indices]
    plan = _index_plan(x.rank, dims, [t.rank for t in indices], masks)
    for i, t in enumerate(indices):
        if masks[i]:
            start = plan.index(i)
            covered = x.shape[start:start + t.rank]
            if any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(t.shape, covered)):
                raise ValueError(f"bool mask {i} of shape {fmt_shape(t.shape)} does not match the "
                                 f"indexed axes {fmt_shape(covered)}")
    index_shape = broadcast_shapes(*((NNZ,) if m else t.shape for m, t in zip(masks, indices)))
    sliced = [a for a, p in enumerate(plan) if p is None]
    indexed = [a for a, p in enumerate(plan) if p is not None]
    # Numpy's rule: adjacent indexed axes are replaced in place, otherwise moved first.
    in_place = indexed == list(range(indexed[0], indexed[-1] + 1))
    split = indexed[0] if in_place else 0
    before = [x.shape[a] for a in sliced if a < split]
    after = [x.shape[a] for a in sliced if a >= split]
    return x.with_shape((*before, *index_shape, *after))


@defop("index", infer=_index_infer, num_inputs=(2, None), attrs={"dims": Attr("ints")})
def index(x, *indices, dims):
    """Advanced indexing: ``indices[i]`` (int, or bool mask) indexes axis ``dims[i]``.

    Numpy/torch placement: when the indexed axes are adjacent the broadcast index shape
    replaces them in place, otherwise it comes first.  A bool mask covering ``k`` axes
    selects its true positions, giving one axis of data-dependent size (``nnz``).
    """
    masks = [i.dtype == np.bool_ for i in indices]
    plan = _index_plan(x.ndim, dims, [i.ndim for i in indices], masks)
    key = tuple(slice(None) if p is None else indices[p] for p in plan if p != -1)
    return np.asarray(x[key])


@defvjp("index")
def _index_vjp(b, inputs, outputs, cotangents, attrs):
    """Accumulate the cotangent into zeros at the indexed positions (``index_put``)."""
    x, indices = inputs[0], inputs[1:]
    if not x.dtype.is_floating:
        return [None] * len(inputs)
    grad = b.op("index_put", b.zeros(x.type), cotangents[0], *indices, dims=attrs["dims"],
                accumulate=True)
    return [grad] + [None] * len(indices)


def _index_put_infer(types, *, dims, accumulate=False):
    x, values, indices = types[0], types[1], types[2:]
    if values.dtype != x.dtype:
        raise TypeError(f"values are {values.dtype.short} but input is {x.dtype.short}; "
                        "cast the values first")
    target = _index_infer([x, *indices], dims=dims).shape
    try:
        fits = broadcast_shapes(values.shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"values {fmt_shape(values.shape)} do not broadcast to the indexed "
                         f"positions {fmt_shape(target)}")
    return x


@defop("index_put", infer=_index_put_infer, num_inputs=(3, None),
       attrs={"dims": Attr("ints"), "accumulate": Attr("bool", False)})
def index_put(x, values, *indices, dims, accumulate=False):
    """``x`` with the positions ``index(x, *indices, dims)`` selects set to ``values``
    (broadcast), or incremented by them with ``accumulate`` (repeated positions add up)."""
    masks = [i.dtype == np.bool_ for i in indices]
    plan = _index_plan(x.ndim, dims, [i.ndim for i in indices], masks)
    key = tuple(slice(None) if p is None else indices[p] for p in plan if p != -1)
    out = np.array(x, copy=True)
    if accumulate:
        np.add.at(out, key, np.broadcast_to(values, out[key].shape))
    else:
        out[key] = values
    return out


@defvjp("index_put")
def _index_put_vjp(b, inputs, outputs, cotangents, attrs):
    """Accumulating: the input gets the cotangent, values get it gathered at their positions.
    Overwriting: the overwritten positions of the input get zero."""
    x, values, indices = inputs[0], inputs[1], inputs[2:]
    if not x.dtype.is_floating:
        return [None] * len(inputs)
    g, dims = cotangents[0], attrs["dims"]
    picked = b.op("index", g, *indices, dims=dims)
    dvalues = unbroadcast(b, picked, values) if b.wants(1) else None
    dx = g
    if not attrs["accumulate"]:
        dx = b.op("index_put", g, b.const(0.0, g), *indices, dims=dims)
    return [dx, dvalues] + [None] * len(indices)


# --------------------------------------------------------------------- triangles, tiles
def _triangle_infer(types, *, diagonal=0):
    t = types[0]
    if t.rank < 2:
        raise ValueError(f"input must be at least 2-d, got {fmt_shape(t.shape)}")
    return t


@defop("tril", infer=_triangle_infer, attrs={"diagonal": Attr("int", 0)})
def tril(x, *, diagonal=0):
    """Zero the elements above diagonal ``diagonal`` of the last two axes."""
    return np.tril(x, k=diagonal)


@defop("triu", infer=_triangle_infer, attrs={"diagonal": Attr("int", 0)})
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


@defop("repeat", infer=_repeat_infer, attrs={"repeats": Attr("ints")})
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


def _flip_source(i, x, ctx, *, dims):
    axes = unique_axes(dims, x.rank)
    return tuple(simplify_index(x.shape[d] - 1 - e) if d in axes else e for d, e in enumerate(i))


def _repeat_source(i, x, ctx, *, repeats):
    lead = len(repeats) - x.rank
    return tuple(e if r == 1 else floormod(e, n)
                 for e, n, r in zip(i[lead:], x.shape, repeats[lead:]))


defcompute("reshape")(_view_rule(_reshape_source))
defcompute("permute")(_view_rule(_permute_source))
defcompute("expand")(_view_rule(lambda i, x, ctx, shape: broadcast_index(i, x.shape)))
defcompute("slice")(_view_rule(_slice_source))
defcompute("select")(_view_rule(_select_source))
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


@defcompute("gather")
def _gather_compute(ctx, x, index, *, dim):
    """``out[i] = x[i with axis dim replaced by index[i]]``."""
    if x.rank == 0:
        return ctx.tensor(ctx.out_shape, x.dtype, lambda i: x[()])
    axis = normalize_dim(dim, x.rank)
    return ctx.tensor(ctx.out_shape, x.dtype,
                      lambda i: x[(*i[:axis], index.at(i, DType.int64), *i[axis + 1:])])


@defcompute("index_select")
def _index_select_compute(ctx, x, index, *, dim):
    axis = normalize_dim(dim, x.rank)

    def element(i):
        pick = index.at((i[axis],) if index.rank else (), DType.int64)
        return x[(*i[:axis], pick, *i[axis + 1:])]

    return ctx.tensor(ctx.out_shape, x.dtype, element)


@defcompute("index")
def _index_compute(ctx, x, *indices, dims):
    """Integer advanced indexing (negative indices wrap).  A bool mask selects a number of
    elements known only at run time, which a loop program over static shapes cannot hold."""
    if any(t.dtype == DType.bool for t in indices):
        raise LoweringError("index with a bool mask has a data-dependent result shape "
                            f"({ctx.out}); it cannot be lowered to loops: run it with its reference")
    plan = _index_plan(x.rank, dims, [t.rank for t in indices], [False] * len(indices))
    index_rank = len(broadcast_shapes(*(t.shape for t in indices)))
    indexed = [a for a, p in enumerate(plan) if p is not None]
    in_place = indexed == list(range(indexed[0], indexed[-1] + 1))
    split = indexed[0] if in_place else 0
    before = [a for a, p in enumerate(plan) if p is None and a < split]
    after = [a for a, p in enumerate(plan) if p is None and a >= split]

    def element(i):
        src: list = [None] * x.rank
        picked = i[len(before):len(before) + index_rank]
        for k, a in enumerate(before):
            src[a] = i[k]
        for k, a in enumerate(after):
            src[a] = i[len(before) + index_rank + k]
        for a in indexed:
            t = indices[plan[a]]
            src[a] = floormod(t.at(broadcast_index(picked, t.shape), DType.int64), x.shape[a])
        return x[tuple(src)]

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


@defcompute("scatter_add")
def _scatter_add_compute(ctx, x, index, src, *, dim):
    """``out[p] = x[p] + sum_r src[p'] [index[p'] == p[dim]]`` with ``p' = p`` except
    ``p'[dim] = r``: contributions in increasing ``r``, added in ``x``'s dtype as the
    reference adds them."""
    t = x.dtype
    if x.rank == 0:
        return ctx.tensor((), t, lambda i: x[()] + src[()])
    axis = normalize_dim(dim, x.rank)

    def body(p, r):
        at = (*p[:axis], r[0], *p[axis + 1:])
        conds = [cmp("<", p[a], n) for a, n in enumerate(index.shape) if a != axis and n < x.shape[a]]
        conds.append(cmp("==", index.at(at, DType.int64), p[axis]))
        return Select(all_of(conds), src.at(at, t), const(0, t))

    return ctx.reduce(x.shape, t, "+", [index.shape[axis]], body, "sum", init=lambda p: x[p])


@defcompute("index_put")
def _index_put_compute(ctx, x, values, *indices, dims, accumulate=False):
    """For each output position, the index positions ``b`` that address it: accumulated
    (``x + sum``, in order of ``b``), or the last of them wins (a ``max`` stage finds it)."""
    if any(t.dtype == DType.bool for t in indices):
        raise LoweringError("index_put with a bool mask writes a data-dependent set of positions; "
                            "it is not lowered to loops: run it with its reference")
    plan = _index_plan(x.rank, dims, [t.rank for t in indices], [False] * len(indices))
    positions = broadcast_shapes(*(t.shape for t in indices))
    indexed = [a for a, p in enumerate(plan) if p is not None]
    in_place = indexed == list(range(indexed[0], indexed[-1] + 1))
    split = indexed[0] if in_place else 0
    before = [a for a, p in enumerate(plan) if p is None and a < split]
    after = [a for a, p in enumerate(plan) if p is None and a >= split]

    def addressed(p, b):
        conds = [cmp("==", floormod(indices[plan[a]].at(broadcast_index(b, indices[plan[a]].shape), DType.int64),
                                    x.shape[a]), p[a]) for a in indexed]
        return all_of(conds)

    def value(p, b):
        target = (*(p[a] for a in before), *b, *(p[a] for a in after))
        return values.at(broadcast_index(target, values.shape), x.dtype)

    if accumulate:
        return ctx.reduce(x.shape, x.dtype, "+", list(positions),
                          lambda p, b: Select(addressed(p, b), value(p, b), const(0, x.dtype)), "sum",
                          init=lambda p: x[p])
    last = ctx.reduce(x.shape, DType.int64, "max", list(positions),
                      lambda p, b: Select(addressed(p, b), linear_index(b, positions), const(-1, DType.int64)),
                      "last", init=-1)

    def element(p):
        flat, b = last[p], []
        for d, n in enumerate(positions):
            stride = math.prod(positions[d + 1:])
            b.append(floormod(floordiv(flat, stride), n) if n != 1 else Const(0))
        return Select(cmp(">=", flat, 0), value(p, tuple(b)), x[p])

    return ctx.tensor(x.shape, x.dtype, element)
