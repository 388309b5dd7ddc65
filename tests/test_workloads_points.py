"""The point-cloud and volume seed workloads (``benchmarks/workloads/points.py``) through kiln:
forward and parameter gradients against eager, training steps against an eager copy, the
sliced Wasserstein distance, and the nodule network's class activation maps."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln

ROOT = Path(__file__).resolve().parents[1]


def _load_points():
    """``benchmarks/workloads/points.py`` imported by file path (it imports ``benchmarks``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location("seed_workloads_points", ROOT / "benchmarks/workloads/points.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


points = _load_points()

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RTOL = 1e-4


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def assert_forward_and_grads_match(model: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    """Forward (max relative error) and every parameter's gradient of
    ``sum(out * fixed_random)`` over all outputs, compiled against eager."""
    fast = kiln.compile(model, args, backend="cpu", cache=False, strict=True)
    with torch.no_grad():
        got, want = _tuple(fast(*args)), _tuple(model(*args))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape
        assert _max_rel(a, b) <= RTOL, f"output {i}: {_max_rel(a, b)}"

    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(b.shape, generator=g) for b in want]
    names, params = zip(*model.named_parameters())

    def loss(outs):
        return sum((o * w).sum() for o, w in zip(_tuple(outs), weights))

    grads = torch.autograd.grad(loss(fast(*args)), params)
    expected = torch.autograd.grad(loss(model(*args)), params)
    for name, a, b in zip(names, grads, expected):
        assert _max_rel(a, b) <= RTOL, f"grad {name}: {_max_rel(a, b)}"


def eager_step(model, loss_fn, optimizer, *args) -> float:
    optimizer.zero_grad()
    loss = loss_fn(model(args[0]), *args[1:])
    loss.backward()
    optimizer.step()
    return loss.item()


def assert_train_steps_match(model, loss_fn, make_optimizer, batches) -> None:
    """``kiln.compile_train`` steps against an eager copy: losses, parameters, buffers."""
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    step = kiln.compile_train(model, loss_fn, optimizer, batches[0], backend="cpu", cache=False)
    for i, batch in enumerate(batches):
        got = step(*batch).item()
        want = eager_step(reference, loss_fn, ref_optimizer, *batch)
        assert got == pytest.approx(want, rel=RTOL), f"step {i}"
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, ref, rtol=RTOL, atol=1e-6, msg=name)
    for (name, b), ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, ref, rtol=RTOL, atol=1e-6, msg=name)


def _randn(*shape, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def tiny_upsampler():
    torch.manual_seed(0)
    return points.EdgeConvUpsampler(widths=(8, 8), k=4, ratio=2, code=4, hidden=8).eval()


def tiny_nodule_net():
    torch.manual_seed(0)
    return points.NoduleNet3D(widths=(4, 8), attribute_levels=3)


# ------------------------------------------------------------------ EdgeConv upsampler + SWD


def test_edgeconv_upsampler_matches_eager():
    model = tiny_upsampler()
    x = _randn(2, 16, 3)
    assert model(x).shape == (2, 32, 3)
    assert_forward_and_grads_match(model, (x,))


def test_sliced_wasserstein_distance():
    x, y = _randn(2, 12, 3, seed=1), _randn(2, 12, 3, seed=2)
    value = points.sliced_wasserstein_distance(x, y, 16, 5)
    # the directions are fixed by the seed and are unit vectors
    directions = points.random_projections(16, 3, 5)
    torch.testing.assert_close(directions.norm(dim=1), torch.ones(16))
    assert value == points.sliced_wasserstein_distance(x, y, 16, 5)
    assert value != points.sliced_wasserstein_distance(x, y, 16, 6)
    # a direct computation: one projection at a time, in float64
    xd, yd, dd = x.double(), y.double(), directions.double()
    total = 0.0
    for b in range(2):
        for d in dd:
            px, _ = torch.sort(xd[b] @ d)
            py, _ = torch.sort(yd[b] @ d)
            total += ((px - py) ** 2).sum().item()
    assert value.item() == pytest.approx(total / (2 * 12 * 16), rel=1e-5)
    torch.testing.assert_close(points.sliced_wasserstein_distance(x, y, projections=directions), value)
    # zero for identical point sets, in any order
    assert points.sliced_wasserstein_distance(x, x, 16, 5).item() == 0.0
    assert points.sliced_wasserstein_distance(x, x[:, torch.randperm(12)], 16, 5).item() == 0.0


def test_edgeconv_swd_training_matches_eager():
    model = tiny_upsampler()
    projections = points.random_projections(8, 3, 0)
    batches = [(_randn(2, 16, 3, seed=s), _randn(2, 32, 3, seed=s + 10), projections) for s in (1, 2)]
    assert_train_steps_match(model, points.swd_loss, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                             batches)


# ------------------------------------------------------------------ SoftPool++


def test_softpool_matches_eager():
    torch.manual_seed(0)
    model = points.SoftPoolNet(widths=(8, 16), regions=2, k=4, up=2).eval()
    x = _randn(2, 16, 3)
    assert model(x).shape == (2, 8, 3)
    assert_forward_and_grads_match(model, (x,))


# ------------------------------------------------------------------ nodule diagnosis


def test_nodule_net_eval_matches_eager():
    model = tiny_nodule_net().eval()
    x = _randn(2, 1, 8, 8, 8)
    outputs = model(x)
    assert [o.shape for o in outputs] == [(2, 5)] + [(2, 3)] * 5
    assert_forward_and_grads_match(model, (x,))


def _nodule_loss(outputs, malignancy, attributes):
    loss = nn.functional.cross_entropy(outputs[0], malignancy)
    for i, logits in enumerate(outputs[1:]):
        loss = loss + nn.functional.cross_entropy(logits, attributes[:, i])
    return loss


def test_nodule_net_training_with_batch_norm_matches_eager():
    model = tiny_nodule_net().train()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 1, 8, 8, 8, generator=g), torch.randint(0, 5, (2,), generator=g),
                torch.randint(0, 3, (2, 5), generator=g)) for _ in range(2)]
    assert_train_steps_match(model, _nodule_loss,
                             lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), batches)
    assert model.body[1].num_batches_tracked.item() == 2


def test_class_activation_map():
    model = tiny_nodule_net().eval()
    x = _randn(2, 1, 8, 8, 8)
    with torch.no_grad():
        outputs = model(x)
        for t, task in enumerate(model.tasks):
            cam = model.class_activation_map(x, task, 1)
            assert cam.shape == (2, 8, 8, 8)
            raw = model.class_activation_map(x, task, 1, upsample=False)
            torch.testing.assert_close(raw.mean(dim=(1, 2, 3)), outputs[t][:, 1] - model.heads[task].bias[1],
                                       rtol=1e-5, atol=1e-6)
