"""kiln's own CPU convolution kernels (kiln/backends/cpu/conv.py) against the op's numpy
reference and PyTorch eager: the implicit GEMM (1x1, patchify, general k x k with padding,
stride and dilation) and the depthwise kernel, at odd sizes (1, 3, 17 and a large one), on
NCHW and channels-last inputs; weight repacking after an in-place update; bad input; the
per-shape choice of the library table and kiln's kernels inside compiled conv nets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.backends.cpu import conv as conv_module
from kiln.backends.cpu.conv import ACTIVATIONS, KilnConv2d, conv2d, kind, native_conv
from kiln.backends.cpu.library import library_call
from kiln.backends.cpu.standalone import ENV_VAR
from kiln.ir import Graph, get_op
from kiln.ir.types import DType, TensorType

pytestmark = pytest.mark.skipif(conv_module.conv_entry() is None, reason="needs a C compiler with OpenMP")

REFERENCE = get_op("conv").reference


def _rel(got: torch.Tensor, want) -> float:
    want = torch.as_tensor(np.asarray(want)).double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(n, c, h, w, cout, k, stride=1, padding=0, dilation=1, groups=1, bias=True, channels_last=False, seed=0,
           direct=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(cout, c // groups, k, k, generator=g)
    b = torch.randn(cout, generator=g) if bias else None
    got = conv2d(x, weight, b, stride=stride, padding=padding, dilation=dilation, groups=groups, direct=direct)
    pair = lambda v: [v, v]  # noqa: E731
    ref = REFERENCE(x.numpy(), weight.numpy(), None if b is None else b.numpy(), stride=pair(stride),
                    padding=pair(padding), dilation=pair(dilation), groups=groups)
    eager = F.conv2d(x, weight, b, stride, padding, dilation, groups)
    assert got.shape == eager.shape
    assert got.permute(0, 2, 3, 1).is_contiguous()  # channels-last result
    assert _rel(got, ref) <= 1e-4 and _rel(got, eager) <= 1e-4


@pytest.mark.parametrize("size", [1, 3, 17])
@pytest.mark.parametrize("channels_last", [False, True])
def test_pointwise_gemm_odd_sizes(size, channels_last):
    _check(1, size, size, size, size, 1, channels_last=channels_last)
    _check(2, 3, size, size + 2, 17, 1, stride=2, bias=False, channels_last=channels_last)


@pytest.mark.parametrize("size", [1, 3, 17])
def test_general_and_patchify_gemm(size):
    _check(2, 3, 17, 17, size, 3, stride=2, padding=1)          # k x k, padded: the implicit GEMM
    _check(1, size, 2 * size + 1, 3 * size, 5, 3, dilation=2, padding=2, channels_last=True)
    _check(1, 3, 4 * size, 4 * size, size, 4, stride=4)        # patchify


def test_large_gemm_crosses_blocks():
    # K = 3*16*16 = 768 > one 256-deep block, M = 196 > one 96-row block, Cout = 1000
    _check(1, 3, 224, 224, 1000, 16, stride=16, seed=1)
    _check(1, 300, 20, 20, 33, 1, seed=2, channels_last=True)  # K = 300: two blocks of K


@pytest.mark.parametrize("cout", [1, 3, 16, 17, 64, 130, 1000])
def test_direct_kernel_for_few_input_channels(cout):
    """The direct kernel (a stem: broadcast input values against 16 output channels, 8
    pixels at once; with AVX-512, 64 channels x 6 pixels first, then the rest 16 at a time)
    at odd sizes: a 3x3 stride-2 stem, a 7x7 one, dilation, a row shorter than 8 pixels,
    NCHW and channels-last inputs, without bias."""
    _check(1, 3, 17, 19, cout, 3, stride=2, padding=1, direct=True)
    _check(2, 3, 13, 13, cout, 7, stride=2, padding=3, direct=True, channels_last=True)
    _check(1, 1, 9, 5, cout, 3, dilation=2, padding=2, bias=False, direct=True)
    _check(1, 4, 3, 3, cout, 2, direct=True)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("cout", [70, 128])
def test_direct_kernel_applies_residual_and_activation_in_its_stores(act, cout):
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(2, 3, 23, 29, generator=g), torch.randn(cout, 3, 5, 5, generator=g), torch.randn(cout, generator=g)
    want = F.conv2d(x, w, b, stride=2, padding=2)
    residual = torch.randn(want.shape, generator=g)
    want = {"none": lambda t: t, "relu": F.relu, "relu6": F.relu6, "hardswish": F.hardswish}[act](want + residual)
    got = KilnConv2d("direct", (2, 2), (2, 2), (1, 1), 1, act=act)(x, w, b, residual)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("cin,cout,hw", [(16, 16, (23, 5)), (24, 72, (7, 7)), (40, 88, (3, 1)), (3, 1000, (5, 5)),
                                         (96, 40, (1, 1)), (17, 33, (9, 11)), (600, 48, (4, 7))])
def test_pointwise_kernel_applies_residual_and_activation_in_its_stores(act, cin, cout, hw):
    """The 1x1 channels-last kernel (one register block of rows x up to 64 channels for the
    whole reduction, the epilogue before its only store; with AVX2, 6 rows x 16 channels):
    every block width (1-4 vectors, masked tails), row counts that leave partial blocks (M = 1, 3, 35, 49, 99, 115), K from 3
    to 600."""
    g = torch.Generator().manual_seed(cin * cout)
    x = torch.randn(1, cin, *hw, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(cout, cin, 1, 1, generator=g), torch.randn(cout, generator=g)
    want = F.conv2d(x, w, b)
    residual = torch.randn(want.shape, generator=g).contiguous(memory_format=torch.channels_last)
    want = {"none": lambda t: t, "relu": F.relu, "relu6": F.relu6, "hardswish": F.hardswish}[act](want + residual)
    got = KilnConv2d("gemm", (1, 1), (0, 0), (1, 1), 1, act=act)(x, w, b, residual)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
    got = KilnConv2d("gemm", (1, 1), (0, 0), (1, 1), 1, act=act)(x, w, None, residual)
    want_nb = {"none": lambda t: t, "relu": F.relu, "relu6": F.relu6, "hardswish": F.hardswish}[act](
        F.conv2d(x, w) + residual)
    assert ((got - want_nb).abs().max() / want_nb.abs().max()).item() <= 1e-4


def test_one_kernel_object_serves_calls_of_several_layouts_and_shapes():
    """A convolution object plans each operand signature (shapes, strides, dtypes) once:
    NCHW and channels-last inputs, another batch size, a non-contiguous float64 bias, and a
    depthwise input that must be made channels-last, all alternating, all match eager."""
    g = torch.Generator().manual_seed(3)
    gemm = KilnConv2d("gemm", (1, 1), (1, 1), (1, 1), 1)
    w = torch.randn(20, 6, 3, 3, generator=g)
    bias = torch.randn(40, generator=g, dtype=torch.float64)[::2]
    x1 = torch.randn(1, 6, 9, 7, generator=g)
    x2 = torch.randn(3, 6, 9, 7, generator=g).contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        for x, b in ((x1, None), (x2, bias), (x1, bias), (x2, None)):
            want = F.conv2d(x, w, None if b is None else b.float(), 1, 1)
            assert _rel(gemm(x, w, b), want) <= 1e-4
    depthwise = KilnConv2d("depthwise", (2, 2), (1, 1), (1, 1), 6)
    wd = torch.randn(6, 1, 3, 3, generator=g)
    for _ in range(2):
        for x in (x1, x2, x1.contiguous(memory_format=torch.channels_last)):
            assert _rel(depthwise(x, wd), F.conv2d(x, wd, None, 2, 1, 1, 6)) <= 1e-4


@pytest.mark.parametrize("cout", [32, 48, 64, 1000])
def test_gemm_tiles_of_two_panels(cout):
    """Output channels filling pairs of 16-column panels (the 12x32 AVX-512 tiles), beside a
    single panel (48) and an edge panel (1000), with last micro-panels of fewer rows, packed
    (k x k) and in place (1x1 of a channels-last input, rows in chunks of six, K > 256 for
    the accumulating blocks), with the threads splitting rows (M >= 48 and M >= Cout) or
    each block's tile grid."""
    _check(1, 40, 5, 7, cout, 1, channels_last=True)                 # M = 35: rows 12 + 12 + 11
    _check(1, 300, 3, 9, cout, 1, channels_last=True, bias=False)    # M = 27, K = 300
    _check(2, 5, 9, 11, cout, 3, padding=1)                           # M = 198 > one 144-row block
    _check(1, 3, 13, 13, cout, 7, stride=2, padding=3)                # a stem: M = 49, K = 147


@pytest.mark.parametrize("size", [1, 3, 17])
@pytest.mark.parametrize("k,stride,padding,dilation", [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 2, 1), (3, 1, 2, 2)])
def test_depthwise_odd_sizes(size, k, stride, padding, dilation):
    _check(1, size, size, size, size, k, stride, padding, dilation, groups=size, channels_last=True)
    _check(2, 17, size + 4, size + 2, 17, k, stride, padding, dilation, groups=17, bias=False)  # NCHW input


def test_depthwise_large():
    _check(1, 1000, 9, 11, 1000, 3, padding=1, groups=1000, channels_last=True, seed=3)
    _check(1, 48, 56, 56, 48, 5, stride=2, padding=2, groups=48, channels_last=True, seed=4)


@pytest.mark.parametrize("kernel_kind,groups", [("gemm", 1), ("depthwise", 8)])
def test_packed_weight_follows_in_place_updates(kernel_kind, groups):
    conv = KilnConv2d(kernel_kind, (1, 1), (1, 1), (1, 1), groups)
    x = torch.randn(1, 8, 5, 5)
    w = torch.randn(8, 8 // groups, 3, 3)
    first = conv(x, w)
    assert _rel(first, F.conv2d(x, w, None, 1, 1, 1, groups)) <= 1e-4
    with torch.no_grad():
        w.mul_(-2.0)  # an optimizer step: same storage, new version
    assert _rel(conv(x, w), F.conv2d(x, w, None, 1, 1, 1, groups)) <= 1e-4


def test_bad_input_is_refused_clearly():
    x, w = torch.randn(1, 4, 5, 5), torch.randn(4, 4, 3, 3)
    with pytest.raises(ValueError, match="groups"):
        conv2d(x, torch.randn(4, 2, 3, 3), groups=2)  # grouped, not depthwise
    with pytest.raises(TypeError, match="float32"):
        conv2d(x.double(), w.double())
    with pytest.raises(ValueError, match="bias"):
        conv2d(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="empty"):
        conv2d(x, torch.randn(4, 4, 7, 7))
    with pytest.raises(ValueError, match="input channels"):
        conv2d(torch.randn(1, 3, 5, 5), w)
    with pytest.raises(ValueError, match="unknown kiln convolution kind"):
        KilnConv2d("winograd", (1, 1), (0, 0), (1, 1), 1)


def test_kind_of_a_convolution():
    assert kind((1, 8, 9, 9), (8, 1, 3, 3), (1, 1), (1, 1), (1, 1), 8) == "depthwise"
    assert kind((1, 8, 9, 9), (16, 8, 1, 1), (2, 2), (0, 0), (1, 1), 1) == "gemm"
    assert kind((1, 3, 32, 32), (8, 3, 16, 16), (16, 16), (0, 0), (1, 1), 1) == "gemm"
    assert kind((1, 8, 9, 9), (8, 8, 3, 3), (1, 1), (1, 1), (1, 1), 1) is None   # 3x3: oneDNN
    assert kind((1, 8, 9, 9), (8, 2, 3, 3), (1, 1), (1, 1), (1, 1), 4) is None   # grouped
    assert kind((1, 3, 224, 224), (16, 3, 3, 3), (2, 2), (1, 1), (1, 1), 1) == "direct"   # a stem
    assert kind((1, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3), (1, 1), 1) == "direct"
    assert kind((1, 5, 9, 9), (8, 5, 3, 3), (1, 1), (1, 1), (1, 1), 1) is None   # five channels: oneDNN
    assert kind((1, 3, 9, 9), (8, 3, 1, 1), (1, 1), (0, 0), (1, 1), 1) == "gemm"


def _conv_node(x_shape, w_shape, stride, padding, groups, dtype=DType.float32):
    g = Graph("conv")
    ins = [g.add_input("x", TensorType(x_shape, dtype)), g.add_input("w", TensorType(w_shape, dtype))]
    return g.add_node("conv", ins, {"stride": list(stride), "padding": list(padding), "dilation": [1, 1],
                                    "groups": groups})


def test_library_table_follows_the_choice(monkeypatch):
    depthwise = _conv_node((1, 8, 9, 9), (8, 1, 3, 3), (1, 1), (1, 1), 8)
    general = _conv_node((1, 8, 9, 9), (8, 8, 3, 3), (1, 1), (1, 1), 1)
    monkeypatch.setenv(ENV_VAR, "1")
    assert library_call(depthwise, [False, True]).label == "kiln depthwise convolution"
    assert library_call(depthwise, [False, True]).channels_last
    assert library_call(general, [False, True]).label.startswith("oneDNN")
    assert native_conv(_conv_node((1, 8, 9, 9), (8, 1, 3, 3), (1, 1), (1, 1), 8, DType.float64), None) is None
    monkeypatch.setenv(ENV_VAR, "0")
    assert library_call(depthwise, [False, True]).label.startswith("oneDNN")


class Separable(nn.Module):
    """An inverted residual: 1x1 expansion, depthwise 3x3, 1x1 projection, batch norm,
    hardswish, a residual; then a patchify convolution."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(5, 17, 1, bias=False), nn.BatchNorm2d(17), nn.Hardswish(),
                                  nn.Conv2d(17, 17, 3, 1, 1, groups=17, bias=False), nn.BatchNorm2d(17),
                                  nn.Hardswish(), nn.Conv2d(17, 5, 1), nn.BatchNorm2d(5))
        self.patch = nn.Conv2d(5, 3, 3, stride=3)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.running_var, 0.5, 1.5)
                nn.init.uniform_(m.running_mean, -0.2, 0.2)

    def forward(self, x):
        return self.patch(x + self.body(x))


def test_compiled_conv_net_runs_kiln_kernels(monkeypatch):
    """All four convolutions run on kiln's kernels, launched by the native run (foreign
    kernels, see tests/test_cpu_conv_native.py); the reference backend agrees."""
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(0)
    model = Separable().eval()
    x = torch.randn(2, 5, 9, 9)
    with torch.no_grad():
        want = model(x)
        for backend in ("cpu", "reference"):
            compiled = kiln.compile(model, (x,), backend=backend)
            assert _rel(compiled(x), want) <= 1e-4, backend
            if backend == "cpu":
                labels = " ".join(compiled.executable.plan.workspace().labels)
                assert compiled.executable.info["foreign_kernels"] == 4
                assert labels.count("kiln gemm convolution") == 3 and labels.count("kiln depthwise convolution") == 1


def test_choice_is_timed_on_the_input_layout_of_the_plan(monkeypatch):
    """A convolution whose input is a kiln convolution's (channels-last) result is timed,
    and its choice stored, on a channels-last input: a 1x1 GEMM reads that layout in place,
    so its cost differs from an NCHW input's.  The first convolution reads the NCHW graph
    input and is timed on it."""
    seen: list[str] = []
    chooser = conv_module._CHOOSER

    def choose(signature, kiln_fn, library_fn):
        seen.append(signature)
        return "kiln"
    monkeypatch.setattr(chooser, "choose", choose)
    model = nn.Sequential(nn.Conv2d(4, 6, 1), nn.ReLU(), nn.Conv2d(6, 5, 1)).eval()
    x = torch.randn(1, 4, 7, 7)
    with torch.no_grad():
        compiled = kiln.compile(model, (x,), cache=False)
        assert _rel(compiled(x), model(x)) <= 1e-4
    first = [s for s in seen if "(6, 4, 1, 1)" in s]
    second = [s for s in seen if "(5, 6, 1, 1)" in s]
    assert first and second
    assert all(not s.endswith("channels-last") for s in first)
    assert all(s.endswith("channels-last") for s in second)
