"""Training-mode ops: group/instance norm, dropout with kiln's seeded generator, batch norm
with batch statistics and running-buffer updates, torch.autograd.Function.

Results are judged with :mod:`kiln.zoo.compare` (kiln float32 against eager float64, within
1e-4 relative or 10x eager float32's own error); gradients use ``loss = (out * R).sum()``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, TensorType
from kiln.ir.ops.random import dropout_mask
from kiln.passes.cse import CommonSubexpressionElimination as CSE
from kiln.zoo.compare import compare

BACKENDS = ("reference", "cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _check(name, actual, eager32, ref64):
    c = compare(name, actual.detach(), eager32.detach(), ref64.detach())
    assert c.ok, f"{name}: error {c.error:.2e} (eager float32 {c.eager_error:.2e})"


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


# ------------------------------------------------------------------ group / instance norm
class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(4, 8)
        self.inorm = nn.InstanceNorm2d(8, affine=True)

    def forward(self, x):
        y = self.gn(self.conv(x))
        return self.inorm(y) + F.group_norm(y, 2)


def _norms_model():
    torch.manual_seed(0)
    m = Norms()
    with torch.no_grad():  # non-trivial affine parameters
        for p in (m.gn.weight, m.gn.bias, m.inorm.weight, m.inorm.bias):
            p.add_(torch.randn_like(p) * 0.3)
    return m


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_and_instance_norm_forward(backend):
    m = _norms_model().eval()
    x = torch.randn(2, 3, 5, 4)
    compiled = kiln.compile(m, (x,), strict=True, backend=backend)
    assert "group_norm" in str(compiled.graph) or backend == "cpu"
    with torch.no_grad():
        _check("out", compiled(x), m(x), copy.deepcopy(m).double()(x.double()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_norm_gradients_through_torch_compile(backend):
    m = _norms_model()
    ref = copy.deepcopy(m).double()
    eager = copy.deepcopy(m)
    x = torch.randn(2, 3, 5, 4)
    r = torch.randn(2, 8, 5, 4)
    compiled = torch.compile(m, backend="kiln", options={"strict": True, "backend": backend})
    (compiled(x) * r).sum().backward()
    (eager(x) * r).sum().backward()
    (ref(x.double()) * r.double()).sum().backward()
    for name, p in m.named_parameters():
        _check(name, p.grad, dict(eager.named_parameters())[name].grad,
               dict(ref.named_parameters())[name].grad)


def test_native_group_norm_statistics():
    def fn(x, w, b):
        y, mean, rstd = torch.ops.aten.native_group_norm(x, w, b, 2, 6, 4, 3, 1e-5)
        return y, mean, rstd

    x, w, b = torch.randn(2, 6, 2, 2), torch.randn(6), torch.randn(6)
    compiled = kiln.compile(fn, (x, w, b), strict=True, backend="reference")
    for got, want in zip(compiled(x, w, b), fn(x, w, b)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- dropout mask
def _mask_graph(shape, p, offset=0):
    g = Graph("mask")
    seed = g.add_input("seed", TensorType((), DType.int64))
    g.set_outputs([g.op("dropout_mask", seed, shape=shape, p=p, offset=offset)])
    return g


def test_dropout_mask_statistics_and_streams():
    m = dropout_mask(np.int64(5), shape=(200, 500), p=0.3)
    assert abs(m.mean() - 0.7) < 0.005
    other_seed = dropout_mask(np.int64(6), shape=(200, 500), p=0.3)
    assert abs((m == other_seed).mean() - (0.7**2 + 0.3**2)) < 0.01  # independent draws
    shifted = dropout_mask(np.int64(5), shape=(200, 500), p=0.3, offset=100_000)
    assert abs((m == shifted).mean() - 0.58) < 0.01
    flat = m.ravel().astype(float)
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) < 0.02
    assert dropout_mask(np.int64(5), shape=(4,), p=0.0).all()
    assert not dropout_mask(np.int64(5), shape=(4,), p=1.0).any()


def test_dropout_mask_cpu_matches_reference_bit_for_bit():
    from kiln.backends import get_backend

    g = _mask_graph((3, 7, 11), 0.4, offset=17)
    seed = torch.tensor(123456789, dtype=torch.int64)
    (cpu,) = get_backend("cpu").build(g, {})([seed])
    (ref,) = run_graph(g, [seed.numpy()], [])
    assert np.array_equal(cpu.numpy(), ref)
    assert 0.5 < cpu.float().mean() < 0.7


def test_cse_keeps_random_ops_apart():
    g = Graph("two")
    s1 = g.add_input("s1", TensorType((), DType.int64))
    s2 = g.add_input("s2", TensorType((), DType.int64))
    a = g.op("dropout_mask", s1, shape=(4,), p=0.5)
    b = g.op("dropout_mask", s2, shape=(4,), p=0.5)
    c = g.op("dropout_mask", s1, shape=(4,), p=0.5)
    g.set_outputs([a, b, c])
    out = CSE().run(g).graph
    assert out.op_histogram()["dropout_mask"] == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_forward_statistics_and_new_mask_per_call(backend):
    f = kiln.compile(lambda x: F.dropout(x, 0.25, training=True), (torch.ones(64, 64),),
                     strict=True, backend=backend)
    with torch.no_grad():
        a, b = f(torch.ones(64, 64)), f(torch.ones(64, 64))
    assert set(torch.unique(a).tolist()) <= {0.0, float(torch.tensor(1 / 0.75))}
    assert abs((a != 0).float().mean().item() - 0.75) < 0.03
    assert abs(a.mean().item() - 1.0) < 0.05  # unbiased: E[y] = x
    assert not torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_reproducible_under_manual_seed(backend):
    x = torch.randn(8, 16)
    f = kiln.compile(lambda x: F.dropout(x, 0.5, training=True), (x,), strict=True, backend=backend)
    torch.manual_seed(3)
    a = f(x)
    torch.manual_seed(3)
    b = f(x)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_gradient_uses_the_forward_mask(backend):
    x = torch.randn(32, 16, requires_grad=True)
    r = torch.randn(32, 16)
    f = kiln.compile(lambda x: F.dropout(x, 0.3, training=True), (x,), strict=True, backend=backend)
    y = f(x)
    (y * r).sum().backward()
    mask = (y != 0).float()
    torch.testing.assert_close(x.grad, mask * r / 0.7, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y, x.detach() * mask / 0.7, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_in_torch_compile_training(backend):
    torch.manual_seed(0)
    fc = nn.Linear(16, 32)
    m = nn.Sequential(fc, nn.Dropout(0.4)).train()
    x, r = torch.randn(8, 16), torch.randn(8, 32)
    compiled = torch.compile(m, backend="kiln", options={"strict": True, "backend": backend})
    out = compiled(x)
    (out * r).sum().backward()
    mask = (out != 0).float()
    assert 0.4 < mask.mean() < 0.8
    eager = copy.deepcopy(fc)
    for p in eager.parameters():
        p.grad = None
    y = eager(x) * mask / 0.6  # the same mask, replayed in eager
    (y * r).sum().backward()
    torch.testing.assert_close(out, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fc.weight.grad, eager.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fc.bias.grad, eager.bias.grad, rtol=1e-4, atol=1e-5)


def test_remat_reproduces_the_mask():
    from kiln.passes.autodiff import grad_graph
    from kiln.passes.remat import rematerialize

    x = torch.randn(6, 5)
    f = kiln.compile(lambda x: (torch.tanh(F.dropout(x, 0.5, training=True)) * 2).sum(), (x,),
                     strict=True, backend="reference", passes=None)
    graph = f.graph
    joint = grad_graph(graph, wrt=[graph.inputs[0].name], loss=0).graph
    remat, recomputed = rematerialize(joint, loss=0)
    assert recomputed > 0
    # the mask itself is recomputed in the backward (a clone reading the same seed)
    assert remat.op_histogram()["dropout_mask"] == 2 * graph.op_histogram()["dropout_mask"]
    seed = np.int64(42)
    inputs = [x.numpy(), seed]
    plain = run_graph(joint, [inputs[0]], [inputs[1]])
    again = run_graph(remat, [inputs[0]], [inputs[1]])
    for a, b in zip(plain, again):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------- training batch norm
class BNNet(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.bn = nn.BatchNorm2d(3, momentum=momentum)
        self.fc = nn.Linear(3, 6)
        self.bn1 = nn.BatchNorm1d(6)

    def forward(self, x):
        y = torch.tanh(self.bn(x * 1.5))
        return self.bn1(self.fc(y.mean(dim=(2, 3))))


def _bn_pair():
    torch.manual_seed(0)
    m = BNNet().train()
    return m, copy.deepcopy(m), copy.deepcopy(m).double()


def _check_buffers(m, eager):
    for (name, b), (_, e) in zip(m.named_buffers(), eager.named_buffers()):
        if b.dtype.is_floating_point:
            torch.testing.assert_close(b, e, rtol=1e-5, atol=1e-5, msg=name)
        else:
            assert torch.equal(b, e), name


def _train_calls(compiled, m, eager, ref, steps=3):
    r = torch.randn(4, 6)
    for step in range(steps):
        x = torch.randn(4, 3, 6, 6) + step
        for p in (*m.parameters(), *eager.parameters(), *ref.parameters()):
            p.grad = None
        out = compiled(x)
        (out * r).sum().backward()
        e = eager(x)
        (e * r).sum().backward()
        (ref(x.double()) * r.double()).sum().backward()
        _check("out", out, e, ref(x.double()))
        for name, p in m.named_parameters():
            _check(name, p.grad, dict(eager.named_parameters())[name].grad,
                   dict(ref.named_parameters())[name].grad)
    _check_buffers(m, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_batch_norm_kiln_compile(backend):
    m, eager, ref = _bn_pair()
    compiled = kiln.compile(m, (torch.randn(4, 3, 6, 6),), strict=True, backend=backend)
    _check_buffers(m, eager)  # compiling does not touch the buffers
    _train_calls(compiled, m, eager, ref)
    assert int(m.bn.num_batches_tracked) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_batch_norm_torch_compile(backend):
    m, eager, ref = _bn_pair()
    compiled = torch.compile(m, backend="kiln", options={"strict": True, "backend": backend})
    _train_calls(compiled, m, eager, ref)
    assert int(m.bn.num_batches_tracked) == 3


def test_train_batch_norm_under_no_grad_updates_buffers():
    m, eager, _ = _bn_pair()
    compiled = kiln.compile(m, (torch.randn(4, 3, 6, 6),), strict=True, backend="cpu")
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 3, 6, 6)
            torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-4)
    _check_buffers(m, eager)


def test_batch_norm_capture_returns_buffer_updates():
    m, _, _ = _bn_pair()
    graph = kiln.capture(m, (torch.randn(4, 3, 6, 6),))
    names = [v.name for v in graph.outputs]
    assert names[0] != "buffer_update.bn.running_mean"
    assert "buffer_update.bn.running_mean" in names and "buffer_update.bn.num_batches_tracked" in names


# ------------------------------------------------------------------ autograd.Function
class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: forward rounds, backward passes the gradient."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class STENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x):
        return RoundSTE.apply(self.fc(x) * 3)


def test_autograd_function_forward_is_inlined_without_grad(kiln_runs):
    torch.manual_seed(0)
    m = STENet()
    x = torch.randn(4, 5)
    compiled = torch.compile(m, backend="kiln", options={"strict": True, "backend": "cpu"})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
    assert kiln_runs


def test_autograd_function_custom_backward_is_honoured():
    torch.manual_seed(0)
    m = STENet()
    eager = copy.deepcopy(m)
    x, r = torch.randn(4, 5), torch.randn(4, 5)
    compiled = torch.compile(m, backend="kiln", options={"strict": True})  # no fallback
    (compiled(x) * r).sum().backward()
    (eager(x) * r).sum().backward()
    torch.testing.assert_close(m.fc.weight.grad, eager.fc.weight.grad)
    assert m.fc.weight.grad.abs().sum() > 0  # the true derivative of round is zero

