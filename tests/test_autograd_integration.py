"""kiln graphs inside torch autograd: kiln.compile and torch.compile(backend="kiln") modules
train with kiln's own forward and backward graphs.

Gradients are compared with torch.autograd on a float64 copy of the model.  The error of a
parameter's gradient is ``||kiln - torch|| / max(||torch||, 1e-6 * G)`` with ``G`` the norm
of all gradients together: per tensor relative error, except for gradients that are zero
analytically (BERT's key biases: softmax ignores a per-row constant), whose reference is
~1e-17 and kiln's float32 rounding noise is all there is.  The bound is 1e-4.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.utils import _pytree as pytree

import kiln
from kiln.backends import get_backend
from kiln.frontends.torch.autograd import DifferentiableGraph

from models import MODELS, mlp

REL_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_inputs(name: str):
    if name == "resnet18":
        g = torch.Generator().manual_seed(1)
        return (torch.randn(1, 3, 32, 32, generator=g),), {}
    return MODELS[name][1]()


def float_leaves(output) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def weighted_loss(output, weights: list[torch.Tensor]) -> torch.Tensor:
    """sum(out_i * w_i) over every float output: a loss with a non-trivial gradient
    (a plain sum through a final layer norm has an analytically zero input gradient)."""
    return sum((t * w.to(t.dtype)).sum() for t, w in zip(float_leaves(output), weights))


def reference_grads(model: nn.Module, args, kwargs, weights) -> dict[str, torch.Tensor | None]:
    ref = copy.deepcopy(model).double()
    def to64(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    weighted_loss(ref(*map(to64, args), **{k: to64(v) for k, v in kwargs.items()}), weights).backward()
    return {n: p.grad for n, p in ref.named_parameters()}


def assert_grads_match(model: nn.Module, want: dict[str, torch.Tensor | None]) -> None:
    total = sum(g.double().norm() ** 2 for g in want.values() if g is not None) ** 0.5
    for name, p in model.named_parameters():
        ref = want[name]
        assert (p.grad is None) == (ref is None), f"{name}: grad {p.grad is not None} vs torch {ref is not None}"
        if ref is None:
            continue
        err = (p.grad.double() - ref).norm() / max(ref.norm(), 1e-6 * total)
        assert err <= REL_TOL, f"{name}: gradient error {err:.2e}"




def run_case(name: str, compile_fn, kiln_runs) -> None:
    model = MODELS[name][0]()
    args, kwargs = small_inputs(name)
    with torch.no_grad():
        outputs = float_leaves(model(*args, **kwargs))
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(t.shape, generator=g) for t in outputs]
    want = reference_grads(model, args, kwargs, weights)
    compiled = compile_fn(model, args, kwargs)
    output = compiled(*args, **kwargs)
    assert all(t.requires_grad for t in float_leaves(output))
    weighted_loss(output, weights).backward()
    assert any(n.endswith(".forward") for n in kiln_runs) and any(n.endswith(".backward") for n in kiln_runs)
    assert_grads_match(model, want)


# resnet18's gradients (slow here) are also checked by compile_train in tests/test_train_modes.py
# (a batch-norm ResNet block and Hugging Face's ResNet)
_MODELS = ["mlp", pytest.param("resnet18", marks=pytest.mark.slow), "gpt2", "bert"]


@pytest.mark.parametrize("name", _MODELS)
def test_kiln_compile_gradients_match_torch(name, kiln_runs):
    run_case(name, lambda m, a, kw: kiln.compile(m, a, example_kwargs=kw), kiln_runs)


@pytest.mark.parametrize("name", _MODELS)
def test_torch_compile_training_gradients_match_torch(name, kiln_runs):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kiln.KilnFallbackWarning)  # everything runs in kiln
        run_case(name, lambda m, a, kw: torch.compile(m, backend="kiln", dynamic=False), kiln_runs)
    torch._dynamo.reset()


# ------------------------------------------------------------------ grad mode and flags


def test_requires_grad_flags_and_input_gradients():
    model = mlp()
    model.fc1.weight.requires_grad_(False)
    x = torch.randn(4, 64, requires_grad=True)
    compiled = kiln.compile(model, (x.detach(),))
    compiled(x).square().mean().backward()
    reference = copy.deepcopy(model)
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).square().mean().backward()
    assert model.fc1.weight.grad is None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-7)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=name)
    pairs = compiled.differentiable._pairs
    assert len(pairs) == 1
    compiled(x.detach()).sum().backward()  # another requires-grad pattern: a second pair
    assert len(pairs) == 2


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_run_the_inference_graph(mode, kiln_runs):
    model = mlp()
    x = torch.randn(4, 64)
    compiled = kiln.compile(model, (x,))
    with mode():
        out = compiled(x)
    assert not out.requires_grad
    assert kiln_runs == ["MLP"]
    frozen = mlp().requires_grad_(False)
    out = kiln.compile(frozen, (x,))(x)
    assert not out.requires_grad and out.grad_fn is None


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 5)
        self.unused_head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.body(x).tanh()
        return h, h.argmax(-1), self.unused_head(h)


def test_integer_outputs_are_non_differentiable_and_unused_outputs_give_none():
    model = TwoHeads()
    x = torch.randn(2, 6)
    features, index, _head = kiln.compile(model, (x,))(x)
    assert not index.requires_grad and index.dtype == torch.int64
    features.sum().backward()  # the head's output is unused: its params get None, as in torch
    assert model.body.weight.grad is not None
    assert model.unused_head.weight.grad is None


@torch.library.custom_op("kiln_test::cube", mutates_args=())
def _cube(x: torch.Tensor) -> torch.Tensor:
    """A user's custom op with a PyTorch gradient: kiln has no rule for it."""
    return x * x * x


@_cube.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _cube_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return grad * 3 * x * x


_cube.register_autograd(_cube_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


class WithUnsupportedOp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.ops.kiln_test.cube(self.fc1(x).tanh()))


def test_modules_with_pytorch_fallback_train_through_kiln_partitions(kiln_runs):
    model = WithUnsupportedOp()
    x = torch.randn(3, 8)
    with pytest.warns(kiln.KilnFallbackWarning, match="kiln_test.cube"):
        compiled = kiln.compile(model, (x,))
    compiled(x).square().sum().backward()
    assert any(n.endswith(".backward") for n in kiln_runs)
    reference = copy.deepcopy(model)
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_remat_policy_gives_the_same_gradients_with_less_saved():
    model = mlp()
    x = torch.randn(4, 64)
    graph = kiln.capture(model, (x,))
    params = [p for p in model.parameters()]
    backend = get_backend("reference")
    inference = backend.build(graph)
    results = {}
    for policy in ("save-all", "remat"):
        differentiable = DifferentiableGraph(graph, inference, backend, policy=policy)
        leaves = [p.detach().clone().requires_grad_(True) for p in params]
        (out,) = differentiable([x, *leaves])
        out.square().sum().backward()
        results[policy] = ([p.grad for p in leaves], differentiable._pairs)
    for a, b in zip(results["save-all"][0], results["remat"][0]):
        torch.testing.assert_close(a, b)
    (saved_all,), (remat,) = (list(r[1].values()) for r in results.values())
    assert remat.saved_bytes < saved_all.saved_bytes
