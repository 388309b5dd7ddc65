"""The autodiff pass on real models, against torch.autograd.

Each test model (``tests/models.py``) is wrapped with a loss -- a cross-entropy written as
``log_softmax`` + ``gather`` (MLP, ResNet-18 on 1x3x32x32, GPT-2), or a weighted sum and a
mean of two outputs (BERT) -- captured with :func:`kiln.frontends.torch.capture.capture`, and
differentiated with respect to every trainable parameter.

Accuracy measure, per gradient tensor: ``||kiln - torch|| / max(||torch||, floor)`` with
``floor = 1e-3 * (largest gradient norm of the model)``, at most 1e-4 in float32.  The floor
exists for gradients that are mathematically zero (BERT's attention key biases: softmax is
invariant to them), where both sides hold float32 rounding noise only; for those the float64
oracle test decides: kiln's joint graph run in float64 (``run_graph(float64=True)``) against
torch in float64 agrees to 1e-6 (kiln keeps float32 constants such as GELU's 0.044715, which
limits the agreement to ~1e-8) with a floor of 1e-7 of the largest norm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import models
import numpy as np
import pytest
import torch

from kiln.backends.reference import run_graph
from kiln.frontends.torch.capture import capture
from kiln.ir import DType, Graph, KilnError, TensorType, verify
from kiln.ir.types import SizeRange
from kiln.passes.autodiff import JointGraph, grad_graph, split_joint


class CrossEntropy(torch.nn.Module):
    """``-mean(log_softmax(logits)[target])`` of a classifier or language model."""

    def __init__(self, model: torch.nn.Module, hf: bool = False):
        super().__init__()
        self.model, self.hf = model, hf

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        logits = out.logits if self.hf else out
        logp = torch.log_softmax(logits, -1)
        return -torch.gather(logp, -1, target.unsqueeze(-1)).mean()


class BertLoss(torch.nn.Module):
    """A weighted sum of the hidden states plus the mean of the pooled output."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.weights = torch.randn(1, 16, 128, generator=torch.Generator().manual_seed(3))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(ids, attention_mask=mask)
        return (out.last_hidden_state * self.weights).sum() + out.pooler_output.mean()


def _wrapped(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(5)
    if name == "mlp":
        return CrossEntropy(models.mlp()), (models.mlp_inputs()[0][0], torch.randint(0, 10, (4,), generator=gen))
    if name == "resnet18":
        x = torch.randn(1, 3, 32, 32, generator=gen)
        return CrossEntropy(models.resnet18()), (x, torch.randint(0, 10, (1,), generator=gen))
    if name == "gpt2":
        ids = models.gpt2_inputs()[0][0]
        target = torch.randint(0, 1000, (1, 16), generator=gen)
        return CrossEntropy(models.gpt2_small_config_model(), hf=True), (ids, target)
    (ids,), kwargs = models.bert_inputs()
    return BertLoss(models.bert_small_model()), (ids, kwargs["attention_mask"])


def merge_tied_params(graph: Graph, params: dict[str, torch.Tensor]) -> tuple[Graph, list[torch.Tensor]]:
    """One graph param per live tensor: capture keeps GPT-2's ``lm_head.weight`` and
    ``transformer.wte.weight`` apart although they are one tensor; merged, autodiff must add
    the gradients of both uses."""
    g, vmap = graph.clone_with_map()
    first: dict[int, object] = {}
    for p in graph.params:
        tensor = params[p.name]
        if id(tensor) in first:
            g.replace_all_uses(vmap[p], vmap[first[id(tensor)]])
            g.params.remove(vmap[p])
        else:
            first[id(tensor)] = p
    return g, [params[p.name] for p in g.params]


@dataclass
class Case:
    name: str
    model: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    graph: Graph
    params: list[torch.Tensor]
    joint: JointGraph
    _outputs: list[np.ndarray] | None = None

    def numpy_args(self) -> list[np.ndarray]:
        return [a.numpy() for a in self.args]

    def numpy_params(self) -> list[np.ndarray]:
        return [p.detach().numpy() for p in self.params]

    def outputs(self) -> list[np.ndarray]:
        """The joint graph's outputs in float32 (computed once)."""
        if self._outputs is None:
            self._outputs = run_graph(self.joint.graph, self.numpy_args(), self.numpy_params())
        return self._outputs

    def torch_grads(self, double: bool = False) -> dict[str, np.ndarray]:
        model = self.model.double() if double else self.model
        try:
            args = [a.double() if double and a.is_floating_point() else a for a in self.args]
            model.zero_grad()
            model(*args).backward()
            return {n: p.grad.double().numpy() for n, p in model.named_parameters()}
        finally:
            self.model.float()


_CACHE: dict[str, Case] = {}


def case(name: str) -> Case:
    if name not in _CACHE:
        model, args = _wrapped(name)
        captured = capture(model, args)
        graph, params = merge_tied_params(captured.graph, captured.params)
        wrt = [n for n, _ in model.named_parameters()]
        _CACHE[name] = Case(name, model, args, graph, params, grad_graph(graph, wrt=wrt))
    return _CACHE[name]


MODELS = ["mlp", "resnet18", "gpt2", "bert"]


def _errors(got: dict[str, np.ndarray], want: dict[str, np.ndarray], floor_fraction: float) -> dict[str, float]:
    floor = floor_fraction * max(np.linalg.norm(w) for w in want.values())
    return {n: float(np.linalg.norm(got[n] - want[n]) / max(np.linalg.norm(want[n]), floor))
            for n in want}


def _kiln_grads(c: Case, outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {n: outputs[i].astype(np.float64) for n, i in c.joint.grad_outputs.items()}


@pytest.mark.parametrize("name", MODELS)
def test_gradients_match_torch_autograd(name: str):
    c = case(name)
    verify(c.joint.graph)
    outputs = c.outputs()
    want = c.torch_grads()
    assert set(c.joint.grad_outputs) == set(want), "every trainable parameter gets a gradient"
    with torch.no_grad():
        loss = float(c.model(*c.args))
    assert abs(float(outputs[0]) - loss) <= 1e-5 * abs(loss)
    errors = _errors(_kiln_grads(c, outputs), want, 1e-3)
    worst = max(errors, key=errors.get)
    print(f"{name}: {len(errors)} gradients, worst relative error {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= 1e-4, f"{worst}: relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_gradients_match_torch_in_float64(name: str):
    c = case(name)
    outputs = run_graph(c.joint.graph, c.numpy_args(), c.numpy_params(), float64=True)
    errors = _errors(_kiln_grads(c, outputs), c.torch_grads(double=True), 1e-7)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-6, f"{worst}: relative error {errors[worst]:.2e}"


def test_tied_weights_accumulate_both_uses():
    c = case("gpt2")
    names = [p.name for p in c.graph.params]
    assert "model.lm_head.weight" not in names and "model.transformer.wte.weight" in names
    wte = next(p for p in c.graph.params if p.name == "model.transformer.wte.weight")
    assert sum(v is wte for n in c.graph.nodes for v in n.inputs) == 2  # embedding + lm_head
    got = c.outputs()[c.joint.grad_outputs["model.transformer.wte.weight"]]
    want = c.torch_grads()["model.transformer.wte.weight"]
    assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)


@pytest.mark.parametrize("name", MODELS)
def test_split_policies_give_the_joint_gradients_and_remat_saves_memory(name: str):
    c = case(name)
    joint_out = c.outputs()
    saved_bytes = {}
    for policy in ("save-all", "remat"):
        forward, backward, info = split_joint(c.joint, policy)
        verify(forward)
        verify(backward)
        assert [v.name for v in backward.inputs] == list(info.saved)
        assert not backward.params
        out = run_graph(forward, c.numpy_args(), c.numpy_params())
        assert len(out) == info.forward_outputs + len(info.saved)
        np.testing.assert_array_equal(out[0], joint_out[0])
        grads = run_graph(backward, out[info.forward_outputs:], [])
        for wrt, i in c.joint.grad_outputs.items():
            np.testing.assert_allclose(grads[info.grad_outputs[wrt]], joint_out[i], rtol=1e-5,
                                       atol=1e-7, err_msg=f"{policy}: {wrt}")
        saved_bytes[policy] = info.saved_bytes
        print(f"{name} {policy}: saves {len(info.saved)} values, {info.saved_bytes} bytes of "
              f"activations, recomputes {info.recomputed} nodes")
    assert saved_bytes["remat"] < saved_bytes["save-all"]


def test_output_cotangents_seed_every_output():
    """BERT's two outputs seeded with given cotangents: the VJP torch.autograd.backward gives."""
    torch.manual_seed(0)
    model = models.bert_small_model()
    (ids,), kwargs = models.bert_inputs()
    captured = capture(model, (ids,), kwargs)
    joint = grad_graph(captured.graph, output_cotangents=True)
    assert joint.forward_outputs == 2 and joint.loss is None
    outs = captured.graph.outputs
    assert [v.name for v in joint.graph.inputs[-2:]] == [f"grad.{outs[0].name}", f"grad.{outs[1].name}"]
    assert joint.cotangent_inputs == {0: f"grad.{outs[0].name}", 1: f"grad.{outs[1].name}"}
    gen = np.random.default_rng(0)
    cts = [gen.standard_normal(v.shape).astype(np.float32) for v in outs]
    inputs = [ids.numpy(), kwargs["attention_mask"].numpy()]
    params = [p.detach().numpy() for p in captured.params.values()]
    got = run_graph(joint.graph, inputs + cts, params)
    out = model(ids, **kwargs)
    model.zero_grad()
    torch.autograd.backward([out.last_hidden_state, out.pooler_output],
                            [torch.from_numpy(ct) for ct in cts])
    torch_params = dict(model.named_parameters())
    want = {n: torch_params[n].grad.numpy() for n in joint.grad_outputs if n in torch_params}
    errors = _errors({n: got[joint.grad_outputs[n]] for n in want}, want, 1e-3)
    assert max(errors.values()) <= 1e-4
    forward, backward, info = split_joint(joint, "remat")
    assert list(info.cotangent_inputs) == [v.name for v in backward.inputs[len(info.saved):]]
    fwd = run_graph(forward, inputs, params)
    grads = run_graph(backward, fwd[2:] + cts, [])
    for n, i in info.grad_outputs.items():
        np.testing.assert_allclose(grads[i], got[joint.grad_outputs[n]], rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- small graphs
def _two_params() -> Graph:
    g = Graph("two")
    x = g.add_input("x", TensorType((2, 3), DType.float32))
    a = g.add_param("a", TensorType((3,), DType.float32))
    b = g.add_param("b", TensorType((3,), DType.float32))
    used = g.op("mul", x, a)
    g.set_outputs([g.op("sum", g.op("mul", used, used)), g.op("add", x, b)])
    return g


def test_input_gradients_and_untouched_values_cost_nothing():
    g = _two_params()
    before = str(g)
    joint = grad_graph(g, wrt=["a", "b", "x"])
    assert str(g) == before, "the input graph is not modified"
    grad_b = joint.graph.outputs[joint.grad_outputs["b"]]
    assert grad_b.producer.op_name == "full"  # no path from b to the loss: zeros
    backward_ops = joint.graph.op_histogram()
    assert sum(1 for n in joint.graph.nodes for v in n.inputs if v.name == "b") == 1  # forward only
    x, a = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, -2, 3], np.float32)
    outs = run_graph(joint.graph, [x], [a, np.ones(3, np.float32)])
    xt, at = torch.tensor(x, requires_grad=True), torch.tensor(a, requires_grad=True)
    ((xt * at) ** 2).sum().backward()
    np.testing.assert_allclose(outs[joint.grad_outputs["a"]], at.grad.numpy(), rtol=1e-6)
    np.testing.assert_allclose(outs[joint.grad_outputs["x"]], xt.grad.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(outs[joint.grad_outputs["b"]], np.zeros(3, np.float32))
    assert backward_ops.get("add", 0) >= 1  # the two uses of `used` are accumulated


def test_default_wrt_is_every_float_param():
    joint = grad_graph(_two_params())
    assert joint.wrt == ("a", "b") and joint.forward_outputs == 2 and joint.loss == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"wrt": ["nope"]}, r"wrt name 'nope' is not an input or param of graph @two \(known: a, b, x\)"),
    ({"wrt": ["x"], "loss": 1}, r"loss output 1 \(%\d+: f32\[2, 3\]\) is not a scalar"),
    ({"loss": 2}, r"loss=2 but graph @two has 2 outputs"),
    ({"loss": 0, "output_cotangents": True}, r"either loss=<output index> or output_cotangents=True"),
])
def test_bad_requests_raise_clear_errors(kwargs, message):
    with pytest.raises(KilnError, match=message):
        grad_graph(_two_params(), **kwargs)


def test_integer_values_cannot_be_differentiated_and_policy_is_checked():
    g = Graph("ints")
    i = g.add_input("i", TensorType((3,), DType.int64))
    g.set_outputs([g.op("sum", g.op("cast", i, dtype=DType.float32))])
    with pytest.raises(KilnError, match=re.escape("cannot differentiate with respect to %i: i64[3]")):
        grad_graph(g, wrt=["i"])
    with pytest.raises(KilnError, match=r"unknown policy 'all'; use one of save-all, remat"):
        split_joint(grad_graph(_two_params()), "all")


def test_symbolic_shapes_on_the_path_are_rejected():
    g = Graph("mask")
    x = g.add_input("x", TensorType((3, 4), DType.float32))
    m = g.add_input("m", TensorType((3,), DType.bool))
    picked = g.op("index", x, m, dims=(0,), loc="model.py:3 in forward: x[m]")
    g.set_outputs([g.op("sum", picked)])
    with pytest.raises(KilnError, match=r"f32\[nnz, 4\] = index.*data-dependent shape.*model.py:3"):
        grad_graph(g, wrt=["x"])


def test_sizes_bound_by_the_inputs_are_differentiated_symbolically():
    from kiln.ir import SymDim
    from kiln.ir.sizes import specialize

    n = SymDim("n")
    g = Graph("rows")
    x = g.add_input("x", TensorType((n, 4), DType.float32))
    w = g.add_param("w", TensorType((4,), DType.float32))
    g.sizes = {"n": SizeRange(2, 16)}
    scaled = g.op("mul", g.op("tanh", x), w)
    g.set_outputs([g.op("sum", g.op("reshape", scaled, shape=(4 * n,)))])
    joint = grad_graph(g, wrt=["x", "w"])
    assert str(joint.graph.outputs[1].type) == "f32[n, 4]"
    for rows in (2, 7):
        xv = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
        wv = np.arange(1, 5, dtype=np.float32)
        _, gx, gw = run_graph(specialize(joint.graph, {"n": rows}), [xv], [wv])
        np.testing.assert_allclose(gx, (1 - np.tanh(xv) ** 2) * wv, rtol=1e-5)
        np.testing.assert_allclose(gw, np.tanh(xv).sum(0), rtol=1e-5)


def test_fused_nodes_are_differentiated_through_their_bodies():
    body = Graph("body")
    bx = body.add_input("x", TensorType((3,), DType.float32))
    body.set_outputs([body.op("tanh", body.op("mul", bx, bx))])
    g = Graph("f")
    x = g.add_input("x", TensorType((3,), DType.float32))
    fused = g.op("fused", x, template="elementwise", body=body)
    g.set_outputs([g.op("sum", fused)])
    joint = grad_graph(g, wrt=["x"])
    assert "fused" not in joint.graph.op_histogram()
    xv = np.array([0.1, -0.5, 0.9], np.float32)
    got = run_graph(joint.graph, [xv], [])[1]
    np.testing.assert_allclose(got, (1 - np.tanh(xv**2) ** 2) * 2 * xv, rtol=1e-6)
