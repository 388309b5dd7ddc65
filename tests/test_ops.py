"""Every registered op against PyTorch: reference values, inferred types, and bad inputs.

``CASES`` holds, per op, a few inputs and the equivalent torch expression.  Each case checks
that the numpy reference matches torch (float32 relative error <= 1e-5, exact for integers
and bools) and that its result has exactly the shape and dtype inference gives.  ``INVALID``
lists inputs inference must reject, matched by regex.  A kiln op with no case fails
``test_every_op_has_a_case``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.ir import DType, Graph, OpTypeError, SymDim, TensorType, builtin_ops, get_op
from kiln.ir.ops.indexing import NNZ
from kiln.ir.parser import parse

rng = np.random.default_rng(0)
BIG = 9223372036854775807


# ----------------------------------------------------------------------------- inputs
def f32(*shape: int) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape), dtype=np.float32)


def f64(*shape: int) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape))


def f16(*shape: int) -> np.ndarray:
    return f32(*shape).astype(np.float16)


def bf16(*shape: int) -> np.ndarray:
    return f32(*shape).astype(ml_dtypes.bfloat16)


def pos(*shape: int) -> np.ndarray:
    return np.asarray(rng.uniform(0.5, 2.0, shape), dtype=np.float32)


def ints(*shape: int, lo: int = -5, hi: int = 5, dtype=np.int64) -> np.ndarray:
    return np.asarray(rng.integers(lo, hi, shape), dtype=dtype)


def bools(*shape: int) -> np.ndarray:
    return np.asarray(rng.random(shape) < 0.5)


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a, order="C"))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


# ------------------------------------------------------------------------------ cases
@dataclass
class Case:
    op: str
    inputs: tuple[np.ndarray, ...]
    expect: Callable[..., Any]
    attrs: dict[str, Any] = field(default_factory=dict)
    tol: float = 1e-5

    def __repr__(self) -> str:
        shapes = ",".join("x".join(map(str, a.shape)) + a.dtype.name for a in self.inputs)
        return f"{self.op}({shapes}){self.attrs or ''}"


def case(op: str, inputs, expect, tol: float = 1e-5, **attrs) -> Case:
    low = any(a.dtype in (np.float16, ml_dtypes.bfloat16) for a in inputs)
    return Case(op, tuple(inputs), expect, attrs, 2e-2 if low else tol)


CASES: list[Case] = []


def add(*cases: Case) -> None:
    CASES.extend(cases)


_UNARY = {
    "exp": (torch.exp, f32), "log": (torch.log, pos), "log2": (torch.log2, pos),
    "log1p": (torch.log1p, pos), "expm1": (torch.expm1, f32), "sqrt": (torch.sqrt, pos),
    "rsqrt": (torch.rsqrt, pos), "reciprocal": (torch.reciprocal, pos),
    "sigmoid": (torch.sigmoid, f32), "tanh": (torch.tanh, f32), "sin": (torch.sin, f32),
    "cos": (torch.cos, f32), "tan": (torch.tan, f32), "atan": (torch.atan, f32),
    "erf": (torch.erf, f32), "silu": (F.silu, f32), "neg": (torch.neg, f32),
    "abs": (torch.abs, f32), "relu": (torch.relu, f32), "floor": (torch.floor, f32),
    "ceil": (torch.ceil, f32), "round": (torch.round, f32), "trunc": (torch.trunc, f32),
    "sign": (torch.sign, f32), "logical_not": (torch.logical_not, bools),
    "isnan": (torch.isnan, f32), "isinf": (torch.isinf, f32),
    "stop_gradient": (torch.Tensor.detach, f32),
}
for _name, (_fn, _make) in _UNARY.items():
    add(case(_name, [_make(3, 5)], _fn))
add(case("exp", [ints(4)], torch.exp), case("abs", [ints(2, 3)], torch.abs),
    case("sigmoid", [bf16(3, 4)], torch.sigmoid),
    case("gelu", [f32(2, 7)], F.gelu), case("gelu", [f16(5)], lambda x: F.gelu(x, approximate="tanh"),
                                           approximate="tanh"))

_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
}
for _name, _fn in _BINARY.items():
    add(case(_name, [f32(3, 1, 4), f32(5, 1)], _fn))
add(case("add", [ints(2, 3, dtype=np.int32), f32(3)], torch.add),
    case("pow", [pos(2, 3), f32(3)], torch.pow), case("pow", [ints(4, lo=1), ints(4, lo=0)], torch.pow),
    case("remainder", [f32(6), pos(6)], torch.remainder),
    case("remainder", [ints(6), ints(6, lo=1)], torch.remainder),
    case("div", [ints(8), ints(8, lo=1)], lambda a, b: torch.div(a, b, rounding_mode="floor"),
         rounding_mode="floor"),
    case("div", [ints(8), ints(8, lo=1)], lambda a, b: torch.div(a, b, rounding_mode="trunc"),
         rounding_mode="trunc"))

# kiln/ir/ops/special.py and the linalg additions
def _within(lo: float, hi: float, *shape: int) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float32)


_SPECIAL = {
    "asin": (torch.asin, lambda *s: _within(-0.95, 0.95, *s)), "acos": (torch.acos, lambda *s: _within(-0.95, 0.95, *s)),
    "asinh": (torch.asinh, f32), "acosh": (torch.acosh, lambda *s: _within(1.0, 4.0, *s)),
    "atanh": (torch.atanh, lambda *s: _within(-0.95, 0.95, *s)), "sinh": (torch.sinh, f32),
    "cosh": (torch.cosh, f32), "log10": (torch.log10, pos), "exp2": (torch.exp2, f32),
    "erfc": (torch.erfc, f32), "erfinv": (torch.erfinv, lambda *s: _within(-0.95, 0.95, *s)),
    "lgamma": (torch.lgamma, f32), "i0": (torch.i0, f32), "i0e": (torch.special.i0e, f32),
    "i1": (torch.special.i1, f32), "i1e": (torch.special.i1e, f32), "erfcx": (torch.special.erfcx, f32),
    "ndtri": (torch.special.ndtri, lambda *s: _within(0.05, 0.95, *s)),
    "log_ndtr": (torch.special.log_ndtr, f32), "entr": (torch.special.entr, f32),
    "signbit": (torch.signbit, f32), "bessel_j0": (torch.special.bessel_j0, f32),
    "bessel_j1": (torch.special.bessel_j1, f32), "bessel_y0": (torch.special.bessel_y0, pos),
    "bessel_y1": (torch.special.bessel_y1, pos), "modified_bessel_i0": (torch.special.modified_bessel_i0, f32),
    "modified_bessel_i1": (torch.special.modified_bessel_i1, f32),
    "modified_bessel_k0": (torch.special.modified_bessel_k0, pos),
    "modified_bessel_k1": (torch.special.modified_bessel_k1, pos),
    "scaled_modified_bessel_k0": (torch.special.scaled_modified_bessel_k0, pos),
    "scaled_modified_bessel_k1": (torch.special.scaled_modified_bessel_k1, pos),
    "spherical_bessel_j0": (torch.special.spherical_bessel_j0, f32), "airy_ai": (torch.special.airy_ai, f32),
    "frexp_exponent": (lambda x: torch.frexp(x)[1], f32),
}
for _name, (_fn, _make) in _SPECIAL.items():
    add(case(_name, [_make(3, 5)], _fn, tol=1e-4))
add(case("polygamma", [pos(3, 4)], torch.digamma, tol=1e-4),
    case("polygamma", [pos(3, 4)], lambda x: torch.polygamma(2, x), tol=1e-4, n=2),
    case("fmod", [f32(3, 1, 4), pos(5, 1)], torch.fmod), case("fmod", [ints(8), ints(8, lo=1)], torch.fmod),
    case("copysign", [f32(3, 4), f32(4)], torch.copysign), case("fmax", [f32(3, 4), f32(4)], torch.fmax),
    case("fmin", [np.array([1.0, np.nan, 2.0, np.nan], np.float32), np.array([np.nan, 3.0, 1.0, np.nan], np.float32)],
         torch.fmin),
    case("nextafter", [f32(3, 4), f32(4)], torch.nextafter),
    case("zeta", [_within(1.5, 4.0, 3, 4), pos(4)], torch.special.zeta, tol=1e-4),
    case("igamma", [pos(3, 4), pos(4)], torch.igamma, tol=1e-4),
    case("igammac", [pos(3, 4), pos(4)], torch.igammac, tol=1e-4),
    case("inv", [f32(2, 3, 3) + 3 * np.eye(3, dtype=np.float32)], torch.linalg.inv, tol=1e-4),
    case("det", [f32(2, 4, 4)], torch.linalg.det, tol=1e-4))


def _spd(*shape: int) -> np.ndarray:
    x = f32(*shape)
    return (x @ np.swapaxes(x, -1, -2) + shape[-1] * np.eye(shape[-1])).astype(np.float32)


def _f64_of(fn):  # torch in float64, back to float32: kiln's factorizations compute in float64
    return lambda *xs: fn(*(x.double() for x in xs)).float()


_TRI = f32(2, 3, 3) + 3 * np.eye(3, dtype=np.float32)
add(case("triangular_solve", [_TRI, f32(3, 2)], lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
         tol=1e-4, upper=True),
    case("triangular_solve", [_TRI, f32(2, 4, 3)], lambda a, b: torch.linalg.solve_triangular(
        a, b, upper=False, left=False, unitriangular=True), tol=1e-4, upper=False, left=False, unitriangular=True),
    case("cholesky", [_spd(2, 4, 4)], torch.linalg.cholesky, tol=1e-4),
    case("cholesky", [_spd(4, 4)], lambda a: torch.linalg.cholesky(a, upper=True).mT, tol=1e-4, triangle="upper"),
    case("cholesky", [np.array([[1.0, 2.0], [2.0, 1.0]], np.float32)],
         lambda a: torch.linalg.cholesky_ex(a).info, part="info"),
    case("svd", [f32(2, 4, 3)], torch.linalg.svdvals, tol=1e-4, part="s"),
    case("svd", [f32(3, 5)], _f64_of(lambda a: torch.linalg.svd(a, full_matrices=True).U), tol=1e-4,
         part="u", full_matrices=True),
    case("svd", [f32(2, 3, 5)], _f64_of(lambda a: torch.linalg.svd(a, full_matrices=False).Vh), tol=1e-4,
         part="vh"),
    case("eigh", [_spd(2, 4, 4)], torch.linalg.eigvalsh, tol=1e-4, part="values"),
    case("eigh", [f32(4, 4)], _f64_of(lambda a: torch.linalg.eigh(a, UPLO="U").eigenvectors), tol=1e-4,
         part="vectors", triangle="upper"),
    case("lu", [f32(2, 3, 5)], _f64_of(lambda a: torch.linalg.lu_factor(a).LU), tol=1e-4, part="packed"),
    case("lu", [f32(5, 3)], lambda a: torch.linalg.lu_factor(a).pivots, part="pivots"),
    case("lu", [f32(4, 4)], _f64_of(lambda a: torch.linalg.lu(a).P), part="p"),
    case("lu", [f32(5, 3)], _f64_of(lambda a: torch.linalg.lu(a).L), tol=1e-4, part="l"),
    case("lu", [f32(3, 5)], _f64_of(lambda a: torch.linalg.lu(a).U), tol=1e-4, part="u"),
    case("lu", [np.array([[1.0, 2.0], [2.0, 4.0]], np.float32)], lambda a: torch.linalg.lu_factor_ex(a).info,
         part="info"),
    case("lu_permutation", [np.array([[3, 2, 4, 4], [1, 4, 3, 4]], np.int32)],
         lambda p: torch.lu_unpack(torch.zeros(2, 4, 4), p)[0], m=4, dtype=DType.float32),
    case("qr", [f32(2, 5, 3)], _f64_of(lambda a: torch.linalg.qr(a).Q), tol=1e-4, part="q"),
    case("qr", [f32(5, 3)], _f64_of(lambda a: torch.linalg.qr(a, mode="complete").R), tol=1e-4, part="r",
         mode="complete"),
    case("qr", [f32(3, 5)], _f64_of(lambda a: torch.linalg.qr(a, mode="r").R), tol=1e-4, part="r", mode="r"),
    case("geqrf", [f32(5, 3)], _f64_of(lambda a: torch.geqrf(a)[0]), tol=1e-4, part="packed"),
    case("geqrf", [f32(2, 3, 4)], _f64_of(lambda a: torch.geqrf(a)[1]), tol=1e-4, part="tau"),
    case("matrix_exp", [f32(2, 4, 4)], torch.linalg.matrix_exp, tol=1e-4))
_SYM = f32(2, 4, 4)
_SYM = _SYM + np.swapaxes(_SYM, -1, -2)
_LD, _LD_PIV = (t.numpy() for t in torch.linalg.ldl_factor(torch.from_numpy(_SYM).double()))
add(case("ldl", [_SYM], _f64_of(lambda a: torch.linalg.ldl_factor(a).LD), tol=1e-4, part="packed"),
    case("ldl", [_SYM], lambda a: torch.linalg.ldl_factor(a.double()).pivots, part="pivots"),
    case("ldl", [_SYM], lambda a: torch.linalg.ldl_factor_ex(a.double()).info, part="info"),
    case("ldl_solve", [_LD.astype(np.float32), _LD_PIV, f32(2, 4, 3)],
         lambda ld, piv, b: torch.linalg.ldl_solve(torch.from_numpy(_LD), piv, b.double()).float(), tol=1e-4))
for _name in ("chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
              "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
              "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
              "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p"):
    add(case(_name, [_within(-1.0, 1.0, 3, 5), np.array([-1, 0, 1, 3, 6], np.float32)],
             getattr(torch.special, _name), tol=1e-4))
for _name, _fn in [("logical_and", torch.logical_and), ("logical_or", torch.logical_or),
                   ("logical_xor", torch.logical_xor)]:
    add(case(_name, [bools(2, 3), bools(3)], _fn))
add(case("where", [bools(2, 1), f32(3), f32(2, 3)], torch.where),
    case("cast", [f32(7) * 4], lambda x: x.to(torch.int32), dtype=DType.int32),
    case("cast", [ints(5)], lambda x: x.to(torch.bfloat16), dtype=DType.bfloat16),
    case("clamp", [f32(9)], lambda x: torch.clamp(x, -0.5, 0.25), min=-0.5, max=0.25),
    case("clamp", [ints(9)], lambda x: torch.clamp(x, max=1), max=1.0),
    case("silu_mul", [f32(2, 3), f32(3)], lambda a, b: F.silu(a) * b))


def _fused_body() -> Graph:
    body = Graph("add_relu")
    a = body.add_input("a", TensorType((2, 3), DType.float32))
    b = body.add_input("b", TensorType((3,), DType.float32))
    body.set_outputs([body.op("relu", body.op("add", a, b))])
    return body


add(case("fused", [f32(2, 3), f32(3)], lambda a, b: torch.relu(a + b), template="elementwise",
         body=_fused_body()))


def _custom_vjp_bodies() -> tuple[Graph, Graph]:
    """forward: round(a) * b; backward (straight-through): g * b for a, g * round(a) for b."""
    t = TensorType((2, 3), DType.float32)
    forward = Graph("ste.forward")
    a, b = forward.add_input("a", t), forward.add_input("b", t)
    r = forward.op("round", a)
    forward.set_outputs([forward.op("mul", r, b)])
    backward = Graph("ste.backward")
    g = backward.add_input("g", t)
    backward.set_outputs([g])
    return forward, backward


add(case("custom_vjp", [f32(2, 3) * 3, f32(2, 3)], lambda a, b: torch.round(a) * b,
         forward=_custom_vjp_bodies()[0], backward=_custom_vjp_bodies()[1], grads=(0, -1)))

# reductions
add(case("sum", [f32(3, 4, 5)], lambda x: x.sum((1, -1), keepdim=True), dims=(1, -1), keepdim=True),
    case("sum", [f32(3, 4)], torch.sum),
    case("sum", [ints(3, 4, dtype=np.int32)], lambda x: x.sum(0), dims=(0,)),
    case("sum", [bools(5)], torch.sum),
    case("sum", [f32(3, 4)], lambda x: x.sum(1, dtype=torch.float64), dims=(1,), dtype=DType.float64),
    case("sum", [f16(6, 3)], lambda x: x.sum(0), dims=(0,)),
    case("sum", [f32()], lambda x: x.sum(0), dims=(0,)),
    case("prod", [pos(3, 4)], lambda x: x.prod(1), dims=(1,)),
    case("prod", [ints(2, 3, dtype=np.int8)], torch.prod),
    case("mean", [f32(3, 4, 5)], lambda x: x.mean((0, 2)), dims=(0, 2)),
    case("mean", [bf16(4, 6)], lambda x: x.mean(-1, keepdim=True), dims=(-1,), keepdim=True),
    case("var", [f32(4, 7)], lambda x: torch.var(x, 1, correction=0), dims=(1,), correction=0.0),
    case("var", [f64(3, 5)], torch.var),
    case("amax", [f32(3, 4)], lambda x: x.amax(-1), dims=(-1,)),
    case("amax", [ints(3, 4, dtype=np.int32)], torch.amax),
    case("amax", [f32()], lambda x: x.amax(0), dims=(0,)),
    case("amin", [f32(2, 3, 4)], lambda x: x.amin((0, 1), keepdim=True), dims=(0, 1), keepdim=True),
    case("any", [bools(3, 4)], lambda x: x.any(1), dims=(1,)),
    case("any", [ints(3, 4, lo=0, hi=2)], torch.any),
    case("all", [bools(2, 3)], lambda x: x.all(0, keepdim=True), dims=(0,), keepdim=True),
    case("all", [pos(3)], torch.all),
    case("argmax", [f32(3, 5)], torch.argmax),
    case("argmax", [ints(3, 6, lo=0, hi=2)], lambda x: x.argmax(1, keepdim=True), dim=1, keepdim=True),
    case("argmax", [f32(2, 3)], lambda x: x.argmax(keepdim=True), keepdim=True),
    case("argmin", [ints(4, 5, lo=0, hi=3)], lambda x: x.argmin(-1), dim=-1),
    case("argmin", [f16(7)], lambda x: x.argmin(0), dim=0),
    case("cumsum", [f32(3, 4)], lambda x: x.cumsum(1), dim=1),
    case("cumsum", [ints(5, dtype=np.int32)], lambda x: x.cumsum(0), dim=0),
    case("cumsum", [f32(2, 3)], lambda x: x.cumsum(-2, dtype=torch.float64), dim=-2,
         dtype=DType.float64),
    case("softmax", [f32(3, 7) * 30], lambda x: x.softmax(-1), dim=-1),
    case("softmax", [f16(4, 3)], lambda x: x.softmax(0), dim=0),
    case("log_softmax", [f32(2, 3, 5) * 30], lambda x: x.log_softmax(1), dim=1),
    case("log_softmax", [f64(6)], lambda x: x.log_softmax(0), dim=0))

# linalg
add(case("matmul", [f32(3, 4), f32(4, 5)], torch.matmul),
    case("matmul", [f32(4), f32(4, 5)], torch.matmul),
    case("matmul", [f32(2, 3, 4), f32(4)], torch.matmul),
    case("matmul", [f32(6), f32(6)], torch.matmul),
    case("matmul", [f32(2, 1, 3, 4), f32(5, 4, 2)], torch.matmul),
    case("matmul", [ints(3, 2), ints(2, 4)], torch.matmul),
    case("matmul", [f16(3, 8), f16(8, 2)], torch.matmul))

# nn
add(case("conv", [f32(2, 4, 9, 7), f32(6, 2, 3, 3), f32(6)],
         lambda x, w, b: F.conv2d(x, w, b, (2, 1), (1, 0), (1, 2), 2),
         stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
    case("conv", [f32(1, 3, 11), f32(4, 3, 3)], lambda x, w: F.conv1d(x, w, None, 1, 2, 2),
         stride=(1,), padding=(2,), dilation=(2,)),
    case("conv", [f32(1, 3, 6, 6), f32(3, 1, 3, 3)], lambda x, w: F.conv2d(x, w, None, 2, 1, 1, 3),
         stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=3),
    case("conv", [f32(1, 2, 4, 5, 3), f32(3, 2, 2, 2, 2)], lambda x, w: F.conv3d(x, w),
         stride=(1, 1, 1), padding=(0, 0, 0), dilation=(1, 1, 1)),
    case("conv", [bf16(1, 2, 5, 5), bf16(2, 2, 3, 3)], lambda x, w: F.conv2d(x, w),
         stride=(1, 1), padding=(0, 0), dilation=(1, 1)),
    case("max_pool2d", [f32(2, 3, 7, 9)], lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
         kernel=(3, 3), stride=(2, 2), padding=(1, 1), ceil_mode=True),
    case("max_pool2d", [f32(3, 8, 9)], lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 0), (2, 1)),
         kernel=(2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1)),
    case("max_pool2d", [f16(1, 2, 8, 10)], lambda x: F.max_pool2d(x, 3, 2, ceil_mode=True),
         kernel=(3, 3), stride=(2, 2), ceil_mode=True),
    case("max_pool2d", [ints(1, 1, 5, 5)], lambda x: F.max_pool2d(x, 2), kernel=(2, 2), stride=()),
    case("avg_pool2d", [f32(2, 3, 7, 8)],
         lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
         kernel=(3, 3), stride=(2, 2), padding=(1, 1), ceil_mode=True, count_include_pad=False),
    case("avg_pool2d", [f32(1, 2, 6, 5)], lambda x: F.avg_pool2d(x, (3, 2), 1, (1, 1)),
         kernel=(3, 2), stride=(1, 1), padding=(1, 1)),
    case("avg_pool2d", [f32(1, 1, 4, 4)], lambda x: F.avg_pool2d(x, 2, divisor_override=3),
         kernel=(2, 2), stride=(2, 2), divisor_override=3),
    case("avg_pool2d", [ints(1, 1, 5, 5)], lambda x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
         kernel=(3, 3), stride=(1, 1), padding=(1, 1), count_include_pad=False),
    case("adaptive_avg_pool2d", [f32(2, 3, 7, 10)], lambda x: F.adaptive_avg_pool2d(x, (3, 4)),
         output_size=(3, 4)),
    case("adaptive_avg_pool2d", [f32(3, 5, 3)], lambda x: F.adaptive_avg_pool2d(x, (7, 1)),
         output_size=(7, 1)),
    case("upsample_nearest2d", [f32(1, 2, 5, 7)], lambda x: F.interpolate(x, (8, 3)),
         output_size=(8, 3)),
    case("upsample_nearest2d", [ints(1, 1, 3, 3, lo=0, hi=9, dtype=np.uint8)],
         lambda x: F.interpolate(x, (6, 7)), output_size=(6, 7)),
    case("upsample_bilinear2d", [f32(1, 2, 5, 7)],
         lambda x: F.interpolate(x, (8, 10), mode="bilinear"), output_size=(8, 10)),
    case("upsample_bilinear2d", [f32(2, 1, 6, 6)],
         lambda x: F.interpolate(x, (4, 9), mode="bilinear", align_corners=True),
         output_size=(4, 9), align_corners=True),
    case("batch_norm", [f32(2, 3, 4, 5), f32(3), f32(3), f32(3), pos(3)],
         lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b, eps=1e-3), eps=1e-3),
    case("layer_norm", [f32(2, 5, 6), f32(6), f32(6)],
         lambda x, w, b: F.layer_norm(x, (6,), w, b), normalized_rank=1),
    case("layer_norm", [f32(3, 4, 5) * 3 + 1], lambda x: F.layer_norm(x, (4, 5)), normalized_rank=2),
    case("layer_norm", [bf16(2, 8), bf16(8)], lambda x, w: F.layer_norm(x, (8,), w), normalized_rank=1),
    case("rms_norm", [f32(2, 3, 8), f32(8)], lambda x, w: F.rms_norm(x, (8,), w, 1e-6),
         normalized_rank=1),
    case("rms_norm", [f32(4, 5)], lambda x: F.rms_norm(x, (4, 5), eps=1e-5), normalized_rank=2,
         eps=1e-5),
    case("embedding", [f32(10, 4), ints(2, 3, lo=0, hi=10)], lambda w, i: F.embedding(i, w)),
    case("embedding", [f16(7, 3), ints(lo=0, hi=7, dtype=np.int32)],
         lambda w, i: F.embedding(i.long(), w)))


def _max_pool_grad(g, x):
    y = F.max_pool2d(x.requires_grad_(), 3, 2, 1, ceil_mode=True)
    return torch.autograd.grad(y, x, g)[0]


def _max_pool_select(t, x):
    _, where = F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True)
    return t.flatten(-2).gather(-1, where.flatten(-2)).view_as(where)


_POOL3 = {"kernel": (3, 3), "stride": (2, 2), "padding": (1, 1), "ceil_mode": True}
add(case("conv_transpose", [f32(2, 4, 3, 5), f32(4, 3, 3, 2), f32(6)],
         lambda x, w, b: F.conv_transpose2d(x, w, b, (2, 1), (1, 0), (1, 0), 2, (1, 2)),
         stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2, output_padding=(1, 0)),
    case("conv_transpose", [f32(1, 3, 6), f32(3, 2, 3)],
         lambda x, w: F.conv_transpose1d(x, w, None, 3, 1, 2), stride=(3,), padding=(1,),
         dilation=(1,), output_padding=(2,)),
    case("max_pool2d_backward", [f32(2, 3, 4, 5), f32(2, 3, 7, 9)], _max_pool_grad, **_POOL3),
    case("max_pool2d_select", [f32(2, 3, 7, 9), f32(2, 3, 7, 9)], _max_pool_select, **_POOL3))

def _max_pool3d_grad(g, x):
    y = F.max_pool3d(x.requires_grad_(), (3, 2, 2), (2, 1, 2), (1, 1, 0), ceil_mode=True)
    return torch.autograd.grad(y, x, g)[0]


def _max_pool3d_select(t, x):
    _, where = F.max_pool3d(x, (3, 2, 2), (2, 1, 2), (1, 1, 0), ceil_mode=True, return_indices=True)
    return t.flatten(-3).gather(-1, where.flatten(-3)).view_as(where)


_POOL3D = {"kernel": (3, 2, 2), "stride": (2, 1, 2), "padding": (1, 1, 0), "ceil_mode": True}
add(case("max_pool2d_indices", [f32(2, 3, 7, 9)],
         lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True)[1], **_POOL3),
    case("max_pool2d_indices", [f32(3, 8, 9)],
         lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 0), (2, 1), return_indices=True)[1],
         kernel=(2, 3), stride=(1, 2), padding=(1, 0), dilation=(2, 1)),
    case("max_pool3d_indices", [f32(2, 3, 5, 7, 6)],
         lambda x: F.max_pool3d(x, (3, 2, 2), (2, 1, 2), (1, 1, 0), (1, 2, 1), True, True)[1],
         kernel=(3, 2, 2), stride=(2, 1, 2), padding=(1, 1, 0), dilation=(1, 2, 1), ceil_mode=True))
add(case("max_pool3d", [f32(2, 3, 5, 7, 6)], lambda x: F.max_pool3d(x, (3, 2, 2), (2, 1, 2), (1, 1, 0), (1, 2, 1), True),
         kernel=(3, 2, 2), stride=(2, 1, 2), padding=(1, 1, 0), dilation=(1, 2, 1), ceil_mode=True),
    case("max_pool3d", [ints(2, 4, 4, 5)], lambda x: F.max_pool3d(x.double(), 2).long(), kernel=(2, 2, 2), stride=()),
    case("max_pool3d_backward", [f32(2, 3, 3, 6, 3), f32(2, 3, 5, 5, 6)], _max_pool3d_grad, **_POOL3D),
    case("max_pool3d_select", [f32(2, 3, 5, 5, 6), f32(2, 3, 5, 5, 6)], _max_pool3d_select, **_POOL3D),
    case("avg_pool3d", [f32(2, 3, 5, 7, 6)],
         lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
         kernel=(3, 3, 3), stride=(2, 2, 2), padding=(1, 1, 1), ceil_mode=True, count_include_pad=False),
    case("avg_pool3d", [f32(3, 4, 4, 5)], lambda x: F.avg_pool3d(x, 2, divisor_override=3),
         kernel=(2, 2, 2), stride=(2, 2, 2), divisor_override=3),
    case("adaptive_avg_pool3d", [f32(2, 3, 5, 7, 9)], lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)),
         output_size=(2, 3, 4)),
    case("upsample_nearest2d", [f32(1, 2, 5, 7)],
         lambda x: F.interpolate(x, scale_factor=(1.3, 0.7), mode="nearest-exact"),
         output_size=(6, 4), exact=True, scales=(1.3, 0.7)),
    case("upsample_nearest3d", [f32(1, 2, 3, 4, 10)], lambda x: F.interpolate(x, scale_factor=(2, 1.5, 0.6)),
         output_size=(6, 6, 6), scales=(2.0, 1.5, 0.6)),
    case("upsample_nearest3d", [ints(2, 3, 4, 5, lo=0, hi=9, dtype=np.uint8)],
         lambda x: F.interpolate(x[None], (5, 3, 7), mode="nearest-exact")[0], output_size=(5, 3, 7), exact=True),
    case("upsample_bilinear2d", [f32(1, 2, 5, 4)], lambda x: F.interpolate(x, scale_factor=1.7, mode="bilinear"),
         output_size=(8, 6), scales=(1.7, 1.7)),
    case("upsample_trilinear3d", [f32(1, 2, 3, 4, 5)], lambda x: F.interpolate(x, (5, 3, 7), mode="trilinear"),
         output_size=(5, 3, 7)),
    case("upsample_trilinear3d", [f32(1, 2, 3, 4, 10)],
         lambda x: F.interpolate(x, scale_factor=(1.5, 2, 0.7), mode="trilinear", align_corners=True),
         output_size=(4, 8, 7), align_corners=True, scales=(1.5, 2.0, 0.7)),
    case("upsample_bicubic2d", [f32(1, 2, 5, 4)], lambda x: F.interpolate(x, (9, 5), mode="bicubic"),
         output_size=(9, 5)),
    case("upsample_bicubic2d", [f32(2, 7, 4)],
         lambda x: F.interpolate(x[None], (3, 8), mode="bicubic", align_corners=True)[0],
         output_size=(3, 8), align_corners=True))


def _torch_dropout_mask(seed: torch.Tensor, shape=(3, 50), p=0.3, offset=7) -> torch.Tensor:
    """The generator of ``kiln.ir.ops.random`` written again in torch: the spec of the op."""
    prime = 2**31 - 1
    s = seed.to(torch.int64) % prime
    x = (torch.arange(math.prod(shape), dtype=torch.int64) + offset) % prime
    h = x
    for mult, inc in ((48271, 1), (16807, 3), (69621, 5)):
        h = (h * mult + s + inc) % prime
        h = (h * h + x) % prime
    return (h >= round(p * prime)).reshape(shape)


add(case("group_norm", [f32(2, 6, 5, 3), f32(6), f32(6)], lambda x, w, b: F.group_norm(x, 3, w, b, 1e-5),
         groups=3),
    case("group_norm", [f32(3, 4, 7)], lambda x: F.group_norm(x, 2, eps=1e-3), groups=2, eps=1e-3),
    case("dropout_mask", [np.array(123456789, dtype=np.int64)], _torch_dropout_mask, shape=(3, 50), p=0.3,
         offset=7))


def _torch_random_uniform(seed: torch.Tensor, shape=(4, 25), offset=11, bits=24,
                          dtype=torch.float32) -> torch.Tensor:
    """``random_uniform`` written again in torch: ``floor(h / 2**(31 - bits)) * 2**-bits``."""
    prime = 2**31 - 1
    s = seed.to(torch.int64) % prime
    x = (torch.arange(math.prod(shape), dtype=torch.int64) + offset) % prime
    h = x
    for mult, inc in ((48271, 1), (16807, 3), (69621, 5)):
        h = (h * mult + s + inc) % prime
        h = (h * h + x) % prime
    return ((h >> (31 - bits)).to(torch.float64) * 2.0 ** -bits).to(dtype).reshape(shape)


add(case("random_uniform", [np.array(987654321, dtype=np.int64)], _torch_random_uniform, tol=0.0,
         shape=(4, 25), offset=11, dtype=DType.float32),
    case("random_uniform", [np.array(5, dtype=np.int64)],
         lambda s: _torch_random_uniform(s, (3, 0, 2), 0, 31, torch.float64), tol=0.0,
         shape=(3, 0, 2), dtype=DType.float64),
    case("random_uniform", [np.array(42, dtype=np.int64)],
         lambda s: _torch_random_uniform(s, (7,), 2**30, 11, torch.float16), tol=0.0,
         shape=(7,), offset=2**30, dtype=DType.float16))


SDPA = "scaled_dot_product_attention"
_SDPA = F.scaled_dot_product_attention
_SCORE_MASK = bools(5, 7)
_SCORE_MASK[2] = False  # a query with every key masked out
add(case(SDPA, [f32(2, 3, 5, 8), f32(2, 3, 7, 8), f32(2, 3, 7, 6)], _SDPA),
    case(SDPA, [f32(2, 4, 8), f32(2, 4, 8), f32(2, 4, 8)],
         lambda q, k, v: _SDPA(q, k, v, is_causal=True, scale=0.3), is_causal=True, scale=0.3),
    case(SDPA, [f32(2, 3, 5, 8), f32(1, 3, 7, 8), f32(3, 7, 6), _SCORE_MASK],
         lambda q, k, v, m: _SDPA(q, k.expand(2, 3, 7, 8), v.expand(2, 3, 7, 6), m)),
    case(SDPA, [f32(1, 2, 5, 4), f32(1, 2, 6, 4), f32(1, 2, 6, 4), f32(1, 1, 5, 6)], _SDPA),
    case(SDPA, [bf16(1, 3, 4), bf16(1, 3, 4), bf16(1, 3, 4)], _SDPA))

# layout
_X = f32(3, 4, 5)
add(case("reshape", [f32(2, 3, 4)], lambda x: x.reshape(4, -1), shape=(4, -1)),
    case("reshape", [f32()], lambda x: x.reshape(1, 1), shape=(1, 1)),
    case("reshape", [ints(6, 0)], lambda x: x.reshape(0, 3), shape=(0, 3)),
    case("permute", [f32(2, 3, 4)], lambda x: x.permute(2, 0, 1), dims=(2, 0, 1)),
    case("permute", [f32(2, 3, 4)], lambda x: x.permute(-1, 0, 1), dims=(-1, 0, 1)),
    case("expand", [f32(3, 1)], lambda x: x.expand(2, -1, 4), shape=(2, -1, 4)),
    case("expand", [f32()], lambda x: x.expand(2, 3), shape=(2, 3)),
    case("slice", [_X], lambda x: x[:, 1::2], dim=1, start=1, end=BIG, step=2),
    case("slice", [_X], lambda x: x[..., -3:-1], dim=-1, start=-3, end=-1),
    case("slice", [_X], lambda x: x[10:], dim=0, start=10, end=BIG),
    case("slice", [_X], lambda x: x[-100:2], dim=0, start=-100, end=2),
    case("select", [_X], lambda x: x[-1], dim=0, index=-1),
    case("select", [_X], lambda x: x[:, :, 1], dim=2, index=1),
    case("select", [f32(4)], lambda x: x[2], dim=0, index=2),
    case("cat", [f32(2, 3), f32(2, 1), f32(2, 4)], lambda *xs: torch.cat(xs, 1), dim=1),
    case("cat", [ints(2, 3, dtype=np.int32), f32(1, 3)], lambda *xs: torch.cat(xs, -2), dim=-2),
    case("cat", [f32(0), f32(2, 3), f32(1, 3)], lambda *xs: torch.cat(xs, 0), dim=0),
    case("cat", [f32(4)], lambda x: torch.cat([x], 0), dim=0),
    case("pad", [f32(2, 3, 4)], lambda x: F.pad(x, (1, 2), value=1.5), pads=(1, 2), value=1.5),
    case("pad", [f32(2, 3, 4)], lambda x: F.pad(x, (1, 1, -1, 2)), pads=(1, 1, -1, 2)),
    case("pad", [ints(3)], lambda x: F.pad(x, (2, -3), value=2.7), pads=(2, -3), value=2.7),
    case("flip", [_X], lambda x: x.flip(0, 2), dims=(0, 2)),
    case("flip", [ints(3, 2)], lambda x: x.flip(-1), dims=(-1,)),
    case("gather", [f32(3, 4), ints(2, 4, lo=0, hi=3)], lambda x, i: torch.gather(x, 0, i), dim=0),
    case("gather", [f32(3, 4), ints(2, 2, lo=0, hi=4)], lambda x, i: torch.gather(x, -1, i), dim=-1),
    case("index_select", [_X, ints(6, lo=0, hi=4)], lambda x, i: x.index_select(1, i), dim=1),
    case("index_select", [f32(3, 2), ints(lo=0, hi=3, dtype=np.int32)],
         lambda x, i: x.index_select(0, i), dim=0),
    case("index", [_X, ints(2, 2, lo=-4, hi=4)], lambda x, i: x[:, i], dims=(1,)),
    case("index", [_X, ints(2, lo=0, hi=3), ints(3, 1, lo=0, hi=5)], lambda x, i, j: x[i, :, j],
         dims=(0, 2)),
    case("index", [_X, ints(2, 1, lo=0, hi=4), ints(3, lo=0, hi=5)], lambda x, i, j: x[:, i, j],
         dims=(1, 2)),
    case("index", [_X, ints(2, lo=0, hi=5), ints(2, lo=0, hi=3)], lambda x, j, i: x[i, :, j],
         dims=(2, 0)),
    case("tril", [f32(4, 5)], lambda x: x.tril(1), diagonal=1),
    case("tril", [bools(2, 3, 3)], lambda x: x.tril(-1), diagonal=-1),
    case("triu", [f32(2, 5, 4)], lambda x: x.triu()),
    case("triu", [ints(3, 3)], lambda x: x.triu(2), diagonal=2),
    case("repeat", [f32(2, 3)], lambda x: x.repeat(2, 1, 3), repeats=(2, 1, 3)),
    case("repeat", [ints(4)], lambda x: x.repeat(0), repeats=(0,)))
add(case("argsort", [f32(3, 5)], lambda x: torch.argsort(x, dim=1, stable=True), dim=1),
    case("argsort", [ints(4, 6, lo=0, hi=3)], lambda x: torch.argsort(x, dim=0, descending=True, stable=True),
         dim=0, descending=True),
    case("cumprod", [f32(3, 4)], lambda x: torch.cumprod(x, 1), dim=1),
    case("cumprod", [ints(2, 5, lo=-2, hi=3)], lambda x: torch.cumprod(x, -1), dim=-1),
    case("cumarg", [ints(3, 6, lo=0, hi=3).astype(np.float32)], lambda x: torch.cummax(x, 1).indices,
         dim=1, mode="max"),
    case("cumarg", [np.array([[1.0, np.nan, 3.0, np.nan, 0.5], [2.0, 2.0, -1.0, 2.0, 5.0]], np.float32)],
         lambda x: torch.cummin(x, 1).indices, dim=1, mode="min"),
    case("argsort", [np.array([[1.0, np.nan, 3.0, 1.0, np.nan, 0.5]], np.float32)],
         lambda x: torch.argsort(x, dim=1, descending=True, stable=True), dim=1, descending=True),
    case("argtopk", [f32(3, 7)], lambda x: torch.topk(x, 3, dim=1).indices, k=3, dim=1),
    case("argtopk", [np.array([[1.0, np.nan, 3.0, 1.0, np.nan, 0.5]], np.float32)],
         lambda x: torch.argsort(x, dim=1, descending=True, stable=True)[:, :4], k=4, dim=1),
    case("argtopk", [ints(6, 4, lo=0, hi=3)], lambda x: torch.argsort(x, dim=0, stable=True)[:2],
         k=2, dim=0, largest=False),
    case("cumarg", [ints(5, 2, lo=0, hi=3)], lambda x: torch.cummin(x, 0).indices, dim=0, mode="min"),
    case("searchsorted", [np.array([-1.0, 0.0, 0.5, 1.0], np.float32), f32(3, 4)],
         lambda s, v: torch.searchsorted(s, v), right=False),
    case("searchsorted", [np.sort(f32(2, 5), axis=-1), f32(2, 3)],
         lambda s, v: torch.searchsorted(s, v, right=True), right=True),
    case("scatter", [f32(3, 4), np.array([[0, 2, 1, 2], [1, 0, 0, 1]], np.int64), f32(2, 5)],
         lambda x, i, s: x.scatter(0, i, s[:, :4]), dim=0),
    case("scatter_reduce", [f32(3, 4), ints(2, 4, lo=0, hi=3), f32(2, 4)],
         lambda x, i, s: x.scatter_reduce(0, i, s, "amax", include_self=False), dim=0, reduce="amax",
         include_self=False),
    case("scatter_reduce", [f32(3, 4), ints(3, 2, lo=0, hi=4), f32(3, 2)],
         lambda x, i, s: x.scatter_reduce(1, i, s, "mean"), dim=1, reduce="mean"),
    case("scatter_reduce", [f32(3, 4), ints(2, 4, lo=0, hi=3), f32(2, 4)],
         lambda x, i, s: x.scatter_reduce(0, i, s, "prod"), dim=0, reduce="prod"))
add(case("scatter_add", [f32(3, 4), ints(2, 3, lo=0, hi=3), f32(2, 4)],
         lambda x, i, s: x.scatter_add(0, i, s), dim=0),
    case("index_put", [f32(3, 4, 5), f32(3, 2, 4), ints(2, lo=0, hi=3), ints(3, 1, lo=0, hi=5)],
         lambda x, v, i, j: torch.ops.aten.index_put(x, [i, None, j], v, True), dims=(0, 2),
         accumulate=True),
    case("index_put", [f32(4, 3), f32(3), np.array([2, -4])],
         lambda x, v, i: torch.index_put(x, (i,), v), dims=(0,)))

# creation
add(case("arange", [], lambda: torch.arange(5), end=5, dtype=DType.int64),
    case("arange", [], lambda: torch.arange(1.5, 3.2, 0.3, dtype=torch.float32),
         start=1.5, end=3.2, step=0.3, dtype=DType.float32),
    case("arange", [], lambda: torch.arange(10, -3, -4, dtype=torch.int32),
         start=10, end=-3, step=-4, dtype=DType.int32),
    case("arange", [], lambda: torch.arange(0.5, 5, 1.5, dtype=torch.int64),
         start=0.5, end=5, step=1.5, dtype=DType.int64),
    case("full", [], lambda: torch.full((2, 3), 1.5), shape=(2, 3), value=1.5, dtype=DType.float32),
    case("full", [], lambda: torch.full((), 2.7, dtype=torch.int64), shape=(), value=2.7,
         dtype=DType.int64),
    case("full", [], lambda: torch.full((4,), 1, dtype=torch.bool), shape=(4,), value=1,
         dtype=DType.bool))
# Collectives without a process group: the simulation of world_size ranks holding this
# operand, this process rank 0 (their multi-rank behavior: tests/test_schedule_dist.py).
add(case("all_reduce", [f32(3, 4)], lambda x: x * 2, world_size=2),
    case("all_gather", [f32(3, 4)], lambda x: torch.cat([x, x], 1), world_size=2, dim=1),
    case("reduce_scatter", [f32(4, 3)], lambda x: x[:2] * 2, world_size=2, dim=0),
    case("all_to_all", [f32(4, 6)], lambda x: torch.cat([x[:, :3]] * 2, 0), world_size=2, split_dim=1,
         concat_dim=0))


# ------------------------------------------------------------------------------ checks
def _type_of(a: np.ndarray) -> TensorType:
    return TensorType(tuple(a.shape), DType.from_numpy(a.dtype))


def _assert_close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    assert got.shape == want.shape, f"shape {got.shape} != torch's {want.shape}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want)
        return
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    with np.errstate(invalid="ignore"):
        diff = np.where(got == want, 0.0, np.abs(got - want))  # equal infinities are exact
    err = np.max(diff[finite], initial=0.0)
    scale = max(np.max(np.abs(want[finite]), initial=0.0), 1e-30)
    assert err <= tol * scale, f"relative error {err / scale:.3g} > {tol}"


@pytest.mark.parametrize("c", CASES, ids=repr)
def test_reference_matches_torch_and_inferred_type(c: Case):
    opdef = get_op(c.op)
    attrs = opdef.normalize_attrs(c.attrs)
    (inferred,) = opdef.infer_types([_type_of(a) for a in c.inputs], attrs)
    with np.errstate(all="ignore"):
        got = opdef.reference(*c.inputs, **attrs)
    assert isinstance(got, np.ndarray), f"reference returned {type(got).__name__}"
    assert _type_of(got) == inferred, f"reference gives {_type_of(got)}, inference {inferred}"
    want = c.expect(*(to_torch(a) for a in c.inputs))
    assert str(want.dtype).removeprefix("torch.") == inferred.dtype.name, (
        f"torch gives {want.dtype}, kiln infers {inferred.dtype.short}")
    _assert_close(got.astype(np.float32) if got.dtype == ml_dtypes.bfloat16 else got,
                  to_numpy(want), c.tol)


@pytest.mark.parametrize("c", CASES, ids=repr)
def test_case_graph_round_trips(c: Case):
    g = Graph("case")
    operands = [g.add_input(f"x{i}", _type_of(a)) for i, a in enumerate(c.inputs)]
    g.set_outputs([g.op(c.op, *operands, **c.attrs)])
    assert str(parse(str(g))) == str(g)


def test_every_op_has_a_case():
    declared = set(builtin_ops())
    missing = declared - {c.op for c in CASES}
    assert not missing, f"ops without a test case in CASES: {sorted(missing)}"


def test_index_with_bool_mask_has_data_dependent_axis():
    x, mask = f32(3, 4, 5), bools(3, 4)
    opdef = get_op("index")
    (inferred,) = opdef.infer_types([_type_of(x), _type_of(mask)], {"dims": (0,)})
    assert inferred == TensorType((NNZ, 5), DType.float32)
    got = opdef.reference(x, mask, dims=(0,))
    np.testing.assert_array_equal(got, to_numpy(to_torch(x)[to_torch(mask)]))
    assert got.shape == (int(mask.sum()), 5)
    g = Graph("masked")
    operands = g.add_input("x", _type_of(x)), g.add_input("m", _type_of(mask))
    g.set_outputs([g.op("index", *operands, dims=(0,))])
    assert "f32[nnz, 5] = index(" in str(g)
    assert str(parse(str(g))) == str(g)


def test_symbolic_sizes_flow_through_shape_rules():
    n = SymDim("n")
    x = TensorType((n, 4, 6), DType.float32)

    def infer(op: str, *types: TensorType, **attrs) -> TensorType:
        opdef = get_op(op)
        return opdef.infer_types(list(types), opdef.normalize_attrs(attrs))[0]

    assert infer("permute", x, dims=(2, 0, 1)).shape == (6, n, 4)
    assert infer("slice", x, dim=0, start=0, end=BIG).shape == (n, 4, 6)
    assert infer("sum", x, dims=(1,)).shape == (n, 6)
    assert infer("softmax", x, dim=-1) == x
    assert infer("matmul", x, TensorType((6, 2), DType.float32)).shape == (n, 4, 2)
    assert infer("expand", TensorType((1, n), DType.float32), shape=(3, -1)).shape == (3, n)
    assert infer("reshape", x, shape=(-1,)).shape == (n * 24,)
    assert infer("reshape", x, shape=(n, -1)).shape == (n, 24)
    with pytest.raises(OpTypeError, match=r"cannot reshape \[n, 4, 6\]"):
        infer("reshape", x, shape=(5, -1))  # 24*n elements need not divide by 5


def test_out_of_range_indices_raise_at_run_time():
    with pytest.raises(IndexError, match="embedding: index 10 is out of range for 10"):
        get_op("embedding").reference(f32(10, 2), np.array([0, 10]))
    with pytest.raises(IndexError, match="gather: index -1 is out of range"):
        get_op("gather").reference(f32(3), np.array([-1]), dim=0)
    with pytest.raises(IndexError, match="index_select: index 4 is out of range"):
        get_op("index_select").reference(f32(4, 2), np.array([4]), dim=0)


def test_conv_reference_is_fast_at_resnet_sizes():
    import time

    x, w = f32(1, 64, 32, 32), f32(64, 64, 3, 3)
    start = time.perf_counter()
    get_op("conv").reference(x, w, stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------ bad inputs
def T(text: str) -> TensorType:
    """``T("f32[2, 3]")``: a tensor type from its text form."""
    dtype, dims = text.rstrip("]").split("[")
    sizes = [d.strip() for d in dims.split(",") if d.strip()]
    shape = tuple(int(d) if d.isdigit() else SymDim(d) for d in sizes)
    return TensorType(shape, DType.parse(dtype))


CONV1 = {"stride": (1,), "padding": (0,), "dilation": (1,)}
CONV2 = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1)}
INVALID = [
    ("sum", ["f32[2, 3]"], {"dims": (0, -2)}, r"dims \[0, -2\] name the same axis more than once"),
    ("sum", ["f32[2, 3]"], {"dims": (2,)}, r"dimension 2 is out of range for rank 2"),
    ("mean", ["i64[2, 3]"], {}, r"mean\(i64\[2, 3\]\): input must be floating-point, got i64"),
    ("var", ["i32[4]"], {}, r"must be floating-point"),
    ("amax", ["f32[2, 0]"], {"dims": (1,)}, r"cannot reduce over axis 1, which has size 0"),
    ("argmax", ["f32[0]"], {}, r"size 0"),
    ("softmax", ["i64[3]"], {"dim": 0}, r"floating-point"),
    ("cumsum", ["f32[3]"], {"dim": 1}, r"dimension 1 is out of range"),
    ("matmul", ["f32[2, 3]", "f16[3, 2]"], {}, r"a is f32 but b is f16"),
    ("matmul", ["f32[2, 3]", "f32[4, 2]"], {},
     r"contraction sizes differ: a \[2, 3\] has 3 columns but b \[4, 2\] has 4 rows"),
    ("matmul", ["f32[]", "f32[3]"], {}, r"at least 1-d"),
    ("matmul", ["f32[2, 2, 3]", "f32[3, 3, 4]"], {},
     r"batch axes \[2\] of a and \[3\] of b do not broadcast"),
    ("matmul", ["bool[2, 2]", "bool[2, 2]"], {}, r"not defined on bool"),
    ("conv", ["f32[1, 4, 8, 8]", "f32[2, 3, 3, 3]"], CONV2,
     r"conv\(.*\): input has 4 channels but weight expects 3 x groups 1"),
    ("conv", ["f32[1, 4, 8, 8]", "f32[3, 2, 3, 3]"], {**CONV2, "groups": 2},
     r"weight's 3 output channels do not split into 2 groups"),
    ("conv", ["f32[1, 3, 8, 8]", "f32[2, 3, 3, 3]"], CONV1,
     r"a 1-d conv \(len\(stride\) = 1\) needs input and weight of rank 3"),
    ("conv", ["f32[1, 3, 8, 8]", "f32[2, 3, 3, 3]"], {**CONV2, "padding": (0,)},
     r"must all have 2 entries"),
    ("conv", ["f32[1, 3, 2, 8]", "f32[2, 3, 3, 3]"], CONV2,
     r"output spatial size \[0, 6\] is empty"),
    ("conv", ["f32[1, 3, 8, 8]", "f32[2, 3, 3, 3]", "f32[3]"], CONV2,
     r"bias has shape \[3\], expected \[2\]"),
    ("conv", ["f32[1, 3, 8, 8]", "f16[2, 3, 3, 3]"], CONV2,
     r"input is f32 but weight is f16"),
    ("conv", ["i64[1, 3, 8]", "i64[2, 3, 3]"], CONV1, r"floating-point"),
    ("conv", ["f32[1, 3, 8]"], CONV1, r"expects 2 to 3 operands, got 1"),
    ("max_pool2d", ["f32[1, 1, 8, 8]"], {"kernel": (3, 3), "stride": (1, 1), "padding": (2, 2)},
     r"padding 2 is more than half the kernel size 3"),
    ("max_pool2d", ["f32[8, 8]"], {"kernel": (2, 2), "stride": (2, 2)}, r"3-d \(C, H, W\) or 4-d"),
    ("max_pool2d", ["f32[1, 1, 8, 8]"], {"kernel": (2,), "stride": (2, 2)},
     r"kernel \[2\] must have 2 entries"),
    ("max_pool2d", ["f32[1, 1, 2, 2]"], {"kernel": (3, 3), "stride": (1, 1)},
     r"output size \[0, 0\] is empty"),
    ("avg_pool2d", ["i32[1, 1, 4, 4]"], {"kernel": (2, 2), "stride": (2, 2)},
     r"floating-point or i64"),
    ("adaptive_avg_pool2d", ["f32[1, 2, 4, 4]"], {"output_size": (1, 2, 3)},
     r"output_size \[1, 2, 3\] must have 2 entries"),
    ("upsample_bilinear2d", ["i64[1, 1, 4, 4]"], {"output_size": (8, 8)}, r"floating-point"),
    ("upsample_nearest2d", ["f32[1, 1, 4, 4]"], {"output_size": (0, 8)}, r"must be positive"),
    ("batch_norm", ["f32[2, 3, 4]", "f32[4]", "f32[3]", "f32[3]", "f32[3]"], {},
     r"weight has shape \[4\] but the input has 3 channels \(axis 1\)"),
    ("layer_norm", ["f32[2, 3]"], {"normalized_rank": 3},
     r"normalized_rank 3 must be between 1 and the input's rank 2"),
    ("layer_norm", ["f32[2, 3]", "f32[2, 3]"], {"normalized_rank": 1},
     r"weight has shape \[2, 3\] but the normalized axes are \[3\]"),
    ("rms_norm", ["f32[2, 3]", "f32[3]", "f32[3]"], {"normalized_rank": 1},
     r"expects 1 to 2 operands, got 3"),
    ("embedding", ["f32[10, 4]", "f32[3]"], {}, r"indices must have an integer dtype, got f32"),
    ("embedding", ["f32[10]", "i64[3]"], {}, r"weight must be 2-d"),
    (SDPA, ["f32[2, 5, 8]", "f32[2, 7, 4]", "f32[2, 7, 4]"], {},
     r"q has embedding size 8 but k has 4"),
    (SDPA, ["f32[2, 5, 8]", "f32[2, 7, 8]", "f32[2, 6, 4]"], {},
     r"k has 7 keys but v has 6 values"),
    (SDPA, ["f32[2, 5, 8]", "f32[2, 7, 8]", "f16[2, 7, 8]"], {}, r"q is f32 but v is f16"),
    (SDPA, ["f32[5, 8]", "f32[5, 8]", "f32[5, 8]", "bool[5, 5]"], {"is_causal": True},
     r"either a mask or is_causal"),
    (SDPA, ["f32[5, 8]", "f32[7, 8]", "f32[7, 8]", "bool[2, 5, 7]"], {},
     r"mask \[2, 5, 7\] does not broadcast to the attention scores \[5, 7\]"),
    (SDPA, ["f32[5, 8]", "f32[7, 8]", "f32[7, 8]", "i64[5, 7]"], {},
     r"mask must be bool .* or floating"),
    ("reshape", ["f32[2, 3]"], {"shape": (4, -1)},
     r"cannot reshape \[2, 3\] \(6 elements\) into \[4, -1\]"),
    ("reshape", ["f32[2, 3]"], {"shape": (-1, -1)}, r"more than one -1"),
    ("reshape", ["f32[0, 3]"], {"shape": (-1, 0)}, r"cannot reshape"),
    ("permute", ["f32[2, 3, 4]"], {"dims": (1, 0)},
     r"dims \[1, 0\] is not a permutation of rank 3"),
    ("permute", ["f32[2, 3]"], {"dims": (0, 0)}, r"not a permutation"),
    ("expand", ["f32[3, 2]"], {"shape": (3, 4)},
     r"cannot expand \[3, 2\] to \[3, 4\]: axis 1 has size 2, which is neither 1 nor 4"),
    ("expand", ["f32[3, 2]"], {"shape": (2,)}, r"to fewer axes"),
    ("expand", ["f32[3]"], {"shape": (-1, 3)}, r"new leading axis 0 .* needs a size"),
    ("slice", ["f32[4]"], {"dim": 0, "start": 0, "end": 2, "step": 0},
     r"step must be positive, got 0"),
    ("slice", ["f32[]"], {"dim": 0, "start": 0, "end": 1}, r"cannot slice a 0-d tensor"),
    ("select", ["f32[2, 3]"], {"dim": 1, "index": 3},
     r"index 3 is out of range for axis 1 of size 3"),
    ("select", ["f32[2, 3]"], {"dim": 0, "index": -3}, r"index -3 is out of range"),
    ("cat", ["f32[2, 3]", "f32[3, 3]"], {"dim": 1},
     r"operand 1 has shape \[3, 3\] but operand 0 has \[2, 3\]; only axis 1 may differ"),
    ("cat", ["f32[2, 3]", "f32[2, 3, 1]"], {"dim": 0}, r"only axis 0 may differ"),
    ("cat", ["f32[]"], {"dim": 0}, r"0-d"),
    ("pad", ["f32[2, 3]"], {"pads": (1, 2, 3)},
     r"pads \[1, 2, 3\] must be \(before, after\) pairs for at most 2 axes"),
    ("pad", ["f32[2, 3]"], {"pads": (-2, -2)},
     r"pads \(-2, -2\) crop more than the 3 elements of axis 1"),
    ("pad", ["i64[3]"], {"pads": (1, 1), "value": float("-inf")},
     r"pad value -inf cannot be stored in i64"),
    ("flip", ["f32[2, 3]"], {"dims": (1, -1)}, r"name the same axis more than once"),
    ("gather", ["f32[3, 4]", "i64[3]"], {"dim": 0}, r"index has rank 1 but input has rank 2"),
    ("gather", ["f32[3, 4]", "f32[3, 4]"], {"dim": 0}, r"index must have an integer dtype"),
    ("gather", ["f32[3, 4]", "i64[2, 5]"], {"dim": 0},
     r"index \[2, 5\] is larger than input \[3, 4\] on axis 1"),
    ("index_select", ["f32[3, 4]", "i64[2, 2]"], {"dim": 0}, r"index must be 0-d or 1-d"),
    ("index", ["f32[3, 4]", "i64[2]"], {"dims": (0, 1)},
     r"dims \[0, 1\] names 2 axes but 1 index tensors"),
    ("index", ["f32[3, 4]", "i64[2]", "i64[2]"], {"dims": (0, 0)}, r"overlap"),
    ("index", ["f32[3, 4]", "bool[3, 4]", "i64[2]"], {"dims": (0, 1)}, r"overlap"),
    ("index", ["f32[3, 4]", "bool[4]"], {"dims": (0,)},
     r"bool mask 0 of shape \[4\] does not match the indexed axes \[3\]"),
    ("index", ["f32[3, 4]", "i64[2]", "i64[3]"], {"dims": (0, 1)}, r"do not broadcast"),
    ("index", ["f32[3, 4]", "f32[2]"], {"dims": (0,)}, r"index 0 must have an integer dtype"),
    ("tril", ["f32[3]"], {}, r"at least 2-d, got \[3\]"),
    ("repeat", ["f32[2, 3]"], {"repeats": (2,)},
     r"repeats \[2\] has fewer entries than the input's rank 2"),
    ("repeat", ["f32[2]"], {"repeats": (-1,)}, r"must be non-negative"),
    ("arange", [], {"end": 5, "step": 0, "dtype": DType.int64}, r"step must be nonzero"),
    ("arange", [], {"start": 5, "end": 0, "dtype": DType.float32}, r"never ends with step 1"),
    ("arange", [], {"end": 5, "dtype": DType.bool}, r"does not produce bool"),
    ("full", [], {"shape": (2,), "value": 300, "dtype": DType.int8}, r"value 300 overflows i8"),
    ("full", [], {"shape": (-1,), "value": 0, "dtype": DType.float32}, r"negative size"),
    ("conv_transpose", ["f32[1, 2, 4]", "f32[2, 3, 3]"],
     {**CONV1, "stride": (2,), "output_padding": (2,)},
     r"output_padding \[2\] must be smaller than stride or dilation"),
    ("conv_transpose", ["f32[1, 4, 4]", "f32[2, 3, 3]"], CONV1,
     r"input has 4 channels but weight \(shape \[Cin, Cout / groups, \*kernel\]\) expects 2"),
    ("max_pool2d_backward", ["f32[1, 1, 3, 3]", "f32[1, 1, 8, 8]"],
     {"kernel": (2, 2), "stride": (2, 2)},
     r"grad has type f32\[1, 1, 3, 3\] but max_pool2d of input f32\[1, 1, 8, 8\] gives f32\[1, 1, 4, 4\]"),
    ("scatter_add", ["f32[3, 4]", "i64[2, 4]", "f16[2, 4]"], {"dim": 0},
     r"src is f16 but input is f32"),
    ("scatter_add", ["f32[3, 4]", "i64[2, 5]", "f32[2, 5]"], {"dim": 0},
     r"index \[2, 5\] is larger than src \[2, 5\] or input \[3, 4\] on axis 1"),
    ("index_put", ["f32[3, 4]", "f32[2, 3]", "i64[2]"], {"dims": (0,)},
     r"values \[2, 3\] do not broadcast to the indexed positions \[2, 4\]"),
]


@pytest.mark.parametrize("op, types, attrs, message", INVALID,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(INVALID)])
def test_inference_rejects_bad_inputs(op: str, types: list[str], attrs: dict, message: str):
    g = Graph("bad")
    operands = [g.add_input(f"x{i}", T(t)) for i, t in enumerate(types)]
    with pytest.raises(OpTypeError, match=message):
        g.op(op, *operands, **attrs)
