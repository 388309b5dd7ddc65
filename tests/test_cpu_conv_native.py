"""kiln's convolutions as foreign kernels of the cpu backend's native runs
(kiln/backends/cpu/conv_plan.py): conv nets against PyTorch eager with poisoned memory; what
the kernels absorb (folded batch norm, residual add, ReLU / ReLU6 / hardswish) and what stays
a generated epilogue; inputs laid out NCHW; a plan with no generated kernel; parameters
updated in place after compiling; the epilogue matcher on graphs of its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kiln
import kiln.ir as ir
from kiln.backends.cpu import conv as conv_module
from kiln.backends.cpu.conv_plan import conv_epilogue
from kiln.backends.cpu.standalone import ENV_VAR

pytestmark = pytest.mark.skipif(conv_module.conv_entry() is None, reason="needs a C compiler with OpenMP")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    nn.init.uniform_(bn.weight, 0.5, 1.5)
    nn.init.uniform_(bn.bias, -0.2, 0.2)
    nn.init.uniform_(bn.running_mean, -0.2, 0.2)
    nn.init.uniform_(bn.running_var, 0.5, 1.5)
    return bn


class Block(nn.Module):
    """An inverted residual: 1x1 expansion, k x k depthwise, 1x1 projection, batch norms,
    ``act`` after the first two, a residual when the shapes allow."""

    def __init__(self, cin: int, expand: int, cout: int, k: int, stride: int, act: type[nn.Module]):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, expand, 1, bias=False), _bn(expand), act(),
                                  nn.Conv2d(expand, expand, k, stride, k // 2, groups=expand, bias=False), _bn(expand),
                                  act(), nn.Conv2d(expand, cout, 1, bias=False), _bn(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.body(x)
        return x + y if self.residual else y


class Net(nn.Module):
    def __init__(self, act: type[nn.Module], c: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(c, 16, 3, 2, 1, bias=False), _bn(16), act())
        self.blocks = nn.Sequential(Block(16, 48, 17, 3, 2, act), Block(17, 51, 17, 5, 1, act), Block(17, 34, 24, 3, 1, act))
        self.head = nn.Conv2d(24, 10, 1)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x))).mean((2, 3))


def _compile(model, x, **options):
    return kiln.compile(model, (x,), backend="cpu", cache=False, poison=True, **options)


def _kernel_labels(compiled) -> list[str]:
    return [label for label in compiled.executable.plan.workspace().labels]


@pytest.mark.parametrize("act", [nn.ReLU, nn.ReLU6, nn.Hardswish])
def test_conv_nets_match_eager_with_their_epilogues_in_the_conv_kernels(monkeypatch, act):
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(0)
    model = Net(act).eval()
    x = torch.randn(2, 3, 33, 31)
    with torch.no_grad():
        want = model(x)
        compiled = _compile(model, x)
        got = compiled(x)
    assert _rel(got, want) <= 1e-4
    info = compiled.executable.info
    assert info["foreign_kernels"] == 11  # every convolution, the head's too
    labels = " ".join(_kernel_labels(compiled))
    assert "epilogue" not in labels  # batch norms, activations and residual adds all absorbed
    name = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.Hardswish: "hardswish"}[act]
    assert labels.count(f", {name}") == 7 and labels.count("residual") == 1
    # a second call on other inputs (the arena reused, packed weights kept)
    x2 = torch.randn(2, 3, 33, 31)
    with torch.no_grad():
        assert _rel(compiled(x2), model(x2)) <= 1e-4


def test_the_whole_conv_chain_is_one_native_call(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(1)
    model = Net(nn.Hardswish).eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        compiled = _compile(model, x)
        compiled(x)
    steps = [label.split(":")[0] for label in _kernel_labels(compiled)]
    # the weights' version checks, then one native call for eleven convolutions, the mean's kernel
    assert steps.count("NativeRunStep") == 1 and steps.count("TorchStep") == 0, steps
    assert [s for s in steps if s != "ContiguousStep"][0] == "PrepareStep", steps


def test_a_depthwise_convolution_of_an_nchw_input_reads_a_channels_last_copy(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(17, 17, 3, 1, 1, groups=17), _bn(17), nn.ReLU6()).eval()
    x = torch.randn(1, 17, 9, 11)
    with torch.no_grad():
        compiled = _compile(model, x)
        got = compiled(x)
        assert _rel(got, model(x)) <= 1e-4
    assert compiled.executable.info["foreign_kernels"] == 1
    assert any("channels-last copy" in label for label in _kernel_labels(compiled))
    # the result is an NCHW tensor (stored channels-last)
    assert got.shape == (1, 17, 9, 11)


def test_a_plan_of_convolutions_only_runs_without_a_generated_unit(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(5, 16, 1), nn.Conv2d(16, 3, 1)).eval()
    x = torch.randn(2, 5, 7, 7).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        compiled = _compile(model, x)
        assert _rel(compiled(x), model(x)) <= 1e-4
    info = compiled.executable.info
    assert info["kernels"] == 0 and info["foreign_kernels"] == 2


def test_parameters_updated_in_place_after_compiling_are_followed(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(4)
    model = Net(nn.ReLU).eval()
    x = torch.randn(1, 3, 20, 20)
    with torch.no_grad():
        compiled = _compile(model, x)
        compiled(x)
        model.blocks[1].body[0].weight.mul_(-1.5)  # a convolution's weight
        model.blocks[2].body[4].running_var.mul_(3.0)  # a batch norm folded into one
        model.head.bias.add_(1.0)  # a bias
        assert _rel(compiled(x), model(x)) <= 1e-4


def test_training_steps_with_native_convolutions_match_eager(monkeypatch):
    """Training-mode batch norms are not folded; the forward convolutions read the weights,
    updated in place by each step, through their packed copies."""
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 8, 1, bias=False), _bn(8), nn.Hardswish(),
                          nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    twin = nn.Sequential(*[m for m in __import__("copy").deepcopy(model)])
    x = torch.randn(2, 3, 9, 9)
    weight = torch.randn(2, 4, 9, 9)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(twin.parameters(), lr=0.1)
    step = kiln.compile_train(model, lambda out, w: (out * w).sum(), opt_a, (x, weight), backend="cpu", cache=False)
    for _ in range(3):
        loss = step(x, weight)
        opt_b.zero_grad()
        want = (twin(x) * weight).sum()
        want.backward()
        opt_b.step()
        assert abs(float(loss.detach()) - float(want.detach())) <= 1e-4 * abs(float(want.detach()))
    assert step._executable.info["foreign_kernels"] == 3  # the forward convolutions
    for p, q in zip(model.parameters(), twin.parameters()):
        assert _rel(p.detach(), q.detach()) <= 1e-4


# ------------------------------------------------------------------------------ the matcher
def _body(text: str) -> tuple[ir.Graph, ir.Node]:
    graph = ir.parse(text)
    return graph, graph.nodes[0]


def _hardswish(y: str, mul: str) -> str:
    return f"""
graph @body(%x: f32[1, 4, 5, 5], %w: f32[8, 4, 1, 1], %r: f32[1, 8, 5, 5]) {{
  %three: f32[] = const 3.0
  %six: f32[] = const 6.0
  %y: f32[1, 8, 5, 5] = conv(%x, %w) {{stride=[1, 1], padding=[0, 0], dilation=[1, 1], groups=1}}
  %s: f32[1, 8, 5, 5] = add({y}, %r)
  %t: f32[1, 8, 5, 5] = add(%s, %three)
  %u: f32[1, 8, 5, 5] = clamp(%t) {{min=0.0, max=6.0}}
  %v: f32[1, 8, 5, 5] = mul({mul})
  %z: f32[1, 8, 5, 5] = div(%v, %six)
  return %z
}}"""


def test_the_matcher_takes_a_residual_then_hardswish_in_either_operand_order():
    for y, mul in (("%y", "%s, %u"), ("%y", "%u, %s")):
        graph, conv = _body(_hardswish(y, mul))
        nodes, act, residual = conv_epilogue(graph, conv)
        assert act == "hardswish" and residual is graph.inputs[2] and len(nodes) == 5


def test_the_matcher_leaves_what_the_kernels_do_not_compute():
    graph, conv = _body(_hardswish("%y", "%s, %u").replace("max=6.0", "max=5.0"))
    nodes, act, residual = conv_epilogue(graph, conv)
    assert act == "none" and [n.op_name for n in nodes] == ["add"] and residual is graph.inputs[2]
    # an intermediate result that is a body output is not absorbed
    graph, conv = _body(_hardswish("%y", "%s, %u").replace("return %z", "return %z, %s"))
    nodes, act, residual = conv_epilogue(graph, conv)
    assert act == "none" and [n.op_name for n in nodes] == ["add"]
    graph, conv = _body(_hardswish("%y", "%s, %u").replace("return %z", "return %z, %y"))
    assert conv_epilogue(graph, conv) == ([], "none", None)


def test_hardswish_is_exact_enough_on_its_edges(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    conv = nn.Conv2d(4, 17, 1).eval()
    x = torch.tensor(np.linspace(-4, 4, 4 * 9 * 9, dtype=np.float32)).reshape(1, 4, 9, 9)
    with torch.no_grad():
        conv.weight.copy_(torch.eye(17, 4).reshape(17, 4, 1, 1))
        conv.bias.zero_()
        model = nn.Sequential(conv, nn.Hardswish())
        assert _rel(_compile(model, x)(x), model(x)) <= 1e-5


def test_the_absorbing_call_from_python_folds_again_only_when_a_tensor_changed():
    """Where a convolution cannot be a foreign kernel, its absorbing call runs from Python;
    the folded weight is kept (and so is its packed copy) until a parameter changes."""
    from kiln.backends.cpu.conv import KilnConv2d
    from kiln.backends.cpu.conv_plan import KilnConvCall

    torch.manual_seed(6)
    conv, bn = nn.Conv2d(8, 12, 1, bias=True), _bn(12)
    call = KilnConvCall(KilnConv2d("gemm", (1, 1), (0, 0), (1, 1), 1, act="relu6"), (12, 8, 1, 1), True,
                        eps=bn.eps, residual=True)
    x, r = torch.randn(2, 8, 5, 5), torch.randn(2, 12, 5, 5)
    stats = [bn.weight, bn.bias, bn.running_mean, bn.running_var]
    with torch.no_grad():
        for step in range(3):
            got = call(x, conv.weight, conv.bias, *stats, r)
            assert _rel(got, torch.nn.functional.relu6(bn.eval()(conv(x)) + r)) <= 1e-5
            folded = call._folded[2]
            assert got.shape == (2, 12, 5, 5)
            if step == 1:
                bn.running_var.mul_(2.0)  # the next call folds again
            else:
                call(x, conv.weight, conv.bias, *stats, r)
                assert call._folded[2] is folded  # unchanged tensors: the same fold


def test_a_channels_last_model_reads_its_weights_in_their_layout(monkeypatch):
    """``model.to(memory_format=torch.channels_last)`` makes the weights channels-last too:
    the packs read them as they are laid out (no contiguous copy of any argument but the
    input is planned for them)."""
    monkeypatch.setenv(ENV_VAR, "1")
    torch.manual_seed(7)
    model = Net(nn.Hardswish).eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 33, 31).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        compiled = _compile(model, x)
        assert _rel(compiled(x), model(x)) <= 1e-4
    assert compiled.executable.info["foreign_kernels"] == 11
    contiguous = [op for op in compiled.executable.plan.steps if type(op).__name__ == "ContiguousStep"]
    assert sum(len(op.slots) for op in contiguous) <= 2  # the input (and the head's bias)
