"""Training-time attention dropout (``F.scaled_dot_product_attention(..., dropout_p=p)``):
the right statistics, a new mask per call, and a backward that uses the forward's mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln


class Attend(torch.nn.Module):
    def __init__(self, p: float, mask: bool = False):
        super().__init__()
        self.p = p
        self.mask = mask
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x).view(2, 5, 2, 4).transpose(1, 2)
        keep = torch.ones(5, 5, dtype=torch.bool).tril() if self.mask else None
        return F.scaled_dot_product_attention(q, q, q, attn_mask=keep, dropout_p=self.p)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_p_zero_and_p_one(backend):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    exact = Attend(0.0)
    compiled = kiln.compile(exact, (x,), backend=backend, strict=True)
    torch.testing.assert_close(compiled(x), exact(x), rtol=1e-5, atol=1e-6)
    dropped = Attend(1.0)
    dropped.proj = exact.proj
    assert not kiln.compile(dropped, (x,), backend=backend, strict=True)(x).any()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_masks_change_per_call_and_follow_the_seed(backend):
    torch.manual_seed(0)
    model, x = Attend(0.5), torch.randn(2, 5, 8)
    compiled = kiln.compile(model, (x,), backend=backend, strict=True)
    a, b = compiled(x), compiled(x)
    assert not torch.equal(a, b)
    torch.manual_seed(7)
    c = compiled(x)
    torch.manual_seed(7)
    torch.testing.assert_close(compiled(x), c, rtol=0, atol=0)
    # unbiased: the mean over many draws approaches the output without dropout
    exact = Attend(0.0)
    exact.proj = model.proj
    with torch.no_grad():
        mean = torch.stack([compiled(x) for _ in range(400)]).mean(0)
    assert (mean - exact(x)).abs().max() < 0.15


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("entry", ["kiln.compile", "torch.compile"])
def test_backward_uses_the_forward_mask(entry, mask):
    # With the seed fixed, the compiled function is deterministic: its gradient must be the
    # finite-difference derivative of that same function (float64), which holds only when
    # the backward multiplies by the mask the forward drew.
    torch.manual_seed(0)
    model = Attend(0.3, mask).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    weights = torch.randn(2, 2, 5, 4, dtype=torch.float64)
    if entry == "kiln.compile":
        compiled = kiln.compile(model, (x,), backend="reference", strict=True)
    else:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kiln", options={"strict": True, "backend": "reference"})

    def loss(inp):
        torch.manual_seed(123)
        return (compiled(inp) * weights).sum()

    xg = x.clone().requires_grad_(True)
    loss(xg).backward()
    eps = 1e-6
    numeric = torch.zeros_like(x)
    flat = numeric.view(-1)
    for i in range(0, x.numel(), 7):
        d = torch.zeros_like(x).view(-1)
        d[i] = eps
        with torch.no_grad():
            flat[i] = (loss(x + d.view_as(x)) - loss(x - d.view_as(x))) / (2 * eps)
    picked = torch.zeros_like(x).view(-1)
    picked[::7] = 1
    picked = picked.view_as(x).bool()
    torch.testing.assert_close(xg.grad[picked], numeric[picked], rtol=1e-5, atol=1e-7)
    assert (xg.grad[picked] != 0).any()
