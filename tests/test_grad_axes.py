"""Gradients over every axis: finite differences per rule, then end to end against float64.

Part 1 -- every gradient rule of an op with an axis-like attribute (``dim``, ``dims``,
``normalized_rank``..., found in the registry, so a new op cannot be forgotten), plus the
shape-moving ops (``expand``, ``reshape``, ``matmul`` batch broadcasting), checked against
float64 central finite differences of the reference executor (the method of
``tests/test_grad_rules.py``: loss ``sum(op(x) * R)`` for a fixed random ``R``) over every
axis, negative axes and ``keepdim`` both ways.  Each case runs three ways: the rule's joint
graph on contiguous inputs, the same on non-contiguous (strided) numpy inputs, and with the
operand made by a ``permute`` inside the graph and the default pass pipeline run over the
joint graph (the passes move axes: ``sink-views``, ``composites``, ``fuse``).

Part 2 -- end to end through ``torch.compile(backend="kiln", options={"strict": True})`` on
the ``reference`` and ``cpu`` backends with the default passes: softmax/reductions over each
axis after ``transpose``/``permute``/``view``, attention in the forms real models call
(``q @ k^T``, ``scaled_dot_product_attention`` with and without masks, causal, scaled,
grouped-query heads; the fused ATen variants), and Hugging Face encoders and a Llama-style
decoder.  Results are judged with :mod:`kiln.zoo.compare`: kiln float32 against eager
float64.  Gradients that are zero in theory (a bias constant along the softmax axis, the key
bias under a softmax over keys) must be reported as float32 noise (``by_float32_noise``);
every other output and gradient must pass the plain 1e-4 relative test.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from fdcheck import central_differences
from torch import nn

import kiln
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, TensorType, builtin_ops, verify
from kiln.ir.ops.vjp import is_nondifferentiable
from kiln.passes import default_pipeline
from kiln.passes.autodiff import grad_graph
from kiln.zoo.compare import compare_all, flatten_outputs, weighted_loss, weights_for

rng = np.random.default_rng(0)
BIG = 2**62


def f(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def pos(*shape: int) -> np.ndarray:
    return rng.uniform(0.5, 2.0, shape).astype(np.float32)


def ints(*shape: int, hi: int) -> np.ndarray:
    return rng.integers(0, hi, shape).astype(np.int64)


@dataclass
class A:
    """One finite-difference case: ``op(*inputs, **attrs)``."""

    op: str
    inputs: tuple[np.ndarray, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        shapes = ",".join("x".join(map(str, a.shape)) or "()" for a in self.inputs)
        attrs = ",".join(f"{k}={v}" for k, v in self.attrs.items())
        return f"{self.op}({shapes}){attrs}"



def _distinct_along(shape, dim: int, n: int) -> np.ndarray:
    """Indices of ``shape`` whose entries along ``dim`` are distinct (0, n-1, 1, n-2, ...)."""
    k = shape[dim]
    order = [(j // 2) if j % 2 == 0 else n - 1 - j // 2 for j in range(k)]
    view = [1] * len(shape)
    view[dim] = k
    return np.broadcast_to(np.array(order, np.int64).reshape(view), shape).copy()


def a(op: str, *inputs: np.ndarray, **attrs: Any) -> A:
    return A(op, tuple(inputs), attrs)


def axis_subsets(rank: int):
    """Every non-empty set of axes, once with positive and once with negative numbers
    (mixed for two or more axes), and the empty set (= every axis)."""
    yield ()
    for n in range(1, rank + 1):
        for combo in itertools.combinations(range(rank), n):
            yield combo
            yield tuple(d - rank if i % 2 == 0 else d for i, d in enumerate(combo))


S3 = (2, 3, 4)
CASES: list[A] = []
for dim in range(-3, 3):
    CASES += [a("softmax", f(*S3), dim=dim), a("log_softmax", f(*S3), dim=dim),
              a("cumsum", f(*S3), dim=dim)]
    if "cumprod" in builtin_ops():
        CASES.append(a("cumprod", pos(*S3), dim=dim))
CASES += [a("softmax", f(2, 1, 3, 2), dim=d) for d in (1, -1, -4)]
CASES += [a("log_softmax", f(5), dim=-1), a("cumsum", f(5), dim=0, dtype=DType.float64)]
for dims in axis_subsets(3):
    for keepdim in (False, True):
        CASES += [a("sum", f(*S3), dims=dims, keepdim=keepdim),
                  a("mean", f(*S3), dims=dims, keepdim=keepdim),
                  a("prod", pos(*S3), dims=dims, keepdim=keepdim),
                  a("amax", f(*S3), dims=dims, keepdim=keepdim),
                  a("amin", f(*S3), dims=dims, keepdim=keepdim),
                  a("var", f(*S3), dims=dims, keepdim=keepdim,
                    correction=1.0 if keepdim else 0.0)]
CASES += [a("sum", f(2, 3), dims=(-1,), dtype=DType.float64), a("sum", f(4), dims=(0,)),
          a("mean", f(2, 1, 3), dims=(1,), keepdim=True)]
for rank in (1, 2, 3):
    shape = S3[3 - rank:]
    CASES += [a("layer_norm", f(*S3), f(*shape), f(*shape), normalized_rank=rank),
              a("layer_norm", f(*S3), normalized_rank=rank),
              a("rms_norm", f(*S3), f(*shape), normalized_rank=rank),
              a("rms_norm", f(*S3), normalized_rank=rank)]
for dim in range(-3, 3):
    sizes = [list(S3) for _ in range(3)]
    for i, n in enumerate((1, 2, 3)):
        sizes[i][dim] = n
    n = S3[dim]
    idx_shape = list(S3)
    idx_shape[dim] = 2
    other = [s - 1 if k != dim % 3 else s for k, s in enumerate(S3)]  # gather's index may be smaller
    other[dim] = 3
    CASES += [
        a("cat", *(f(*s) for s in sizes), dim=dim),
        a("slice", f(*S3), dim=dim, start=1, end=BIG, step=2),
        a("slice", f(*S3), dim=dim, start=-n, end=-1),
        a("select", f(*S3), dim=dim, index=-1), a("select", f(*S3), dim=dim, index=0),
        a("gather", f(*S3), ints(*other, hi=n), dim=dim),
        a("index_select", f(*S3), ints(5, hi=n), dim=dim),
        a("scatter_add", f(*S3), ints(*idx_shape, hi=n), f(*idx_shape), dim=dim),
        # scatter: last write wins, so distinct targets along dim keep it differentiable
        a("scatter", f(*S3), _distinct_along(idx_shape, dim, n), f(*idx_shape), dim=dim),
        a("scatter_reduce", f(*S3), ints(*idx_shape, hi=n), f(*idx_shape), dim=dim, reduce="sum"),
        a("scatter_reduce", f(*S3), ints(*idx_shape, hi=n), f(*idx_shape), dim=dim, reduce="mean",
          include_self=False),
        a("index", f(*S3), ints(2, 2, hi=n), dims=(dim,)),
        a("index_put", f(*S3), f(*[2 if k == dim % 3 else s for k, s in enumerate(S3)]),
          ints(2, hi=n), dims=(dim,), accumulate=True),
    ]
CASES += [a("cat", f(2, 3), f(2, 3), dim=-2)]
CASES += [a("index", f(*S3), ints(3, hi=2), ints(3, hi=4), dims=(0, -1))]
CASES += [a("flip", f(*S3), dims=dims) for dims in axis_subsets(3) if dims]
CASES += [a("permute", f(*S3), dims=p) for p in itertools.permutations(range(3))]
CASES += [a("permute", f(*S3), dims=(-1, 0, -2)), a("permute", f(2, 1, 3, 2), dims=(3, 1, 0, 2))]
CASES += [a("expand", f(3, 1), shape=(2, -1, 4)), a("expand", f(1, 3, 1), shape=(2, 3, 4)),
          a("expand", f(2, 1, 4), shape=(-1, 3, -1)), a("expand", f(4), shape=(2, 3, 4))]
CASES += [a("reshape", f(*S3), shape=s) for s in ((6, 4), (-1, 12), (2, 12), (4, -1, 2), (24,),
                                                    (1, 2, 3, 4, 1))]
CASES += [a("pad", f(*S3), pads=(1, 0)), a("pad", f(*S3), pads=(0, 0, 2, 1)),
          a("pad", f(*S3), pads=(0, 1, -1, 0, 1, 1))]
_MASK = np.where(rng.random((3, 5)) < 0.6, f(3, 5), -np.inf).astype(np.float32)
_MASK[1] = -np.inf  # a query row with every key masked out
CASES += [a("scaled_dot_product_attention", f(2, 3, 4), f(2, 5, 4), f(2, 5, 2), _MASK)]
# collectives over each axis, world_size=1 (one process; across ranks: tests/test_schedule_dist.py)
CASES += [a("all_gather", f(*S3), world_size=1, dim=d) for d in (0, 2, -1)]
CASES += [a("reduce_scatter", f(*S3), world_size=1, dim=d) for d in (1, -3)]
CASES += [a("all_to_all", f(*S3), world_size=1, split_dim=s, concat_dim=c) for s, c in ((0, 2), (-1, 1))]
CASES += [a("matmul", x, y) for x, y in (
    (f(2, 1, 3, 4), f(5, 4, 2)), (f(4), f(2, 4, 3)), (f(2, 3, 4), f(4)), (f(1, 3, 4), f(2, 4, 5)),
    (f(3, 4), f(2, 2, 4, 5)), (f(2, 2, 3, 4), f(4, 5)), (f(2, 1, 3, 4), f(1, 2, 4, 2)))]

AXIS_ATTR_NAMES = {"normalized_rank", "axis", "axes"}
"""Attribute names that name axes besides those containing ``dim`` (dim, dims, start_dim...)."""
SHAPE_MOVING = {"expand", "reshape", "matmul", "pad"}
"""Ops that move or broadcast axes without an axis attribute; checked here too."""


def axis_ops() -> set[str]:
    """Registry ops with an axis-like attribute."""
    return {name for name, d in builtin_ops().items()
            if any("dim" in attr or attr in AXIS_ATTR_NAMES for attr in d.attrs)}


def test_every_op_with_an_axis_attribute_has_cases():
    ops = builtin_ops()
    needed = {n for n in axis_ops() | SHAPE_MOVING
              if ops[n].vjp is not None and not is_nondifferentiable(ops[n].vjp)}
    assert {"softmax", "sum", "cat", "layer_norm", "gather"} <= needed  # the detection works
    missing = needed - {c.op for c in CASES}
    assert not missing, (f"ops with an axis attribute and a gradient rule lack axis cases in "
                         f"tests/test_grad_axes.py: {sorted(missing)}")
    for name in ("sum", "softmax", "amax", "cumsum", "gather", "cat"):
        dims = {c.attrs.get("dim", c.attrs.get("dims")) for c in CASES if c.op == name}
        assert any(isinstance(d, int) and d < 0 or isinstance(d, tuple) and any(x < 0 for x in d)
                   for d in dims), f"{name}: no negative axis"


# ------------------------------------------------------------------------------ harness
def _graph(case: A, float_dtype: DType, permuted: bool) -> Graph:
    """``sum(op(*inputs) * R)``; with ``permuted`` the floating operands enter reversed and
    are permuted back inside the graph (a strided view for a backend, an axis move for the
    passes)."""
    graph = Graph("case")
    values = []
    for i, arr in enumerate(case.inputs):
        floating = arr.dtype.kind == "f"
        dtype = float_dtype if floating else DType.from_numpy(arr.dtype)
        if permuted and floating and arr.ndim > 1:
            x = graph.add_input(f"x{i}", TensorType(tuple(reversed(arr.shape)), dtype))
            values.append(graph.op("permute", x, dims=tuple(reversed(range(arr.ndim)))))
        else:
            values.append(graph.add_input(f"x{i}", TensorType(tuple(arr.shape), dtype)))
    y = graph.op(case.op, *values, **case.attrs)
    weights = np.random.default_rng(1).standard_normal(y.shape)
    r = graph.add_constant(weights.astype(y.dtype.numpy), y.dtype)
    graph.set_outputs([graph.op("sum", graph.op("mul", y, r))])
    return graph


def _arrays(case: A, dtype, permuted: bool = False) -> list[np.ndarray]:
    out = []
    for arr in case.inputs:
        if arr.dtype.kind == "f":
            arr = np.array(arr, dtype=dtype)
            if permuted and arr.ndim > 1:
                arr = arr.transpose()
        out.append(arr)
    return out


def _strided(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The same values in non-contiguous arrays (every other element of a larger buffer)."""
    out = []
    for arr in arrays:
        if arr.ndim:
            big = np.zeros((*arr.shape[:-1], 2 * arr.shape[-1]), arr.dtype)
            big[..., ::2] = arr
            arr = big[..., ::2]
            assert not arr.flags.c_contiguous or arr.size <= 1
        out.append(arr)
    return out


def _finite_differences(case: A, eps: float = 1e-6) -> list[np.ndarray]:
    graph = _graph(case, DType.float64, False)
    arrays = _arrays(case, np.float64)
    return central_differences(lambda: float(run_graph(graph, arrays, [])[0]), arrays, eps)


_PASSES = default_pipeline()


def _check(got: list[np.ndarray], want: list[np.ndarray], how: str) -> None:
    assert len(got) == len(want)
    for i, (actual, expected) in enumerate(zip(got, want)):
        actual = np.asarray(actual).reshape(expected.shape)
        scale = max(np.linalg.norm(expected), 1e-3)
        err = np.linalg.norm(actual - expected) / scale
        assert err < 1e-5, f"{how}: gradient {i}: relative error {err:.2e}\n{actual}\nvs\n{expected}"


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_axis_gradient_matches_finite_differences(case: A):
    want = _finite_differences(case)
    for permuted in (False, True):
        graph = _graph(case, DType.float32, permuted)
        wrt = [v.name for v in graph.inputs if v.dtype.is_floating]
        joint = grad_graph(graph, wrt=wrt)
        verify(joint.graph)
        arrays = _arrays(case, np.float32, permuted)
        grads = [joint.grad_outputs[n] for n in wrt]
        if permuted:  # through the default passes, which move the axes
            optimized = _PASSES.run(joint.graph).graph
            got = run_graph(optimized, arrays, [], float64=True)
            _check([got[i].transpose() for i in grads], want, "permuted operand, default passes")
        else:
            got = run_graph(joint.graph, arrays, [], float64=True)
            _check([got[i] for i in grads], want, "contiguous")
            got = run_graph(joint.graph, _strided(arrays), [], float64=True)
            _check([got[i] for i in grads], want, "strided inputs")


# ============================================================ part 2: end to end, float64-judged
BACKENDS = ("reference", "cpu")


def _to(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype).requires_grad_(True)
    return x


def _run(model: nn.Module, args: tuple, kwargs: dict, dtype: torch.dtype,
         backend: str | None) -> dict[str, torch.Tensor]:
    """Outputs, parameter gradients and floating input gradients of ``model`` run eagerly in
    ``dtype`` or compiled by kiln (float32) with ``backend``; loss ``sum(out * R)``."""
    model = copy.deepcopy(model).to(dtype)
    args = tuple(_to(x, dtype) for x in args)
    kwargs = {k: _to(v, dtype) if k != "attention_mask" else v for k, v in kwargs.items()}
    fn = model
    if backend is not None:
        torch._dynamo.reset()
        fn = torch.compile(model, backend="kiln", dynamic=False,
                           options={"strict": True, "backend": backend})
    outputs = flatten_outputs(fn(*args, **kwargs))
    weighted_loss(outputs, weights_for(outputs)).backward()
    found = dict(outputs)
    for name, p in model.named_parameters():
        found[f"grad.{name}"] = p.grad
    for i, x in enumerate(args):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            found[f"grad.input{i}"] = x.grad
    return found  # a gradient is None where the loss does not depend on the tensor


def judge(model: nn.Module, args: tuple, backend: str, kwargs: dict | None = None,
          zero: set[str] = frozenset(), kiln_runs: list | None = None) -> list:
    """Compare kiln (float32, ``backend``) with eager float64.  Names in ``zero`` are
    gradients that are zero in theory: they must pass as float32 noise (eager float32 is as
    far off); every other tensor must pass the plain relative tolerance."""
    model = model.eval()
    kwargs = kwargs or {}
    ref64 = _run(model, args, kwargs, torch.float64, None)
    eager32 = _run(model, args, kwargs, torch.float32, None)
    before = len(kiln_runs) if kiln_runs is not None else 0
    got = _run(model, args, kwargs, torch.float32, backend)
    if kiln_runs is not None:
        assert len(kiln_runs) > before, "kiln did not run"
    unused = {k for k, v in ref64.items() if v is None}
    assert unused == {k for k, v in got.items() if v is None}, "kiln and eager differ in which "\
        "tensors get no gradient"
    results = compare_all(got, eager32, {k: v for k, v in ref64.items() if v is not None})
    report = "\n".join(f"  {c.name}: error {c.error:.2e} (eager float32 {c.eager_error:.2e}), "
                       f"{'ok' if c.ok else 'FAIL'}{' by float32 noise' if c.by_float32_noise else ''}"
                       for c in results)
    assert {c.name for c in results} >= set(zero), f"unknown names in zero: {zero}"
    for c in results:
        assert c.ok, f"{c.name} is wrong:\n{report}"
        if c.name in zero:
            assert c.by_float32_noise or c.error <= 1e-4, c
        else:
            assert not c.by_float32_noise, f"{c.name} passes only as float32 noise:\n{report}"
    return results


class Proj(nn.Module):
    """``fn(q(x), k(x), v(x))`` with three linear projections."""

    def __init__(self, fn, width: int = 8, out: int = 8):
        super().__init__()
        self.fn = fn
        self.q, self.k, self.v = nn.Linear(width, out), nn.Linear(width, out), nn.Linear(width, out)

    def forward(self, x):
        return self.fn(self.q(x), self.k(x), self.v(x))


def heads(t: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T, n*d) -> (B, n, T, d) by view and transpose, as attention layers split heads."""
    b, length, c = t.shape
    return t.view(b, length, n, c // n).transpose(1, 2)


def merge(t: torch.Tensor) -> torch.Tensor:
    b, n, length, d = t.shape
    return t.transpose(1, 2).reshape(b, length, n * d)


class SoftmaxOfLinear(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.lin = nn.Linear(8, 6)

    def forward(self, x):
        return torch.softmax(self.lin(x), dim=self.dim)


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("backend", BACKENDS)
def test_reported_cases_are_float32_noise_only(backend, kiln_runs):
    """The reported "wrong gradients": only the gradients that are zero in theory differ,
    and eager float32 is as far from the exact answer there."""
    torch.manual_seed(0)
    x = _x(2, 5, 8)
    judge(SoftmaxOfLinear(1), (x,), backend, zero={"grad.lin.bias"}, kiln_runs=kiln_runs)
    judge(Proj(lambda q, k, v: merge(F.scaled_dot_product_attention(heads(q, 2), heads(k, 2),
                                                                     heads(v, 2)))),
          (x,), backend, zero={"grad.k.bias"}, kiln_runs=kiln_runs)
    if backend == "cpu":  # the rest on the cpu backend: test_attention_forms
        return
    judge(SoftmaxOfLinear(-1), (x,), backend, kiln_runs=kiln_runs)  # bias matters over dim -1
    judge(Proj(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1)), (x,), backend,
          zero={"grad.k.bias"}, kiln_runs=kiln_runs)
    judge(Proj(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2), -1) @ v), (x,), backend,
          zero={"grad.k.bias"}, kiln_runs=kiln_runs)
    judge(Proj(lambda q, k, v: merge(F.scaled_dot_product_attention(heads(q, 2), heads(k, 2),
                                                                     heads(v, 2)))),
          (x,), backend, zero={"grad.k.bias"}, kiln_runs=kiln_runs)


def _per_axis(y: torch.Tensor) -> list[torch.Tensor]:
    """Softmax, log-softmax, cumsum and the reductions over each axis of ``y`` (positive and
    negative numbers), over axis pairs and over everything."""
    out = []
    r = y.dim()
    for d in range(r):
        n = d - r if d % 2 else d
        out += [torch.softmax(y, n), torch.log_softmax(y, d), y.cumsum(n), y.sum(d),
                y.mean(n, keepdim=True), y.amax(d), y.var(n), y.prod(d, keepdim=True),
                y.amin(n, keepdim=True), y.std(d, correction=0)]
    out += [y.sum((0, -1)), y.mean((1, 2), keepdim=True), y.amax((0, r - 1)), y.var((0, 1)),
            y.sum(), y.logsumexp(-1)]
    return out


LAYOUTS = {
    "transpose": lambda y: y.transpose(1, 2),
    "permute": lambda y: y.permute(2, 0, 3, 1),
    "view": lambda y: y.view(2, 12, 5),
    "view-transpose": lambda y: y.reshape(2, 3, 4, 5).view(2, 3, 2, 10).transpose(-1, -2),
    "transpose-contiguous-view": lambda y: y.transpose(0, 2).contiguous().view(4, 6, 5),
}


class AxisModel(nn.Module):
    """Every op of :func:`_per_axis` after every layout of :data:`LAYOUTS`, one graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        y = self.lin(x) * 0.5
        return tuple(out for layout in LAYOUTS.values() for out in _per_axis(layout(y)))


class OneLayout(nn.Module):
    def __init__(self, layout: str):
        super().__init__()
        self.layout = LAYOUTS[layout]
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return tuple(_per_axis(self.layout(self.lin(x) * 0.5)))


def test_softmax_and_reductions_over_each_axis_after_views(kiln_runs):
    torch.manual_seed(1)
    judge(AxisModel(), (_x(2, 3, 4, 5),), "reference", kiln_runs=kiln_runs)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name != "view"
                                    else name for name in LAYOUTS])
def test_softmax_and_reductions_over_each_axis_after_views_cpu(layout, kiln_runs):
    torch.manual_seed(1)
    judge(OneLayout(layout), (_x(2, 3, 4, 5),), "cpu", kiln_runs=kiln_runs)


T = 5
_BOOL = torch.rand(T, T, generator=torch.Generator().manual_seed(3)) < 0.6
_BOOL[:, 0] = True
_FLOAT = torch.randn(2, 1, T, T, generator=torch.Generator().manual_seed(4))
_NEG = torch.where(_BOOL, torch.randn(T, T, generator=torch.Generator().manual_seed(5)),
                   float("-inf"))
_NEG[1] = float("-inf")  # a query row with every key masked out


def _repeat_kv(t: torch.Tensor, n: int) -> torch.Tensor:
    """Llama's ``repeat_kv``: (B, H, S, D) -> (B, H * n, S, D) by expand and reshape."""
    b, h, s, d = t.shape
    return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def _attention_forms(q, k, v):
    """Attention as real models call it; every key/value comes from ``k``/``v``."""
    sdpa = F.scaled_dot_product_attention
    q2, k2, v2 = heads(q, 2), heads(k, 2), heads(v, 2)
    q4, k2h, v2h = heads(q, 4), heads(k[..., :4], 2), heads(v[..., :4], 2)
    scores = q2 @ k2.transpose(-1, -2) / 2.0
    return (
        merge(sdpa(q2, k2, v2)),
        merge(sdpa(q2, k2, v2, attn_mask=_BOOL)),
        merge(sdpa(q2, k2, v2, attn_mask=_FLOAT)),
        merge(sdpa(q2, k2, v2, attn_mask=_NEG)),
        merge(sdpa(q2, k2, v2, is_causal=True)),
        merge(sdpa(q2, k2, v2, scale=0.3)),
        merge(sdpa(q4, k2h, v2h, enable_gqa=True)),
        merge(sdpa(q4, _repeat_kv(k2h, 2), _repeat_kv(v2h, 2))),
        merge(sdpa(q4, k2h.repeat_interleave(2, dim=1), v2h.repeat_interleave(2, dim=1))),
        merge(sdpa(q2[:, :, :3], k2, v2)),  # cross attention: 3 queries, 5 keys
        torch.softmax(scores.masked_fill(~_BOOL, float("-inf")), -1) @ v2,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_forms(backend, kiln_runs):
    torch.manual_seed(2)
    judge(Proj(_attention_forms), (_x(2, T, 8),), backend, zero={"grad.k.bias"},
          kiln_runs=kiln_runs)


@pytest.fixture
def flash_kept(monkeypatch):
    """Capture with torch's fused CPU attention kept whole (kiln's own rule lowers it)
    instead of torch's decomposition of it."""
    import dataclasses

    from kiln.frontends.torch.aten import ATEN_TABLE

    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    monkeypatch.setitem(ATEN_TABLE, flash, dataclasses.replace(ATEN_TABLE[flash], keep=True))


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=pytest.mark.slow)])
def test_attention_forms_through_the_fused_cpu_op(backend, flash_kept, kiln_runs):
    torch.manual_seed(2)
    judge(Proj(_attention_forms), (_x(2, T, 8),), backend, zero={"grad.k.bias"},
          kiln_runs=kiln_runs)


def _fused_variants(q, k, v):
    q2, k2, v2 = heads(q, 2), heads(k, 2), heads(v, 2)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    math_ = torch.ops.aten._scaled_dot_product_attention_math
    out, lse = flash(q2, k2, v2, attn_mask=_NEG, scale=0.4)
    causal, causal_lse = flash(q2, k2, v2, is_causal=True)
    m_out, weights = math_(q2, k2, v2, _FLOAT)
    g_out, g_weights = math_(heads(q, 4), heads(k[..., :4], 2), heads(v[..., :4], 2), _BOOL,
                                enable_gqa=True)
    return out, lse, causal, causal_lse, m_out, weights, g_out, g_weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_attention_results_under_no_grad(backend):
    """The log-sum-exp and attention-weight results of the fused variants, called directly
    (``torch.export`` keeps them as they are)."""
    torch.manual_seed(3)
    model, x = Proj(_fused_variants).eval(), _x(2, T, 8)
    with torch.no_grad():
        want = model.double()(x.double())
        model.float()
        eager = model(x)
        got = kiln.compile(model, (x,), strict=True, backend=backend)(x)
    assert want[1][:, :, 1].abs().max() == 0  # torch's log-sum-exp of a fully masked row
    for i, (g, e, w) in enumerate(zip(got, eager, want)):
        c = compare_all({"r": g}, {"r": e}, {"r": w})[0]
        assert c.ok and not c.by_float32_noise, (i, c)


def test_math_attention_weights_gradients(kiln_runs):
    """The math variant's attention weights are differentiable (as in PyTorch)."""
    model = Proj(lambda q, k, v: torch.ops.aten._scaled_dot_product_attention_math(
        heads(q, 2), heads(k, 2), heads(v, 2), _BOOL)[1])
    model, x = model.eval(), _x(2, T, 8)
    ref = copy.deepcopy(model).double()
    w = torch.randn(2, 2, T, T, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (ref(x.double()) * w).sum().backward()
    compiled = kiln.compile(model, (x,), strict=True, backend="reference")
    (compiled(x) * w.float()).sum().backward()
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if r.grad is None:
            assert p.grad is None
            continue
        err = (p.grad.double() - r.grad).norm() / r.grad.norm().clamp_min(1e-6)
        assert err < 1e-4 or name == "k.bias", (name, err)


def test_log_sum_exp_with_gradients_is_refused(flash_kept):
    def fn(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(heads(q, 2), heads(k, 2),
                                                                         heads(v, 2))
    torch._dynamo.reset()
    compiled = torch.compile(Proj(fn), backend="kiln", options={"strict": True})
    with pytest.raises(Exception, match="log-sum-exp result is used with gradients enabled"):
        compiled(_x(2, T, 8))


@pytest.mark.parametrize("call, reason", [
    (lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True)[1], "padded beyond the query length"),
    (lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, False)[2], "philox_seed"),
    (lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k[:, :3], v[:, :3])[0], "multiple of the key/value heads"),
])
def test_unsupported_attention_calls_are_refused(call, reason):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.frontends.torch.aten import ATEN_TABLE
    from kiln.frontends.torch.aten_support import unsupported_reason

    with FakeTensorMode():  # the efficient variant has no CPU kernel; capture needs none
        q = torch.randn(1, 4, T, 8)
        gm = torch.fx.experimental.proxy_tensor.make_fx(call, pre_dispatch=True)(q, q, q)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATEN_TABLE
             and "attention" in str(n.target)]
    assert nodes, gm.graph
    assert reason in (unsupported_reason(nodes[0]) or "")


def test_detach_stops_gradients(kiln_runs):
    class Detached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y * y.detach()

    judge(Detached(), (_x(3, 4),), "reference", kiln_runs=kiln_runs)


def _hf_model(kind: str, attn: str) -> nn.Module:
    import transformers as tf

    common = dict(hidden_size=32, num_attention_heads=4, intermediate_size=48, vocab_size=64,
                  max_position_embeddings=32, attn_implementation=attn)
    if kind == "bert":
        model = tf.BertModel(tf.BertConfig(num_hidden_layers=1, **common))
    elif kind == "roberta":
        model = tf.RobertaModel(tf.RobertaConfig(num_hidden_layers=1, **common))
    elif kind == "distilbert":
        model = tf.DistilBertModel(tf.DistilBertConfig(
            n_layers=1, dim=32, n_heads=4, hidden_dim=48, vocab_size=64,
            max_position_embeddings=32, attn_implementation=attn))
    else:
        model = tf.LlamaModel(tf.LlamaConfig(num_hidden_layers=1, num_key_value_heads=2, **common))
    return model.eval()


_ZERO_IN_THEORY = ("key.bias", "k_lin.bias", "k_proj.bias")


_SLOW = pytest.mark.slow
HF_CASES = [("bert", "sdpa", "reference"), ("llama", "eager", "reference"),
            pytest.param("bert", "eager", "reference", marks=_SLOW),
            pytest.param("roberta", "sdpa", "reference", marks=_SLOW),
            pytest.param("roberta", "eager", "reference", marks=_SLOW),
            pytest.param("distilbert", "sdpa", "reference", marks=_SLOW),
            pytest.param("distilbert", "eager", "reference", marks=_SLOW),
            pytest.param("llama", "sdpa", "reference", marks=_SLOW),
            pytest.param("bert", "sdpa", "cpu", marks=_SLOW),
            pytest.param("llama", "sdpa", "cpu", marks=_SLOW)]


@pytest.mark.parametrize("kind, attn, backend", HF_CASES)
def test_transformers_models(kind, attn, backend, kiln_runs):
    torch.manual_seed(5)
    model = _hf_model(kind, attn)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0  # padding
    zero = {f"grad.{n}" for n, _ in model.named_parameters() if n.endswith(_ZERO_IN_THEORY)}
    judge(model, (ids,), backend, kwargs={"attention_mask": mask}, zero=zero, kiln_runs=kiln_runs)
    if kind == "bert" or backend == "cpu":  # without a mask too
        judge(model, (ids,), backend, zero=zero, kiln_runs=kiln_runs)
