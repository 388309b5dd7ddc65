"""Linear algebra: ``matmul`` with numpy/torch semantics, inverse, determinant, and the
matrix factorizations and solvers (Cholesky, LU, LDL^T, QR and geqrf, SVD, symmetric
eigendecomposition, triangular solve, matrix exponential).

``matmul``: both operands have one dtype (kiln inserts no implicit casts around a
contraction).  A 1-d left operand is treated as a row vector and a 1-d right operand as a
column vector, the added axis being dropped from the result; batch axes (all but the last
two) broadcast.  The factorizations are described above their declarations below.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..graph import Value
from ..registry import Attr, defop
from ..types import DType, TensorType, broadcast_shapes
from ._infer import fmt_shape, same_dtypes, upcast_half
from .compute import broadcast_index, compute_dtype, defcompute
from .vjp import GradBuilder, defvjp, nondifferentiable, set_vjp, unbroadcast


def _matmul_infer(types, **_) -> TensorType:
    a, b = types
    dtype = same_dtypes(types, ["a", "b"])
    if dtype == DType.bool:
        raise TypeError("matmul is not defined on bool; cast the operands to a numeric dtype")
    if a.rank == 0 or b.rank == 0:
        raise ValueError(f"both operands must be at least 1-d, got {fmt_shape(a.shape)} "
                         f"and {fmt_shape(b.shape)}")
    a_shape = (1, *a.shape) if a.rank == 1 else a.shape
    b_shape = (*b.shape, 1) if b.rank == 1 else b.shape
    if a_shape[-1] != b_shape[-2]:
        raise ValueError(f"contraction sizes differ: a {fmt_shape(a.shape)} has {a_shape[-1]} "
                         f"columns but b {fmt_shape(b.shape)} has {b_shape[-2]} rows")
    try:
        batch = broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        raise ValueError(f"batch axes {fmt_shape(a_shape[:-2])} of a and {fmt_shape(b_shape[:-2])} "
                         "of b do not broadcast") from None
    rows = () if a.rank == 1 else (a_shape[-2],)
    cols = () if b.rank == 1 else (b_shape[-1],)
    return TensorType((*batch, *rows, *cols), dtype)


@defop("matmul", infer=_matmul_infer, num_inputs=2, traits=("matmul",), amp="low")
def matmul(a, b):
    """Matrix product with numpy/torch semantics (1-d operands, broadcast batch axes)."""
    return np.asarray(np.matmul(upcast_half(a), upcast_half(b))).astype(a.dtype, copy=False)


@defvjp("matmul")
def _matmul_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``da = g @ b^T`` and ``db = a^T @ g``, summed over broadcast batch axes.

    1-d operands are first viewed as a row (``a``) or column (``b``) matrix.  When ``b`` is a
    matrix and ``a`` has batch axes (a linear layer), ``db`` is one matmul over the
    flattened batch instead of a batched product summed afterwards.
    """
    x, w = inputs
    if not x.dtype.is_floating:
        return [None, None]
    x2 = x if x.type.rank > 1 else b.reshape(x, (1, x.shape[0]))
    w2 = w if w.type.rank > 1 else b.reshape(w, (w.shape[0], 1))
    g = cotangents[0]
    batch = g.shape[: max(x2.type.rank, w2.type.rank) - 2]
    g2 = b.reshape(g, (*batch, x2.shape[-2], w2.shape[-1]))
    dx = dw = None
    if b.wants(0):
        dx = b.reshape(unbroadcast(b, b.op("matmul", g2, b.transpose(w2)), x2), x.shape)
    if b.wants(1):
        if w2.type.rank == 2 and x2.type.rank > 2:
            rows = b.reshape(x2, (-1, x2.shape[-1]))
            dw2 = b.op("matmul", b.transpose(rows), b.reshape(g2, (-1, g2.shape[-1])))
        else:
            dw2 = unbroadcast(b, b.op("matmul", b.transpose(x2), g2), w2)
        dw = b.reshape(dw2, w.shape)
    return [dx, dw]


# --------------------------------------------------------------- compute rule (lowering)
@defcompute("matmul")
def _matmul_compute(ctx, a, b):
    """``out[batch, m, n] = sum_k a[bcast(batch), m, k] * b[bcast(batch), k, n]`` (1-d
    operands lose their row or column axis); accumulates in the compute dtype."""
    out = ctx.out.dtype
    t = compute_dtype(out)
    a, b = ctx.operand(a, "a"), ctx.operand(b, "b")
    nb = len(ctx.out_shape) - (a.rank > 1) - (b.rank > 1)

    def body(i, r):
        batch, (k,) = i[:nb], r
        a_index = (*broadcast_index(batch, a.shape[:-2]), i[nb], k) if a.rank > 1 else (k,)
        b_index = (*broadcast_index(batch, b.shape[:-2]), k, i[-1]) if b.rank > 1 else (k,)
        return a.at(a_index, t) * b.at(b_index, t)

    return ctx.convert(ctx.reduce(ctx.out_shape, t, "+", [a.shape[-1]], body, "acc"), out)


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
# Every op below works on matrices in the last two axes with any batch axes before, computes
# in float64 whatever the operand's float dtype -- through scipy's LAPACK, except SVD and eigh,
# which call torch.linalg (LAPACK builds differ in the signs of singular vectors and
# eigenvectors, and kiln gives torch's) -- and follows torch's conventions: LAPACK's signs
# for QR, eigenvalues ascending, LU pivots 1-based (int32).  A factorization with several results is one op with a ``part`` attribute naming
# the result it returns; nodes of the other parts recompute the same factorization (the
# numpy reference is deterministic, so they agree).  Gradient rules are torch's published
# formulas, written with kiln ops.  A matrix LAPACK cannot factor (not positive definite for
# Cholesky, not converging for SVD/eigh) gives NaN in place of its factors, as ``inv`` gives
# inf/NaN for a singular matrix; the ``info`` parts say which matrices failed.  No compute
# definitions: the cpu backend runs the numpy references.
_SVD_PARTS = ("u", "s", "vh")
_EIGH_PARTS = ("values", "vectors")
_LU_PARTS = ("packed", "pivots", "p", "l", "u", "info")
_QR_PARTS = ("q", "r")
_QR_MODES = ("reduced", "complete", "r")


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


set_vjp("lu_permutation", nondifferentiable)


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
