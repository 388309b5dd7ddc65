"""Every gradient rule against float64 central finite differences of the reference.

``TABLE`` holds, per differentiable op, a few inputs (with broadcasting where the op
broadcasts).  Each case builds ``loss = sum(op(*inputs) * R)`` for a fixed random ``R`` (so
the whole vector-Jacobian product is checked, not just its sum), differentiates it with
:func:`grad_graph` with respect to every floating-point input, runs the joint graph with the
reference executor in float64 oracle mode, and compares with central differences of the same
graph declared in float64.  Inputs sit away from kinks (relu at 0, ties of max) so finite
differences are meaningful; tie-breaking is checked against torch separately.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fdcheck import central_differences

from kiln.backends.reference import run_graph
from kiln.ir import (
    DType,
    Graph,
    KilnError,
    TensorType,
    builtin_ops,
    get_op,
    parse,
    verify,
)
from kiln.ir.ops.vjp import is_nondifferentiable
from kiln.passes.autodiff import grad_graph

rng = np.random.default_rng(0)
BIG = 2**62


def f(*shape: int, lo: float | None = None, hi: float | None = None) -> np.ndarray:
    """float32 values (normal, or uniform in [lo, hi])."""
    if lo is None:
        return rng.standard_normal(shape).astype(np.float32)
    return rng.uniform(lo, hi, shape).astype(np.float32)


def pos(*shape: int) -> np.ndarray:
    return f(*shape, lo=0.5, hi=2.0)


def ints(*shape: int, lo: int = 0, hi: int = 3) -> np.ndarray:
    return rng.integers(lo, hi, shape).astype(np.int64)


def away_from_zero(*shape: int) -> np.ndarray:
    x = f(*shape)
    return np.where(np.abs(x) < 0.1, x + np.sign(x + 1e-3) * 0.2, x).astype(np.float32)


@dataclass
class G:
    op: str
    inputs: tuple[np.ndarray, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        shapes = ",".join("x".join(map(str, a.shape)) or "()" for a in self.inputs)
        return f"{self.op}({shapes}){self.attrs or ''}"


def g(op: str, *inputs: np.ndarray, **attrs: Any) -> G:
    return G(op, tuple(inputs), attrs)


UNARY = {"exp": f, "log": pos, "log2": pos, "log1p": pos, "expm1": f, "sqrt": pos, "rsqrt": pos,
         "reciprocal": pos, "sigmoid": f, "tanh": f, "sin": f, "cos": f, "tan": lambda *s: f(*s, lo=-1, hi=1),
         "atan": f, "erf": f, "silu": f, "neg": f, "abs": away_from_zero, "relu": away_from_zero,
         "floor": f, "ceil": f, "round": f, "trunc": f, "sign": away_from_zero}
TABLE: list[G] = [g(name, make(2, 3)) for name, make in UNARY.items()]
TABLE += [
    g("gelu", f(2, 3)), g("gelu", f(5), approximate="tanh"),
    g("add", f(2, 3), f(3)), g("sub", f(2, 1), f(1, 3)), g("mul", f(2, 3), f(2, 1)),
    g("mul", f(3), ints(3)), g("div", f(2, 3), pos(3)), g("pow", pos(2, 3), f(3)),
    g("pow", pos(4), np.full((), 2.5, np.float32)),
    g("maximum", f(2, 3), f(3)), g("minimum", f(2, 1), f(2, 4)),
    g("remainder", f(2, 3, lo=-3, hi=3), f(3, lo=0.7, hi=1.3)), g("atan2", f(2, 3), f(3)),
    g("where", rng.random((2, 3)) < 0.5, f(3), f(2, 1)),
    g("cast", f(2, 3), dtype=DType.float64), g("clamp", f(3, 4) * 2, min=-0.5, max=0.7),
    g("clamp", f(6), max=0.3), g("silu_mul", f(2, 3), f(3)),
    # reductions
    g("sum", f(2, 3, 4), dims=(1, -1)), g("sum", f(2, 3), dims=(0,), keepdim=True, dtype=DType.float64),
    g("mean", f(2, 3, 4), dims=(0, 2)), g("mean", f(3, 2)),
    g("prod", pos(2, 3), dims=(1,)), g("prod", np.array([[0.5, 0.0, 2.0], [1.5, 0.7, 0.0], [0.0, 1.2, 2.0]],
                                                       np.float32), dims=(1,), keepdim=True),
    g("var", f(3, 4), dims=(1,)), g("var", f(2, 5), dims=(0,), correction=0.0, keepdim=True),
    g("amax", f(3, 4), dims=(1,)), g("amin", f(2, 3, 2), dims=(0, 2), keepdim=True),
    g("cumsum", f(3, 4), dim=1), g("cumsum", f(2, 3), dim=0, dtype=DType.float64),
    g("softmax", f(2, 5), dim=-1), g("log_softmax", f(3, 4), dim=0),
    # linalg
    g("matmul", f(2, 3), f(3, 4)), g("matmul", f(2, 2, 3), f(3, 2)), g("matmul", f(3), f(3, 2)),
    g("matmul", f(2, 3), f(3)), g("matmul", f(4), f(4)), g("matmul", f(2, 1, 2, 3), f(3, 3, 2)),
    # special functions and float manipulation (kiln/ir/ops/special.py)
    g("asin", f(2, 3, lo=-0.9, hi=0.9)), g("acos", f(2, 3, lo=-0.9, hi=0.9)), g("asinh", f(2, 3)),
    g("acosh", f(2, 3, lo=1.2, hi=3.0)), g("atanh", f(2, 3, lo=-0.9, hi=0.9)), g("sinh", f(2, 3)),
    g("cosh", f(2, 3)), g("log10", pos(2, 3)), g("exp2", f(2, 3)), g("erfc", f(2, 3)),
    g("erfinv", f(2, 3, lo=-0.9, hi=0.9)), g("lgamma", pos(2, 3)), g("polygamma", pos(2, 3)),
    g("polygamma", pos(2, 3), n=2), g("i0", f(2, 3)), g("i0e", away_from_zero(2, 3)),
    g("i1", np.array([0.0, 0.5, -1.5, 2.0], np.float32)), g("i1e", away_from_zero(2, 3)),
    g("fmod", f(2, 3, lo=-3, hi=3), f(3, lo=0.7, hi=1.3)), g("copysign", away_from_zero(2, 3), f(3)),
    g("fmax", f(2, 3), f(3)), g("fmin", f(2, 1), f(2, 4)), g("nextafter", f(2, 3), f(3)),
    g("erfcx", f(2, 3)), g("ndtri", f(2, 3, lo=0.1, hi=0.9)), g("log_ndtr", f(2, 3)),
    g("entr", pos(2, 3)), g("zeta", ints(2, 3, lo=2, hi=5), pos(3)),
    g("igamma", ints(2, 3, lo=1, hi=4), pos(3)), g("igammac", ints(2, 3, lo=1, hi=4), pos(3)),
    g("inv", f(2, 3, 3) + 3 * np.eye(3, dtype=np.float32)), g("det", f(3, 3) + 2 * np.eye(3, dtype=np.float32)),
    # factorizations (kiln/ir/ops/linalg.py, factorizations.py); symmetric inputs are read with triangle="both",
    # whose derivative is the rule's symmetric gradient exactly
    g("triangular_solve", f(2, 3, 3) + 3 * np.eye(3, dtype=np.float32), f(3, 2), upper=True),
    g("triangular_solve", f(3, 3) + 3 * np.eye(3, dtype=np.float32), f(2, 4, 3), upper=False, left=False,
      unitriangular=True),
    g("cholesky", f(2, 3, 3) + 4 * np.eye(3, dtype=np.float32), triangle="both"),
    g("svd", f(4, 3), part="u"), g("svd", f(3, 4), part="u"), g("svd", f(2, 4, 3), part="s"),
    g("svd", f(3, 4), part="s"), g("svd", f(4, 3), part="vh"), g("svd", f(3, 4), part="vh"),
    g("eigh", f(2, 3, 3), part="values", triangle="both"), g("eigh", f(4, 4), part="vectors", triangle="both"),
    g("lu", f(2, 3, 3), part="packed"), g("lu", f(4, 3), part="packed"), g("lu", f(3, 4), part="packed"),
    g("lu", f(4, 3), part="l"), g("lu", f(3, 4), part="u"),
    g("qr", f(2, 4, 3), part="q"), g("qr", f(4, 3), part="r"), g("qr", f(3, 4), part="q"),
    g("qr", f(3, 4), part="r"), g("qr", f(3, 3), part="q", mode="complete"),
    g("matrix_exp", f(2, 3, 3) * 0.5),
    # nn
    g("conv", f(2, 4, 5, 5), f(4, 2, 3, 2), f(4), stride=(2, 1), padding=(1, 0), dilation=(1, 2),
      groups=2),
    g("conv", f(1, 2, 7), f(3, 2, 3), stride=(2,), padding=(1,), dilation=(2,)),
    g("conv", f(1, 3, 4, 4), f(3, 1, 3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=3),
    g("conv_transpose", f(1, 4, 3, 3), f(4, 1, 3, 2), f(2), stride=(2, 1), padding=(1, 0),
      dilation=(1, 2), groups=2, output_padding=(1, 0)),
    g("max_pool2d", f(1, 2, 5, 6), kernel=(3, 3), stride=(2, 2), padding=(1, 1), ceil_mode=True),
    g("max_pool2d", f(2, 4, 5), kernel=(2, 2), stride=(1, 2), dilation=(2, 1)),
    g("max_pool2d_backward", f(1, 2, 3, 4), f(1, 2, 5, 6), kernel=(3, 3), stride=(2, 2),
      padding=(1, 1), ceil_mode=True),
    g("max_pool2d_select", f(1, 2, 5, 6), f(1, 2, 5, 6), kernel=(3, 3), stride=(2, 2),
      padding=(1, 1), ceil_mode=True),
    g("avg_pool2d", f(1, 2, 5, 6), kernel=(3, 3), stride=(2, 2), padding=(1, 1), ceil_mode=True,
      count_include_pad=False),
    g("avg_pool2d", f(1, 1, 5, 5), kernel=(2, 3), stride=(2, 1), padding=(1, 1)),
    g("avg_pool2d", f(1, 1, 4, 4), kernel=(2, 2), stride=(2, 2), divisor_override=3),
    g("adaptive_avg_pool2d", f(1, 2, 5, 7), output_size=(3, 2)),
    g("upsample_nearest2d", f(1, 1, 3, 4), output_size=(5, 7)),
    g("upsample_bilinear2d", f(1, 2, 3, 4), output_size=(5, 6)),
    g("upsample_bilinear2d", f(1, 1, 4, 3), output_size=(3, 5), align_corners=True),
    g("upsample_bilinear2d", f(1, 1, 3, 4), output_size=(5, 6), scales=(1.7, 1.5)),
    g("upsample_nearest2d", f(1, 1, 3, 4), output_size=(5, 6), exact=True, scales=(1.7, 1.5)),
    g("conv_transpose", f(1, 2, 2, 3, 2), f(2, 2, 2, 3, 2), stride=(2, 1, 2), padding=(1, 1, 0),
      dilation=(1, 1, 1), output_padding=(1, 0, 1)),
    g("max_pool3d", f(1, 2, 4, 5, 3), kernel=(2, 3, 2), stride=(1, 2, 2), padding=(1, 1, 0),
      dilation=(1, 1, 1), ceil_mode=True),
    g("max_pool3d_backward", f(1, 1, 2, 3, 2), f(1, 1, 4, 5, 3), kernel=(3, 3, 2), stride=(2, 2, 1),
      padding=(1, 1, 0)),
    g("max_pool3d_select", f(1, 1, 4, 5, 3), f(1, 1, 4, 5, 3), kernel=(3, 3, 2), stride=(2, 2, 1),
      padding=(1, 1, 0)),
    g("avg_pool3d", f(1, 2, 4, 5, 3), kernel=(3, 2, 2), stride=(2, 2, 1), padding=(1, 1, 0),
      ceil_mode=True, count_include_pad=False),
    g("avg_pool3d", f(2, 3, 4, 4), kernel=(2, 2, 2), stride=(2, 2, 2), divisor_override=3),
    g("adaptive_avg_pool3d", f(1, 2, 5, 4, 7), output_size=(3, 2, 4)),
    g("upsample_nearest3d", f(1, 1, 2, 3, 4), output_size=(3, 5, 7)),
    g("upsample_trilinear3d", f(1, 1, 2, 3, 4), output_size=(3, 5, 3)),
    g("upsample_trilinear3d", f(2, 3, 2, 3), output_size=(4, 2, 5), align_corners=True),
    g("upsample_bicubic2d", f(1, 2, 4, 3), output_size=(6, 5)),
    g("upsample_bicubic2d", f(1, 1, 5, 4), output_size=(3, 7), align_corners=True),
    g("batch_norm", f(2, 3, 2, 2), f(3), f(3), f(3), pos(3), eps=1e-3),
    g("layer_norm", f(2, 3, 4), f(4), f(4), normalized_rank=1),
    g("group_norm", f(2, 4, 3, 2), f(4), f(4), groups=2, eps=1e-3),
    g("group_norm", f(2, 6, 5), groups=3),
    g("layer_norm", f(2, 3, 4), normalized_rank=2),
    g("rms_norm", f(2, 5), f(5), normalized_rank=1), g("rms_norm", f(2, 2, 3), normalized_rank=2),
    g("embedding", f(5, 3), ints(2, 4, hi=5)),
    g("scaled_dot_product_attention", f(2, 3, 4), f(2, 5, 4), f(2, 5, 2)),
    g("scaled_dot_product_attention", f(1, 4, 3), f(1, 4, 3), f(1, 4, 3), is_causal=True, scale=0.7),
    g("scaled_dot_product_attention", f(2, 3, 4), f(1, 5, 4), f(5, 2), rng.random((3, 5)) < 0.7),
    g("scaled_dot_product_attention", f(2, 3, 4), f(2, 5, 4), f(2, 5, 2), f(1, 5)),
    # layout
    g("reshape", f(2, 6), shape=(3, -1)), g("permute", f(2, 3, 4), dims=(2, 0, 1)),
    g("expand", f(3, 1), shape=(2, -1, 4)), g("slice", f(3, 7), dim=1, start=1, end=BIG, step=3),
    g("slice", f(4, 3), dim=0, start=-3, end=-1), g("select", f(3, 4), dim=1, index=-2),
    g("cat", f(2, 3), f(2, 1), f(2, 2), dim=1), g("cat", f(2, 2), ints(1, 2), dim=0),
    g("pad", f(2, 3, 4), pads=(1, 2, -1, 1)), g("flip", f(2, 3, 2), dims=(0, 2)),
    g("gather", f(3, 4), ints(2, 4), dim=0), g("gather", f(3, 4), ints(3, 2, hi=4), dim=-1),
    # one position per row (a loss picking each target): the elementwise where() form
    g("gather", f(5, 7), ints(5, 1, hi=7), dim=1), g("gather", f(5, 7), ints(1, 7, hi=5), dim=0),
    g("gather", f(2, 6, 3), ints(2, 1, 3, hi=6), dim=-2), g("gather", f(4, 1), ints(4, 1, hi=1), dim=1),
    g("scatter_add", f(3, 4), ints(2, 3), f(2, 4), dim=0),
    g("index_select", f(3, 4), ints(5, hi=4), dim=1),
    g("index_select", f(3, 2), np.array(2, np.int64), dim=0),
    g("index", f(3, 4, 2), ints(2, 3, lo=-3, hi=3), dims=(0,)),
    g("index", f(3, 4, 2), ints(2, hi=3), ints(3, 1, hi=2), dims=(0, 2)),
    g("index_put", f(4, 3), f(2, 3), ints(2, hi=4), dims=(0,), accumulate=True),
    g("index_put", f(4, 3), f(3), np.array([2, 0], np.int64), dims=(0,)),
    g("tril", f(3, 4), diagonal=1), g("triu", f(2, 3, 3)), g("repeat", f(2, 3), repeats=(2, 1, 2)),
    # sorting, scans and scatters (kiln/ir/ops/sorting.py, scatter.py)
    g("cumprod", f(3, 4), dim=1), g("cumprod", np.array([[0.5, 0.0, 2.0, 1.5], [0.0, 1.2, 0.0, -2.0]],
                                                       np.float32), dim=-1),
    g("scatter", f(3, 4), np.array([[0, 2, 1, 2], [1, 0, 0, 1]], np.int64), f(2, 5), dim=0),
    g("scatter_reduce", f(3, 4), ints(2, 3), f(2, 4), dim=0, reduce="sum", include_self=False),
    g("scatter_reduce", f(3, 4), ints(3, 3, hi=4), f(3, 3), dim=1, reduce="mean"),
    g("scatter_reduce", f(4, 3), ints(2, 3, hi=4), f(2, 3), dim=0, reduce="mean", include_self=False),
    g("scatter_reduce", f(3, 4), ints(2, 4), f(2, 4), dim=0, reduce="amax"),
    g("scatter_reduce", f(3, 4), ints(2, 4), f(2, 4), dim=0, reduce="amin", include_self=False),
    g("scatter_reduce", pos(3, 4), ints(2, 4), pos(2, 4), dim=0, reduce="prod"),
    g("scatter_reduce", np.array([[0.0, 1.5], [2.0, 0.5], [0.7, 1.1]], np.float32),
      np.array([[0, 0], [1, 0], [0, 2]], np.int64), np.array([[1.3, 0.0], [0.0, 0.9], [0.6, 1.7]], np.float32),
      dim=0, reduce="prod"),
    g("scatter_reduce", pos(3, 2), np.array([[0, 1], [0, 1]], np.int64),
      np.array([[0.0, 1.2], [0.8, 0.0]], np.float32), dim=0, reduce="prod", include_self=False),
]


# ------------------------------------------------------------------------------ harness
def _build(case: G, float_dtype: DType) -> Graph:
    graph = Graph("case")
    values = []
    for i, a in enumerate(case.inputs):
        dtype = float_dtype if a.dtype.kind == "f" else DType.from_numpy(a.dtype)
        values.append(graph.add_input(f"x{i}", TensorType(tuple(a.shape), dtype)))
    y = graph.op(case.op, *values, **case.attrs)
    weights = np.random.default_rng(1).standard_normal(y.shape).astype(np.float32)
    r = graph.add_constant(weights.astype(y.dtype.numpy), y.dtype)
    graph.set_outputs([graph.op("sum", graph.op("mul", y, r))])
    return graph


def _arrays(case: G, dtype) -> list[np.ndarray]:
    return [np.array(a, dtype=dtype) if a.dtype.kind == "f" else a for a in case.inputs]


def _finite_differences(case: G, eps: float = 1e-6) -> list[np.ndarray]:
    graph = _build(case, DType.float64)
    arrays = _arrays(case, np.float64)
    return central_differences(lambda: float(run_graph(graph, arrays, [])[0]), arrays, eps)


@pytest.mark.parametrize("case", TABLE, ids=repr)
def test_rule_matches_finite_differences(case: G):
    graph = _build(case, DType.float32)
    wrt = [v.name for v in graph.inputs if v.dtype.is_floating]
    joint = grad_graph(graph, wrt=wrt)
    verify(joint.graph)
    assert str(parse(str(joint.graph))) == str(joint.graph)
    for v, name in zip([graph.inputs[int(n[1:])] for n in wrt], wrt):
        out = joint.graph.outputs[joint.grad_outputs[name]]
        assert out.type == v.type, f"gradient of {name} has type {out.type}, want {v.type}"
    arrays = _arrays(case, np.float32)
    got = run_graph(joint.graph, arrays, [], float64=True)
    run_graph(joint.graph, arrays, [])  # the float32 graph runs too
    want = _finite_differences(case)
    for name, expected in zip(wrt, want):
        actual = got[joint.grad_outputs[name]]
        scale = max(np.linalg.norm(expected), 1e-3)
        err = np.linalg.norm(actual - expected) / scale
        assert err < 1e-5, f"d loss / d {name}: relative error {err:.2e}\n{actual}\nvs\n{expected}"


NONDIFFERENTIABLE = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
                     "logical_not", "isnan", "isinf", "any", "all", "argmax", "argmin", "arange", "full",
                     "argsort", "argtopk", "cumarg", "searchsorted", "dropout_mask", "random_uniform", "signbit",
                     "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0",
                     "modified_bessel_i1", "modified_bessel_k0", "modified_bessel_k1",
                     "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "spherical_bessel_j0",
                     "airy_ai", "stop_gradient"}
NONDIFFERENTIABLE |= {"frexp_exponent", "hermite_polynomial_h", "hermite_polynomial_he",
                      "laguerre_polynomial_l", "legendre_polynomial_p",
                      *(f"{s}chebyshev_polynomial_{k}" for s in ("", "shifted_") for k in "tuvw")}
NONDIFFERENTIABLE |= {"max_pool2d_indices", "max_pool3d_indices"}  # integer positions
NONDIFFERENTIABLE |= {"lu_permutation", "geqrf", "ldl", "ldl_solve"}  # from integer pivots; not differentiable in torch
# Collectives: one process can only check world_size=1 (an identity) by finite differences;
# their transposes over ranks are checked against one process in tests/test_schedule_dist.py
TABLE += [g("all_reduce", f(2, 3), world_size=1), g("all_gather", f(2, 3), world_size=1, dim=1),
          g("reduce_scatter", f(2, 3), world_size=1, dim=0),
          g("all_to_all", f(2, 3), world_size=1, split_dim=1, concat_dim=0)]
INLINED = {"fused"}  # autodiff inlines fused bodies before differentiating
# custom_vjp's rule is the user's backward graph, typed for one dtype (no float64 twin for
# finite differences): tests/test_custom_function.py checks it against finite differences
# and against eager
INLINED |= {"custom_vjp"}


def test_every_op_has_a_rule_and_every_rule_is_checked():
    ops = builtin_ops()  # ops other tests declare do not count
    missing = {n for n, d in ops.items() if d.vjp is None} - INLINED
    assert not missing, f"ops without a gradient rule: {sorted(missing)}"
    marked = {n for n, d in ops.items() if is_nondifferentiable(d.vjp)}
    assert marked == NONDIFFERENTIABLE
    unchecked = set(ops) - marked - INLINED - {c.op for c in TABLE}
    assert not unchecked, f"rules without a finite-difference case: {sorted(unchecked)}"


def test_nondifferentiable_ops_pass_no_gradient():
    graph = Graph("mask")
    x = graph.add_input("x", TensorType((2, 3), DType.float32))
    zero = graph.add_constant(np.float32(0))
    positive = graph.op("gt", x, zero)
    picked = graph.op("where", positive, graph.add_constant(np.float32(2)), graph.add_constant(np.float32(3)))
    index = graph.op("cast", graph.op("argmax", x, dim=1), dtype=DType.float32)
    graph.set_outputs([graph.op("add", graph.op("sum", picked), graph.op("sum", index))])
    joint = grad_graph(graph, wrt=["x"])
    (grad,) = run_graph(joint.graph, [f(2, 3)], [])[1:]
    np.testing.assert_array_equal(grad, np.zeros((2, 3), np.float32))
    assert joint.graph.outputs[1].producer.op_name == "full"  # structurally zero


def test_missing_rule_names_op_and_location(monkeypatch):
    graph = Graph("g")
    x = graph.add_input("x", TensorType((3,), DType.float32))
    y = graph.op("tanh", x, loc="model.py:7 in forward: y = torch.tanh(x)")
    graph.set_outputs([graph.op("sum", y)])
    monkeypatch.setattr(get_op("tanh"), "vjp", None)
    with pytest.raises(KilnError, match=re.escape("op 'tanh' has no gradient rule") +
                       r".*at model.py:7 in forward: y = torch.tanh\(x\)"):
        grad_graph(graph, wrt=["x"])


# ----------------------------------------------------------- tie-breaking against torch
def _kiln_grad(op: str, arrays: list[np.ndarray], **attrs) -> list[np.ndarray]:
    graph = Graph("ties")
    values = [graph.add_input(f"x{i}", TensorType(a.shape, DType.float32)) for i, a in enumerate(arrays)]
    graph.set_outputs([graph.op("sum", graph.op(op, *values, **attrs))])
    joint = grad_graph(graph, wrt=[v.name for v in values])
    return run_graph(joint.graph, arrays, [])[1:]


def _torch_grad(fn, arrays: list[np.ndarray]) -> list[np.ndarray]:
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    fn(*ts).sum().backward()
    return [t.grad.numpy() for t in ts]


TIES = [
    ("maximum", [np.array([1, 2, 3], np.float32), np.array([1, 0, 3], np.float32)], {}, torch.maximum),
    ("minimum", [np.array([1, 2, 3], np.float32), np.array([1, 5, 0], np.float32)], {}, torch.minimum),
    ("amax", [np.array([[1, 3, 3], [2, 2, 2]], np.float32)], {"dims": (1,)}, lambda x: x.amax(1)),
    ("amin", [np.array([[1, 1, 3], [0, 2, 0]], np.float32)], {}, lambda x: x.amin()),
    ("clamp", [np.array([-1, -0.5, 0, 0.5, 1], np.float32)], {"min": -0.5, "max": 0.5},
     lambda x: x.clamp(-0.5, 0.5)),
    ("relu", [np.array([-1, 0, 1], np.float32)], {}, torch.relu),
    ("abs", [np.array([-1, 0, 1], np.float32)], {}, torch.abs),
    ("max_pool2d", [np.array([[[[1, 1, 0], [0, 1, 2], [2, 0, 2]]]], np.float32)],
     {"kernel": (2, 2), "stride": (1, 1)}, lambda x: F.max_pool2d(x, 2, 1)),
    ("prod", [np.array([[0, 2, 3], [0, 0, 1], [1, 2, 4]], np.float32)], {"dims": (1,)},
     lambda x: x.prod(1)),
]


@pytest.mark.parametrize("op, arrays, attrs, fn", TIES, ids=[t[0] for t in TIES])
def test_ties_and_kinks_follow_torch(op, arrays, attrs, fn):
    for got, want in zip(_kiln_grad(op, arrays, **attrs), _torch_grad(fn, arrays)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
