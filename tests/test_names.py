"""Names from PyTorch are data, never identifiers: parameter and buffer names with leading
digits, dots, dashes, spaces, quotes or unicode work through capture, kiln.compile (reference
and cpu), torch.compile, compile_train and the IR text form."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln import ir
from kiln.backends import get_backend
from kiln.ir import DType, Graph, TensorType
from kiln.zoo.compare import compare

ODD_NAMES = ["0.weight", "blocks.a-b", "ünï.côdé", "with space", 'quo"te', "back\\slash", "%x", "1", "7a"]


def sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def nested_sequential() -> nn.Module:
    return nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.GELU()), nn.Sequential(nn.Linear(8, 3)))


class OddKeys(nn.Module):
    """ModuleDict keys and a parameter registered under names no identifier allows."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({"a-b": nn.Linear(6, 6), "ünï": nn.Linear(6, 6), "0": nn.Linear(6, 3)})
        self.register_parameter("gain-1 ü", nn.Parameter(torch.linspace(0.5, 1.5, 6)))
        self.register_buffer("shift 0", torch.linspace(-0.2, 0.2, 3))

    def forward(self, x):
        h = self.blocks["a-b"](x) * getattr(self, "gain-1 ü")
        h = torch.tanh(self.blocks["ünï"](h))
        return self.blocks["0"](h) + getattr(self, "shift 0")


MODELS = {"sequential": sequential, "nested_sequential": nested_sequential, "odd_keys": OddKeys}


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def test_odd_names_are_really_there():
    names = {n for n, _ in make("odd_keys").named_parameters()}
    assert {"blocks.a-b.weight", "blocks.ünï.bias", "blocks.0.weight", "gain-1 ü"} <= names


# ------------------------------------------------------------------ IR text
def odd_graph() -> Graph:
    g = Graph("odd names")
    t = TensorType((2, 3), DType.float32)
    x = g.add_input(ODD_NAMES[0], t)
    params = [g.add_param(name, t) for name in ODD_NAMES[1:4]]
    c = g.add_constant(np.full((2, 3), 0.5, np.float32), DType.float32, ODD_NAMES[4], dedup=False)
    (h,) = g.add_node(ir.get_op("add"), [x, params[0]], {}, names=[ODD_NAMES[5]]).outputs
    (h,) = g.add_node(ir.get_op("mul"), [h, params[1]], {}, names=[ODD_NAMES[6]]).outputs
    (h,) = g.add_node(ir.get_op("sub"), [h, params[2]], {}, names=[ODD_NAMES[7]]).outputs
    (h,) = g.add_node(ir.get_op("add"), [h, c], {}, names=[ODD_NAMES[8]]).outputs
    g.set_outputs([h])
    return g


def test_text_round_trip_quotes_odd_names():
    g = odd_graph()
    text = str(g)
    assert '%"0.weight"' in text and '%"with space"' in text and '%"quo\\"te"' in text
    assert '%"1"' not in text and "%1:" in text  # plain names stay bare
    back = ir.parse(text)
    assert str(back) == text
    assert [v.name for v in back.params] == ODD_NAMES[1:4]
    assert back.outputs[0].name == "7a"
    ir.verify(back)


def test_bare_invalid_names_still_point_at_the_fix():
    with pytest.raises(ir.ParseError, match=r"invalid value name.*quote any other name"):
        ir.parse("graph @g(%0.weight: f32[2]) {\n  return %0.weight\n}")


def test_generated_c_maps_odd_names_to_identifiers():
    g = odd_graph()
    args = [torch.randn(2, 3) for _ in range(4)]
    want = (args[0] + args[1]) * args[2] - args[3] + 0.5
    for backend in ("reference", "cpu"):
        (out,) = get_backend(backend).build(ir.parse(str(g)))(args)
        torch.testing.assert_close(out, want, msg=backend)


# ------------------------------------------------------------------ entry points
@pytest.mark.parametrize("name", list(MODELS))
def test_capture_and_compile(name):
    model, x = make(name).eval(), torch.randn(4, 6)
    graph = kiln.capture(model, (x,))
    assert str(ir.parse(str(graph))) == str(graph)
    for backend in ("reference", "cpu"):
        compiled = kiln.compile(model, (x,), backend=backend, strict=True, cache=False)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5, msg=backend)


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_compile_gradients(name):
    model, x = make(name), torch.randn(4, 6)
    weights = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    reference = make(name).double()
    ref_loss = (reference(x.double()) * weights.double()).sum()
    ref_loss.backward()
    eager = make(name)
    (eager(x) * weights).sum().backward()
    compiled = torch.compile(model, backend="kiln", options={"strict": True, "backend": "cpu"})
    (compiled(x) * weights).sum().backward()
    for (pname, p), r, e in zip(model.named_parameters(), reference.parameters(), eager.parameters()):
        verdict = compare(pname, p.grad, e.grad, r.grad)
        assert verdict.ok, f"{name}: grad of {pname!r}: {verdict}"


def _loss(out, y):
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize("name", list(MODELS))
def test_compile_train(name):
    model, eager = make(name), make(name)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    step = kiln.compile_train(model, _loss, opt, (x, y))
    for _ in range(2):
        loss = step(x, y)
        eager_opt.zero_grad()
        eager_loss = _loss(eager(x), y)
        eager_loss.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-4, atol=1e-6)
    for (pname, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=pname)
