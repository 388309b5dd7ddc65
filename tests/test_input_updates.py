"""Programs that write their own tensor inputs in place (``x.mul_(2)``, ``x.uniform_()``,
``F.batch_norm`` with running statistics passed in): the compiled program writes the new
values back into the caller's tensors after the call, as eager does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_in_place_update_of_an_input_reaches_the_caller(backend):
    def f(x, y):
        x.mul_(2)
        return x + y

    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled = kiln.compile(f, (x.clone(), y), backend=backend, strict=True)
    for _ in range(2):
        mine, theirs = x.clone(), x.clone()
        out = compiled(mine, y)
        torch.testing.assert_close(out, f(theirs, y))
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_batch_norm_running_statistics_passed_as_inputs(backend):
    def f(x, mean, var):
        return F.batch_norm(x, mean, var, training=True, momentum=0.3)

    torch.manual_seed(0)
    x = torch.randn(6, 4, 3)
    compiled = kiln.compile(f, (x, torch.zeros(4), torch.ones(4)), backend=backend, strict=True)
    mine = [torch.zeros(4), torch.ones(4)]
    theirs = [torch.zeros(4), torch.ones(4)]
    for _ in range(3):
        torch.testing.assert_close(compiled(x, *mine), f(x, *theirs), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine[0], theirs[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mine[1], theirs[1], rtol=1e-5, atol=1e-7)


def test_random_fill_of_an_input():
    def f(x):
        x.uniform_(2.0, 3.0)
        return x * 1

    x = torch.zeros(1000)
    compiled = kiln.compile(f, (x.clone(),), strict=True)
    out = compiled(x)
    torch.testing.assert_close(out, x)  # the input holds the drawn values too
    assert 2.0 <= float(x.min()) and float(x.max()) < 3.0 and abs(float(x.mean()) - 2.5) < 0.05
