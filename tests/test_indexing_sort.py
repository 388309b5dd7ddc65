"""Sorting, scans, scatter/gather, index writes, padding modes, roll and einsum, end to end.

Forward: each group of ops runs through ``kiln.compile(..., strict=True)`` on the reference
and cpu backends and is compared with eager (integer results exactly).  Gradients: through
``torch.compile(backend="kiln", options={"strict": True})`` with ``loss = sum(out * R)``,
judged by :mod:`kiln.zoo.compare` against eager float64.  The finite-difference checks of
the new gradient rules are in ``tests/test_grad_rules.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from eagercheck import Fn, assert_same, check_gradients, gen, randn

import kiln
from kiln.zoo.compare import compare_all, flatten_outputs, weighted_loss, weights_for

X = randn(3, 5, 4)
IDX = torch.randint(0, 5, (3, 2, 4), generator=gen(1))
TIES = torch.tensor([[3., 1, 3, 3, 1, 2, float("nan"), 2], [0, 0, 0, 0, 1, 1, 1, 1]])

GROUPS = {
    "sort": (lambda x, t: (
        torch.sort(x, dim=1, descending=True, stable=True), torch.sort(x, -1), torch.argsort(x, dim=0),
        torch.sort(t, stable=True), torch.sort(t, descending=True, stable=True),
        torch.argsort(t, dim=-1, descending=True, stable=True), torch.msort(x),
        torch.topk(x, 2, dim=1), torch.topk(x, 3, dim=-1, largest=False), torch.topk(x, 3, 0),
        torch.kthvalue(x, 2, dim=1), torch.kthvalue(x, 3, dim=-1, keepdim=True),
        torch.median(x, dim=1), torch.median(x, dim=0, keepdim=True), torch.median(x),
        torch.median(t, dim=1)), (X, TIES)),
    "scans": (lambda x, t: (
        torch.cumsum(x, -2), torch.cumprod(x, 1), torch.cumprod(x, -1, dtype=torch.float64),
        torch.cummax(x, 1), torch.cummin(x, -1), torch.cummax(t, 1), torch.cummin(t, 1),
        torch.cumprod(torch.arange(1, 7).reshape(2, 3), 1)), (X, TIES)),
    "scatter": (lambda x, i: (
        torch.zeros(3, 5, 4).scatter(1, i, x[:, :2]), x.scatter(1, i, 2.5), x.scatter(-1, i[..., :3] % 4, x),
        x.scatter(1, i, x[:, :2], reduce="add"), x.scatter(1, i, 1.5, reduce="multiply"),
        x.scatter_add(1, i, x[:, :2]), x.scatter_reduce(1, i, x[:, :2], "sum", include_self=False),
        x.scatter_reduce(1, i, x[:, :2], "prod"), x.scatter_reduce(1, i, x[:, :2], "mean"),
        x.scatter_reduce(1, i, x[:, :2], "mean", include_self=False),
        x.scatter_reduce(1, i, x[:, :2], "amax"), x.scatter_reduce(0, i[:2] % 3, x[:2, :2], "amin", include_self=False),
        torch.zeros(3, 5, dtype=torch.long).scatter_reduce(1, i[:, :, 0], i[:, :, 1], "amax")), (X, IDX)),
    "gather": (lambda x, i: (
        x.gather(1, i), x.gather(-1, i[:, :, :3] % 4), torch.take_along_dim(x, i, dim=1),
        torch.take_along_dim(x, torch.argsort(x, dim=-1), dim=-1), x.index_select(-1, torch.tensor([3, 0, 3])),
        x[torch.tensor([[0], [2]]), :, torch.tensor([1, -1])], x[:, torch.tensor([-1, 0])],
        x[torch.tensor([2, -3]), torch.tensor([[4], [0]])], x[..., torch.tensor([0, 0, 3])]), (X, IDX)),
    "index_write": (lambda x, m: (
        x.masked_fill(m, -1.0), x.masked_fill(x > 0, torch.tensor(2.0)), torch.where(m, x, 0.5),
        torch.where(x > 0, 1.0, x[0]), torch.where(m[0], x, x[1:2]),
        x.index_put((m,), torch.tensor(3.0)), x.index_put((m[:, :, 0],), torch.arange(4.)),
        x.index_put((m,), torch.tensor(1.0), accumulate=True),
        x.index_put((torch.tensor([0, 2, 0]),), torch.ones(5, 4), accumulate=True),
        x.index_put((torch.tensor([[1, -1], [0, 1]]),), x[:1] * 3, accumulate=True),
        x.index_put((torch.tensor([-3, 2, -1]),), x, accumulate=True),
        x.index_put((torch.tensor([0, -1]), torch.tensor([1, 3])), torch.tensor([7.0, 8.0]).unsqueeze(-1)),
        x.masked_scatter(m, torch.arange(60.).reshape(3, 5, 4)),
        x.masked_scatter(m[0, :, 0:1], -torch.arange(60.)),
        x.index_add(1, torch.tensor([0, 4, 0]), torch.ones(3, 3, 4), alpha=2.0),
        x.index_copy(1, torch.tensor([0, 4, 2]), torch.ones(3, 3, 4)),
        x.index_fill(-1, torch.tensor([0, 3]), -2.0)), (X, X.abs() > 0.7)),
    "setitem": (lambda x, m: _setitems(x, m), (X, X.abs() > 0.7)),
    "layout": (lambda x: (
        torch.roll(x, (1, -2), (1, 2)), torch.roll(x, 3), torch.roll(x, -7, -2), torch.flip(x, (0, -1)),
        torch.rot90(x, 1, (1, 2)), torch.rot90(x, -1, (0, 2)), torch.rot90(x, 2), torch.diag(x[0]),
        torch.diag(x[0], -2), torch.diag(x[0, 0], 1), torch.diagonal(x, 1, 1, 2), torch.diagonal(x, -2, -1, 1),
        torch.diag_embed(x, -1), torch.tril(x, -1), torch.triu(x, 2), torch.repeat_interleave(x, 2, dim=1),
        x.unfold(1, 2, 2), x.unfold(-1, 3, 1), x.narrow(-2, 1, 3), torch.split(x, 2, dim=1),
        torch.chunk(x, 2, dim=-1), torch.unbind(x, 1), torch.stack([x, x * 2], -1), torch.movedim(x, 0, -1),
        torch.tile(x, (2, 1)), torch.meshgrid(x[0, :, 0], x[0, 0], indexing="ij"),
        torch.meshgrid(x[0, :, 0], x[0, 0], indexing="xy"),
        torch.searchsorted(torch.tensor([-1., 0., 0.5, 1.]), x),
        torch.searchsorted(torch.tensor([-1., 0., 0.5, 1.]), x, right=True, out_int32=True),
        torch.searchsorted(torch.sort(x, -1)[0], x[..., :2] + 0.1, side="right"),
        torch.bucketize(x, torch.tensor([-1., 0., 0.5, 1.]), right=True), torch.bucketize(0.3, torch.tensor([0., 1.])),
        F.one_hot(torch.argmax(x, -1), 5)), (X,)),
    "pad": (lambda x: (
        F.pad(x, (1, -1, 2, 0), value=1.5), F.pad(x, (1, 2), mode="reflect"),
        F.pad(x[None], (1, 2, 2, 1), mode="reflect"), F.pad(x, (3, 0), mode="replicate"),
        F.pad(x[None], (1, 2, 0, 3), mode="replicate"), F.pad(x, (1, 2), mode="circular"),
        F.pad(x[None], (1, 2, 2, 1), mode="circular"), F.pad(x[None, None], (1, 1, 2, 1, 1, 2), mode="reflect"),
        F.pad(x[None, None], (1, 1, 2, 1, 1, 2), mode="circular"),
        F.pad(x[None, None], (0, 1, 2, 0, 1, 2), mode="replicate"),
        F.pad(x[None], (-1, 2, 1, -2), mode="circular")), (X,)),
    "einsum": (lambda x, y: (
        torch.einsum("bqd,bkd->bqk", x, y), torch.einsum("bhqd,bhkd->bhqk", x[None], y[None]),
        torch.einsum("bi,bj->bij", x[:, 0], y[:, 1]), torch.einsum("ii->", x[0, :4]),
        torch.einsum("bii->bi", x[:, :4]), torch.einsum("bij->j", x), torch.einsum("i,i->", x[0, 0], y[0, 0]),
        torch.einsum("...ij,...kj->...ik", x, y), torch.einsum("bij,bkj->bik", x, y).diagonal(0, -2, -1),
        torch.einsum("bii", x[:, :4]), torch.einsum("ijk->kji", x)), (X, randn(3, 6, 4, seed=2))),
}


def _setitems(x, m):
    a = x.clone()
    a[m] = 2.0
    b = x.clone()
    b[m[:, :, 0]] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    c = x.clone()
    c[:, torch.tensor([0, 3])] = 0.0
    return a, b, c


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_forward_matches_eager(group, backend, one_torch_thread, kiln_runs):
    fn, inputs = GROUPS[group]
    want = fn(*(t.clone() for t in inputs))
    compiled = kiln.compile(Fn(fn), tuple(t.clone() for t in inputs), strict=True, backend=backend)
    got = compiled(*(t.clone() for t in inputs))
    assert kiln_runs, "kiln did not run"
    assert_same(got, want)


def test_stable_sort_ties_and_nan_follow_torch():
    """Ties keep input order in both directions; NaN sorts above every number."""
    t = GROUPS["sort"][1][1]
    compiled = kiln.compile(Fn(lambda t: (torch.sort(t, descending=True, stable=True).indices,
                                          torch.sort(t, stable=True).indices)), (t,), strict=True)
    got_desc, got_asc = compiled(t)
    assert got_desc[0].tolist() == [6, 0, 2, 3, 5, 7, 1, 4]
    assert got_asc[0].tolist() == [1, 4, 5, 7, 0, 2, 3, 6]
    assert got_desc[1].tolist() == [4, 5, 6, 7, 0, 1, 2, 3]


# ------------------------------------------------------------------------- gradients
GRAD_CASES = {
    "sort_topk": (lambda x: (torch.sort(x, dim=1, descending=True)[0], torch.topk(x, 2, dim=-1)[0],
                             torch.topk(x, 2, dim=0, largest=False).values, torch.kthvalue(x, 2, dim=1)[0],
                             torch.median(x, dim=-1).values, torch.msort(x)), (X,), 1),
    "scans": (lambda x: (torch.cumprod(x, 1), torch.cummax(x, 1)[0], torch.cummin(x, -1).values,
                         torch.cumsum(x, 0)), (X,), 1),
    "scatter": (lambda x, s, i: (x.scatter(1, i, s), x.scatter_add(1, i, s),
                                 x.scatter_reduce(1, i, s, "sum", include_self=False),
                                 x.scatter_reduce(1, i, s, "mean"), x.scatter_reduce(1, i, s, "amax"),
                                 x.scatter_reduce(1, i, s, "amin", include_self=False),
                                 x.scatter_reduce(1, i, s, "prod"), x.gather(1, i) * s),
                (X, randn(3, 2, 4, seed=3), IDX), 2),
    "index_write": (lambda x, v, m: (x.masked_fill(m, 0.0), torch.where(m, x, v[:, :1]),
                                     x.index_put((torch.tensor([0, 2, 0]),), v[0], accumulate=True),
                                     x.masked_scatter(m, v), x.index_add(1, torch.tensor([0, 4, 0]), v[:, :3]),
                                     x.index_copy(1, torch.tensor([1, 3]), v[:, 1:3]),
                                     x.index_fill(-1, torch.tensor([0, 3]), -2.0),
                                     x[torch.tensor([[0], [2]]), :, torch.tensor([1, -1])]),
                    (X, randn(3, 5, 4, seed=4), X.abs() > 0.7), 2),
    "layout": (lambda x, y: (torch.roll(x, (1, -2), (1, 2)), torch.rot90(x, 1, (1, 2)), torch.diagonal(x, 1, 1, 2),
                             torch.diag_embed(x[0], 1), x.unfold(1, 2, 2), F.pad(x[None], (1, 2, 2, 1), mode="reflect"),
                             F.pad(x, (2, 1), mode="replicate"), F.pad(x[None], (1, 2, 2, 1), mode="constant", value=0.5),
                             F.pad(x, (1, -1, 2, 0), value=1.5), torch.einsum("bqd,bkd->bqk", x, y),
                             torch.einsum("bii->bi", x[:, :4]), torch.einsum("ii", y[0, :4]),
                             torch.repeat_interleave(x, 2, dim=-1)), (X, randn(3, 6, 4, seed=2)), 2),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_through_torch_compile_match_eager(case, one_torch_thread):
    fn, inputs, n_float = GRAD_CASES[case]
    check_gradients(fn, inputs, n_float)


def test_tied_values_share_gradient_like_torch(one_torch_thread):
    """The gradient of sorted/topk values lands on the selected positions (ties included),
    and amax ties share it evenly, as in eager."""
    t = torch.tensor([[3., 1, 3, 3, 1, 2, 2, 0]])
    src = torch.tensor([[3., 3.]])
    index = torch.tensor([[0, 0]])
    check_gradients(lambda t, s: (torch.sort(t, descending=True, stable=True)[0] * torch.arange(8.),
                                   torch.cummax(t, 1)[0], t[:, :2].scatter_reduce(1, index, s, "amax")),
                     (t, src), 2)


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fn, match", [
    (lambda x: x[x > 0], r"aten\.index\.Tensor.*(data-dependent|symbolic)"),
    (lambda x: torch.nonzero(x > 0), r"aten\.nonzero.*(data-dependent|symbolic)"),
    (lambda x: x.masked_select(x > 0), r"aten\.(masked_select|index).*(data-dependent|symbolic)"),
])
def test_data_dependent_shapes_are_refused_clearly(fn, match):
    with pytest.raises(kiln.UnsupportedOpError, match=match):
        kiln.compile(Fn(fn), (X,), strict=True)


def test_mask_write_of_per_element_values_is_refused_clearly():
    def fn(x, v):
        y = x.clone()
        y[x > 0] = v
        return y

    with pytest.raises(kiln.UnsupportedOpError, match=r"aten\.index_put.*data-dependent.*torch\.where"):
        kiln.capture(Fn(fn), (torch.ones(4), torch.ones(4)))


# ------------------------------------------------------------------- small real models
class PointCloudNet(torch.nn.Module):
    """DGCNN-style edge convolution: kNN by topk on pairwise distances, gather of the
    neighbours' features, max over neighbours, a sort-based pooling of the points."""

    def __init__(self, k: int = 4):
        super().__init__()
        self.k = k
        self.edge = torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8 * 3, 5)

    def forward(self, points):  # [B, N, 3]
        b, n, c = points.shape
        dist = (points.unsqueeze(2) - points.unsqueeze(1)).pow(2).sum(-1)
        idx = dist.topk(self.k, dim=-1, largest=False).indices  # [B, N, k]
        neigh = torch.gather(points.unsqueeze(1).expand(b, n, n, c), 2,
                             idx.unsqueeze(-1).expand(b, n, self.k, c))
        centre = points.unsqueeze(2).expand(b, n, self.k, c)
        feat = torch.relu(self.edge(torch.cat([centre, neigh - centre], -1))).amax(2)  # [B, N, 8]
        ranked = feat.sort(dim=1, descending=True).values[:, :3]  # top-3 points per channel
        return self.head(ranked.reshape(b, -1))


def window_attention_mask(h: int, w: int, window: int, shift: int) -> torch.Tensor:
    """Swin's shifted-window mask, computed in the graph: region ids rolled, windows by
    integer division/remainder, -100 where two positions of a window come from different
    regions."""
    ys = torch.arange(h).reshape(h, 1).expand(h, w)
    xs = torch.arange(w).reshape(1, w).expand(h, w)
    region = (ys >= h - window).long() * 3 + (ys >= h - shift).long() + \
        (xs >= w - window).long() + (xs >= w - shift).long()
    region = torch.roll(region, (-shift, -shift), (0, 1))
    win = (ys // window) * (w // window) + torch.remainder(xs, w) // window
    order = torch.argsort(win.reshape(-1) * (h * w) + torch.arange(h * w), stable=True)
    ids = region.reshape(-1)[order].reshape(-1, window * window)
    diff = ids.unsqueeze(1) - ids.unsqueeze(2)
    return torch.zeros(diff.shape).masked_fill(diff != 0, -100.0)


class ShiftedWindowAttention(torch.nn.Module):
    def __init__(self, dim: int = 8, window: int = 2, shift: int = 1):
        super().__init__()
        self.window, self.shift = window, shift
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):  # [B, H, W, C]
        b, h, w, c = x.shape
        s, win = self.shift, self.window
        x = torch.roll(x, (-s, -s), (1, 2))
        x = x.reshape(b, h // win, win, w // win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(b, -1, win * win, c)
        q, k, v = self.qkv(x).chunk(3, -1)
        att = torch.einsum("bnqc,bnkc->bnqk", q, k) / c ** 0.5 + window_attention_mask(h, w, win, s)
        y = torch.einsum("bnqk,bnkc->bnqc", att.softmax(-1), v)
        y = y.reshape(b, h // win, w // win, win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        return torch.roll(y, (s, s), (1, 2))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("model, inputs", [
    (PointCloudNet, (randn(2, 9, 3, seed=5),)),
    (ShiftedWindowAttention, (randn(1, 4, 6, 8, seed=6),)),
], ids=["point_cloud", "shifted_window"])
def test_models_match_eager(model, inputs, backend, one_torch_thread):
    torch.manual_seed(0)
    net = model().eval()
    want = net(*inputs)
    got = kiln.compile(net, inputs, strict=True, backend=backend)(*inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model, inputs", [
    (PointCloudNet, (randn(2, 9, 3, seed=5),)),
    (ShiftedWindowAttention, (randn(1, 4, 6, 8, seed=6),)),
], ids=["point_cloud", "shifted_window"])
def test_models_train_like_eager(model, inputs, one_torch_thread):
    torch.manual_seed(0)
    net = model()
    params = dict(net.named_parameters())

    def grads(dtype, compile_it):
        m = model()
        m.load_state_dict(net.state_dict())
        m = m.to(dtype)
        f = torch.compile(m, backend="kiln", dynamic=False, options={"strict": True}) if compile_it else m
        outs = flatten_outputs(f(*(t.to(dtype) for t in inputs)))
        loss = weighted_loss(outs, weights_for(outs))
        named = dict(zip(params, torch.autograd.grad(loss, list(m.parameters()))))
        named.update({f"out:{k}": v for k, v in outs.items()})
        return named

    torch._dynamo.reset()
    kiln32 = grads(torch.float32, True)
    results = compare_all(kiln32, grads(torch.float32, False), grads(torch.float64, False))
    assert all(c.ok for c in results), [c for c in results if not c.ok]


@pytest.mark.parametrize("descending", [False, True])
def test_long_rows_sort_with_the_library_and_keep_ties_and_nan_order(descending):
    """Rows of at least LIBRARY_SORT_MIN elements run torch's stable sort on the cpu backend
    (the generated ranking kernel is quadratic); ties stay in input order, NaN sorts above
    every number, as in the reference."""
    from kiln.backends.cpu.library import LIBRARY_SORT_MIN

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (6, 3 * LIBRARY_SORT_MIN), generator=g).float()  # many ties
    x[1, 7] = x[4, 0] = float("nan")

    def f(t):
        return torch.argsort(t, dim=-1, descending=descending, stable=True), torch.topk(t, 4, largest=descending).values

    compiled = kiln.compile(f, (x,), backend="cpu", cache=False, strict=True)
    choices = compiled.executable.info["choices"]
    assert any("argsort" in node and how == "library" for node, how in choices.items()), choices
    (order, top), (want_order, want_top) = compiled(x), f(x)
    assert torch.equal(order, want_order)
    torch.testing.assert_close(top, want_top, equal_nan=True)  # torch.topk's tie order is unspecified
