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
