"""``nn.Embedding``'s gradient options: ``padding_idx`` rows get no gradient and
``scale_grad_by_freq`` divides by the lookup count, through every entry point; ``sparse``
gradients are refused clearly."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.frontends.errors import UnsupportedOpError

OPTIONS = [dict(padding_idx=1), dict(padding_idx=-2), dict(scale_grad_by_freq=True),
           dict(padding_idx=1, scale_grad_by_freq=True), {}]


def _eager_grad(emb, ids, weights):
    emb.zero_grad()
    (emb(ids) * weights).sum().backward()
    return emb.weight.grad.clone()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_embedding_gradient_options(backend, options):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, **options)
    ids = torch.tensor([[1, 2, 3, 1, 2, 2], [8, 8, 1, 0, 5, 2]])
    weights = torch.randn(2, 6, 4)
    want = _eager_grad(emb, ids, weights)
    torch._dynamo.reset()
    dynamo = torch.compile(emb, backend="kiln", options={"strict": True, "backend": backend})
    emb.zero_grad()
    (dynamo(ids) * weights).sum().backward()
    torch.testing.assert_close(emb.weight.grad, want, rtol=1e-5, atol=1e-6)
    compiled = kiln.compile(emb, (ids,), backend=backend, strict=True)
    emb.zero_grad()
    (compiled(ids) * weights).sum().backward()
    torch.testing.assert_close(emb.weight.grad, want, rtol=1e-5, atol=1e-6)
    if options.get("padding_idx") is not None:
        assert not emb.weight.grad[options["padding_idx"]].any()


def test_sparse_embedding_is_refused_with_a_reason():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    with pytest.raises(UnsupportedOpError, match="sparse=True"):
        kiln.capture(emb, (torch.tensor([[1, 2]]),))
