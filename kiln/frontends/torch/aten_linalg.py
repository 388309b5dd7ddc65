"""ATen -> kiln rules for matrix factorizations and solvers.

Cholesky, LU, QR, SVD, the symmetric eigendecomposition, triangular solves and the matrix
exponential map onto the kiln ops of :mod:`kiln.ir.ops.linalg` (one op per factorization,
its ``part`` attribute naming the result; :mod:`kiln.ir.ops.factorizations` holds the
factorizations); the solvers and inverses built from them
(``cholesky_solve``, ``cholesky_inverse``, ``lu_solve``, ``lu_unpack``, ``pinv``,
``householder_product``, ``ormqr``, ``tensorinv``, ``tensorsolve``) are compositions of
those ops with matmuls, so their gradients follow from the factorizations' rules.  Results
of a multi-result ATen op are built only when a ``getitem`` reads them.  General (non
symmetric) eigendecompositions have complex results and are refused.  See
:mod:`kiln.frontends.torch.aten` for how rules are declared.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, Value

from .aten import IGNORED_OPS, LoweringContext, aten, lowers, meta, optional_ops

# torch's check of a factorization's info (raises for a singular or indefinite matrix in
# eager); kiln gives NaN factors there instead, and the info results say which matrices failed.
IGNORED_OPS.update(optional_ops("_linalg_check_errors"))


# ---------------------------------------------------------------- checks
def _float_matrix(x: Any, what: str = "A", square: bool = False) -> str | None:
    m = meta(x)
    if not isinstance(m, torch.Tensor) or m.dim() < 2:
        shape = list(m.shape) if isinstance(m, torch.Tensor) else m
        return f"{what} must be a (batch of) matrices, got shape {shape}"
    if square and m.shape[-1] != m.shape[-2]:
        return f"{what} must be a (batch of) square matrices, got shape {list(m.shape)}"
    if m.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return f"{what} must be a real floating-point matrix, got {m.dtype}"
    return None


def _square(node: torch.fx.Node, a: Any, *_: Any) -> str | None:
    return _float_matrix(a, square=True)


def _matrix(node: torch.fx.Node, a: Any, *_: Any) -> str | None:
    return _float_matrix(a)


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


# ---------------------------------------------------------------- helpers
def _t(ctx: LoweringContext, x: Value) -> Value:
    r = x.type.rank
    return ctx.op("permute", x, dims=(*range(r - 2), r - 1, r - 2))


def _zeros(ctx: LoweringContext, index: int) -> Any:
    """A zero tensor shaped as the node's result ``index`` (the empty results torch returns
    for factors it was told not to compute)."""
    out = ctx.outs[index]
    return lambda: ctx.op("full", shape=tuple(int(d) for d in out.shape), value=0,
                          dtype=ctx.out.dtype if out.is_floating_point() else DType.int32)


def _eye(ctx: LoweringContext, m: int, n: int, dtype: DType) -> Value:
    return ctx.const(np.eye(m, n), dtype)


def _int_result(ctx: LoweringContext, x: Value, index: int) -> Value:
    """``x`` cast to the dtype torch gives result ``index`` (int32 pivots and infos)."""
    from .aten import kiln_dtype

    return ctx.cast(x, kiln_dtype(ctx.outs[index].dtype))


def _upper_factor(ctx: LoweringContext, a: Value, upper: bool, triangle: str = "lower") -> Value:
    l = ctx.op("cholesky", a, part="l", triangle=triangle)
    return _t(ctx, l) if upper else l


# ---------------------------------------------------------------- Cholesky
def _cholesky_triangle(upper: bool) -> str:
    return "upper" if upper else "lower"


@lowers(aten.linalg_cholesky.default, aten.cholesky.default, check=_square)
def _cholesky(ctx: LoweringContext, a: Value, upper: bool = False) -> Value:
    """``L`` (``U = L^T`` when ``upper``).  torch's ``cholesky(A, upper)`` reads the upper
    triangle when ``upper``, as ``linalg_cholesky`` does."""
    return _upper_factor(ctx, a, upper, _cholesky_triangle(upper))


@lowers(aten.linalg_cholesky_ex.default, check=_square)
def _cholesky_ex(ctx: LoweringContext, a: Value, upper: bool = False, check_errors: bool = False) -> tuple:
    info = lambda: _int_result(ctx, ctx.op("cholesky", a, part="info", triangle=_cholesky_triangle(upper)), 1)
    return (lambda: _upper_factor(ctx, a, upper, _cholesky_triangle(upper)), info)


def _cholesky_solve_values(ctx: LoweringContext, b: Value | None, f: Value, upper: bool) -> Value:
    """``X = A^-1 B`` (``A^-1`` when ``b`` is None) for ``A = L L^T`` (``U^T U`` when
    ``upper``): two triangular solves.

    torch differentiates ``A = L L^T`` with the whole of ``L`` (its gradient is not confined
    to the triangle the solves read): ``X`` carries the solves' value and the gradient of
    ``inv(L L^T) B`` formed from the full factor (``Y - stop_gradient(Y)`` adds 0)."""
    n = f.shape[-1]
    rhs = _eye(ctx, n, n, f.dtype) if b is None else b
    ft = _t(ctx, f)
    if upper:
        y = ctx.op("triangular_solve", ft, rhs, upper=False, left=True, unitriangular=False)
        x = ctx.op("triangular_solve", f, y, upper=True, left=True, unitriangular=False)
    else:
        y = ctx.op("triangular_solve", f, rhs, upper=False, left=True, unitriangular=False)
        x = ctx.op("triangular_solve", ft, y, upper=True, left=True, unitriangular=False)
    a_inv = ctx.op("inv", ctx.op("matmul", ft, f) if upper else ctx.op("matmul", f, ft))
    full = a_inv if b is None else ctx.op("matmul", a_inv, b)
    return ctx.op("add", ctx.op("stop_gradient", x), ctx.op("sub", full, ctx.op("stop_gradient", full)))


def _cholesky_solve_check(node: torch.fx.Node, b: Any, f: Any, *_: Any) -> str | None:
    return _first(_float_matrix(b, "B"), _float_matrix(f, "the Cholesky factor", square=True))


@lowers(aten.cholesky_solve.default, check=_cholesky_solve_check)
def _cholesky_solve(ctx: LoweringContext, b: Value, f: Value, upper: bool = False) -> Value:
    return _cholesky_solve_values(ctx, b, f, upper)


@lowers(aten.cholesky_inverse.default, check=_square)
def _cholesky_inverse(ctx: LoweringContext, f: Value, upper: bool = False) -> Value:
    return _cholesky_solve_values(ctx, None, f, upper)


# ---------------------------------------------------------------- triangular solves
def _solve_triangular_check(node: torch.fx.Node, a: Any, b: Any, *_: Any) -> str | None:
    return _first(_float_matrix(a, "A", square=True), _float_matrix(b, "B"))


@lowers(aten.linalg_solve_triangular.default, check=_solve_triangular_check)
def _solve_triangular(ctx: LoweringContext, a: Value, b: Value, upper: bool, left: bool = True,
                      unitriangular: bool = False) -> Value:
    return ctx.op("triangular_solve", a, b, upper=upper, left=left, unitriangular=unitriangular)


def _triangular_solve_check(node: torch.fx.Node, b: Any, a: Any, *_: Any) -> str | None:
    return _solve_triangular_check(node, a, b)


@lowers(aten.triangular_solve.default, check=_triangular_solve_check)
def _triangular_solve(ctx: LoweringContext, b: Value, a: Value, upper: bool = True,
                      transpose: bool = False, unitriangular: bool = False) -> tuple:
    """``(X, A)`` with ``op(A) X = B`` (``op(A) = A^T`` when ``transpose``); torch returns
    a copy of ``A`` as the second result."""
    if transpose:
        x = lambda: ctx.op("triangular_solve", _t(ctx, a), b, upper=not upper, left=True,
                           unitriangular=unitriangular)
    else:
        x = lambda: ctx.op("triangular_solve", a, b, upper=upper, left=True, unitriangular=unitriangular)
    return (x, lambda: a)


# ---------------------------------------------------------------- SVD
def _svd_parts(ctx: LoweringContext, a: Value, full: bool) -> tuple:
    return (lambda: ctx.op("svd", a, part="u", full_matrices=full),
            lambda: ctx.op("svd", a, part="s", full_matrices=full),
            lambda: ctx.op("svd", a, part="vh", full_matrices=full))


@lowers(aten._linalg_svd.default, check=_matrix)
def _linalg_svd_internal(ctx: LoweringContext, a: Value, full_matrices: bool = False,
                         compute_uv: bool = True, driver: str | None = None) -> tuple:
    u, s, vh = _svd_parts(ctx, a, full_matrices)
    if not compute_uv:
        return (_zeros(ctx, 0), s, _zeros(ctx, 2))
    return (u, s, vh)


@lowers(aten.linalg_svd.default, check=_matrix)
def _linalg_svd(ctx: LoweringContext, a: Value, full_matrices: bool = True, driver: str | None = None) -> tuple:
    return _svd_parts(ctx, a, full_matrices)


@lowers(aten.linalg_svdvals.default, check=_matrix)
def _linalg_svdvals(ctx: LoweringContext, a: Value, driver: str | None = None) -> Value:
    return ctx.op("svd", a, part="s", full_matrices=False)


@lowers(aten.svd.default, check=_matrix)
def _svd(ctx: LoweringContext, a: Value, some: bool = True, compute_uv: bool = True) -> tuple:
    """``(U, S, V)`` (V, not V^T); without ``compute_uv`` torch returns zero U and V."""
    u, s, vh = _svd_parts(ctx, a, not some)
    if not compute_uv:
        return (_zeros(ctx, 0), s, _zeros(ctx, 2))
    return (u, s, lambda: _t(ctx, vh()))


# ---------------------------------------------------------------- symmetric eigendecomposition
def _eigh_check(node: torch.fx.Node, a: Any, uplo: str = "L", *_: Any) -> str | None:
    if uplo not in ("L", "U"):
        return f"UPLO must be 'L' or 'U', got {uplo!r}"
    return _square(node, a)


def _triangle(uplo: str) -> str:
    return "upper" if uplo == "U" else "lower"


@lowers(aten._linalg_eigh.default, check=_eigh_check)
def _linalg_eigh_internal(ctx: LoweringContext, a: Value, uplo: str = "L", compute_v: bool = True) -> tuple:
    values = lambda: ctx.op("eigh", a, part="values", triangle=_triangle(uplo))
    if not compute_v:
        return (values, _zeros(ctx, 1))
    return (values, lambda: ctx.op("eigh", a, part="vectors", triangle=_triangle(uplo)))


@lowers(aten.linalg_eigh.default, check=_eigh_check)
def _linalg_eigh(ctx: LoweringContext, a: Value, uplo: str = "L") -> tuple:
    return _linalg_eigh_internal(ctx, a, uplo, True)


@lowers(aten.linalg_eigvalsh.default, check=_eigh_check)
def _linalg_eigvalsh(ctx: LoweringContext, a: Value, uplo: str = "L") -> Value:
    return ctx.op("eigh", a, part="values", triangle=_triangle(uplo))


def _complex_results(node: torch.fx.Node, *_: Any) -> str:
    return ("the eigenvalues and eigenvectors of a general matrix are complex, and kiln has no "
            "complex dtypes; for a symmetric matrix use torch.linalg.eigh / eigvalsh")


@lowers(*optional_ops("linalg_eig", "linalg_eigvals", "_linalg_eigvals"), check=_complex_results)
def _linalg_eig(ctx: LoweringContext, *_: Any) -> Value:  # never called: the check refuses
    raise AssertionError("linalg_eig is refused by its check")


# ---------------------------------------------------------------- LU
def _lu_check(node: torch.fx.Node, a: Any, pivot: bool = True, *_: Any) -> str | None:
    if not pivot:
        return "LU without pivoting (pivot=False) is not supported; kiln factors with partial pivoting"
    return _matrix(node, a)


@lowers(aten.linalg_lu_factor_ex.default, aten._lu_with_info.default, check=_lu_check)
def _lu_factor_ex(ctx: LoweringContext, a: Value, pivot: bool = True, check_errors: bool = False) -> tuple:
    return (lambda: ctx.op("lu", a, part="packed"),
            lambda: _int_result(ctx, ctx.op("lu", a, part="pivots"), 1),
            lambda: _int_result(ctx, ctx.op("lu", a, part="info"), 2))


@lowers(aten.linalg_lu_factor.default, check=_lu_check)
def _lu_factor(ctx: LoweringContext, a: Value, pivot: bool = True) -> tuple:
    return _lu_factor_ex(ctx, a, pivot)[:2]


@lowers(aten.linalg_lu.default, check=_lu_check)
def _linalg_lu(ctx: LoweringContext, a: Value, pivot: bool = True) -> tuple:
    # P through the (integer) pivots: it is not differentiable, as in torch
    p = lambda: ctx.op("lu_permutation", ctx.op("lu", a, part="pivots"), m=a.shape[-2], dtype=a.dtype)
    return (p, lambda: ctx.op("lu", a, part="l"), lambda: ctx.op("lu", a, part="u"))


def _unpack_check(node: torch.fx.Node, lu: Any, pivots: Any, *_: Any) -> str | None:
    m = meta(pivots)
    if isinstance(m, torch.Tensor) and (m.dtype.is_floating_point or m.dtype == torch.bool):
        return f"the pivots must be an integer tensor, got {m.dtype}"
    return _float_matrix(lu, "the LU factors")


def _unpacked(ctx: LoweringContext, lu: Value) -> tuple[Value, Value]:
    m, n = lu.shape[-2:]
    k = min(m, n)
    r = lu.type.rank
    left = lu if n == k else ctx.op("slice", lu, dim=r - 1, start=0, end=k, step=1)
    top = lu if m == k else ctx.op("slice", lu, dim=r - 2, start=0, end=k, step=1)
    l = ctx.op("add", ctx.op("tril", left, diagonal=-1), _eye(ctx, m, k, lu.dtype))
    return l, ctx.op("triu", top, diagonal=0)


@lowers(aten.lu_unpack.default, check=_unpack_check)
def _lu_unpack(ctx: LoweringContext, lu: Value, pivots: Value, unpack_data: bool = True,
               unpack_pivots: bool = True) -> tuple:
    m = lu.shape[-2]
    p = lambda: ctx.op("lu_permutation", pivots, m=m, dtype=lu.dtype)
    l = lambda: _unpacked(ctx, lu)[0]
    u = lambda: _unpacked(ctx, lu)[1]
    return (p if unpack_pivots else _zeros(ctx, 0), l if unpack_data else _zeros(ctx, 1),
            u if unpack_data else _zeros(ctx, 2))


def _lu_solve_values(ctx: LoweringContext, lu: Value, pivots: Value, b: Value, left: bool,
                     adjoint: bool) -> Value:
    """``A X = B`` (``X A = B`` when not ``left``; ``A^T`` when ``adjoint``) with
    ``A = P L U`` given by its packed factors and pivots."""
    n = lu.shape[-1]
    l, u = _unpacked(ctx, lu)
    p = ctx.op("lu_permutation", pivots, m=n, dtype=lu.dtype)
    solve = lambda x, y, **kw: ctx.op("triangular_solve", x, y, **kw)
    if left and not adjoint:  # X = U^-1 L^-1 P^T B
        y = solve(l, ctx.op("matmul", _t(ctx, p), b), upper=False, left=True, unitriangular=True)
        return solve(u, y, upper=True, left=True, unitriangular=False)
    if left:  # A^T X = B: X = P L^-T U^-T B
        y = solve(_t(ctx, u), b, upper=False, left=True, unitriangular=False)
        return ctx.op("matmul", p, solve(_t(ctx, l), y, upper=True, left=True, unitriangular=True))
    if not adjoint:  # X P L U = B: X = B U^-1 L^-1 P^T
        y = solve(u, b, upper=True, left=False, unitriangular=False)
        return ctx.op("matmul", solve(l, y, upper=False, left=False, unitriangular=True), _t(ctx, p))
    # X U^T L^T P^T = B: X = B P L^-T U^-T
    y = solve(_t(ctx, l), ctx.op("matmul", b, p), upper=True, left=False, unitriangular=True)
    return solve(_t(ctx, u), y, upper=False, left=False, unitriangular=False)


def _lu_solve_check(node: torch.fx.Node, lu: Any, pivots: Any, b: Any, *_: Any) -> str | None:
    return _first(_unpack_check(node, lu, pivots), _float_matrix(lu, "the LU factors", square=True),
                  _float_matrix(b, "B"))


@lowers(aten.linalg_lu_solve.default, check=_lu_solve_check)
def _linalg_lu_solve(ctx: LoweringContext, lu: Value, pivots: Value, b: Value, left: bool = True,
                     adjoint: bool = False) -> Value:
    return _lu_solve_values(ctx, lu, pivots, b, left, adjoint)


@lowers(aten.lu_solve.default, check=lambda node, b, lu, piv: _lu_solve_check(node, lu, piv, b))
def _lu_solve(ctx: LoweringContext, b: Value, lu: Value, pivots: Value) -> Value:
    return _lu_solve_values(ctx, lu, pivots, b, True, False)


# ---------------------------------------------------------------- QR and Householder products
def _qr_check(node: torch.fx.Node, a: Any, mode: Any = "reduced", *_: Any) -> str | None:
    if isinstance(mode, str) and mode not in ("reduced", "complete", "r"):
        return f"mode must be 'reduced', 'complete' or 'r', got {mode!r}"
    return _matrix(node, a)


@lowers(aten.linalg_qr.default, check=_qr_check)
def _linalg_qr(ctx: LoweringContext, a: Value, mode: str = "reduced") -> tuple:
    q = _zeros(ctx, 0) if mode == "r" else (lambda: ctx.op("qr", a, part="q", mode=mode))
    return (q, lambda: ctx.op("qr", a, part="r", mode=mode))


@lowers(aten.qr.default, check=_matrix)
def _qr(ctx: LoweringContext, a: Value, some: bool = True) -> tuple:
    return _linalg_qr(ctx, a, "reduced" if some else "complete")


@lowers(aten.geqrf.default, check=_matrix)
def _geqrf(ctx: LoweringContext, a: Value) -> tuple:
    return (lambda: ctx.op("geqrf", a, part="packed"), lambda: ctx.op("geqrf", a, part="tau"))


def _householder(ctx: LoweringContext, v: Value, tau: Value, e: Value, transpose: bool = False) -> Value:
    """``H_1 H_2 ... H_k E`` (``H_k ... H_1 E`` when ``transpose``, i.e. ``Q^T E``) with
    ``H_i = I - tau_i v_i v_i^T`` and ``v_i`` column ``i`` of ``v``'s strictly lower part
    with a unit diagonal entry: the reflectors geqrf leaves below R."""
    m = v.shape[-2]
    k = tau.shape[-1]
    r = v.type.rank
    vs = ctx.op("add", ctx.op("tril", ctx.op("slice", v, dim=r - 1, start=0, end=k, step=1), diagonal=-1),
                _eye(ctx, m, k, v.dtype))
    order = range(k) if transpose else range(k - 1, -1, -1)
    for i in order:
        vi = ctx.op("slice", vs, dim=r - 1, start=i, end=i + 1, step=1)  # (..., m, 1)
        ti = ctx.reshape(ctx.op("slice", tau, dim=r - 2, start=i, end=i + 1, step=1),
                         (*tau.shape[:-1], 1, 1))
        proj = ctx.op("matmul", _t(ctx, vi), e)  # (..., 1, n)
        e = ctx.op("sub", e, ctx.op("mul", ti, ctx.op("matmul", vi, proj)))
    return e


def _householder_check(node: torch.fx.Node, a: Any, tau: Any, *_: Any) -> str | None:
    problem = _float_matrix(a, "the reflectors")
    if problem:
        return problem
    ma, mt = meta(a), meta(tau)
    if not isinstance(mt, torch.Tensor) or mt.dim() != ma.dim() - 1 or mt.shape[-1] > ma.shape[-1] \
            or ma.shape[-1] > ma.shape[-2] or tuple(mt.shape[:-1]) != tuple(ma.shape[:-2]):
        return (f"needs reflectors (*, m, n) with m >= n and tau (*, k) with k <= n, got "
                f"{list(ma.shape)} and {list(mt.shape) if isinstance(mt, torch.Tensor) else mt}")
    return None


@lowers(aten.linalg_householder_product.default, check=_householder_check)
def _householder_product(ctx: LoweringContext, a: Value, tau: Value) -> Value:
    """The first ``n`` columns of ``H_1 ... H_k`` (LAPACK orgqr), as matmuls."""
    m, n = a.shape[-2:]
    e = ctx.op("expand", _eye(ctx, m, n, a.dtype), shape=tuple(a.shape))
    return _householder(ctx, a, ctx.cast(tau, a.dtype), e)


def _ormqr_check(node: torch.fx.Node, a: Any, tau: Any, c: Any, left: bool = True, *_: Any) -> str | None:
    problem = _first(_float_matrix(a, "the reflectors"), _float_matrix(c, "C"))
    if problem:
        return problem
    ma, mt, mc = meta(a), meta(tau), meta(c)
    rows = mc.shape[-2] if left else mc.shape[-1]
    if ma.shape[-2] != rows or not isinstance(mt, torch.Tensor) or mt.shape[-1] > min(ma.shape[-2:]) \
            or tuple(ma.shape[:-2]) != tuple(mc.shape[:-2]) or tuple(mt.shape[:-1]) != tuple(ma.shape[:-2]):
        return (f"reflectors {list(ma.shape)}, tau {list(mt.shape) if isinstance(mt, torch.Tensor) else mt} "
                f"and C {list(mc.shape)} do not match")
    return None


@lowers(aten.ormqr.default, check=_ormqr_check)
def _ormqr(ctx: LoweringContext, a: Value, tau: Value, c: Value, left: bool = True,
           transpose: bool = False) -> Value:
    """``op(Q) C`` (``C op(Q)`` when not ``left``) with ``Q`` the full ``m x m`` product of
    the reflectors and ``op(Q) = Q^T`` when ``transpose``."""
    tau = ctx.cast(tau, a.dtype)
    if left:
        return _householder(ctx, a, tau, c, transpose)
    # C Q = (Q^T C^T)^T and C Q^T = (Q C^T)^T
    return _t(ctx, _householder(ctx, a, tau, _t(ctx, c), not transpose))


# ---------------------------------------------------------------- pseudo-inverse
def _pinv_values(ctx: LoweringContext, a: Value, atol: Any, rtol: Any, hermitian: bool) -> Value:
    """torch's ``linalg_pinv``: the SVD (eigh when ``hermitian``) with the singular values
    below ``max(atol, rtol * largest)`` dropped; ``rtol`` defaults to ``eps * max(m, n)``, or
    0 when a positive ``atol`` is given."""
    m, n = a.shape[-2:]
    dtype = a.dtype
    out = tuple(int(d) for d in ctx.out.shape)
    if min(m, n) == 0:
        return ctx.op("full", shape=out, value=0.0, dtype=dtype)
    default_rtol = float(np.finfo(dtype.numpy if dtype.is_floating else np.float32).eps) * max(m, n)
    as_value = lambda x: x if isinstance(x, Value) else ctx.const(x, dtype)
    if rtol is None:
        if atol is None:
            rtol = default_rtol
        elif isinstance(atol, Value):
            rtol = ctx.op("where", ctx.op("gt", atol, ctx.const(0, atol.dtype)), ctx.const(0.0, dtype),
                          ctx.const(default_rtol, dtype))
        else:
            rtol = 0.0 if atol > 0 else default_rtol
    atol = 0.0 if atol is None else atol
    atol, rtol = ctx.cast(as_value(atol), dtype), ctx.cast(as_value(rtol), dtype)
    col = lambda x: ctx.reshape(x, (*x.shape, 1)) if x.type.rank else x

    def pinv(hermitian: bool) -> Value:
        if hermitian:
            w = ctx.op("eigh", a, part="values", triangle="lower")
            v = ctx.op("eigh", a, part="vectors", triangle="lower")
            size = ctx.op("abs", w)
            largest = ctx.op("amax", size, dims=(w.type.rank - 1,), keepdim=True)
            left, right, s = v, _t(ctx, v), w
        else:
            s = ctx.op("svd", a, part="s", full_matrices=False)
            size = s
            largest = ctx.op("slice", s, dim=s.type.rank - 1, start=0, end=1, step=1)
            left = _t(ctx, ctx.op("svd", a, part="vh", full_matrices=False))
            right = _t(ctx, ctx.op("svd", a, part="u", full_matrices=False))
        tol = ctx.op("maximum", col(atol), ctx.op("mul", col(rtol), largest))
        keep = ctx.op("gt", size, tol)
        safe = ctx.op("where", keep, s, ctx.const(1.0, dtype))
        inv_s = ctx.op("where", keep, ctx.op("reciprocal", safe), ctx.const(0.0, dtype))
        scaled = ctx.op("mul", left, ctx.reshape(inv_s, (*inv_s.shape[:-1], 1, inv_s.shape[-1])))
        return ctx.op("matmul", scaled, right)

    result = pinv(hermitian)
    if hermitian:
        # torch reads the lower triangle (eigh) but differentiates with the differential of
        # the pseudo-inverse at the whole matrix A0 with P = pinv(triangle):
        # dP = -P dA P + P P^T dA^T (I - A0 P) + (I - P A0) dA^T P^T P.  h below is that
        # linear map of A (P and A0 held constant); P + h(A) - h(A) has P's value and its rule.
        p, a0 = ctx.op("stop_gradient", result), ctx.op("stop_gradient", a)
        mm = lambda *xs: xs[0] if len(xs) == 1 else ctx.op("matmul", xs[0], mm(*xs[1:]))
        pt, at = _t(ctx, p), _t(ctx, a)
        i_ap = ctx.op("sub", _eye(ctx, m, m, dtype), mm(a0, p))
        i_pa = ctx.op("sub", _eye(ctx, n, n, dtype), mm(p, a0))
        h = ctx.op("add", ctx.op("neg", mm(p, a, p)),
                   ctx.op("add", mm(p, pt, at, i_ap), mm(i_pa, at, pt, p)))
        result = ctx.op("add", p, ctx.op("sub", h, ctx.op("stop_gradient", h)))
    return result if tuple(result.shape) == out else ctx.op("expand", result, shape=out)


def _pinv_check(node: torch.fx.Node, a: Any, atol: Any = None, rtol: Any = None, hermitian: bool = False) -> str | None:
    for name, tol in (("atol", atol), ("rtol", rtol)):
        m = meta(tol)
        if isinstance(m, torch.Tensor) and m.dim() > max(meta(a).dim() - 2, 0):
            return f"{name} must broadcast over the batch axes, got shape {list(m.shape)}"
    return _matrix(node, a)


@lowers(*optional_ops("linalg_pinv.atol_rtol_tensor", "linalg_pinv.atol_rtol_float"), check=_pinv_check)
def _linalg_pinv(ctx: LoweringContext, a: Value, atol: Any = None, rtol: Any = None,
                 hermitian: bool = False) -> Value:
    return _pinv_values(ctx, a, atol, rtol, hermitian)


@lowers(*optional_ops("linalg_pinv.default"), check=_matrix)
def _linalg_pinv_rcond(ctx: LoweringContext, a: Value, rcond: Any, hermitian: bool = False) -> Value:
    return _pinv_values(ctx, a, 0.0, rcond, hermitian)


@lowers(aten.pinverse.default, check=_matrix)
def _pinverse(ctx: LoweringContext, a: Value, rcond: float = 1e-15) -> Value:
    return _pinv_values(ctx, a, 0.0, rcond, False)


# ---------------------------------------------------------------- matrix exponential
@lowers(aten.linalg_matrix_exp.default, aten.matrix_exp.default, check=_square)
def _matrix_exp(ctx: LoweringContext, a: Value) -> Value:
    return ctx.op("matrix_exp", a)


# ---------------------------------------------------------------- tensor inverse and solve
def _tensorinv_check(node: torch.fx.Node, a: Any, ind: int = 2) -> str | None:
    m = meta(a)
    rows, cols = math.prod(m.shape[:ind]), math.prod(m.shape[ind:])
    if ind <= 0 or rows != cols:
        return (f"needs prod(shape[:ind]) == prod(shape[ind:]) with ind > 0, got shape "
                f"{list(m.shape)} and ind={ind}")
    if not m.dtype.is_floating_point:
        return f"needs a floating-point tensor, got {m.dtype}"
    return None


@lowers(aten.linalg_tensorinv.default, check=_tensorinv_check)
def _tensorinv(ctx: LoweringContext, a: Value, ind: int = 2) -> Value:
    rows = math.prod(a.shape[:ind])
    inv = ctx.op("inv", ctx.reshape(a, (rows, rows)))
    return ctx.reshape(inv, (*a.shape[ind:], *a.shape[:ind]))


def _tensorsolve_check(node: torch.fx.Node, a: Any, b: Any, dims: Any = None) -> str | None:
    ma, mb = meta(a), meta(b)
    if not (ma.dtype.is_floating_point and mb.dtype == ma.dtype):
        return f"needs floating-point tensors of one dtype, got {ma.dtype} and {mb.dtype}"
    rest = ma.dim() - mb.dim()
    if rest < 0 or tuple(ma.shape[: mb.dim()]) != tuple(mb.shape) and dims is None:
        return f"A {list(ma.shape)} must start with the shape of B {list(mb.shape)}"
    if math.prod(mb.shape) != math.prod(ma.shape) // max(math.prod(mb.shape), 1) and dims is None:
        return f"A {list(ma.shape)} is not square over B {list(mb.shape)}"
    return None


@lowers(aten.linalg_tensorsolve.default, check=_tensorsolve_check)
def _tensorsolve(ctx: LoweringContext, a: Value, b: Value, dims: Any = None) -> Value:
    """``X`` with ``tensordot(A, X, X.ndim) = B``: ``A`` (``dims`` moved to the end) as a
    square matrix over ``B``'s elements, solved through the inverse."""
    if dims is not None:
        moved = [d % a.type.rank for d in dims]
        kept = [d for d in range(a.type.rank) if d not in moved]
        a = ctx.op("permute", a, dims=(*kept, *moved))
    x_shape = tuple(a.shape[b.type.rank:])
    n = math.prod(b.shape)
    x = ctx.op("matmul", ctx.op("inv", ctx.reshape(a, (n, n))), ctx.reshape(b, (n, 1)))
    return ctx.reshape(x, x_shape)


# ---------------------------------------------------------------- LDL^T
def _ldl_check(node: torch.fx.Node, a: Any, hermitian: bool = False, *_: Any) -> str | None:
    return _square(node, a)  # real matrices: hermitian and symmetric are the same


@lowers(aten.linalg_ldl_factor_ex.default, check=_ldl_check)
def _ldl_factor_ex(ctx: LoweringContext, a: Value, hermitian: bool = False, check_errors: bool = False) -> tuple:
    return (lambda: ctx.op("ldl", a, part="packed"),
            lambda: _int_result(ctx, ctx.op("ldl", a, part="pivots"), 1),
            lambda: _int_result(ctx, ctx.op("ldl", a, part="info"), 2))


@lowers(aten.linalg_ldl_factor.default, check=_ldl_check)
def _ldl_factor(ctx: LoweringContext, a: Value, hermitian: bool = False) -> tuple:
    return _ldl_factor_ex(ctx, a, hermitian)[:2]


def _ldl_solve_check(node: torch.fx.Node, ld: Any, pivots: Any, b: Any, *_: Any) -> str | None:
    mb, mld = meta(b), meta(ld)
    problem = _first(_unpack_check(node, ld, pivots), _float_matrix(ld, "the LDL factors", square=True),
                     _float_matrix(b, "B"))
    if problem is None and tuple(mb.shape[:-2]) != tuple(mld.shape[:-2]):
        return f"batch axes of the factors {list(mld.shape)} and B {list(mb.shape)} must be equal"
    return problem


@lowers(aten.linalg_ldl_solve.default, check=_ldl_solve_check)
def _ldl_solve(ctx: LoweringContext, ld: Value, pivots: Value, b: Value, hermitian: bool = False) -> Value:
    return ctx.op("ldl_solve", ld, ctx.cast(pivots, DType.int32), b)
