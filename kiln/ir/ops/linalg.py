"""Linear algebra beyond ``matmul`` (:mod:`.matmul`): inverse, determinant, triangular
solve, Cholesky, SVD, symmetric eigendecomposition and the matrix exponential; LU, QR,
geqrf and LDL^T are in :mod:`.factorizations`.  Each op is described above its
declaration below.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..graph import Value
from ..registry import Attr, defop
from ..types import DType, TensorType, broadcast_shapes
from ._infer import fmt_shape, upcast_half
from .vjp import GradBuilder, defvjp, unbroadcast


# --------------------------------------------------------------- inverse and determinant
# Square matrices in the last two axes, any batch axes before.  No compute definition: a
# loop nest is no way to factor a matrix, so the cpu backend runs the numpy (LAPACK) reference.
def _square(types, what: str) -> TensorType:
    (a,) = types
    if a.rank < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"{what} needs square matrices in the last two axes, got {fmt_shape(a.shape)}")
    if not a.dtype.is_floating:
        raise TypeError(f"{what} needs a floating-point matrix, got {a.dtype.short}")
    return a


def _inv_infer(types, **_) -> TensorType:
    return _square(types, "inv")


def _det_infer(types, **_) -> TensorType:
    a = _square(types, "det")
    return TensorType(tuple(a.shape[:-2]), a.dtype)


@defop("inv", infer=_inv_infer, amp="float32")
def inv(a):
    """Matrix inverse over the last two axes (LAPACK getrf/getri through numpy)."""
    with np.errstate(all="ignore"):
        return np.linalg.inv(upcast_half(a)).astype(a.dtype, copy=False)


@defop("det", infer=_det_infer, amp="float32")
def det(a):
    """Determinant over the last two axes."""
    return np.asarray(np.linalg.det(upcast_half(a))).astype(a.dtype, copy=False)


@defvjp("inv")
def _inv_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``dA = -Y^T g Y^T`` with ``Y = A^-1``."""
    yt = b.transpose(outputs[0])
    return [b.neg(b.op("matmul", b.op("matmul", yt, cotangents[0]), yt))]


@defvjp("det")
def _det_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``dA = g * det(A) * A^-T`` (invertible matrices)."""
    a, d, g = inputs[0], outputs[0], cotangents[0]
    scale = b.reshape(b.mul(g, d), (*d.shape, 1, 1))
    return [b.mul(scale, b.transpose(b.op("inv", a)))]


# --------------------------------------------------------------- factorizations and solvers
# Every op below (and every op of kiln.ir.ops.factorizations) works on matrices in the last
# two axes with any batch axes before, computes in float64 whatever the operand's float
# dtype -- through scipy's LAPACK, except SVD and eigh, which call torch.linalg (LAPACK builds
# differ in the signs of singular vectors and eigenvectors, and kiln gives torch's) -- and
# follows torch's conventions: LAPACK's signs for QR, eigenvalues ascending, LU pivots
# 1-based (int32).  A factorization with several results is one op with a ``part`` attribute
# naming the result it returns; nodes of the other parts recompute the same factorization
# (the numpy reference is deterministic, so they agree).  Gradient rules are torch's
# published formulas, written with kiln ops.  A matrix LAPACK cannot factor (not positive
# definite for Cholesky, not converging for SVD/eigh) gives NaN in place of its factors, as
# ``inv`` gives inf/NaN for a singular matrix; the ``info`` parts say which matrices failed.
# No compute definitions: the cpu backend runs the numpy references.
_SVD_PARTS = ("u", "s", "vh")
_EIGH_PARTS = ("values", "vectors")


def _matrices(types, what: str, square: bool = False) -> TensorType:
    a = types[0]
    if a.rank < 2:
        raise ValueError(f"{what} needs matrices in the last two axes, got {fmt_shape(a.shape)}")
    if square and a.shape[-1] != a.shape[-2]:
        raise ValueError(f"{what} needs square matrices in the last two axes, got {fmt_shape(a.shape)}")
    if not a.dtype.is_floating:
        raise TypeError(f"{what} needs a floating-point matrix, got {a.dtype.short}")
    return a


def _part(part: str, parts: tuple[str, ...], what: str) -> None:
    if part not in parts:
        raise ValueError(f"{what}: part must be one of {', '.join(parts)}, got {part!r}")


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _eye(n: int, batch: tuple, dtype=np.float64) -> np.ndarray:
    return np.broadcast_to(np.eye(n, dtype=dtype), (*batch, n, n)).copy()


def _each(x: np.ndarray, fn, out_shapes: Sequence, out_dtypes: Sequence) -> list[np.ndarray]:
    """``fn(matrix) -> tuple of arrays`` applied to every matrix of batch ``x``."""
    batch = x.shape[:-2]
    outs = [np.zeros((*batch, *s), dtype=d) for s, d in zip(out_shapes, out_dtypes)]
    for idx in np.ndindex(*batch):
        for o, r in zip(outs, fn(x[idx])):
            o[idx] = r
    return outs


# ---- triangular solve
def _triangular_solve_infer(types, *, upper, left, unitriangular) -> TensorType:
    a, b = types
    _matrices([a], "triangular_solve", square=True)
    if b.rank < 2:
        raise ValueError(f"triangular_solve needs a matrix right-hand side, got {fmt_shape(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"triangular_solve operands differ in dtype: {a.dtype.short} and {b.dtype.short}")
    n = a.shape[-1]
    if (b.shape[-2] if left else b.shape[-1]) != n:
        side = "rows" if left else "columns"
        raise ValueError(f"triangular_solve: A {fmt_shape(a.shape)} is {n}x{n} but B "
                         f"{fmt_shape(b.shape)} has {b.shape[-2] if left else b.shape[-1]} {side}")
    try:
        batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(f"batch axes of A {fmt_shape(a.shape)} and B {fmt_shape(b.shape)} "
                         "do not broadcast") from None
    return TensorType((*batch, *b.shape[-2:]), a.dtype)


def _substitute(a: np.ndarray, b: np.ndarray, upper: bool, unit: bool) -> np.ndarray:
    """``A X = B`` for triangular ``A`` by substitution, batched and broadcast (a singular
    ``A`` gives inf/NaN, as LAPACK's trsm)."""
    n = a.shape[-1]
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, (*batch, n, n))
    x = np.array(np.broadcast_to(b, (*batch, *b.shape[-2:])), dtype=np.float64)
    rows = range(n - 1, -1, -1) if upper else range(n)
    done: list[int] = []
    with np.errstate(all="ignore"):
        for i in rows:
            if done:
                x[..., i, :] -= np.einsum("...k,...kj->...j", a[..., i, done], x[..., done, :])
            if not unit:
                x[..., i, :] /= a[..., i, i][..., None]
            done.append(i)
    return x


@defop("triangular_solve", infer=_triangular_solve_infer, num_inputs=2, amp="float32",
       attrs={"upper": Attr("bool"), "left": Attr("bool", True), "unitriangular": Attr("bool", False)})
def triangular_solve(a, b, *, upper, left=True, unitriangular=False):
    """``X`` with ``A X = B`` (``X A = B`` when not ``left``) for triangular ``A`` (the
    upper or lower triangle is read, the other ignored; ``unitriangular``: unit diagonal)."""
    a64, b64 = _f64(a), _f64(b)
    if left:
        x = _substitute(a64, b64, upper, unitriangular)
    else:  # X A = B  <=>  A^T X^T = B^T, and A^T swaps the triangles
        x = np.swapaxes(_substitute(np.swapaxes(a64, -1, -2), np.swapaxes(b64, -1, -2),
                                    not upper, unitriangular), -1, -2)
    return x.astype(a.dtype)


def _triangle(b: GradBuilder, x: Value, upper: bool, strict: bool) -> Value:
    if upper:
        return b.op("triu", x, diagonal=1 if strict else 0)
    return b.op("tril", x, diagonal=-1 if strict else 0)


@defvjp("triangular_solve")
def _triangular_solve_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``gB = A^-T gX`` (``gX A^-T`` on the right) and ``gA = -gB X^T`` (``-X^T gB``) in
    A's triangle (strictly, for a unit diagonal)."""
    a, rhs = inputs
    x, g = outputs[0], cotangents[0]
    upper, left, unit = attrs["upper"], attrs["left"], attrs["unitriangular"]
    gb = b.op("triangular_solve", b.transpose(a), g, upper=not upper, left=left, unitriangular=unit)
    da = None
    if b.wants(0):
        prod = b.op("matmul", gb, b.transpose(x)) if left else b.op("matmul", b.transpose(x), gb)
        da = unbroadcast(b, _triangle(b, b.neg(prod), upper, unit), a)
    return [da, unbroadcast(b, gb, rhs) if b.wants(1) else None]


# ---- Cholesky
_TRIANGLES = ("lower", "upper", "both")


def _symmetric(x: np.ndarray, triangle: str) -> np.ndarray:
    """The symmetric matrices read from ``triangle`` of ``x`` (``both``: ``(x + x^T) / 2``)."""
    xt = np.swapaxes(x, -1, -2)
    if triangle == "both":
        return (x + xt) / 2
    t = np.tril(x) if triangle == "lower" else np.triu(x)
    return t + np.swapaxes(np.tril(t, -1) if triangle == "lower" else np.triu(t, 1), -1, -2)


def _cholesky_infer(types, *, part, triangle) -> TensorType:
    a = _matrices(types, "cholesky", square=True)
    _part(part, ("l", "info"), "cholesky")
    _part(triangle, _TRIANGLES, "cholesky triangle")
    return a if part == "l" else TensorType(tuple(a.shape[:-2]), DType.int32)


def _potrf(m: np.ndarray):
    from scipy.linalg import lapack

    n = m.shape[-1]
    if n == 0:
        return m, 0
    c, info = lapack.dpotrf(m, lower=1, clean=1)
    if info != 0:  # not positive definite (info > 0 is the order of the failing minor)
        return np.full((n, n), np.nan), max(int(info), 0)
    return np.tril(c), 0


@defop("cholesky", infer=_cholesky_infer, amp="float32",
       attrs={"part": Attr("str", "l"), "triangle": Attr("str", "lower")})
def cholesky(a, *, part="l", triangle="lower"):
    """Cholesky factor ``L`` (lower, ``A = L L^T``) of symmetric positive-definite matrices
    (NaN for a matrix that is not positive definite), or with ``part="info"`` LAPACK's info:
    0, or the order of the first minor that is not positive definite (int32, one per matrix).
    The matrix is read from its ``triangle``: ``lower``, ``upper``, or ``both`` (the
    symmetric part ``(A + A^T) / 2``)."""
    n = a.shape[-1]
    l, info = _each(_symmetric(_f64(a), triangle), _potrf, [(n, n), ()], [np.float64, np.int32])
    return l.astype(a.dtype) if part == "l" else info


@defvjp("cholesky")
def _cholesky_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``gA = L^-T Phi L^-1`` with ``P = tril(L^T gL)`` and ``Phi = (P + tril(P, -1)^T) / 2``
    (symmetric, as torch: the derivative along symmetric perturbations, whichever triangle
    is read)."""
    if attrs["part"] != "l":
        return [None]
    l, g = outputs[0], cotangents[0]
    p = b.op("tril", b.op("matmul", b.transpose(l), g), diagonal=0)
    phi = b.mul(b.add(p, b.transpose(b.op("tril", p, diagonal=-1))), b.const(0.5, p))
    left = b.op("triangular_solve", b.transpose(l), phi, upper=True, left=True, unitriangular=False)
    return [b.op("triangular_solve", l, left, upper=False, left=False, unitriangular=False)]


# ---- SVD
def _svd_infer(types, *, part, full_matrices) -> TensorType:
    a = _matrices(types, "svd")
    _part(part, _SVD_PARTS, "svd")
    m, n = a.shape[-2:]
    k = min(m, n)
    batch = tuple(a.shape[:-2])
    if part == "s":
        return TensorType((*batch, k), a.dtype)
    if part == "u":
        return TensorType((*batch, m, m if full_matrices else k), a.dtype)
    return TensorType((*batch, n if full_matrices else k, n), a.dtype)


def _svd(x: np.ndarray, full_matrices: bool):
    m, n = x.shape[-2:]
    batch = x.shape[:-2]
    k = min(m, n)
    if x.size == 0:
        u = _eye(m, batch)[..., : m if full_matrices else k]
        vh = _eye(n, batch)[..., : n if full_matrices else k, :]
        return u, np.zeros((*batch, k)), vh
    import torch  # torch's LAPACK (MKL): its singular vectors' signs, which other builds do not share

    t = torch.from_numpy(np.ascontiguousarray(x))
    try:
        u, s, vh = torch.linalg.svd(t, full_matrices=full_matrices)
        return u.numpy(), s.numpy(), vh.numpy()
    except RuntimeError:  # some matrix did not converge (inf/NaN in it): NaN for all
        u = np.full((*batch, m, m if full_matrices else k), np.nan)
        vh = np.full((*batch, n if full_matrices else k, n), np.nan)
        return u, np.full((*batch, k), np.nan), vh


@defop("svd", infer=_svd_infer, amp="float32",
       attrs={"part": Attr("str"), "full_matrices": Attr("bool", False)})
def svd(a, *, part, full_matrices=False):
    """One factor of ``A = U diag(S) Vh`` (torch's LAPACK and signs, S descending): ``part`` is
    ``u``, ``s`` or ``vh``; ``full_matrices`` makes U and Vh square."""
    u, s, vh = _svd(_f64(a), full_matrices)
    return {"u": u, "s": s, "vh": vh}[part].astype(a.dtype)


def _diag_embed(b: GradBuilder, v: Value) -> Value:
    """Diagonal matrices from the vectors of ``v`` (last axis)."""
    n = v.shape[-1]
    eye = b.array(np.eye(n), v.dtype)
    return b.mul(b.reshape(v, (*v.shape[:-1], 1, n)), eye)


def _row(b: GradBuilder, v: Value) -> Value:  # v[..., None, :]
    return b.reshape(v, (*v.shape[:-1], 1, v.shape[-1]))


def _col(b: GradBuilder, v: Value) -> Value:  # v[..., :, None]
    return b.reshape(v, (*v.shape, 1))


def _narrow(b: GradBuilder, x: Value, dim: int, size: int) -> Value:
    d = dim % x.type.rank
    if x.shape[d] == size:
        return x
    return b.op("slice", x, dim=d, start=0, end=size, step=1)


@defvjp("svd")
def _svd_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """torch's ``svd_backward`` with only this part's cotangent (the rule is linear in the
    three, so the parts' contributions add up to it): ``gA = U (skew(U^T gU) S / E +
    S skew(V^T gV) / E + diag(gS)) Vh`` with ``E_ij = S_j^2 - S_i^2`` (1 on the diagonal),
    plus ``(I - U U^T) gU S^-1 Vh`` for tall and ``U S^-1 gVh (I - V V^T)`` for wide
    matrices.  Full matrices use the first ``k`` columns of U and rows of Vh."""
    a, g = inputs[0], cotangents[0]
    part = attrs["part"]
    m, n = a.shape[-2:]
    k = min(m, n)
    if k == 0:
        return [b.zeros(a.type)]
    u = _narrow(b, b.op("svd", a, part="u", full_matrices=False), -1, k)
    vh = b.op("svd", a, part="vh", full_matrices=False)
    s = b.op("svd", a, part="s", full_matrices=False)
    if part == "s":
        if m >= n:
            return [b.op("matmul", u, b.mul(_col(b, g), vh))]
        return [b.op("matmul", b.mul(u, _row(b, g)), vh)]
    s2 = b.mul(s, s)
    e = b.sub(_row(b, s2), _col(b, s2))
    e = b.add(e, b.array(np.eye(k), a.dtype))  # E_ii = 1: the diagonal of the numerator is 0
    if part == "u":
        gu = _narrow(b, g, -1, k)
        uhgu = b.op("matmul", b.transpose(u), gu)
        inner = b.mul(b.div(b.sub(uhgu, b.transpose(uhgu)), e), _row(b, s))
        if m > n:
            out = b.op("matmul", u, inner)
            gus = b.div(gu, _row(b, s))
            out = b.add(out, b.sub(gus, b.op("matmul", u, b.op("matmul", b.transpose(u), gus))))
            return [b.op("matmul", out, vh)]
        return [b.op("matmul", b.op("matmul", u, inner), vh)]
    gvh = _narrow(b, g, -2, k)
    vhgv = b.op("matmul", vh, b.transpose(gvh))
    inner = b.mul(_col(b, s), b.div(b.sub(vhgv, b.transpose(vhgv)), e))
    if m < n:
        out = b.op("matmul", inner, vh)
        sgvh = b.div(gvh, _col(b, s))
        out = b.add(out, b.sub(sgvh, b.op("matmul", b.op("matmul", sgvh, b.transpose(vh)), vh)))
        return [b.op("matmul", u, out)]
    return [b.op("matmul", u, b.op("matmul", inner, vh))]


# ---- symmetric eigendecomposition
def _eigh_infer(types, *, part, triangle) -> TensorType:
    a = _matrices(types, "eigh", square=True)
    _part(part, _EIGH_PARTS, "eigh")
    _part(triangle, _TRIANGLES, "eigh triangle")
    return a if part == "vectors" else TensorType(tuple(a.shape[:-1]), a.dtype)


@defop("eigh", infer=_eigh_infer, amp="float32",
       attrs={"part": Attr("str"), "triangle": Attr("str", "lower")})
def eigh(a, *, part, triangle="lower"):
    """Eigenvalues (ascending) or eigenvectors (columns, torch's LAPACK and signs) of symmetric
    matrices read from their ``triangle`` (``lower``, ``upper``, or ``both``: the symmetric
    part ``(A + A^T) / 2``)."""
    x = _f64(a)
    if triangle == "both":
        x, triangle = _symmetric(x, "both"), "lower"
    n = x.shape[-1]
    if x.size == 0:
        w, v = np.zeros(x.shape[:-1]), _eye(n, x.shape[:-2])
    else:
        import torch  # torch's LAPACK (MKL): its eigenvectors' signs

        try:
            w, v = torch.linalg.eigh(torch.from_numpy(np.ascontiguousarray(x)),
                                     UPLO="U" if triangle == "upper" else "L")
            w, v = w.numpy(), v.numpy()
        except RuntimeError:
            w, v = np.full(x.shape[:-1], np.nan), np.full(x.shape, np.nan)
    return (w if part == "values" else v).astype(a.dtype)


@defvjp("eigh")
def _eigh_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """torch's rule: ``gA = V diag(gL) V^T`` for the eigenvalues and
    ``gA = V (skew(V^T gV) / 2 / E) V^T`` with ``E_ij = L_j - L_i`` for the eigenvectors
    (symmetric: the derivative along symmetric perturbations)."""
    a, g = inputs[0], cotangents[0]
    n = a.shape[-1]
    if n == 0:
        return [b.zeros(a.type)]
    v = b.op("eigh", a, part="vectors", triangle=attrs["triangle"])
    if attrs["part"] == "values":
        return [b.op("matmul", b.mul(v, _row(b, g)), b.transpose(v))]
    w = b.op("eigh", a, part="values", triangle=attrs["triangle"])
    vhgv = b.op("matmul", b.transpose(v), g)
    skew = b.mul(b.sub(vhgv, b.transpose(vhgv)), b.const(0.5, vhgv))
    e = b.add(b.sub(_row(b, w), _col(b, w)), b.array(np.eye(n), a.dtype))
    return [b.op("matmul", v, b.op("matmul", b.div(skew, e), b.transpose(v)))]


# ---- matrix exponential
def _matrix_exp_infer(types, **_) -> TensorType:
    return _matrices(types, "matrix_exp", square=True)


@defop("matrix_exp", infer=_matrix_exp_infer, amp="float32")
def matrix_exp(a):
    """``exp(A)`` of square matrices (scipy's scaling and squaring with Pade approximants)."""
    from scipy.linalg import expm

    x = _f64(a)
    if x.size == 0:
        return x.astype(a.dtype)
    with np.errstate(all="ignore"):
        return np.asarray(expm(x)).astype(a.dtype)


@defvjp("matrix_exp")
def _matrix_exp_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``gA`` is the upper-right block of ``exp([[A^T, g], [0, A^T]])`` (the Frechet
    derivative of exp at A^T applied to g, as torch)."""
    a, g = inputs[0], cotangents[0]
    n = a.shape[-1]
    if n == 0:
        return [b.zeros(a.type)]
    r = a.type.rank
    at = b.transpose(a)
    top = b.op("cat", at, g, dim=r - 1)
    bottom = b.op("cat", b.full(a.shape, 0.0, a.dtype), at, dim=r - 1)
    e = b.op("matrix_exp", b.op("cat", top, bottom, dim=r - 2))
    block = b.op("slice", b.op("slice", e, dim=r - 2, start=0, end=n, step=1), dim=r - 1, start=n, end=2 * n, step=1)
    return [block]
