"""Sorting, scans with an order and search: argsort, argtopk (the first ``k`` of argsort),
cumprod, cumarg (the indices of cummax/cummin) and searchsorted.

kiln ops have one result, so torch's two-result ops are built from an index op and a
``gather``: ``sort``/``kthvalue``/``median`` are ``argsort`` (then a slice or select),
``topk`` is ``argtopk`` (``argsort`` when ``k`` is the whole axis), each followed by
``gather`` of the values; ``cummax``/``cummin`` are ``cumarg`` followed by ``gather``.  The
values' gradient is therefore ``gather``'s: the cotangent scattered back to the selected
positions.

Orders follow torch exactly: ``argsort`` is stable (ties keep their input order, in both
directions), NaN sorts above every number (last ascending, first descending), and
``cumarg`` picks the latest position among equal extremes, a NaN once seen winning (as
torch's ``cummax``/``cummin`` do).
"""

from __future__ import annotations

import numpy as np

from ..registry import Attr, defop
from ..types import DType, normalize_dim
from ._infer import fmt_shape, upcast_half
from .compute import Select, cmp, const, convert, defcompute, identity
from .reduction import scan_compute
from .vjp import defvjp, nondifferentiable


def _axis_infer(types, *, dim, **_):
    t = types[0]
    if t.rank:
        normalize_dim(dim, t.rank)
    elif dim not in (0, -1):
        raise ValueError(f"dim {dim} is out of range for a 0-d tensor (use 0 or -1)")
    return t


# ------------------------------------------------------------------------------ argsort
def _argsort_infer(types, *, dim=-1, descending=False):
    return _axis_infer(types, dim=dim).with_dtype(DType.int64)


def stable_argsort(x: np.ndarray, axis: int, descending: bool) -> np.ndarray:
    """Stable ascending or descending order along ``axis``, NaN above every number."""
    if not descending:
        return np.argsort(x, axis=axis, kind="stable")
    # A stable ascending sort of the reversed axis, read backwards, is a stable descending
    # sort (ties in input order, NaN first) without negating (which breaks bool/int64 min).
    n = x.shape[axis]
    order = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
    return (n - 1 - np.flip(order, axis)).astype(np.int64)


@defop("argsort", infer=_argsort_infer, attrs={"dim": Attr("int", -1), "descending": Attr("bool", False)})
def argsort(x, *, dim=-1, descending=False):
    """Positions along ``dim`` that sort ``x`` (stable; NaN counts as the largest value)."""
    if x.ndim == 0:
        return np.zeros((), np.int64)
    return stable_argsort(x, normalize_dim(dim, x.ndim), descending).astype(np.int64)


defvjp("argsort")(nondifferentiable)


def _is_nan(v):
    return cmp("!=", v, v)


def _ranks(ctx, x, axis: int, descending: bool):
    """``rank[i]``: the number of elements of ``x``'s row along ``axis`` ordered before
    ``x[i]`` in the stable order (ties: those at smaller positions), ``O(n^2)`` per row."""
    t = x.dtype if x.dtype.is_floating else DType.int64
    n = x.shape[axis]

    def at(p, k):
        return x.at((*p[:axis], k, *p[axis + 1:]), t)

    def less(u, v):  # u before v ascending; NaN is the largest
        return cmp("||", cmp("<", u, v), cmp("&&", _is_nan(v), cmp("==", u, u))) if t.is_floating \
            else cmp("<", u, v)

    def equal(u, v):
        return cmp("||", cmp("==", u, v), cmp("&&", _is_nan(u), _is_nan(v))) if t.is_floating \
            else cmp("==", u, v)

    def before(p, r):
        u, v = at(p, r[0]), x.at(p, t)
        first = less(v, u) if descending else less(u, v)
        tie = cmp("&&", equal(u, v), cmp("<", r[0], p[axis]))
        return convert(cmp("||", first, tie), DType.bool, DType.int64)

    return ctx.reduce(x.shape, DType.int64, "+", [n], before, "rank")


def _pick_ranks(ctx, rank, shape, axis: int, n):
    """``out[.., r, ..]``: the position along ``axis`` whose rank is ``r``, for the ranks
    ``0 .. shape[axis] - 1``."""
    def pick(p, r):
        src = (*p[:axis], r[0], *p[axis + 1:])
        return Select(cmp("==", rank[src], p[axis]), r[0], const(0, DType.int64))

    return ctx.reduce(shape, DType.int64, "+", [n], pick, "order")


@defcompute("argsort")
def _argsort_compute(ctx, x, *, dim=-1, descending=False):
    """By ranks, ``O(n^2)`` per row: ``rank[i]`` counts the elements ordered before ``x[i]``
    (ties: those at smaller positions), then ``out[r]`` is the ``i`` whose rank is ``r``."""
    if x.rank == 0:
        return ctx.tensor((), DType.int64, lambda i: const(0, DType.int64))
    axis = normalize_dim(dim, x.rank)
    rank = _ranks(ctx, x, axis, descending)
    return _pick_ranks(ctx, rank, x.shape, axis, x.shape[axis])


# ------------------------------------------------------------------------------ argtopk
def _argtopk_infer(types, *, k, dim=-1, largest=True):
    t = types[0]
    if t.rank == 0:
        raise ValueError("argtopk needs at least a 1-d tensor (a 0-d topk is argsort's)")
    axis = normalize_dim(dim, t.rank)
    n = t.shape[axis]
    if k < 0 or (isinstance(n, int) and k > n):
        raise ValueError(f"argtopk k={k} is out of range for an axis of {n} elements")
    return t.with_shape(t.shape[:axis] + (k,) + t.shape[axis + 1:]).with_dtype(DType.int64)


@defop("argtopk", infer=_argtopk_infer,
       attrs={"k": Attr("int"), "dim": Attr("int", -1), "largest": Attr("bool", True)})
def argtopk(x, *, k, dim=-1, largest=True):
    """Positions of the ``k`` largest (``largest``) or smallest elements along ``dim``, in
    order: exactly the first ``k`` of ``argsort(x, dim, descending=largest)`` (ties in
    input order, NaN the largest value)."""
    axis = normalize_dim(dim, x.ndim)
    order = stable_argsort(x, axis, largest)
    return np.take(order, np.arange(k), axis=axis).astype(np.int64)


defvjp("argtopk")(nondifferentiable)


@defcompute("argtopk")
def _argtopk_compute(ctx, x, *, k, dim=-1, largest=True):
    """``argsort``'s ranks, picked for the ranks below ``k`` only (``O(n^2)`` per row to
    rank, ``O(n k)`` to pick)."""
    axis = normalize_dim(dim, x.rank)
    rank = _ranks(ctx, x, axis, largest)
    shape = (*x.shape[:axis], k, *x.shape[axis + 1:])
    return _pick_ranks(ctx, rank, shape, axis, x.shape[axis])


# ------------------------------------------------------------------------------ cumprod
def _cumprod_infer(types, *, dim):
    t = _axis_infer(types, dim=dim)
    return t if t.dtype.is_floating else t.with_dtype(DType.int64)


@defop("cumprod", infer=_cumprod_infer, attrs={"dim": Attr("int")}, amp="float32")
def cumprod(x, *, dim):
    """Inclusive prefix product along ``dim`` (integer and bool input multiply in int64)."""
    out = x.dtype if x.dtype.kind == "f" else np.int64
    src = upcast_half(x.astype(out, copy=False))
    if x.ndim == 0:
        return np.asarray(src).astype(out)
    return np.cumprod(src, axis=normalize_dim(dim, x.ndim)).astype(out, copy=False)


@defvjp("cumprod")
def _cumprod_vjp(b, inputs, outputs, cotangents, attrs):
    """Exact also where ``x`` has zeros (no division): with ``n`` the axis length,

    ``dx[i] = prod(x[k] for k < i) * sum(g[j] * prod(x[k] for i < k <= j) for j >= i)``.

    The inner products come from one ``cumprod`` of an ``[.., n, n]`` tensor whose row ``i``
    holds ``x[k]`` for ``k > i`` and 1 elsewhere, so the rule costs ``O(n^2)`` per row."""
    x, g = inputs[0], cotangents[0]
    if not x.dtype.is_floating:
        return [None]
    if x.type.rank == 0:
        return [b.cast(g, x.dtype)]
    rank = x.type.rank
    axis = normalize_dim(attrs["dim"], rank)
    n = x.shape[axis]
    g = b.cast(g, x.dtype)
    # Move the scanned axis last: xs [.., n], viewed as rows i [.., n(i), n(k)].
    order = [a for a in range(rank) if a != axis] + [axis]
    back = sorted(range(rank), key=order.__getitem__)
    xs, gs = b.permute(x, order), b.permute(g, order)
    lead = tuple(xs.shape[:-1])
    i_idx = np.arange(n).reshape(n, 1)
    k_idx = np.arange(n).reshape(1, n)
    after = b.array(k_idx > i_idx, DType.bool)
    rows = b.where(after, b.reshape(xs, (*lead, 1, n)), b.const(1.0, x))
    inner = b.op("cumprod", rows, dim=-1)  # inner[.., i, j] = prod(x[k], i < k <= j)
    upper = b.array(k_idx >= i_idx, DType.bool)
    weighted = b.where(upper, b.mul(inner, b.reshape(gs, (*lead, 1, n))), b.const(0.0, x))
    tail = b.sum(weighted, (rank,))  # [.., n(i)]
    before = b.op("pad", b.op("slice", b.op("cumprod", xs, dim=-1), dim=-1, start=0, end=n - 1),
                  pads=(1, 0), value=1.0)  # prod(x[k], k < i)
    dx = b.mul(before, tail)
    return [b.permute(dx, back)]


defcompute("cumprod")(scan_compute("*", "cumprod"))  # multiplied in order


# ------------------------------------------------------------------------------- cumarg
@defop("cumarg", infer=lambda types, *, dim, mode: _axis_infer(types, dim=dim).with_dtype(DType.int64),
       attrs={"dim": Attr("int"), "mode": Attr("str")})
def cumarg(x, *, dim, mode):
    """Position of the running maximum (``mode="max"``) or minimum (``"min"``) along ``dim``:
    the latest among equal extremes; a NaN, once seen, is the extreme (its latest position
    when there are several).  ``gather`` of ``x`` at these positions is torch.cummax/cummin."""
    if mode not in ("max", "min"):
        raise ValueError(f"cumarg mode must be 'max' or 'min', got {mode!r}")
    if x.ndim == 0:
        return np.zeros((), np.int64)
    axis = normalize_dim(dim, x.ndim)
    xs = np.moveaxis(x, axis, -1)
    out = np.zeros(xs.shape, np.int64)
    n = xs.shape[-1]
    if n == 0:
        return np.moveaxis(out, -1, axis)
    best = xs[..., 0].copy()
    pos = np.zeros(xs.shape[:-1], np.int64)
    floating = xs.dtype.kind == "f"
    for j in range(1, n):
        v = xs[..., j]
        better = (v >= best) if mode == "max" else (v <= best)
        if floating:
            better = np.isnan(v) | (better & ~np.isnan(best))
        best = np.where(better, v, best)
        pos = np.where(better, j, pos)
        out[..., j] = pos
    return np.moveaxis(out, -1, axis)


defvjp("cumarg")(nondifferentiable)


@defcompute("cumarg")
def _cumarg_compute(ctx, x, *, dim, mode):
    """Three prefix reductions: the last NaN so far, the running extreme of the numbers, and
    the last position holding that extreme; a NaN seen wins."""
    if x.rank == 0:
        return ctx.tensor((), DType.int64, lambda i: const(0, DType.int64))
    t = x.dtype if x.dtype.is_floating else DType.int64
    axis = normalize_dim(dim, x.rank)
    combiner = "max" if mode == "max" else "min"
    prefix = lambda i: [(0, i[axis] + 1)]

    def at(p, k):
        return x.at((*p[:axis], k, *p[axis + 1:]), t)

    def number(p, r):
        v = at(p, r[0])
        return Select(_is_nan(v), identity(combiner, t), v) if t.is_floating else v

    best = ctx.reduce(x.shape, t, combiner, prefix, number, "best")

    def holder(p, r):
        return Select(cmp("==", at(p, r[0]), best[p]), r[0], const(-1, DType.int64))

    last = ctx.reduce(x.shape, DType.int64, "max", prefix, holder, "last", init=-1)
    if not t.is_floating:
        return last
    nan = ctx.reduce(x.shape, DType.int64, "max", prefix,
                     lambda p, r: Select(_is_nan(at(p, r[0])), r[0], const(-1, DType.int64)), "nan", init=-1)
    return ctx.tensor(x.shape, DType.int64, lambda p: Select(cmp(">=", nan[p], 0), nan[p], last[p]))


# ------------------------------------------------------------------------- searchsorted
def _searchsorted_infer(types, *, right=False, out_int32=False):
    seq, values = types
    if seq.dtype == DType.bool or values.dtype == DType.bool:
        raise TypeError("searchsorted does not take bool tensors; cast them to a number type first")
    if seq.rank == 0:
        raise ValueError("the sorted sequence must be at least 1-d")
    if seq.rank > 1 and (values.rank != seq.rank or tuple(values.shape[:-1]) != tuple(seq.shape[:-1])):
        raise ValueError(f"a {seq.rank}-d sorted sequence {fmt_shape(seq.shape)} needs values with "
                         f"the same leading axes, got {fmt_shape(values.shape)}")
    return values.with_dtype(DType.int32 if out_int32 else DType.int64)


@defop("searchsorted", infer=_searchsorted_infer, num_inputs=2,
       attrs={"right": Attr("bool", False), "out_int32": Attr("bool", False)})
def searchsorted(seq, values, *, right=False, out_int32=False):
    """For each value, the number of entries of the (ascending) last axis of ``seq`` below
    it (``right``: at or below it): the insertion point keeping ``seq`` sorted.  A 1-d
    ``seq`` serves every value; an N-d one has one row per leading index of ``values``."""
    dtype = np.int32 if out_int32 else np.int64
    side = "right" if right else "left"
    if seq.ndim == 1:
        return np.searchsorted(seq, values, side=side).astype(dtype)
    rows_s = seq.reshape(-1, seq.shape[-1])
    rows_v = values.reshape(-1, values.shape[-1])
    out = np.stack([np.searchsorted(s, v, side=side) for s, v in zip(rows_s, rows_v)])
    return out.reshape(values.shape).astype(dtype)


defvjp("searchsorted")(nondifferentiable)


@defcompute("searchsorted")
def _searchsorted_compute(ctx, seq, values, *, right=False, out_int32=False):
    """``out[i] = sum_r [seq[.., r] < values[i]]`` (``<=`` with ``right``): a count, equal to
    the binary search's answer on a sorted sequence."""
    out = ctx.out.dtype
    n = seq.shape[-1]
    common = DType.float64 if (seq.dtype.is_floating or values.dtype.is_floating) else DType.int64

    def body(i, r):
        row = (r[0],) if seq.rank == 1 else (*i[:-1], r[0])
        below = cmp("<=" if right else "<", seq.at(row, common), values.at(i, common))
        return convert(below, DType.bool, out)

    return ctx.reduce(values.shape, out, "+", [n], body, "count")

