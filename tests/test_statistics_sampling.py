"""Statistics, segment, index-write and sampling ops, end to end.

Forward: each group runs through ``kiln.compile(..., strict=True)`` on the reference and cpu
backends and is compared with eager (integer results exactly).  Gradients: through
``torch.compile(backend="kiln", options={"strict": True})`` with ``loss = sum(out * R)``,
judged by :mod:`kiln.zoo.compare` against eager float64.  The rules are compositions of kiln
ops (``kiln/frontends/torch/aten_statistics.py``, ``kiln/frontends/torch/aten_sampling.py``), whose own
gradient rules have finite-difference checks in ``tests/test_grad_rules.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from eagercheck import Fn, assert_same, check_gradients, randn

import kiln

X = randn(3, 6, 5)
NANS = torch.tensor([[1., float("nan"), 3., -2., float("nan"), 0.5],
                     [float("nan")] * 5 + [7.0], [4., 4., 1., 1., 2., 9.]])
TIES = torch.tensor([[3., 1, 3, 3, 1, 2, 2, 0], [5, 5, 7, 7, 1, 1, 2, 2]])
WIDE = torch.tensor([[-100., 0., 50., -200., 3.], [float("-inf"), -1., float("-inf"), 2., 88.]])
IMG = randn(2, 3, 5, 7, seed=1)
GRID = randn(2, 4, 3, 2, seed=2) * 1.3  # some points outside [-1, 1]
VOL = randn(1, 2, 3, 4, 5, seed=3)
GRID3 = randn(1, 2, 3, 2, 3, seed=4) * 1.2

GROUPS = {
    "histograms": (lambda x: (
        torch.histc(x, bins=7), torch.histc(x, bins=4, min=-1, max=1), torch.histc(x[0, 0], 3, 2.0, 2.0),
        torch.histc(torch.full((4,), 2.0), bins=5),
        torch.histogram(x, bins=6), torch.histogram(x, bins=5, range=(-1.0, 0.5)),
        torch.histogram(x, bins=4, weight=x.abs(), density=True),
        torch.histogram(x, bins=torch.tensor([-2.0, -0.5, 0.0, 0.3, 2.0])),
        torch.histogram(torch.ones(5), bins=3),
        torch.histogramdd(x[0, :, :2], bins=[3, 4]), torch.histogramdd(x[1, :, :3], bins=[2, 3, 2], density=True,
                                                                      range=[-1.0, 1.0, -2.0, 0.5, 0.0, 0.0]),
        torch.histogramdd(x[2, :, :2], bins=[torch.tensor([-1.0, 0.0, 2.0]), torch.tensor([-3.0, 0.1, 0.2, 3.0])],
                          weight=x[2, :, 4])), (X,)),
    "selection": (lambda x, nans, ties: (
        torch.mode(ties), torch.mode(ties, 0), torch.mode(ties, -1, keepdim=True), torch.mode(x, 1),
        torch.nanmedian(nans), torch.nanmedian(nans, 1), torch.nanmedian(nans, 0, keepdim=True),
        torch.nanmedian(x), torch.nanmedian(x, -1), torch.nanmedian(ties, 1),
        torch.masked.median(x, 1, mask=x > -0.5)), (X, NANS, TIES)),
    "scans": (lambda x, wide: (
        torch.logcumsumexp(x, 1), torch.logcumsumexp(x, -1), torch.logcumsumexp(wide, 1),
        torch.logcumsumexp(x[0, 0, 0], 0)), (X, WIDE)),
    "index_writes": (lambda x, s: (
        x.index_reduce(1, torch.tensor([0, 4, 0, 2]), s, "prod"),
        x.index_reduce(1, torch.tensor([0, 4, 0, 2]), s, "mean", include_self=False),
        x.index_reduce(1, torch.tensor([5, 4, 5, 2]), s, "amax"),
        x.index_reduce(1, torch.tensor([1, 1, 3, 3]), s, "amin", include_self=False),
        x.put(torch.tensor([0, -1, 17, 40]), torch.tensor([1.0, 2.0, 3.0, 4.0])),
        x.put(torch.tensor([[3, 3], [-5, 0]]), torch.tensor([1.0, 2.0, 3.0, 4.0]), accumulate=True),
        torch.diagonal_scatter(x, torch.ones(3, 5), 0, 1, 2),
        torch.diagonal_scatter(x, torch.ones(3, 4), 1, 1, 2),
        torch.diagonal_scatter(x, torch.ones(5, 2), -1, 0, 1),
        torch.diagonal_scatter(x[0], torch.ones(3), -3),
        torch.narrow_copy(x, 1, 2, 3), torch.narrow_copy(x, -1, -3, 2),
        torch.take(x, torch.tensor([[0, 89], [-1, 7]])), torch.take(x[0, 0, 0], torch.tensor([0, -1])),
        torch.nonzero_static(x > 0.8, size=12), torch.nonzero_static(x[0] * (x[0] > 0), size=40, fill_value=-3),
        torch.nonzero_static(x[0, 0, 0], size=2)), (X, randn(3, 4, 5, seed=5))),
    "search": (lambda x, v: (
        torch.searchsorted(x, v, sorter=torch.argsort(x, dim=-1)),
        torch.searchsorted(x[0, 0], v, sorter=torch.argsort(x[0, 0]), right=True),
        torch.searchsorted(x[0], v[0], sorter=torch.argsort(x[0]), side="right", out_int32=True),
        torch.index_select(x[0, 0, 0], 0, torch.tensor([0])),
        torch.index_select(x[0, 0, 0], 0, torch.tensor(0))), (X, randn(3, 6, 2, seed=6))),
    # every mode with every padding, align_corners alternating; 3-d: each padding once
    "grid_sample": (lambda img, grid, vol, grid3: tuple(
        F.grid_sample(img, grid, mode=m, padding_mode=p, align_corners=(k % 2 == 1))
        for k, (m, p) in enumerate(itertools.product(("bilinear", "nearest", "bicubic"),
                                                     ("zeros", "border", "reflection")))) + (
        F.grid_sample(vol, grid3, mode="bilinear", padding_mode="zeros", align_corners=True),
        F.grid_sample(vol, grid3, mode="nearest", padding_mode="border", align_corners=False),
        F.grid_sample(vol, grid3, mode="bilinear", padding_mode="reflection", align_corners=False)),
        (IMG, GRID, VOL, GRID3)),
    "sampling": (lambda img, x: (
        F.interpolate(img, size=(3, 4), mode="bilinear", antialias=True),
        F.interpolate(img, size=(8, 3), mode="bicubic", antialias=True, align_corners=True),
        F.interpolate(img, scale_factor=0.6, mode="bilinear", antialias=True),
        F.pdist(x[0]), F.pdist(x[1], p=1), F.pdist(x[2], p=0.5), F.pdist(x[0], p=float("inf")),
        F.pdist(x[0, :1])), (IMG, X)),
    "multilinear": (lambda a, b, w, bias: (
        F.bilinear(a, b, w, bias), F.bilinear(a, b, w),
        torch.ops.aten._trilinear(a, w, b, [1, 3], [0], [1, 2], [2, 3])), (
        randn(4, 3, seed=7), randn(4, 5, seed=8), randn(2, 3, 5, seed=9), randn(2, seed=10))),
    "embedding_bag": (lambda w, psw: (
        F.embedding_bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), w, torch.tensor([0, 4, 4, 6]), mode="sum"),
        F.embedding_bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), w, torch.tensor([0, 3, 3, 8]), mode="mean",
                        include_last_offset=True),
        F.embedding_bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), w, torch.tensor([0, 2, 2, 5]), mode="max"),
        F.embedding_bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), w, torch.tensor([0, 4]), mode="sum",
                        per_sample_weights=psw),
        F.embedding_bag(torch.tensor([[1, 2, 0], [0, 0, 0], [4, 0, 3]]), w, mode="mean", padding_idx=0),
        F.embedding_bag(torch.tensor([[1, 2, 0], [0, 0, 0], [4, 0, 3]]), w, mode="max", padding_idx=0)),
        (randn(10, 3, seed=11), randn(8, seed=12))),
}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_forward_matches_eager(group, backend, one_torch_thread, kiln_runs):
    fn, inputs = GROUPS[group]
    want = fn(*(t.clone() for t in inputs))
    compiled = kiln.compile(Fn(fn), tuple(t.clone() for t in inputs), strict=True, backend=backend)
    got = compiled(*(t.clone() for t in inputs))
    assert kiln_runs, "kiln did not run"
    assert_same(got, want, rtol=1e-4, atol=1e-5)


def test_logcumsumexp_is_exact_over_a_wide_range():
    """Prefixes far below the row's maximum keep their value (no underflow to -inf)."""
    x = torch.tensor([-300.0, -250.0, 0.0, float("-inf")])
    got = kiln.compile(Fn(lambda x: torch.logcumsumexp(x, 0)), (x,), strict=True, backend="reference")(x)
    torch.testing.assert_close(got, torch.logcumsumexp(x.double(), 0).float())


# ------------------------------------------------------------------------- gradients
GRID_IN = randn(1, 2, 4, 5, seed=13)
GRID_PTS = randn(1, 3, 2, 2, seed=14) * 0.8  # inside, away from the kinks of the padding

GRAD_CASES = {
    "selection": (lambda x: (torch.mode(x, 1)[0], torch.nanmedian(x, -1)[0], torch.nanmedian(x),
                             torch.logcumsumexp(x, 1), torch.logcumsumexp(x, 0)), (X,), 1),
    "index_writes": (lambda x, s: (x.index_reduce(1, torch.tensor([0, 4, 0, 2]), s, "prod"),
                                   x.index_reduce(1, torch.tensor([0, 4, 1, 2]), s, "mean", include_self=False),
                                   x.index_reduce(1, torch.tensor([5, 4, 3, 2]), s, "amax"),
                                   x.put(torch.tensor([0, -1, 17]), s[0, 0, :3], accumulate=True),
                                   x.put(torch.tensor([2, 9]), s[1, 1, :2]),
                                   torch.diagonal_scatter(x, s[:, :, 0], 1, 1, 2), torch.narrow_copy(x, 1, 2, 3),
                                   torch.take(x, torch.tensor([[0, 89], [-1, 0]]))),
                     (X, randn(3, 4, 5, seed=5)), 2),
    "grid_sample": (lambda img, grid: (
        F.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False),
        F.grid_sample(img, grid, mode="bilinear", padding_mode="reflection", align_corners=True),
        F.grid_sample(img, grid, mode="bicubic", padding_mode="border", align_corners=False),
        F.grid_sample(img, grid, mode="bicubic", padding_mode="reflection", align_corners=False)),
        (GRID_IN, GRID_PTS), 2),
    "grid_sample_3d": (lambda vol, grid: (F.grid_sample(vol, grid, align_corners=False),
                                          F.grid_sample(vol, grid, padding_mode="border", align_corners=True)),
                       (VOL, GRID3 * 0.7), 2),
    "sampling": (lambda img, x: (F.interpolate(img, size=(3, 4), mode="bilinear", antialias=True),
                                 F.interpolate(img, size=(7, 9), mode="bicubic", antialias=True),
                                 F.pdist(x[0]), F.pdist(x[1], p=1.5), F.pdist(x[2], p=float("inf"))), (IMG, X), 2),
    "multilinear": (lambda a, b, w, bias: (F.bilinear(a, b, w, bias),),
                    (randn(4, 3, seed=7), randn(4, 5, seed=8), randn(2, 3, 5, seed=9), randn(2, seed=10)), 4),
    "embedding_bag": (lambda w, psw: (
        F.embedding_bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), w, torch.tensor([0, 4, 4, 6]), mode="mean"),
        F.embedding_bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), w, torch.tensor([0, 2, 2, 5]), mode="max"),
        F.embedding_bag(torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), w, torch.tensor([0, 4]), mode="sum",
                        per_sample_weights=psw)), (randn(10, 3, seed=11), randn(8, seed=12)), 2),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_through_torch_compile_match_eager(case, one_torch_thread):
    fn, inputs, n_float = GRAD_CASES[case]
    check_gradients(fn, inputs, n_float)


def test_views_of_inputs_train_through_torch_compile():
    """A Dynamo graph that returns only views of its inputs (``x.mT``) has no kiln outputs;
    its gradient is eager's."""
    x = randn(3, 4).requires_grad_()
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.mT, x.T), backend="kiln", dynamic=False, options={"strict": True})
    a, b = f(x)
    (a * 2 + b).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 4), 3.0))


# ------------------------------------------------------------------------- refusals
def test_segment_reduce_with_constant_lengths_matches_eager():
    def fn(x):
        return (torch.segment_reduce(x, "sum", lengths=torch.tensor([2, 0, 3, 1])),
                torch.segment_reduce(x, "max", lengths=torch.tensor([2, 0, 3, 1]), initial=0.0),
                torch.segment_reduce(x, "mean", offsets=torch.tensor([0, 2, 5, 6])))

    x = randn(6, 3)
    got = kiln.compile(Fn(fn), (x,), strict=True, backend="reference")(x)
    assert_same(got, fn(x), rtol=1e-4, atol=1e-5)


def test_segment_reduce_with_run_time_lengths_is_refused_clearly():
    def fn(x, lengths):
        return torch.segment_reduce(x, "sum", lengths=lengths)

    with pytest.raises(kiln.UnsupportedOpError, match=r"segment_reduce.*lengths.*run time.*strict=False"):
        kiln.compile(Fn(fn), (randn(6, 3), torch.tensor([2, 4])), strict=True)


@pytest.mark.parametrize("fn, match", [
    (lambda x: F.embedding_bag(torch.tensor([1, 2]), x, torch.tensor([0]), mode="max")
     + torch.ops.aten._embedding_bag(x, torch.tensor([1, 2]), torch.tensor([0]), False, 2)[3].float().sum(),
     r"_embedding_bag.*result 3"),
])
def test_unsupported_arguments_are_refused_clearly(fn, match):
    with pytest.raises(kiln.UnsupportedOpError, match=match):
        kiln.compile(Fn(fn), (randn(4, 3),), strict=True)


def test_grid_sampler_3d_compiles_on_cpu():
    # Its kernel collapses two parallel loops; the inner one once also got `omp simd`, which
    # OpenMP forbids between collapsed loops (the C compiler refused the kernel).
    torch.manual_seed(0)
    x, grid = torch.randn(2, 3, 5, 20, 20), torch.rand(2, 12, 11, 10, 3) * 2 - 1
    fn = lambda x, g: torch.grid_sampler_3d(x, g, 0, 0, False)  # noqa: E731
    compiled = kiln.compile(fn, (x, grid), strict=True, backend="cpu")
    torch.testing.assert_close(compiled(x, grid), fn(x, grid), rtol=1e-4, atol=1e-5)
