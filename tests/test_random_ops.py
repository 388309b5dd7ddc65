"""Random ops through kiln: distributions, reproducibility, backends agreeing, gradients.

Every distribution is drawn with ``kiln.compile(..., strict=True)`` under a fixed
``torch.manual_seed`` (so each test is deterministic) and checked statistically: the mean
within five standard errors, the variance, and a Kolmogorov-Smirnov statistic
``sqrt(n) * max|F_n - F|`` below 1.95 (exceeded by chance with probability 0.001 under the
right distribution; a wrong distribution of this many draws exceeds it by far).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir import DType
from kiln.ir.ops.distributions import UNIFORM_BITS, random_uniform
from kiln.zoo.compare import compare

N = 40_000
KS_BOUND = 1.95


def draw(fn, *inputs, backend="reference", seed=0, calls=1):
    """``fn`` compiled by kiln (strict), called ``calls`` times after ``torch.manual_seed(seed)``."""
    compiled = kiln.compile(fn, inputs, strict=True, backend=backend)
    torch.manual_seed(seed)
    outs = [compiled(*inputs) for _ in range(calls)]
    return outs[0] if calls == 1 else outs


def ks_statistic(samples: torch.Tensor, cdf) -> float:
    x = np.sort(samples.detach().double().reshape(-1).numpy())
    n = len(x)
    f = cdf(x)
    return math.sqrt(n) * max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n))


def assert_moments(x: torch.Tensor, mean: float, var: float, what: str) -> None:
    x = x.detach().double().reshape(-1)
    n = x.numel()
    assert abs(float(x.mean()) - mean) < 5 * math.sqrt(var / n), f"{what}: mean {float(x.mean())}, want {mean}"
    assert abs(float(x.var()) - var) < 0.05 * var, f"{what}: variance {float(x.var())}, want {var}"


def normal_cdf(x, mean=0.0, std=1.0):
    from scipy.special import ndtr

    return ndtr((x - mean) / std)


# ------------------------------------------------------------------ the generator op
def test_uniform_grid_is_exact_and_below_one():
    for dtype, bits in UNIFORM_BITS.items():
        u = random_uniform(np.int64(12345), shape=(20_000,), offset=3, dtype=dtype).astype(np.float64)
        assert u.min() >= 0.0 and u.max() < 1.0
        assert np.all(u * 2.0**bits == np.floor(u * 2.0**bits)), f"{dtype}: values off the 2**-{bits} grid"
    # a different seed or offset is a different stream
    a = random_uniform(np.int64(1), shape=(1000,), offset=0, dtype=DType.float32)
    b = random_uniform(np.int64(2), shape=(1000,), offset=0, dtype=DType.float32)
    c = random_uniform(np.int64(1), shape=(1000,), offset=1000, dtype=DType.float32)
    assert (a == b).mean() < 0.01 and (a == c).mean() < 0.01
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.1 and abs(np.corrcoef(a[:-1], a[1:])[0, 1]) < 0.1


# ------------------------------------------------------------------ distributions
def test_rand_is_uniform():
    u = draw(lambda x: torch.rand(200, 200) + x, torch.zeros(()))
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert_moments(u, 0.5, 1 / 12, "rand")
    assert ks_statistic(u, lambda x: x) < KS_BOUND


def test_uniform_in_place_on_a_fresh_tensor_and_rand_like():
    u = draw(lambda x: torch.empty(N, dtype=torch.float64).uniform_(-3.0, 5.0) + x,
             torch.zeros((), dtype=torch.float64))
    assert u.dtype == torch.float64 and u.min() >= -3 and u.max() < 5
    assert ks_statistic(u, lambda x: (x + 3) / 8) < KS_BOUND
    v = draw(lambda x: torch.rand_like(x), torch.zeros(N))
    assert ks_statistic(v, lambda x: x) < KS_BOUND


def test_randn_and_normal_overloads():
    z = draw(lambda x: torch.randn(N) + x, torch.zeros(()))
    assert_moments(z, 0.0, 1.0, "randn")
    assert ks_statistic(z, normal_cdf) < KS_BOUND
    mean = torch.linspace(-5, 5, N)
    std = torch.linspace(0.1, 3, N)
    out = draw(lambda m, s: torch.normal(m, s), mean, std)
    assert ks_statistic((out - mean) / std, normal_cdf) < KS_BOUND
    out = draw(lambda m: torch.normal(m, 2.0), mean)
    assert ks_statistic((out - mean) / 2, normal_cdf) < KS_BOUND
    out = draw(lambda s: torch.normal(1.5, s), std)
    assert ks_statistic((out - 1.5) / std, normal_cdf) < KS_BOUND
    out = draw(lambda x: torch.normal(-1.0, 0.5, (N,)) + x, torch.zeros(()))
    assert ks_statistic(out, lambda x: normal_cdf(x, -1.0, 0.5)) < KS_BOUND
    like = draw(lambda x: torch.randn_like(x, dtype=torch.float64), torch.zeros(N))
    assert like.dtype == torch.float64 and ks_statistic(like, normal_cdf) < KS_BOUND


def test_exponential_cauchy_log_normal_geometric():
    e = draw(lambda x: torch.empty(N).exponential_(2.5) + x, torch.zeros(()))
    assert e.min() >= 0 and ks_statistic(e, lambda x: 1 - np.exp(-2.5 * x)) < KS_BOUND
    c = draw(lambda x: torch.empty(N).cauchy_(1.0, 0.5) + x, torch.zeros(()))
    assert torch.isfinite(c).all()
    assert ks_statistic(c, lambda x: 0.5 + np.arctan((x - 1.0) / 0.5) / np.pi) < KS_BOUND
    ln = draw(lambda x: torch.empty(N).log_normal_(0.3, 0.7) + x, torch.zeros(()))
    assert ln.min() > 0 and ks_statistic(torch.log(ln), lambda x: normal_cdf(x, 0.3, 0.7)) < KS_BOUND
    g = draw(lambda x: torch.empty(N).geometric_(0.3) + x, torch.zeros(()))
    assert torch.equal(g, g.round()) and g.min() >= 1
    assert_moments(g, 1 / 0.3, 0.7 / 0.3**2, "geometric")
    assert abs(float((g == 1).double().mean()) - 0.3) < 5 * math.sqrt(0.3 * 0.7 / N)


def test_randint_covers_its_range_uniformly():
    r = draw(lambda x: torch.randint(-3, 7, (N,)) + x, torch.zeros((), dtype=torch.int64))
    assert r.dtype == torch.int64 and r.min() == -3 and r.max() == 6
    counts = torch.bincount(r + 3, minlength=10).double()
    chi2 = float(((counts - N / 10) ** 2 / (N / 10)).sum())
    assert chi2 < 30, f"chi-square {chi2} over 9 degrees of freedom"
    like = draw(lambda x: torch.randint_like(x, 5), torch.zeros(1000, dtype=torch.float16))
    assert like.dtype == torch.float16 and set(like.unique().tolist()) == {0.0, 1.0, 2.0, 3.0, 4.0}


def test_bernoulli_tensor_and_float_p():
    p = torch.rand(N, generator=torch.Generator().manual_seed(3))
    b = draw(lambda p: torch.bernoulli(p), p)
    assert b.dtype == torch.float32 and set(b.unique().tolist()) <= {0.0, 1.0}
    # calibration: within each tenth of p the frequency of ones is the mean p
    for lo in np.arange(0, 1, 0.1):
        sel = (p >= lo) & (p < lo + 0.1)
        want, n = float(p[sel].mean()), int(sel.sum())
        assert abs(float(b[sel].mean()) - want) < 5 * math.sqrt(0.25 / n)
    q = draw(lambda x: torch.bernoulli(x, 0.2), torch.zeros(N))
    assert abs(float(q.mean()) - 0.2) < 5 * math.sqrt(0.16 / N)
    assert draw(lambda x: torch.bernoulli(x, 0.0), torch.zeros(100)).sum() == 0
    assert draw(lambda x: torch.bernoulli(x, 1.0), torch.zeros(100)).sum() == 100


def test_multinomial_with_and_without_replacement():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [2.0, 1.0, 1.0, 0.0]])
    s = draw(lambda p: torch.multinomial(p, 20_000, replacement=True), probs)
    assert s.shape == (2, 20_000) and s.dtype == torch.int64
    for row in range(2):
        freq = torch.bincount(s[row], minlength=4).double() / 20_000
        want = probs[row].double() / probs[row].sum()
        assert freq[want == 0].sum() == 0, "a zero-probability category was drawn"
        assert (freq - want).abs().max() < 5 * math.sqrt(0.25 / 20_000), (freq, want)
    # without replacement: distinct categories per row, the first one drawn proportionally to p
    p = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0]).expand(4000, 5).contiguous()
    w = draw(lambda p: torch.multinomial(p, 3), p)
    assert w.shape == (4000, 3)
    assert all(len(set(row)) == 3 for row in w.tolist()) and (w != 4).all()
    first = torch.bincount(w[:, 0], minlength=5).double() / 4000
    assert (first - p[0]).abs().max() < 5 * math.sqrt(0.25 / 4000)
    one_d = draw(lambda p: torch.multinomial(p, 4), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert sorted(one_d.tolist()) == [0, 1, 2, 3]


def test_rrelu_training_draws_slopes_between_bounds():
    x = torch.linspace(-3, 3, N)
    y = draw(lambda x: F.rrelu(x, 0.1, 0.4, training=True), x)
    pos = x > 0
    assert torch.equal(y[pos], x[pos])
    slopes = (y[~pos] / x[~pos])[x[~pos] != 0]
    assert slopes.min() >= 0.1 - 1e-6 and slopes.max() <= 0.4 + 1e-6
    assert ks_statistic(slopes, lambda s: (s - 0.1) / 0.3) < KS_BOUND
    ev = draw(lambda x: F.rrelu(x, 0.1, 0.4, training=False), x)
    torch.testing.assert_close(ev, F.leaky_relu(x, 0.25))


def test_channel_and_alpha_dropout_in_training():
    x = torch.randn(64, 32, 5, 5, generator=torch.Generator().manual_seed(1))
    y = draw(lambda x: F.dropout2d(x, 0.3, training=True), x)
    ratio = y / x
    dropped = (ratio == 0).all(dim=(2, 3))
    kept = torch.isclose(ratio, torch.tensor(1 / 0.7)).all(dim=(2, 3))
    assert bool((dropped | kept).all()), "dropout2d must drop whole channels"
    assert abs(float(dropped.double().mean()) - 0.3) < 5 * math.sqrt(0.21 / dropped.numel())
    y3 = draw(lambda x: F.dropout3d(x, 0.5, training=True), x)
    assert bool(((y3 == 0).all(dim=(2, 3)) | torch.isclose(y3, 2 * x).all(dim=(2, 3))).all())
    z = torch.randn(N, generator=torch.Generator().manual_seed(2))
    a = draw(lambda z: F.alpha_dropout(z, 0.2, training=True), z)
    assert_moments(a, 0.0, 1.0, "alpha_dropout of a standard normal")  # self-normalizing
    _, counts = a.unique(return_counts=True)
    assert abs(float(counts.max()) / N - 0.2) < 5 * math.sqrt(0.16 / N)  # one value for every drop
    fa = draw(lambda x: F.feature_alpha_dropout(x, 0.5, training=True), x)
    constant = fa.flatten(2).std(dim=2) < 1e-6  # a dropped channel is one value throughout
    assert abs(float(constant.double().mean()) - 0.5) < 5 * math.sqrt(0.25 / constant.numel())


def test_empty_strided_gives_the_shape_and_dtype():
    out = draw(lambda x: torch.empty_strided((3, 4), (1, 3)) + x, torch.zeros(()))
    assert out.shape == (3, 4) and out.dtype == torch.float32
    new = draw(lambda x: x.new_empty_strided((2, 5), (5, 1), dtype=torch.float64), torch.zeros(3))
    assert new.shape == (2, 5) and new.dtype == torch.float64


# ------------------------------------------------------------------ the seed
def test_reproducible_under_manual_seed_and_new_per_call():
    fn = lambda x: (torch.rand(50) + x, torch.randn(50), torch.bernoulli(x.expand(50), 0.5))
    compiled = kiln.compile(fn, (torch.zeros(()),), strict=True, backend="reference")
    torch.manual_seed(7)
    first, second = compiled(torch.zeros(())), compiled(torch.zeros(()))
    torch.manual_seed(7)
    again = compiled(torch.zeros(()))
    for a, b, c in zip(first, second, again):
        assert torch.equal(a, c), "the same torch.manual_seed must draw the same values"
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
    # two draws of one call are different streams
    assert (first[0] == first[1]).float().mean() < 0.1


def test_draws_of_one_graph_use_disjoint_counters():
    from kiln.frontends.torch.aten_random import STREAM_BASE

    graph = kiln.capture(lambda x: (torch.rand(10, 10) + F.dropout(x, 0.5, True), torch.randn(7)),
                         (torch.zeros(10, 10),))
    ranges = sorted((n.attrs["offset"], n.attrs["offset"] + math.prod(n.attrs["shape"]))
                    for n in graph.nodes if n.op.has("random"))
    assert len(ranges) == 4  # dropout mask, rand, two uniforms of randn
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges)), ranges
    assert ranges[1][0] >= STREAM_BASE


def _mixed(x, p):
    return (torch.rand(40, 30) + x, torch.randint(0, 9, (40, 30)), torch.bernoulli(p),
            torch.multinomial(p, 5, replacement=True), torch.multinomial(p, 4),
            torch.randn(40, 30), torch.empty(40, 30).exponential_(), F.dropout2d(x.expand(4, 10, 40, 30), 0.4, True),
            F.rrelu(x - 0.5, training=True))


def test_cpu_and_reference_draw_the_same_values():
    x = torch.rand(40, 30, generator=torch.Generator().manual_seed(4))
    p = torch.rand(40, 30, generator=torch.Generator().manual_seed(5))
    ref = draw(_mixed, x, p, backend="reference", seed=11)
    cpu = draw(_mixed, x, p, backend="cpu", seed=11)
    for i, (r, c) in enumerate(zip(ref, cpu)):
        assert r.dtype == c.dtype and r.shape == c.shape
        if i in (5, 6, 8):  # libm's log/cos/sqrt and contracted multiply-adds: last bits differ
            torch.testing.assert_close(c, r, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(r, c), f"result {i} differs between backends"


# ------------------------------------------------------------------ gradients
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gradients_go_through_the_drawn_noise(backend):
    """rrelu and dropout2d in training: ``d out / d x`` is the noise kiln drew (out / x),
    checked against eager's gradient of ``x * noise`` with kiln's noise."""
    torch._dynamo.reset()

    def fn(x):
        return F.rrelu(x, 0.1, 0.3, training=True) + F.dropout2d(x, 0.5, training=True) * 2

    x = torch.randn(6, 8, 3, 3, generator=torch.Generator().manual_seed(0))
    weights = torch.randn(6, 8, 3, 3, generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(fn, backend="kiln", options={"strict": True, "backend": backend})
    xk = x.clone().requires_grad_(True)
    torch.manual_seed(3)
    out = compiled(xk)
    (out * weights).sum().backward()
    # the noise kiln drew: rrelu's slope where x <= 0 (1 elsewhere) plus dropout's 0 or 2 * 2
    noise = out.detach() / x

    def eager(x, dtype):
        x = x.detach().to(dtype).clone().requires_grad_(True)
        (x * noise.to(dtype) * weights.to(dtype)).sum().backward()
        return x.grad

    c = compare("grad x", xk.grad, eager(x, torch.float32), eager(x, torch.float64))
    assert c.ok, c
    # the slopes where x <= 0 lie in [0.1, 0.3] (+ 0 or 4 from the channel dropout)
    slope = (noise - torch.where(x > 0, 1.0, 0.0))
    neg = slope[x <= 0]
    frac = torch.remainder(neg, 4.0)
    assert frac.min() >= 0.1 - 1e-5 and frac.max() <= 0.3 + 1e-5
    torch._dynamo.reset()


# ------------------------------------------------------------------ refusals
_GENERATOR = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("fn,pattern", [
    (lambda p: torch.multinomial(p, 6), r"multinomial without replacement draws at most the 4"),
    (lambda p: torch.randint(0, 2**40, (3,)) + p.sum().long(), r"randint over a range of .* not supported"),
    (lambda p: torch.rand(4, generator=_GENERATOR) + p, r"torch._C.Generator"),
])
def test_bad_random_calls_are_refused_clearly(fn, pattern):
    with pytest.raises(kiln.UnsupportedOpError, match=pattern) as info:
        kiln.compile(fn, (torch.ones(4),), strict=True)
    assert "kiln cannot lower ATen op" in str(info.value)
