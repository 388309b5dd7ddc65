"""Helpers of the op-family tests that compare kiln with eager on seeded inputs."""

from __future__ import annotations

import torch


class Fn(torch.nn.Module):
    """A function of its inputs as a module (what ``kiln.compile`` takes)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed))


def assert_same(got, want, path: str = "out", rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same structure, shapes and dtypes; floats close (NaNs where eager has them), the rest equal."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), path
        for k, (a, b) in enumerate(zip(got, want)):
            assert_same(a, b, f"{path}.{k}", rtol, atol)
        return
    assert got.shape == want.shape and got.dtype == want.dtype, (path, got.shape, want.shape, got.dtype)
    if want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True, msg=path)
    else:
        assert torch.equal(got, want), f"{path}: {got} != {want}"


def check_gradients(fn, inputs, n_float: int) -> None:
    """Gradients of ``sum(out * R)`` w.r.t. the first ``n_float`` inputs through
    ``torch.compile(backend="kiln")`` (float32) against eager float32 and float64, by the rule
    of :mod:`kiln.zoo.compare`."""
    from kiln.zoo.compare import (
        compare_all,
        flatten_outputs,
        weighted_loss,
        weights_for,
    )

    def grads(dtype, compile_it):
        leaves = [t.to(dtype).requires_grad_() if k < n_float else t for k, t in enumerate(inputs)]
        f = torch.compile(Fn(fn), backend="kiln", dynamic=False, options={"strict": True}) if compile_it else Fn(fn)
        outs = flatten_outputs(f(*leaves))
        loss = weighted_loss(outs, weights_for(outs))
        got = torch.autograd.grad(loss, leaves[:n_float], allow_unused=True)
        named = {f"d{k}": (g if g is not None else torch.zeros_like(leaves[k])) for k, g in enumerate(got)}
        named.update({f"out:{k}": v for k, v in outs.items()})
        return named

    torch._dynamo.reset()
    kiln32 = grads(torch.float32, True)
    eager32, ref64 = grads(torch.float32, False), grads(torch.float64, False)
    bad = [c for c in compare_all(kiln32, eager32, ref64) if not c.ok]
    assert not bad, bad
