"""``topk`` as a partial selection: the ``argtopk`` op, its cpu library call and its lowering.

``argtopk(x, k, dim, largest)`` is exactly the first ``k`` positions of kiln's stable order
(``argsort(x, dim, descending=largest)[..., :k]``: ties in input order, NaN the largest
value).  ``aten.topk`` with ``k`` below the axis length lowers to it, then ``gather`` of the
values, so the values' gradient is ``gather``'s.  Where torch's tie order is unspecified
(ties, NaN) indices are compared with torch's stable argsort sliced to ``k``, values with
``torch.topk``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from eagercheck import Fn, check_gradients, gen, randn

import kiln
from kiln.backends.cpu.library import LIBRARY_SORT_MIN, stable_topk
from kiln.ir import DType, Graph, TensorType, get_op
from kiln.ir.ops.sorting import stable_argsort


def _stable_first_k(x: torch.Tensor, k: int, dim: int, largest: bool) -> torch.Tensor:
    return torch.argsort(x, dim=dim, descending=largest, stable=True).narrow(dim, 0, k)


def _inputs(kind: str, rows: int, n: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    if kind == "distinct":
        return torch.randn(rows, n, generator=g)
    if kind == "ties":
        return torch.randint(0, 3, (rows, n), generator=g).float()
    if kind == "special":  # NaN, +-inf and signed zeros, many ties among them
        pool = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0])
        return pool[torch.randint(0, len(pool), (rows, n), generator=g)]
    if kind == "int":
        return torch.randint(-3, 3, (rows, n), generator=g)
    if kind == "bool":
        return torch.randint(0, 2, (rows, n), generator=g).bool()
    raise ValueError(kind)


KINDS = ("distinct", "ties", "special", "int", "bool")


# --------------------------------------------------------------------- the op itself
def test_reference_is_the_stable_order_sliced():
    rng = np.random.default_rng(0)
    op = get_op("argtopk")
    for trial in range(200):
        n = int(rng.integers(1, 40))
        x = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0, 1.0, 2.0], np.float32), (3, n))
        k, largest, dim = int(rng.integers(0, n + 1)), bool(trial % 2), -1 if trial % 3 else 1
        want = stable_argsort(x, 1, largest)[:, :k]
        got = op.reference(x, k=k, dim=dim, largest=largest)
        assert got.dtype == np.int64 and np.array_equal(got, want), (x, k, largest)


def test_inference_gives_k_positions_and_rejects_bad_k():
    g = Graph("t")
    x = g.add_input("x", TensorType((4, 7, 2), DType.float16))
    assert g.op("argtopk", x, k=3, dim=1).type == TensorType((4, 3, 2), DType.int64)
    assert g.op("argtopk", x, k=0, dim=-1, largest=False).type == TensorType((4, 7, 0), DType.int64)
    with pytest.raises(Exception, match="out of range"):
        g.op("argtopk", x, k=8, dim=1)
    with pytest.raises(Exception, match="1-d"):
        g.op("argtopk", g.add_input("s", TensorType((), DType.float32)), k=1)


@pytest.mark.parametrize("kind", KINDS)
def test_library_selection_matches_the_stable_order(kind):
    """The cpu library call (torch.topk, then ties fixed) on every dtype kind, both
    directions, both axes, k from 0 to n."""
    for seed, n in enumerate((1, 2, 3, 17, 40, 333)):
        x = _inputs(kind, 5, n, seed)
        for dim in (0, 1):
            for largest in (False, True):
                for k in sorted({0, 1, x.shape[dim] // 2, x.shape[dim] - 1, x.shape[dim]} - {-1}):
                    want = torch.from_numpy(stable_argsort(x.numpy(), dim, largest)).narrow(dim, 0, k)
                    got = stable_topk(x, k, dim, largest)
                    assert got.dtype == torch.int64 and torch.equal(got, want), (kind, n, dim, largest, k)


def test_library_selection_reads_strided_views():
    x = _inputs("ties", 64, 50, 3).t()  # [50, 64], not contiguous
    for dim in (0, 1):
        assert torch.equal(stable_topk(x, 5, dim, True), _stable_first_k(x, 5, dim, True))


# ----------------------------------------------------------------- topk through kiln
SIZES = (1, 3, 17, 1000)


def _ks(n: int) -> list[int]:
    return sorted({1, (n + 1) // 2, n})


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("n", SIZES)
def test_topk_matches_torch(n, backend, one_torch_thread):
    """Distinct values: indices and values exactly torch.topk's; ties and NaN: indices the
    stable order's first k, values torch.topk's."""
    distinct, tied = _inputs("distinct", 4, n, n), _inputs("special" if n > 3 else "ties", 4, n, n + 1)
    for k in _ks(n):
        def f(a, b, k=k):
            return (torch.topk(a, k), torch.topk(a, k, dim=-1, largest=False),
                    torch.topk(b, k, largest=True), torch.topk(b, k, largest=False))

        compiled = kiln.compile(Fn(f), (distinct, tied), backend=backend, strict=True, cache=False)
        got = compiled(distinct, tied)
        want = f(distinct, tied)
        for (gv, gi), (wv, wi) in zip(got[:2], want[:2]):
            assert torch.equal(gi, wi) and torch.equal(gv, wv), (n, k)
        for (gv, gi), (wv, _), largest in zip(got[2:], want[2:], (True, False)):
            assert torch.equal(gi, _stable_first_k(tied, k, -1, largest)), (n, k, largest)
            torch.testing.assert_close(gv, wv, equal_nan=True, rtol=0, atol=0)


def test_topk_on_integers_and_the_first_axis(one_torch_thread):
    x = _inputs("int", 40, 6, 5)  # the selected axis (0) has 40 elements: the library call
    for k in (1, 7, 39):
        def f(t, k=k):
            return torch.topk(t, k, dim=0), torch.topk(t, k, dim=0, largest=False)

        got = kiln.compile(Fn(f), (x,), backend="cpu", strict=True, cache=False)(x)
        for (gv, gi), largest in zip(got, (True, False)):
            want = _stable_first_k(x, k, 0, largest)
            assert torch.equal(gi, want) and torch.equal(gv, x.gather(0, want))


@pytest.mark.parametrize("n, how", [(1000, "library"), (17, "generated")])
def test_topk_below_the_axis_is_a_partial_selection(n, how, one_torch_thread):
    """k < n lowers to argtopk (library call from LIBRARY_SORT_MIN elements, generated
    kernel below); k == n stays a full sort."""
    assert (n >= LIBRARY_SORT_MIN) == (how == "library")
    x = _inputs("ties", 3, n, 7)
    compiled = kiln.compile(Fn(lambda t: (torch.topk(t, 5).indices, torch.topk(t, n).indices)), (x,),
                            backend="cpu", strict=True, cache=False)
    choices = compiled.executable.info["choices"]
    assert [v for name, v in choices.items() if "argtopk" in name] == [how], choices
    assert any("argsort" in name for name in choices), choices
    top5, full = compiled(x)
    assert torch.equal(top5, _stable_first_k(x, 5, -1, True)) and torch.equal(full, _stable_first_k(x, n, -1, True))


def test_generated_kernel_above_the_library_threshold(one_torch_thread):
    """select="generated": the rank-based compute on a row the library call would take."""
    x = _inputs("special", 3, 2 * LIBRARY_SORT_MIN + 1, 9)
    compiled = kiln.compile(Fn(lambda t: (torch.topk(t, 6).indices, torch.topk(t, 4, largest=False).indices)),
                            (x,), backend="cpu", strict=True, cache=False, select="generated")
    assert "library" not in compiled.executable.info["choices"].values()
    top, bottom = compiled(x)
    assert torch.equal(top, _stable_first_k(x, 6, -1, True))
    assert torch.equal(bottom, _stable_first_k(x, 4, -1, False))


# ---------------------------------------------------------------------------- gradient
@pytest.mark.parametrize("n", [3, 17, 1000])
def test_topk_values_gradient_matches_eager(n, one_torch_thread):
    """Gradients of ``(out * fixed_random).sum()`` through the topk values (distinct values:
    the selected positions are unambiguous)."""
    x = randn(2, 3, n, seed=n)
    k = min(4, n - 1)
    check_gradients(lambda t: (torch.topk(t, k)[0], torch.topk(t, 1, dim=-1, largest=False).values,
                               torch.topk(t, 1, dim=0).values), (x,), 1)
