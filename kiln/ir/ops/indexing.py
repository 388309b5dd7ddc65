"""Gathers and advanced indexing: gather, index_select, index (int or bool mask indices)
and index_put.

Every rule follows torch: indices are integer tensors (``index`` and ``index_put`` also
take bool masks), negative axes count from the end, and the references raise
``IndexError`` for the indices torch rejects.  Scatters are in :mod:`.scatter`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import DType, SymDim, broadcast_shapes, normalize_dim
from ._infer import broadcasts_to, fmt_shape, require_int
from .compute import (
    Const,
    LoweringError,
    Select,
    all_of,
    broadcast_index,
    cmp,
    const,
    defcompute,
    floordiv,
    floormod,
    linear_index,
)
from .vjp import defvjp, unbroadcast

NNZ = SymDim("nnz")
"""Size of the axis a bool mask index produces: its number of true elements, known at run time."""


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


@defop("gather", infer=_gather_infer, num_inputs=2, attrs={"dim": Attr("int", axes="axis")})
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
    """Scatter-add the cotangent into zeros at the gathered positions.  One position per row
    (an index of size 1 along ``dim``, full size elsewhere: a negative log-likelihood's pick
    of each target) cannot collide, so the gradient is the elementwise ``where(position ==
    index, cotangent, 0)``, which fuses into the kernel that reads it (no dense scatter)."""
    x, index = inputs
    if not x.dtype.is_floating:
        return [None, None]
    axis = normalize_dim(attrs["dim"], x.type.rank) if x.type.rank else 0
    shape = x.type.shape
    if (x.type.rank and x.type.is_static and index.type.is_static and index.type.shape[axis] == 1
            and all(index.type.shape[a] == n for a, n in enumerate(shape) if a != axis)):
        positions = b.reshape(b.op("arange", end=shape[axis], dtype=index.dtype),
                              [n if a == axis else 1 for a, n in enumerate(shape)])
        picked = b.op("eq", positions, index)
        return [b.where(picked, cotangents[0], b.const(0.0, x)), None]
    return [b.op("scatter_add", b.zeros(x.type), index, cotangents[0], dim=attrs["dim"]), None]


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


@defop("index_select", infer=_index_select_infer, num_inputs=2, attrs={"dim": Attr("int", axes="axis")})
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


@defop("index", infer=_index_infer, num_inputs=(2, None), attrs={"dims": Attr("ints", axes="seq")})
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
    if not broadcasts_to(values.shape, target):
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


# --------------------------------------------------------------- compute rules (lowering)
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
