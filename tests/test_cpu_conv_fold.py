"""The cpu backend's convolution calls: oneDNN with prepacked 2-d and 3-d weights, inference
batch norm folded into the weight, oneDNN's fused ReLU, and parameters read live."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import kiln
from kiln.backends.cpu.packed_conv import packed_conv_available
from kiln.backends.cpu.standalone import ENV_VAR
from kiln.runtime.module import InputMismatchError

pytestmark = pytest.mark.skipif(not packed_conv_available(2), reason="torch without oneDNN")


def _randomize_norms(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                m.weight.copy_(torch.randn(m.num_features, generator=gen))
                m.bias.copy_(torch.randn(m.num_features, generator=gen))
    return model.eval()


def _labels(compiled, args) -> list[str]:
    with torch.no_grad():
        return [label for label, _ in compiled.executable.plan.profile([*args, *compiled.params], repeat=1)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


CASES = [
    # conv, norm, activation, input shape
    (lambda: nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d, nn.ReLU, (1, 3, 17, 17)),
    (lambda: nn.Conv2d(4, 6, 3, stride=2, bias=True), nn.BatchNorm2d, None, (3, 4, 17, 17)),
    (lambda: nn.Conv2d(5, 5, 1, bias=False), nn.BatchNorm2d, nn.Hardswish, (1, 5, 3, 3)),
    (lambda: nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d, nn.ReLU, (1, 16, 17, 17)),
    (lambda: nn.Conv3d(1, 8, 3, padding=1, bias=False), nn.BatchNorm3d, nn.ReLU, (1, 1, 9, 9, 9)),
    (lambda: nn.Conv3d(3, 4, 3, bias=True), nn.BatchNorm3d, None, (2, 3, 5, 6, 7)),
]


@pytest.fixture
def fold_everything(monkeypatch):
    """Fold at every size (the test shapes are small); builds bypass the compile cache, which
    does not know the threshold changed."""
    import kiln.backends.cpu.partition as partition
    monkeypatch.setattr(partition, "FOLD_MIN_ELEMENTS", 0)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_conv_batch_norm_activation_matches_eager_and_sees_parameter_updates(case, fold_everything):
    make_conv, norm, act, shape = CASES[case]
    torch.manual_seed(case)
    conv = make_conv()
    layers = [conv, norm(conv.out_channels)] + ([act()] if act else [])
    model = _randomize_norms(nn.Sequential(*layers))
    x = torch.randn(shape)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True, cache=False)
    with torch.no_grad():
        assert _rel(compiled(x), model(x)) <= 1e-4
        labels = _labels(compiled, (x,))
        assert any("conv+batch_norm" in label and "folded" in label for label in labels), labels
        # every tensor the folded weight is made from is read live
        for update in (lambda: model[1].running_var.mul_(3.0), lambda: model[1].running_mean.add_(1.0),
                       lambda: model[1].weight.mul_(-0.5), lambda: model[1].bias.add_(2.0),
                       lambda: model[0].weight.mul_(0.25)):
            update()
            assert _rel(compiled(x), model(x)) <= 1e-4
        if conv.bias is not None:
            conv.bias.add_(1.5)
            assert _rel(compiled(x), model(x)) <= 1e-4


def test_relu_runs_inside_the_onednn_call_and_other_epilogues_stay_kernels(fold_everything):
    torch.manual_seed(0)
    model = _randomize_norms(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()))
    x = torch.randn(1, 8, 17, 17)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True, cache=False)
    labels = _labels(compiled, (x,))
    if any("oneDNN" in label for label in labels):  # kiln's own kernel may have measured faster
        assert any("conv+batch_norm+relu" in label and "+relu" in label for label in labels), labels
        assert not any("epilogue" in label for label in labels), labels

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

        def forward(self, x):
            y = self.bn(self.conv(x))
            return torch.relu(y + x), y  # the norm's result is also an output: not folded away

    model = _randomize_norms(Residual())
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True, cache=False)
    with torch.no_grad():
        for got, want in zip(compiled(x), model(x)):
            assert _rel(got, want) <= 1e-4


def test_only_large_results_fold_their_batch_norm(monkeypatch):
    """On a oneDNN call, folding costs a check per call (a few microseconds); it pays only
    for results from FOLD_MIN_ELEMENTS elements, where the separate normalization pass is
    dearer.  (kiln's own kernels fold every inference batch norm: their weights are checked
    with the rest of a native run's, see tests/test_cpu_conv_native.py.)"""
    from kiln.backends.cpu.partition import FOLD_MIN_ELEMENTS
    monkeypatch.setenv(ENV_VAR, "0")
    torch.manual_seed(0)
    for side, folded in ((8, False), (64, True)):
        model = _randomize_norms(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)))
        x = torch.randn(1, 3, side, side)
        assert (16 * side * side >= FOLD_MIN_ELEMENTS) == folded
        compiled = kiln.compile(model, (x,), backend="cpu", strict=True)
        with torch.no_grad():
            assert _rel(compiled(x), model(x)) <= 1e-4
        assert any("folded" in label for label in _labels(compiled, (x,))) == folded


def test_folding_under_inference_mode_and_a_norm_on_constant_statistics(fold_everything):
    """Calls in inference mode fold once and see later updates; a norm whose statistics are
    not parameters is left to the epilogue."""
    model = _randomize_norms(nn.Sequential(nn.Conv3d(2, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4)))
    x = torch.randn(1, 2, 6, 6, 6)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True, cache=False)
    with torch.inference_mode():
        assert _rel(compiled(x), model(x)) <= 1e-4
        assert _rel(compiled(x), model(x)) <= 1e-4
    with torch.no_grad():
        model[1].running_var.mul_(4.0)
    with torch.inference_mode():
        assert _rel(compiled(x), model(x)) <= 1e-4

    class ConstantNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, bias=False)

        def forward(self, x):
            c = torch.arange(4.0)
            return torch.nn.functional.batch_norm(self.conv(x), c, c + 1, c * 0.5, c - 1)

    model = ConstantNorm().eval()
    x = torch.randn(1, 3, 9, 9)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True)
    with torch.no_grad():
        assert _rel(compiled(x), model(x)) <= 1e-4


def test_conv_batch_norm_gradients_match_eager(fold_everything):
    """The folded call serves the forward of a differentiable module; gradients come from
    kiln's backward graph."""
    torch.manual_seed(3)
    model = _randomize_norms(nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()))
    x = torch.randn(2, 3, 9, 9)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True)
    weight = torch.randn(2, 6, 9, 9)
    (model(x) * weight).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (compiled(x) * weight).sum().backward()
    for p, g in zip(model.parameters(), want):
        assert _rel(p.grad, g) <= 1e-4


@pytest.mark.parametrize("shapes", [((4,), (4, 4)), ((4,), (2, 4, 5)), ((2, 3, 4), (4,)), ((3, 4), (4,))])
def test_vector_matmul_library_call_does_not_resize_its_output(shapes):
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])

    class MatMul(nn.Module):
        def forward(self, a, b):
            return a @ b

    compiled = kiln.compile(MatMul(), (a, b), backend="cpu", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compiled(a, b)
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)


def test_module_call_fast_path_still_refuses_wrong_inputs():
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    compiled = kiln.compile(model, (x,), backend="cpu")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        for bad in (torch.randn(3, 4), torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, 1)):
            with pytest.raises(InputMismatchError, match="expects"):
                compiled(bad)


def test_three_d_convolution_chains_stay_channels_last():
    """Between two 3-d convolutions (oneDNN returns NDHWC) the kernel writes NDHWC; the
    result matches the reference on memory poisoned before every call."""
    import kiln.ir as ir
    from kiln.backends import get_backend
    from kiln.backends.cpu.library import rule_choice
    from kiln.backends.cpu.partition import build_graph_plan
    from kiln.passes import default_pipeline

    text = """
graph @chain3d(%x: f32[1, 2, 7, 9, 5]) params(%w1: f32[4, 2, 3, 3, 3], %w2: f32[3, 4, 3, 3, 3], %s: f32[4, 1, 1, 1]) {
  %0: f32[1, 4, 7, 9, 5] = conv(%x, %w1) {stride=[1, 1, 1], padding=[1, 1, 1], dilation=[1, 1, 1], groups=1}
  %1: f32[1, 4, 7, 9, 5] = mul(%0, %s)
  %2: f32[1, 4, 7, 9, 5] = tanh(%1)
  %3: f32[1, 3, 7, 9, 5] = conv(%2, %w2) {stride=[1, 1, 1], padding=[1, 1, 1], dilation=[1, 1, 1], groups=1}
  return %3
}"""
    graph = ir.parse(text)
    fused = default_pipeline().run(graph).graph
    exe = get_backend("cpu").build(fused, {"poison": True})
    ref = get_backend("reference").build(graph, {"float64": True})
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(tuple(v.type.shape), generator=gen) for v in (*graph.inputs, *graph.params)]
    for _ in range(2):
        for got, want in zip(exe(args), ref(args)):
            assert _rel(got, want.float()) <= 1e-4
    plan = build_graph_plan(fused, rule_choice)
    written = [pv.name for op in plan.ops if op.step == "kernel" for pv in op.outputs]
    assert any(name.endswith(".nhwc") for name in written), written
    assert not [op for op in plan.ops if op.step == "copy"]


@pytest.mark.parametrize("kind", ["oneDNN", "kiln-gemm", "kiln-depthwise"])
def test_a_packed_weight_is_not_taken_for_a_new_tensor_at_a_freed_ones_address(kind):
    """The conv chooser times a convolution on random weights, then the same object runs the
    real (folded) weight: a new tensor often gets the freed random weight's address and
    version 0, so a packing cache keyed on (address, version) alone would run the random
    weights.  The packers keep the tensor their packing came from."""
    import torch.nn.functional as F

    from kiln.backends.cpu.conv import KilnConv2d
    from kiln.backends.cpu.packed_conv import PackedConv

    groups = 16 if kind == "kiln-depthwise" else 1
    shape = (16, 1, 3, 3) if groups == 16 else (8, 16, 3, 3)
    x = torch.randn(1, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    if kind == "oneDNN":
        conv = PackedConv(tuple(x.shape), (1, 1), (1, 1), (1, 1), groups)
    else:
        conv = KilnConv2d("depthwise" if groups == 16 else "gemm", (1, 1), (1, 1), (1, 1), groups)
    for _ in range(20):
        timed = torch.randn(shape)
        conv(x, timed)
        del timed
        real = torch.randn(shape)  # often at the freed tensor's address, version 0
        torch.testing.assert_close(conv(x, real), F.conv2d(x, real, padding=1, groups=groups), rtol=1e-4, atol=1e-4)


class _Block(nn.Module):
    """``act(conv(x') [+ bn] + residual)``, the residual being the block's input (NCHW
    contiguous) or an earlier convolution's result (channels-last, as kiln keeps it)."""

    def __init__(self, bias: bool, norm: bool, act: bool, residual_from_conv: bool):
        super().__init__()
        self.stem = nn.Conv2d(6, 8, 1) if residual_from_conv else None
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=bias)
        self.bn = nn.BatchNorm2d(8) if norm else None
        self.act, self.from_conv = act, residual_from_conv

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        y = y + x
        return torch.relu(y) if self.act else y


@pytest.mark.parametrize("bias,norm,act,from_conv", [
    (False, True, True, True),     # a ResNet block: conv, batch norm, sum, ReLU
    (True, False, False, False),   # a bias and a plain sum with the (NCHW) input
    (False, False, True, True),    # no bias between the weight and the residual
    (True, True, False, False),
])
def test_residual_add_and_relu_run_inside_the_onednn_call(monkeypatch, fold_everything, bias, norm, act, from_conv):
    monkeypatch.setenv(ENV_VAR, "0")  # oneDNN for every convolution
    torch.manual_seed(0)
    model = _randomize_norms(_Block(bias, norm, act, from_conv))
    x = torch.randn(2, 6 if from_conv else 8, 17, 13)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True, cache=False)
    with torch.no_grad():
        assert _rel(compiled(x), model(x)) <= 1e-4
        labels = _labels(compiled, (x,))
        fused = [label for label in labels if "residual add" in label]
        assert len(fused) == 1 and ("+relu" in fused[0]) == act, labels
        assert not any("epilogue" in label for label in labels), labels
        model.conv.weight.mul_(-0.5)  # a parameter update is seen by the prepacked weight
        assert _rel(compiled(x), model(x)) <= 1e-4


def test_a_residual_that_is_also_read_elsewhere_is_left_intact(monkeypatch, fold_everything):
    monkeypatch.setenv(ENV_VAR, "0")

    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return torch.relu(self.b(h) + h), h * 2

    torch.manual_seed(0)
    model = TwoReaders().eval()
    x = torch.randn(1, 8, 11, 11)
    compiled = kiln.compile(model, (x,), backend="cpu", strict=True, cache=False)
    with torch.no_grad():
        for got, want in zip(compiled(x), model(x)):
            assert _rel(got, want) <= 1e-4
    assert any("residual add" in label for label in _labels(compiled, (x,)))
