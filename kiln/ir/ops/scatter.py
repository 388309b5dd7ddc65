"""Scatters along one axis: ``scatter_add`` (accumulate), ``scatter`` (overwrite) and
``scatter_reduce`` (sum, prod, mean, amax, amin, with or without the input's own value).
``gather``, ``index_select``, ``index`` and ``index_put`` are in :mod:`.indexing`.

Shapes follow torch.scatter: ``x``, ``index`` and ``src`` have one rank, ``index`` is no
larger than ``src`` on any axis nor than ``x`` off axis ``dim``, and only the leading
``index.shape`` window of ``src`` is read.  Where several positions of ``index`` address one
element, ``scatter`` keeps the last of them in row-major order (torch leaves this
unspecified), and ``scatter_reduce`` combines them in that order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..registry import Attr, defop
from ..types import DType, normalize_dim
from ._infer import fmt_shape, require_int
from .compute import (
    LoweringError,
    Select,
    all_of,
    cmp,
    const,
    convert,
    defcompute,
    identity,
)
from .indexing import _check_bounds
from .vjp import defvjp

def scatter_infer(types, *, dim, **_):
    """Inference of the scatter family (``scatter_add``, ``scatter`` and
    ``scatter_reduce``): the input's type, after checking the operands."""
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


REDUCTIONS = ("sum", "prod", "mean", "amax", "amin")


def _scatter_reduce_infer(types, *, dim, reduce, include_self=True):
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
    return scatter_infer(types, dim=dim)


def _targets(x: np.ndarray, index: np.ndarray, src: np.ndarray, dim: int, what: str):
    """The fancy-index key of the addressed elements of ``x`` and the ``src`` values, both
    in row-major order of ``index``."""
    if x.ndim == 0:
        _check_bounds(index, 1, what)
        return (), src
    axis = normalize_dim(dim, x.ndim)
    _check_bounds(index, x.shape[axis], what)
    grid = list(np.indices(index.shape))
    grid[axis] = index.astype(np.int64)
    window = tuple(slice(0, n) for n in index.shape)
    return tuple(g.reshape(-1) for g in grid), src[window].reshape(-1)


@defop("scatter", infer=scatter_infer, num_inputs=3, attrs={"dim": Attr("int")})
def scatter(x, index, src, *, dim):
    """``out = x; out[index[i][j]][j] = src[i][j]`` for ``dim=0`` (torch.scatter); of repeated
    positions the last in row-major order of ``index`` wins."""
    out = np.array(x, copy=True)
    key, values = _targets(x, index, src, dim, "scatter")
    if x.ndim == 0:
        if index.size:
            out[()] = src.reshape(-1)[index.size - 1]
        return out
    out[key] = values  # numpy assigns repeated positions in order: the last one stays
    return out


_UFUNC = {"sum": np.add, "mean": np.add, "prod": np.multiply, "amax": np.maximum, "amin": np.minimum}


@defop("scatter_reduce", infer=_scatter_reduce_infer, num_inputs=3,
       attrs={"dim": Attr("int"), "reduce": Attr("str"), "include_self": Attr("bool", True)})
def scatter_reduce(x, index, src, *, dim, reduce, include_self=True):
    """torch.scatter_reduce: each addressed element of ``x`` combined with the ``src`` values
    sent to it (``sum``, ``prod``, ``mean``, ``amax``, ``amin``); without ``include_self``
    the addressed elements' own values are left out (elements nothing addresses keep
    theirs).  Integer ``mean`` rounds down, as torch does."""
    x = np.asarray(x)
    if x.ndim == 0:
        key, values = (), np.asarray(src).reshape(-1)[:index.size]
        _check_bounds(index, 1, "scatter_reduce")
        hit = index.size > 0
    else:
        key, values = _targets(x, index, src, dim, "scatter_reduce")
        hit = True
    out = np.array(x, copy=True)
    ufunc = _UFUNC[reduce]
    if x.ndim == 0:
        if not hit:
            return out
        start = [out[()]] if include_self else []
        acc = ufunc.reduce(np.concatenate([np.asarray(start, x.dtype), values.astype(x.dtype)]))
        if reduce == "mean":
            count = len(start) + values.size
            acc = acc // count if x.dtype.kind in "iu" else acc / count
        return np.asarray(acc, x.dtype)
    count = np.ones(x.shape, np.int64) if include_self else np.zeros(x.shape, np.int64)
    np.add.at(count, key, 1)
    if not include_self:
        out[key] = identity_value(reduce, x.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        ufunc.at(out, key, values)
        if reduce == "mean":
            touched = np.zeros(x.shape, bool)
            touched[key] = True
            div = np.maximum(count, 1).astype(out.dtype)
            mean = out // div if x.dtype.kind in "iu" else out / div
            out = np.where(touched, mean, out).astype(x.dtype)
    return out


def identity_value(reduce: str, dtype: np.dtype):
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if np.dtype(dtype).kind == "f":
        return -np.inf if reduce == "amax" else np.inf
    if np.dtype(dtype).kind == "b":
        return reduce == "amin"
    info = np.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


# ------------------------------------------------------------------------- gradients
def _src_grad(b, picked, index, src):
    """A cotangent gathered at ``index`` grown back to ``src``'s shape (zeros beyond)."""
    if tuple(index.shape) != tuple(src.shape):
        picked = b.op("pad", picked, pads=_tail_pads(index.shape, src.shape))
    return picked


@defvjp("scatter")
def _scatter_vjp(b, inputs, outputs, cotangents, attrs):
    """The overwritten elements of ``x`` get zero, ``src`` gets the cotangent gathered from
    where it was written (torch's rule, also for repeated positions)."""
    x, index, src = inputs
    if not x.dtype.is_floating:
        return [None, None, None]
    g, dim = cotangents[0], attrs["dim"]
    dx = b.op("scatter", g, index, b.zeros(index.type.with_dtype(x.dtype)), dim=dim) if b.wants(0) else None
    dsrc = _src_grad(b, b.op("gather", g, index, dim=dim), index, src) if b.wants(2) else None
    return [dx, None, dsrc]


@defvjp("scatter_reduce")
def _scatter_reduce_vjp(b, inputs, outputs, cotangents, attrs):
    """Per reduction, as torch: sum passes the cotangent through; mean divides it by the
    number of values combined; amax/amin share it evenly between the values equal to the
    result; prod multiplies it by the product of the other values (exact with zeros:
    counted zeros and the product of the nonzero values, no division by zero)."""
    x, index, src = inputs
    if not x.dtype.is_floating:
        return [None, None, None]
    y, g = outputs[0], cotangents[0]
    dim, reduce, keep = attrs["dim"], attrs["reduce"], attrs["include_self"]
    zsrc = b.zeros(index.type.with_dtype(x.dtype))

    def gather(v):
        return b.op("gather", v, index, dim=dim)

    def combine(self_part, src_part, how):
        return b.op("scatter_reduce", self_part, index, src_part, dim=dim, reduce=how, include_self=keep)

    def window(v):  # src restricted to index's window
        if tuple(index.shape) == tuple(src.shape):
            return v
        for a, n in enumerate(index.shape):
            v = b.op("slice", v, dim=a, start=0, end=n)
        return v

    def self_grad(per_element):
        """``x``'s cotangent: ``per_element`` where ``x`` takes part, else ``g`` untouched
        (without include_self, the addressed elements do not take part: zero)."""
        return per_element if keep else b.op("scatter", g, index, zsrc, dim=dim)

    s = window(src)
    one = b.const(1.0, x)
    if reduce == "sum":
        dx, ds = self_grad(g), gather(g)
    elif reduce == "mean":
        count = combine(b.full(x.shape, 1.0, x.dtype), b.full(index.shape, 1.0, x.dtype), "sum")
        share = b.div(g, count)
        dx = self_grad(share) if keep else b.op("scatter", g, index, zsrc, dim=dim)
        ds = gather(share)
    elif reduce in ("amax", "amin"):
        ys = gather(y)
        src_hit = b.cast(b.op("eq", s, ys), x.dtype)
        self_hit = b.cast(b.op("eq", x, y), x.dtype) if keep else b.full(x.shape, 1.0, x.dtype)
        ties = combine(self_hit, src_hit, "sum")
        share = b.div(g, ties)
        dx = b.mul(share, self_hit) if keep else b.op("scatter", g, index, zsrc, dim=dim)
        ds = b.mul(gather(share), src_hit)
    else:  # prod
        zero = b.const(0.0, x)

        def nonzero_parts(v):
            is_zero = b.op("eq", v, zero)
            return is_zero, b.where(is_zero, one, v)

        x_zero, x_safe = nonzero_parts(x)
        s_zero, s_safe = nonzero_parts(s)
        zeros = combine(b.cast(x_zero, x.dtype) if keep else b.zeros(x.type), b.cast(s_zero, x.dtype), "sum")
        nonzero_prod = combine(x_safe, s_safe, "prod")

        def others(v_zero, v_safe, z, p):
            """Product of the other values combined with ``v``."""
            when_nonzero = b.where(b.op("eq", z, zero), b.div(p, v_safe), zero)
            when_zero = b.where(b.op("eq", z, one), p, zero)
            return b.where(v_zero, when_zero, when_nonzero)

        dx = b.mul(g, others(x_zero, x_safe, zeros, nonzero_prod)) if keep else self_grad(None)
        ds = b.mul(gather(g), others(s_zero, s_safe, gather(zeros), gather(nonzero_prod)))
    return [dx if b.wants(0) else None, None, _src_grad(b, ds, index, src) if b.wants(2) else None]


# ----------------------------------------------------------------------------- compute
def _match(p, r, axis, index, x):
    """Index position ``p`` with ``p[axis] = r`` addresses output element ``p``."""
    at = (*p[:axis], r, *p[axis + 1:])
    conds = [cmp("<", p[a], n) for a, n in enumerate(index.shape) if a != axis and n < x.shape[a]]
    conds.append(cmp("==", index.at(at, DType.int64), p[axis]))
    return at, all_of(conds)


@defcompute("scatter")
def _scatter_compute(ctx, x, index, src, *, dim):
    """The last ``r`` along ``dim`` addressing each element (a ``max`` stage), then that
    ``src`` value or ``x``'s own."""
    t = x.dtype
    if x.rank == 0:
        return ctx.tensor((), t, lambda i: src[()] if index.shape == () else x[()])
    axis = normalize_dim(dim, x.rank)
    last = ctx.reduce(x.shape, DType.int64, "max", [index.shape[axis]],
                      lambda p, r: Select(_match(p, r[0], axis, index, x)[1], r[0], const(-1, DType.int64)),
                      "last", init=-1)

    def element(p):
        at = (*p[:axis], last[p], *p[axis + 1:])
        return Select(cmp(">=", last[p], 0), src.at(at, t), x[p])

    return ctx.tensor(x.shape, t, element)


_COMBINER = {"sum": "+", "mean": "+", "prod": "*", "amax": "max", "amin": "min"}


@defcompute("scatter_reduce")
def _scatter_reduce_compute(ctx, x, index, src, *, dim, reduce, include_self=True):
    """One reduction over ``r`` along ``dim`` per output element (contributions in order of
    ``r``), started from ``x`` (or the combiner's identity without include_self); a count
    stage supplies mean's divisor and tells addressed elements apart."""
    t = x.dtype
    if x.rank == 0 or (reduce == "mean" and not t.is_floating):
        raise LoweringError(f"scatter_reduce ({reduce}) of {x.dtype.short}{list(x.shape)} (0-d, or "
                            "an integer mean, which rounds down) is not lowered to loops; run it "
                            "with its reference")
    axis = normalize_dim(dim, x.rank)
    n = [index.shape[axis]]
    combiner = _COMBINER[reduce]

    def body(p, r):
        at, hit = _match(p, r[0], axis, index, x)
        return Select(hit, src.at(at, t), identity(combiner, t))

    init = (lambda p: x[p]) if include_self else None
    total = ctx.reduce(x.shape, t, combiner, n, body, "acc", init=init)
    if reduce != "mean" and include_self:
        return total
    count = ctx.reduce(x.shape, DType.int64, "+", n,
                       lambda p, r: convert(_match(p, r[0], axis, index, x)[1], DType.bool, DType.int64),
                       "count")

    def element(p):
        value = total[p]
        if reduce == "mean":
            divisor = count[p] + 1 if include_self else count[p]
            div = convert(Select(cmp(">", divisor, 0), divisor, const(1, DType.int64)), DType.int64, t)
            value = value / div
        return Select(cmp(">", count[p], 0), value, x[p]) if not include_self else value

    return ctx.tensor(x.shape, t, element)


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
