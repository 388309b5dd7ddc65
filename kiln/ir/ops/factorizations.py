"""Matrix factorizations with pivoting or reflectors: LU (with ``lu_permutation`` of its
pivots), QR and geqrf, and LDL^T (with ``ldl_solve``).  Cholesky, SVD and eigh are in
:mod:`.linalg`, whose conventions these ops share: matrices in the last two axes with any
batch axes before, float64 computation through LAPACK (scipy), torch's conventions (LAPACK's
signs for QR, LU pivots 1-based, int32), one op per factorization with a ``part``
attribute naming the result it returns, and no compute definitions (the cpu backend runs
the numpy references).
"""

from __future__ import annotations

import numpy as np

from ..graph import Value
from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import fmt_shape
from .linalg import _each, _eye, _f64, _matrices, _narrow, _part
from .vjp import GradBuilder, defvjp, nondifferentiable, set_vjp


_LU_PARTS = ("packed", "pivots", "p", "l", "u", "info")
_QR_PARTS = ("q", "r")
_QR_MODES = ("reduced", "complete", "r")


# ---- LU with partial pivoting
def _lu_infer(types, *, part) -> TensorType:
    a = _matrices(types, "lu")
    _part(part, _LU_PARTS, "lu")
    m, n = a.shape[-2:]
    k = min(m, n)
    batch = tuple(a.shape[:-2])
    shapes = {"packed": ((m, n), a.dtype), "pivots": ((k,), DType.int32), "p": ((m, m), a.dtype),
              "l": ((m, k), a.dtype), "u": ((k, n), a.dtype), "info": ((), DType.int32)}
    shape, dtype = shapes[part]
    return TensorType((*batch, *shape), dtype)


def _getrf(x: np.ndarray):
    from scipy.linalg import lapack

    m, n = x.shape
    if m == 0 or n == 0:
        return x, np.zeros(0, np.int32), 0
    lu, piv, info = lapack.dgetrf(x)
    return lu, piv.astype(np.int32) + 1, max(int(info), 0)


def permutation_of_pivots(piv: np.ndarray, m: int) -> np.ndarray:
    """``P`` (float64, ``A = P L U``) of 1-based LAPACK row interchanges, batched."""
    batch = piv.shape[:-1]
    p = _eye(m, batch)
    for idx in np.ndindex(*batch):
        perm = list(range(m))
        for i, j in enumerate(piv[idx]):
            j = int(j) - 1
            if 0 <= j < m:
                perm[i], perm[j] = perm[j], perm[i]
        p[idx] = np.eye(m)[:, perm] if m else p[idx]
    return p


@defop("lu", infer=_lu_infer, amp="float32", attrs={"part": Attr("str")})
def lu(a, *, part):
    """LU factorization with partial pivoting (LAPACK getrf), ``A = P L U``: ``packed`` (L
    below the diagonal, its unit diagonal implied, U on and above), ``pivots`` (1-based row
    interchanges, int32), ``p``, ``l`` (m x k, unit lower), ``u`` (k x n) or ``info`` (0, or
    the 1-based index of U's first zero pivot)."""
    x = _f64(a)
    m, n = x.shape[-2:]
    k = min(m, n)
    packed, piv, info = _each(x, _getrf, [(m, n), (k,), ()], [np.float64, np.int32, np.int32])
    if part == "pivots":
        return piv
    if part == "info":
        return info
    if part == "p":
        out = permutation_of_pivots(piv, m)
    elif part == "l":
        out = np.tril(packed[..., :, :k], -1) + np.eye(m, k)
    elif part == "u":
        out = np.triu(packed[..., :k, :])
    else:
        out = packed
    return out.astype(a.dtype)


def lu_backward(b: GradBuilder, a: Value, gl: Value | None, gu: Value | None) -> Value:
    """torch's ``linalg_lu_backward``: the cotangent of ``A = P L U`` from those of L
    (m x k) and U (k x n), either of which may be absent."""
    m, n = a.shape[-2:]
    k = min(m, n)
    p = b.op("lu", a, part="p")
    l = b.op("lu", a, part="l")
    u = b.op("lu", a, part="u")
    lt, ut = b.transpose(l), b.transpose(u)
    solve = lambda x, y, **kw: b.op("triangular_solve", x, y, **kw)
    if m == n:
        terms = []
        if gl is not None:
            terms.append(b.op("tril", b.op("matmul", lt, gl), diagonal=-1))
        if gu is not None:
            terms.append(b.op("triu", b.op("matmul", gu, ut), diagonal=0))
        ga = terms[0] if len(terms) == 1 else b.add(*terms)
        ga = solve(lt, ga, upper=True, left=True, unitriangular=True)
        ga = solve(ut, ga, upper=False, left=False, unitriangular=False)
    elif m < n:  # wide: U = [U1 | U2]
        u1t = b.transpose(_narrow(b, u, -1, k))
        ga = b.op("matmul", lt, gl) if gl is not None else None
        if gu is not None:
            t = b.op("matmul", b.op("triu", gu, diagonal=0), ut)
            ga = b.neg(t) if ga is None else b.sub(ga, t)
        ga = solve(u1t, b.op("tril", ga, diagonal=-1), upper=False, left=False, unitriangular=False)
        if gu is not None:
            gu1 = b.op("triu", _narrow(b, gu, -1, k), diagonal=0)
            gu2 = b.op("slice", gu, dim=gu.type.rank - 1, start=k, end=n, step=1)
            ga = b.op("cat", b.add(ga, gu1), gu2, dim=ga.type.rank - 1)
        ga = solve(lt, ga, upper=True, left=True, unitriangular=True)
        if gu is None:
            ga = b.op("cat", ga, b.full((*ga.shape[:-1], n - k), 0.0, a.dtype), dim=ga.type.rank - 1)
    else:  # tall: L = [L1; L2]
        l1t = b.transpose(_narrow(b, l, -2, k))
        ga = b.op("matmul", gu, ut) if gu is not None else None
        if gl is not None:
            t = b.op("matmul", lt, gl)
            ga = b.neg(t) if ga is None else b.sub(ga, t)
        ga = solve(l1t, b.op("triu", ga, diagonal=0), upper=True, left=True, unitriangular=True)
        if gl is not None:
            gl1 = b.op("tril", _narrow(b, gl, -2, k), diagonal=-1)
            gl2 = b.op("slice", gl, dim=gl.type.rank - 2, start=k, end=m, step=1)
            ga = b.op("cat", b.add(ga, gl1), gl2, dim=ga.type.rank - 2)
        ga = solve(ut, ga, upper=False, left=False, unitriangular=False)
        if gl is None:
            ga = b.op("cat", ga, b.full((*ga.shape[:-2], m - k, k), 0.0, a.dtype), dim=ga.type.rank - 2)
    return b.op("matmul", p, ga)


@defvjp("lu")
def _lu_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """L and U through :func:`lu_backward`; the packed factors split into ``tril(g, -1)``
    for L and ``triu(g)`` for U; P, the pivots and info are piecewise constant."""
    a, g = inputs[0], cotangents[0]
    part = attrs["part"]
    m, n = a.shape[-2:]
    k = min(m, n)
    if part not in ("packed", "l", "u"):
        return [None]
    if k == 0:
        return [b.zeros(a.type)]
    if part == "l":  # only L's strictly lower part varies (its diagonal is 1, above it 0)
        return [lu_backward(b, a, b.op("tril", g, diagonal=-1), None)]
    if part == "u":
        return [lu_backward(b, a, None, b.op("triu", g, diagonal=0))]
    gl = b.op("tril", _narrow(b, g, -1, k), diagonal=-1)
    gu = b.op("triu", _narrow(b, g, -2, k), diagonal=0)
    return [lu_backward(b, a, gl, gu)]


def _permutation_infer(types, *, m, dtype) -> TensorType:
    (piv,) = types
    if piv.dtype.is_floating or piv.dtype == DType.bool or piv.rank < 1:
        raise TypeError(f"lu_permutation needs integer pivots with at least one axis, got {piv}")
    if piv.shape[-1] > m:
        raise ValueError(f"lu_permutation: {piv.shape[-1]} pivots for {m} rows")
    return TensorType((*piv.shape[:-1], m, m), dtype)


@defop("lu_permutation", infer=_permutation_infer, attrs={"m": Attr("int"), "dtype": Attr("dtype")})
def lu_permutation(piv, *, m, dtype):
    """The permutation matrix ``P`` (``A = P L U``) of 1-based LAPACK pivots (``m`` rows)."""
    return permutation_of_pivots(np.asarray(piv), m).astype(dtype.numpy)


set_vjp("lu_permutation", nondifferentiable)


# ---- QR
def _qr_infer(types, *, part, mode) -> TensorType:
    a = _matrices(types, "qr")
    _part(part, _QR_PARTS, "qr")
    if mode not in _QR_MODES:
        raise ValueError(f"qr: mode must be one of {', '.join(_QR_MODES)}, got {mode!r}")
    if mode == "r" and part == "q":
        raise ValueError("qr: mode 'r' computes no Q")
    m, n = a.shape[-2:]
    k = min(m, n)
    rows = m if mode == "complete" else k
    batch = tuple(a.shape[:-2])
    return TensorType((*batch, m, rows) if part == "q" else (*batch, rows, n), a.dtype)


@defop("qr", infer=_qr_infer, amp="float32", attrs={"part": Attr("str"), "mode": Attr("str", "reduced")})
def qr(a, *, part, mode="reduced"):
    """Q or R of ``A = Q R`` (LAPACK geqrf/orgqr's signs: R's diagonal may be negative);
    ``mode`` is ``reduced`` (Q m x k, R k x n), ``complete`` (Q m x m, R m x n) or ``r``."""
    x = _f64(a)
    m, n = x.shape[-2:]
    k = min(m, n)
    batch = x.shape[:-2]
    rows = m if mode == "complete" else k
    if x.size == 0:
        q, r = _eye(m, batch)[..., :rows], np.zeros((*batch, rows, n))
    else:
        q, r = np.linalg.qr(x, mode="complete" if mode == "complete" else "reduced")
    return (q if part == "q" else r).astype(a.dtype)


def _square_qr_backward(b: GradBuilder, q: Value, r: Value, gq: Value | None, gr: Value | None) -> Value:
    """``gA = (gQ + Q copyutl(M)) R^-T`` with ``M = gR R^T - Q^T gQ`` for ``A = Q R``, A m x n
    with m >= n (``copyutl``: the symmetric matrix of M's upper triangle)."""
    terms = []
    if gr is not None:
        terms.append(b.op("matmul", gr, b.transpose(r)))
    if gq is not None:
        terms.append(b.neg(b.op("matmul", b.transpose(q), gq)))
    mm = terms[0] if len(terms) == 1 else b.add(*terms)
    sym = b.add(b.op("triu", mm, diagonal=0), b.transpose(b.op("triu", mm, diagonal=1)))
    ga = b.op("matmul", q, sym)
    if gq is not None:
        ga = b.add(ga, gq)
    return b.op("triangular_solve", b.transpose(r), ga, upper=False, left=False, unitriangular=False)


@defvjp("qr")
def _qr_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """Reduced QR (and complete QR of wide matrices, the same factors).  A wide matrix
    ``[X | Y] = Q [U | V]`` is the QR of X with ``V = Q^T Y``: ``gY = Q gV`` and X gets the
    square rule with ``gQ + Y gV^T``."""
    from ..errors import KilnError

    a, g = inputs[0], cotangents[0]
    part, mode = attrs["part"], attrs["mode"]
    m, n = a.shape[-2:]
    k = min(m, n)
    if mode == "r" or (mode == "complete" and m > n):
        raise KilnError(f"qr: no gradient for mode {mode!r} of a {m}x{n} matrix (Q is not "
                        "determined by A there); use mode='reduced' to differentiate")
    if k == 0:
        return [b.zeros(a.type)]
    q = b.op("qr", a, part="q", mode="reduced")
    r = b.op("qr", a, part="r", mode="reduced")
    gq, gr = (g, None) if part == "q" else (None, g)
    if m >= n:
        return [_square_qr_backward(b, q, r, gq, gr)]
    last = a.type.rank - 1
    y = b.op("slice", a, dim=last, start=m, end=n, step=1)
    u = _narrow(b, r, -1, m)
    if gr is None:
        gx = _square_qr_backward(b, q, u, gq, None)
        return [b.op("cat", gx, b.full((*a.shape[:-1], n - m), 0.0, a.dtype), dim=last)]
    gu = _narrow(b, gr, -1, m)
    gv = b.op("slice", gr, dim=last, start=m, end=n, step=1)
    gx = _square_qr_backward(b, q, u, b.op("matmul", y, b.transpose(gv)), gu)
    return [b.op("cat", gx, b.op("matmul", q, gv), dim=last)]


# ---- geqrf: QR as Householder reflectors
def _geqrf_infer(types, *, part) -> TensorType:
    a = _matrices(types, "geqrf")
    _part(part, ("packed", "tau"), "geqrf")
    m, n = a.shape[-2:]
    return a if part == "packed" else TensorType((*a.shape[:-2], min(m, n)), a.dtype)


def _dgeqrf(x: np.ndarray):
    from scipy.linalg import lapack

    if x.size == 0:
        return x, np.zeros(0)
    packed, tau, _, _ = lapack.dgeqrf(x)
    return packed, tau


@defop("geqrf", infer=_geqrf_infer, amp="float32", attrs={"part": Attr("str")})
def geqrf(a, *, part):
    """LAPACK geqrf: ``packed`` holds R on and above the diagonal and the Householder
    vectors below it, ``tau`` their scales (``Q = H_1 ... H_k``, ``H_i = I - tau_i v_i v_i^T``)."""
    x = _f64(a)
    m, n = x.shape[-2:]
    packed, tau = _each(x, _dgeqrf, [(m, n), (min(m, n),)], [np.float64, np.float64])
    return (packed if part == "packed" else tau).astype(a.dtype)


set_vjp("geqrf", nondifferentiable)  # as torch: differentiate through linalg.qr instead


# ---- LDL^T (Bunch-Kaufman) of symmetric matrices
def _ldl_infer(types, *, part) -> TensorType:
    a = _matrices(types, "ldl", square=True)
    _part(part, ("packed", "pivots", "info"), "ldl")
    if part == "packed":
        return a
    return TensorType(tuple(a.shape[:-1] if part == "pivots" else a.shape[:-2]), DType.int32)


def _sytrf(x: np.ndarray):
    from scipy.linalg import lapack

    if x.size == 0:
        return x, np.zeros(0, np.int32), 0
    ld, piv, info = lapack.dsytrf(x, lower=1)
    return np.tril(ld), piv, max(int(info), 0)


@defop("ldl", infer=_ldl_infer, amp="float32", attrs={"part": Attr("str")})
def ldl(a, *, part):
    """LAPACK sytrf of symmetric matrices read from the lower triangle, ``A = L D L^T``:
    ``packed`` (L's strictly lower part and the 1x1/2x2 blocks of D, zero above the
    diagonal), ``pivots`` (LAPACK's 1-based interchanges, negative for 2x2 blocks; int32) or
    ``info`` (0, or the 1-based index of a zero diagonal block of D)."""
    n = a.shape[-1]
    packed, piv, info = _each(_f64(a), _sytrf, [(n, n), (n,), ()], [np.float64, np.int32, np.int32])
    return {"packed": packed.astype(a.dtype), "pivots": piv, "info": info}[part]


def _ldl_solve_infer(types, **_) -> TensorType:
    ld, piv, b = types
    _matrices([ld], "ldl_solve", square=True)
    if piv.dtype.is_floating or tuple(piv.shape) != tuple(ld.shape[:-1]):
        raise TypeError(f"ldl_solve needs integer pivots of shape {fmt_shape(ld.shape[:-1])}, got {piv}")
    if b.rank < 2 or b.shape[-2] != ld.shape[-1] or tuple(b.shape[:-2]) != tuple(ld.shape[:-2]) \
            or b.dtype != ld.dtype:
        raise ValueError(f"ldl_solve: B {b} does not match the factors {ld}")
    return b


@defop("ldl_solve", infer=_ldl_solve_infer, num_inputs=3, amp="float32")
def ldl_solve(ld, piv, b):
    """``X`` with ``A X = B`` from ``ldl``'s packed factors and pivots (LAPACK sytrs)."""
    from scipy.linalg import lapack

    ld64, b64 = _f64(ld), _f64(b)
    out = np.zeros(b64.shape)
    if b64.size:
        for idx in np.ndindex(*b64.shape[:-2]):
            out[idx], _ = lapack.dsytrs(ld64[idx], np.asarray(piv[idx], np.int32), b64[idx], lower=1)
    return out.astype(b.dtype)


# as in torch, neither has a gradient
set_vjp("ldl", nondifferentiable)
set_vjp("ldl_solve", nondifferentiable)
