"""Packed copies kept across calls (GEMM panels, oneDNN conv weights) are only made of
parameters: an input or an intermediate operand is a new tensor at every call, and may sit
at the address and version counter of the last call's tensor, so a packed copy of it would
silently go stale (it once did: the weight gradient of a convolution, a convolution whose
"weight" is the incoming gradient, came out wrong from the second call on)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kiln
from kiln.zoo.compare import rel_error


def _fresh_calls(fn, make_args, calls=4):
    compiled = kiln.compile(fn, make_args(), backend="cpu")
    for _ in range(calls):
        args = make_args()
        yield compiled(*args), fn(*args)


def test_conv_with_input_weight_is_not_reused_across_calls():
    torch.manual_seed(0)
    make = lambda: (torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3))  # noqa: E731
    for got, want in _fresh_calls(lambda x, w: F.conv2d(x, w, padding=1), make):
        assert rel_error(got, want) < 1e-5


def test_matmul_with_input_operand_is_not_reused_across_calls():
    torch.manual_seed(0)
    make = lambda: (torch.randn(7, 64), torch.randn(64, 48))  # noqa: E731
    for got, want in _fresh_calls(lambda a, b: a @ b, make):
        assert rel_error(got, want) < 1e-5


def test_conv_weight_gradient_on_new_inputs_every_call():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh())
    compiled = kiln.compile(model, (torch.randn(2, 3, 8, 8),), backend="cpu")
    for _ in range(4):
        x = torch.randn(2, 3, 8, 8)
        weights = torch.randn(2, 4, 6, 6)
        model.zero_grad()
        (compiled(x) * weights).sum().backward()
        got = model[0].weight.grad.clone()
        model.zero_grad()
        (model(x) * weights).sum().backward()
        assert rel_error(got, model[0].weight.grad) < 1e-5


def test_parameter_packing_follows_in_place_updates():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 36, 40))
    x = torch.randn(2, 3, 8, 8)
    compiled = kiln.compile(model, (x,), backend="cpu")
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9).add_(0.01)
            assert rel_error(compiled(x), model(x)) < 1e-5


class _ConvThenChannelsLastNorm(torch.nn.Module):
    """A ConvNeXt block's shape: conv, permute to channels-last, layer norm, linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.norm = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x).permute(0, 2, 3, 1)))


def test_kernel_result_read_by_a_gemm_keeps_its_layout():
    # The cpu backend stores some kernel results channels-last (NHWC) behind an NCHW view so
    # that convolutions read them without a copy; a GEMM planned against the contiguous
    # layout must not get such a result (it once read it in the wrong order: 150% error).
    torch.manual_seed(0)
    model = _ConvThenChannelsLastNorm().eval()
    x = torch.randn(1, 16, 8, 8)
    for passes in (None, "default"):
        compiled = kiln.compile(model, (x,), backend="cpu", passes=passes, strict=True)
        with torch.no_grad():
            assert rel_error(compiled(x), model(x)) < 1e-5
