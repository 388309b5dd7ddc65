"""``torch.autograd.Function`` through kiln: the user's backward is compiled, never re-derived;
and no in-place write is dropped on the way to kiln.

Training checks run ``torch.compile(model, backend="kiln", options={"strict": True})`` and
``kiln.compile(model, ..., strict=True)`` (the torch.export path) on the ``reference`` and
``cpu`` backends and judge the outputs and every parameter gradient of
``loss = (out * R).sum()`` with :mod:`kiln.zoo.compare` (kiln float32 against eager float64);
``kiln.compile_train`` runs three SGD and AdamW steps against eager float64.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, KilnError, TensorType
from kiln.ir.parser import parse
from kiln.passes import default_pipeline
from kiln.passes.autodiff import grad_graph
from kiln.passes.inline_custom_vjp import inline_custom_vjp
from kiln.zoo.compare import (
    compare_all,
    flatten_outputs,
    weighted_loss,
    weights_for,
    worst,
)

BACKENDS = ["reference", "cpu"]


@pytest.fixture(autouse=True)
def fresh_dynamo(one_torch_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------ Functions
class ExactGELU(torch.autograd.Function):
    """erf-GELU with its exact derivative written by hand (as some Hugging Face models do)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return g * (cdf + x * pdf)


class RoundIdentity(torch.autograd.Function):
    """Straight-through estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class RoundSigmoid(torch.autograd.Function):
    """Straight-through estimator with a sigmoid-derivative backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * s * (1 - s)


class ScaleAndNorm(torch.autograd.Function):
    """Two outputs, the second marked non-differentiable; a weight operand; a constant."""

    @staticmethod
    def forward(ctx, x, w, scale):
        y = x * w * scale
        n = x.abs().sum(-1, keepdim=True)
        ctx.mark_non_differentiable(n)
        ctx.save_for_backward(x, w)
        ctx.scale = scale
        return y, n

    @staticmethod
    def backward(ctx, gy, gn):
        x, w = ctx.saved_tensors
        # deliberately not the derivative: twice it for x, and w's summed over the batch axis
        return 2 * gy * w * ctx.scale, (gy * x * ctx.scale).sum(0), None


class ExpSavesOutput(torch.autograd.Function):
    """Saves an input and its output: d/dx (exp(x) * x) = exp(x) * (1 + x)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.exp(x) * x
        e = torch.exp(x)
        ctx.save_for_backward(x, e)
        return y

    @staticmethod
    def backward(ctx, g):
        x, e = ctx.saved_tensors
        return g * e * (1 + x)


class TwoLayer(nn.Module):
    def __init__(self, fn, width=6):
        super().__init__()
        self.fn = fn
        self.fc1 = nn.Linear(5, width)
        self.fc2 = nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(self.fn.apply(self.fc1(x)))


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        y, n = ScaleAndNorm.apply(self.fc(x), self.w, 1.5)
        return y * torch.tanh(n)


class UsedTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 5)
        self.fc2 = nn.Linear(5, 5)

    def forward(self, x):
        h = RoundSigmoid.apply(self.fc1(x))
        return RoundSigmoid.apply(self.fc2(h) + h) * 2


class Block(nn.Module):
    """A pre-norm transformer block whose MLP uses the Function as its activation."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(ExactGELU.apply(self.up(self.ln2(x))))


# ----------------------------------------------------------------------------- harness
def _train_check(model: nn.Module, x: torch.Tensor, backend: str, kiln_runs: list[str]):
    """Outputs and parameter gradients of (out * R).sum() through kiln, against eager."""
    torch.manual_seed(0)
    eager32, eager64 = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="kiln", options={"strict": True, "backend": backend})
    results = {}
    for name, module, inp, run in (("kiln", model, x, compiled), ("eager32", eager32, x, eager32),
                                   ("eager64", eager64, x.double(), eager64)):
        out = flatten_outputs(run(inp))
        weights = weights_for(out)
        weighted_loss(out, weights).backward()
        grads = {f"grad.{n}": p.grad for n, p in module.named_parameters()}
        results[name] = {**{k: v.detach() for k, v in out.items()}, **grads}
    comparisons = compare_all(results["kiln"], results["eager32"], results["eager64"])
    bad = worst(comparisons)
    assert all(c.ok for c in comparisons), f"{bad.name}: error {bad.error:.2e} (eager f32 {bad.eager_error:.2e})"
    assert any(name.endswith(".backward") for name in kiln_runs), kiln_runs  # kiln's backward ran
    return results


MODELS = {
    "gelu": lambda: (TwoLayer(ExactGELU), torch.randn(4, 5)),
    "ste_identity": lambda: (TwoLayer(RoundIdentity), torch.randn(4, 5) * 3),
    "ste_sigmoid": lambda: (TwoLayer(RoundSigmoid), torch.randn(4, 5)),
    "two_outputs_nondiff": lambda: (TwoOutputs(), torch.randn(4, 5)),
    "saves_input_and_output": lambda: (TwoLayer(ExpSavesOutput), torch.randn(4, 5)),
    "used_twice": lambda: (UsedTwice(), torch.randn(4, 5)),
    "transformer_block": lambda: (Block(), torch.randn(2, 5, 8)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", sorted(MODELS))
def test_training_uses_the_functions_own_backward(which, backend, kiln_runs):
    torch.manual_seed(0)
    model, x = MODELS[which]()
    with _no_fallback():
        _train_check(model, x, backend, kiln_runs)


class _no_fallback:
    """Fails on any KilnFallbackWarning (strict would raise anyway; this also covers warnings)."""

    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", kiln.KilnFallbackWarning)

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)


def test_ste_gradient_is_not_the_derivative_of_its_forward(kiln_runs):
    """round() has zero derivative: a re-derived backward would give zero gradients."""
    torch.manual_seed(0)
    model, x = TwoLayer(RoundIdentity), torch.randn(4, 5) * 3
    results = _train_check(model, x, "reference", kiln_runs)
    assert results["kiln"]["grad.fc1.weight"].abs().sum() > 0.1


def test_non_strict_compiles_without_fallback(kiln_runs):
    torch.manual_seed(0)
    model, x = TwoOutputs(), torch.randn(4, 5)
    compiled = torch.compile(model, backend="kiln", options={"backend": "reference"})
    with _no_fallback():
        compiled(x).sum().backward()
    assert any(n.endswith(".backward") for n in kiln_runs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_only_use(backend, kiln_runs):
    torch.manual_seed(0)
    model, x = TwoOutputs(), torch.randn(4, 5)
    compiled = torch.compile(model, backend="kiln", options={"strict": True, "backend": backend})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert kiln_runs and not any(n.endswith(".forward") for n in kiln_runs)


def test_passes_none_still_runs_the_forward_graph(kiln_runs):
    torch.manual_seed(0)
    model, x = TwoLayer(RoundSigmoid), torch.randn(4, 5)
    compiled = torch.compile(model, backend="kiln",
                             options={"strict": True, "backend": "cpu", "passes": None})
    r = torch.randn(4, 3)
    (compiled(x) * r).sum().backward()
    eager = copy.deepcopy(model)
    for p in eager.parameters():
        p.grad = None
    (eager(x) * r).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# ------------------------------------------------------------------------------ the IR op
def _ste_node_graph() -> Graph:
    """y = custom_vjp(x): forward 2*round(x) saving x; backward g * sigmoid(x)."""
    f32 = TensorType((2, 3), DType.float32)
    forward = Graph("ste.forward")
    x = forward.add_input("x", f32)
    two = forward.add_constant(np.float32(2))
    forward.set_outputs([forward.op("mul", forward.op("round", x), two), x])
    backward = Graph("ste.backward")
    g, saved = backward.add_input("g", f32), backward.add_input("x", f32)
    backward.set_outputs([backward.op("mul", g, backward.op("sigmoid", saved))])
    graph = Graph("main")
    a = graph.add_input("a", f32)
    node = graph.add_node("custom_vjp", [a], {"forward": forward, "backward": backward,
                                              "outputs": 1, "grads": (0,), "name": "STE"})
    graph.set_outputs([graph.op("sum", node.outputs[0])])
    return graph


def test_text_round_trip_prints_both_graphs_inline():
    graph = _ste_node_graph()
    text = str(graph)
    assert "custom_vjp(%a)" in text and "graph @ste.forward" in text and "graph @ste.backward" in text
    assert str(parse(text)) == text


def test_gradient_rule_is_the_backward_graph_and_inlining_keeps_values():
    graph = _ste_node_graph()
    a = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    joint = grad_graph(graph, wrt=["a"])
    value, grad = run_graph(joint.graph, [a], [])
    np.testing.assert_allclose(value, (2 * np.round(a)).sum(), rtol=1e-6)
    np.testing.assert_allclose(grad, 1 / (1 + np.exp(-a)), rtol=1e-6)
    inlined = inline_custom_vjp(joint.graph)
    assert "custom_vjp" not in {n.op_name for n in inlined.nodes}
    for got, want in zip(run_graph(inlined, [a], []), (value, grad)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    optimized = default_pipeline()(graph).graph
    assert "custom_vjp" not in str(optimized)
    np.testing.assert_allclose(run_graph(optimized, [a], [])[0], value, rtol=1e-6)


def test_exact_backward_matches_finite_differences():
    """The rule with an exact backward (d tanh) against float64 central differences."""
    f64 = TensorType((3,), DType.float64)
    forward = Graph("tanh.forward")
    x = forward.add_input("x", f64)
    y = forward.op("tanh", x)
    forward.set_outputs([y, y])
    backward = Graph("tanh.backward")
    g, saved = backward.add_input("g", f64), backward.add_input("y", f64)
    one = backward.add_constant(np.float64(1))
    backward.set_outputs([backward.op("mul", g, backward.op("sub", one, backward.op("mul", saved, saved)))])
    graph = Graph("main")
    a = graph.add_input("a", f64)
    node = graph.add_node("custom_vjp", [a], {"forward": forward, "backward": backward,
                                              "outputs": 1, "grads": (0,)})
    r = graph.add_constant(np.array([0.3, -1.2, 2.0]))
    graph.set_outputs([graph.op("sum", graph.op("mul", node.outputs[0], r))])
    point = np.array([0.1, -0.7, 1.3])
    (_, grad) = run_graph(grad_graph(graph, wrt=["a"]).graph, [point], [])
    eps, fd = 1e-6, np.zeros(3)
    for i in range(3):
        up, down = point.copy(), point.copy()
        up[i] += eps
        down[i] -= eps
        fd[i] = (run_graph(graph, [up], [])[0] - run_graph(graph, [down], [])[0]) / (2 * eps)
    np.testing.assert_allclose(grad, fd, rtol=1e-6)


def test_bad_backward_signature_is_a_clear_error():
    graph = _ste_node_graph()
    node = next(n for n in graph.nodes if n.op_name == "custom_vjp")
    with pytest.raises(kiln.ir.OpTypeError, match="backward graph @ste.forward must take"):
        graph.add_node("custom_vjp", [graph.inputs[0]],
                       {**node.attrs, "backward": node.attrs["forward"]})


def test_missing_backward_refuses_gradients_naming_the_function():
    graph = _ste_node_graph()
    node = next(n for n in graph.nodes if n.op_name == "custom_vjp")
    node.attrs["backward"] = None
    with pytest.raises(KilnError, match=r"torch.autograd.Function STE.*torch.compile"):
        grad_graph(graph, wrt=["a"])


# ------------------------------------------------------------------- torch.export path
class ExportedSTE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return RoundIdentity.apply(self.fc(x)) * 2


EXPORT_MODELS = {k: MODELS[k] for k in ("gelu", "ste_identity", "ste_sigmoid", "two_outputs_nondiff",
                                        "used_twice")}


def _export_train_check(model: nn.Module, x: torch.Tensor, backend: str, **options):
    """Outputs and parameter gradients of (out * R).sum() through ``kiln.compile`` (the
    torch.export path), judged against eager float64 with kiln.zoo.compare's rule."""
    eager32, eager64 = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = kiln.compile(model, (x,), strict=True, backend=backend, **options)
    results = {}
    for name, module, inp, run in (("kiln", model, x, compiled), ("eager32", eager32, x, eager32),
                                   ("eager64", eager64, x.double(), eager64)):
        out = flatten_outputs(run(inp))
        weighted_loss(out, weights_for(out)).backward()
        grads = {f"grad.{n}": p.grad for n, p in module.named_parameters()}
        results[name] = {**{k: v.detach() for k, v in out.items()}, **grads}
    comparisons = compare_all(results["kiln"], results["eager32"], results["eager64"])
    bad = worst(comparisons)
    assert all(c.ok for c in comparisons), f"{bad.name}: error {bad.error:.2e} (eager f32 {bad.eager_error:.2e})"
    return compiled, results


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", sorted(EXPORT_MODELS))
def test_kiln_compile_training_uses_the_functions_own_backward(which, backend):
    torch.manual_seed(0)
    model, x = EXPORT_MODELS[which]()
    compiled, _ = _export_train_check(model, x, backend, capture_cache=False)
    kinds = {n.op_name for n in compiled.graph.nodes}
    assert "custom_vjp" not in kinds  # inlined after autodiff; its backward came from the user


def test_kiln_compile_ste_gradient_is_the_users():
    """round() has zero derivative: a re-derived backward would give fc1 zero gradients."""
    torch.manual_seed(0)
    model, x = TwoLayer(RoundIdentity), torch.randn(4, 5) * 3
    _, results = _export_train_check(model, x, "reference", capture_cache=False)
    assert results["kiln"]["grad.fc1.weight"].abs().sum() > 0.1


def test_exported_program_holds_one_function_op_with_both_bodies():
    from kiln.frontends.torch.capture import capture_program, export_program

    torch.manual_seed(0)
    model, x = MODELS["two_outputs_nondiff"]()
    ep = export_program(model, (x,))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.kiln.autograd_function.default) == 1
    assert torch.ops.kiln.function_output.default not in targets
    (node,) = [n for n in capture_program(ep).graph.nodes if n.op_name == "custom_vjp"]
    assert node.attrs["backward"] is not None and node.attrs["nondiff"] == (1,)
    assert node.attrs["grads"][2:] == () and len(node.inputs) == 2  # x and w; 1.5 is a constant
    assert "test_custom_function.py" in node.attrs["name"]  # the Function's forward line


def _mse(out, target):
    return F.mse_loss(out, target)


def _train_batches(steps=3):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 5, generator=g) * 2, torch.randn(4, 3, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("fn", ["gelu", "ste_identity"])
def test_compile_train_uses_the_functions_own_backward(fn, optimizer):
    from test_train import assert_matches_float64

    torch.manual_seed(0)
    model = TwoLayer({"gelu": ExactGELU, "ste_identity": RoundIdentity}[fn])
    make = {"sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05)}[optimizer]
    before = model.fc1.weight.detach().clone()
    assert_matches_float64(model, _mse, make, _train_batches(), backend="cpu")
    assert (model.fc1.weight - before).abs().max() > 1e-3  # the user's backward reached fc1


@torch.compiler.disable
def _opaque_double(x):
    return x * 2


class Opaque(torch.autograd.Function):
    """Calls a function Dynamo must not trace: no autograd_function_apply for it."""

    @staticmethod
    def forward(ctx, x):
        return _opaque_double(x)

    @staticmethod
    def backward(ctx, g):
        return g * 3


class ExportedOpaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return Opaque.apply(self.fc(x)) + 1


def test_untraceable_function_infers_and_refuses_gradients_naming_it():
    torch.manual_seed(0)
    model, x = ExportedOpaque(), torch.randn(4, 5)
    compiled = kiln.compile(model, (x,), strict=True, backend="reference", capture_cache=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    with pytest.raises(KilnError, match=r"(?s)Function Opaque.*TorchDynamo cannot trace it.*torch.compile"):
        compiled(x).sum().backward()


def test_compile_train_refuses_an_untraceable_function():
    torch.manual_seed(0)
    model, x = ExportedOpaque(), torch.randn(4, 5)
    with pytest.raises(KilnError, match="Function Opaque.*TorchDynamo cannot trace it"):
        kiln.compile_train(model, lambda out: out.sum(), torch.optim.SGD(model.parameters(), 0.1), (x,))


def test_dynamo_runs_once_per_function_and_argument_types(monkeypatch):
    from kiln.frontends.torch import autograd_function

    calls = []
    trace = autograd_function._trace_for_export
    monkeypatch.setattr(autograd_function, "_trace_for_export", lambda *a: calls.append(a[0]) or trace(*a))
    monkeypatch.setattr(autograd_function, "_EXPORTED", {})
    torch.manual_seed(0)
    model, x = UsedTwice(), torch.randn(4, 5)  # RoundSigmoid twice on f32[4, 5]
    kiln.compile(model, (x,), backend="reference", capture_cache=False)
    kiln.compile(model, (x,), backend="reference", capture_cache=False)
    assert calls == [RoundSigmoid]
    kiln.compile(model, (torch.randn(2, 5),), backend="reference", capture_cache=False)
    assert calls == [RoundSigmoid, RoundSigmoid]


def test_capture_cache_hit_needs_no_registered_function(tmp_path, monkeypatch):
    """A cached capture holds the Function's graphs themselves, never a key into this
    process's registry: with the registry emptied (as in a new process) a hit still trains
    with the user's backward."""
    from kiln.frontends.torch import autograd_function

    torch.manual_seed(0)
    model, x = TwoLayer(RoundSigmoid), torch.randn(4, 5)
    first = kiln.compile(copy.deepcopy(model), (x,), backend="reference", cache_dir=str(tmp_path))
    assert first.stats["capture_cache"] == "miss"
    monkeypatch.setattr(autograd_function, "_FUNCTIONS", {})
    monkeypatch.setattr(autograd_function, "_EXPORTED", {})
    compiled, _ = _export_train_check(model, x, "reference", cache_dir=str(tmp_path))
    assert compiled.stats["capture_cache"] == "hit"
    assert not autograd_function._FUNCTIONS and not autograd_function._EXPORTED  # nothing traced, nothing looked up


# -------------------------------------------------------- in-place writes are never dropped
def _pad(mode):
    return lambda x: F.pad(x, (1, 2), mode=mode) * 1.5


def _index_put(x):
    y = torch.zeros(x.shape[0], 7)
    y[:, torch.tensor([0, 3, 5])] = x[:, :3]
    return y * x.sum()


def _copy_into_view(x):
    y = torch.zeros(x.shape[0], 2 * x.shape[1])
    y[:, ::2].copy_(x)
    return y + 1


def _masked_fill_slice(x):
    y = x * 2
    y[:, 1:].masked_fill_(y[:, 1:] > 0, 0.5)
    return y


def _setitem_slice(x):
    y = x.clone()
    y[..., 1:] = x[..., :-1] * 3
    return y


def _add_view_of_fresh(x):
    y = torch.ones(x.shape[0], x.shape[1] + 1)
    y[:, 1:].add_(x)
    return y * x.sum(-1, keepdim=True)


WRITES = {"pad_circular": _pad("circular"), "pad_reflect": _pad("reflect"),
          "pad_replicate": _pad("replicate"), "pad_constant": _pad("constant"),
          "index_put_": _index_put, "copy_into_view": _copy_into_view,
          "masked_fill_slice": _masked_fill_slice, "setitem_slice": _setitem_slice,
          "add_view_of_fresh": _add_view_of_fresh}


class Wrap(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x).unsqueeze(1)).squeeze(1) if self.fn in _PADS else self.fn(self.fc(x))


_PADS = tuple(WRITES[k] for k in WRITES if k.startswith("pad"))


@pytest.mark.parametrize("which", sorted(WRITES))
def test_in_place_writes_through_torch_compile(which, kiln_runs):
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    model = Wrap(WRITES[which])
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln", options={"strict": True, "backend": "reference"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    r = torch.randn_like(eager(x))
    (compiled(x) * r).sum().backward()
    (eager(x) * r).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert any(n.endswith(".backward") for n in kiln_runs)


@pytest.mark.parametrize("which", sorted(WRITES))
def test_in_place_writes_through_kiln_compile(which):
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    model = Wrap(WRITES[which])
    eager = copy.deepcopy(model)
    compiled = kiln.compile(model, (x,), strict=True, backend="reference")
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    r = torch.randn_like(eager(x))
    (compiled(x) * r).sum().backward()
    (eager(x) * r).sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_an_unloweable_write_is_refused_not_dropped():
    """An FX graph that writes into a view of a fresh tensor with an op kiln cannot lower."""
    from kiln.frontends.torch.fallback import compile_fx

    def f(x):
        y = torch.zeros(3, 8)
        torch.ops.aten.copy_.default(torch.ops.aten.slice.Tensor(y, 1, 0, 5), x)
        return y

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(3, 5))
    with pytest.raises(kiln.UnsupportedOpError, match="copy_"):
        compile_fx(gm, [torch.randn(3, 5)], backend="reference")


# ------------------------------------------------------- batch norm with momentum=None
def _cumulative_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=None)).train()


def test_cumulative_batch_norm_through_torch_compile_matches_eager():
    """Dynamo breaks the graph at ``float(num_batches_tracked)`` and runs that module in
    PyTorch; the training steps must still match eager, running statistics included."""
    model = _cumulative_bn()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="kiln", options={"strict": True, "backend": "reference"})
    for step in range(2):
        x = torch.randn(2, 3, 6, 6)
        r = torch.randn(2, 4, 4, 4)
        out, want = compiled(x), eager(x)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        (out * r).sum().backward()
        (want * r).sum().backward()
        bn, bn_eager = model[1], eager[1]
        torch.testing.assert_close(bn.running_mean, bn_eager.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, bn_eager.running_var, rtol=1e-5, atol=1e-6)
        assert int(bn.num_batches_tracked) == step + 1
        torch.testing.assert_close(model[0].weight.grad, eager[0].weight.grad, rtol=1e-4, atol=1e-5)


def test_cumulative_batch_norm_through_export_is_a_clear_error():
    model = _cumulative_bn()
    with pytest.raises(kiln.UnsupportedOpError,
                       match=r"(?s)BatchNorm2d '1'.*momentum=None.*torch.compile\(model, backend='kiln'\)"):
        kiln.compile(model, (torch.randn(2, 3, 6, 6),), backend="reference")
    model.eval()  # inference uses the running statistics: fine
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(kiln.compile(model, (x,), backend="reference")(x), model(x))
