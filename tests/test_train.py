"""kiln.compile_train: whole training steps (forward, backward, optimizer) track eager PyTorch.

Every run compares kiln's loss at each step with the same loop in eager PyTorch
(``zero_grad``, ``backward``, ``optimizer.step``) from identical weights: relative error
<= 1e-3 at every one of 50 steps (float32).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from models import mlp
from torch import nn

import kiln
from kiln.backends.reference import run_graph
from kiln.ir import DType, Graph, KilnError, TensorType
from kiln.passes.optim import GroupSpec, append_optimizer
from kiln.runtime import InputMismatchError

STEPS = 50
LOSS_TOL = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_gpt2() -> nn.Module:
    """A 1-layer GPT-2 small enough to train 50 steps on the reference backend quickly."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, use_cache=False)
    return GPT2LMHeadModel(config).eval()


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy written as log_softmax + gather (a causal LM's training loss)."""
    logp = torch.log_softmax(output.logits, dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).mean()


def mlp_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 64, generator=g), torch.randn(8, 10, generator=g)) for _ in range(steps)]


def gpt2_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
            for _ in range(4)]
    return [data[i % len(data)] for i in range(steps)]


def eager_step(model, loss_fn, optimizer, x, *targets) -> float:
    optimizer.zero_grad()
    loss = loss_fn(model(x), *targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def assert_tracks_eager(model, loss_fn, make_optimizer, batches, *, scheduler=None,
                        check_params=True, **options):
    """Loss within LOSS_TOL of eager at every step; with ``check_params`` the final weights too
    (not for Adam on models with analytically zero gradients, e.g. GPT-2's key bias: Adam
    divides float32 rounding noise by its own magnitude, so those weights drift apart while
    the loss does not move)."""
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    schedulers = [scheduler(optimizer), scheduler(ref_optimizer)] if scheduler else []
    step = kiln.compile_train(model, loss_fn, optimizer, batches[0], **options)
    for i, (x, y) in enumerate(batches):
        got = step(x, y).item()
        want = eager_step(reference, loss_fn, ref_optimizer, x, y)
        assert abs(got - want) <= LOSS_TOL * abs(want), f"step {i}: kiln {got} vs eager {want}"
        for s in schedulers:
            s.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters() if check_params else ()):
        err = ((p - q).norm() / q.norm()).item()
        assert err <= LOSS_TOL, f"{name}: relative error {err:.2e} after {len(batches)} steps"
    return step, optimizer, ref_optimizer


def sgd_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)


@pytest.mark.parametrize("make_optimizer", [sgd_momentum, adamw], ids=["sgd-momentum", "adamw"])
def test_mlp_tracks_eager(make_optimizer):
    step, optimizer, ref_optimizer = assert_tracks_eager(mlp(), nn.functional.mse_loss, make_optimizer,
                                                         mlp_batches(STEPS))
    assert step.builds == 1
    for p, q in zip(optimizer.param_groups[0]["params"], ref_optimizer.param_groups[0]["params"]):
        state, ref_state = optimizer.state[p], ref_optimizer.state[q]
        assert sorted(state) == sorted(ref_state)  # torch's own state format
        for key, value in ref_state.items():
            assert state[key].dtype == value.dtype and state[key].shape == value.shape
            torch.testing.assert_close(state[key], value, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("make_optimizer", [sgd_momentum, adamw], ids=["sgd-momentum", "adamw"])
def test_tiny_gpt2_tracks_eager(make_optimizer):
    assert_tracks_eager(tiny_gpt2(), lm_loss, make_optimizer, gpt2_batches(STEPS),
                        check_params=make_optimizer is sgd_momentum)


def test_param_groups_with_own_hyperparameters_and_flags():
    def make(model):
        return torch.optim.SGD([
            {"params": model.fc1.parameters(), "lr": 0.02, "momentum": 0.9, "nesterov": True},
            {"params": model.fc2.parameters(), "momentum": 0.5, "dampening": 0.2, "weight_decay": 0.01},
            {"params": model.fc3.parameters(), "lr": 0.1, "maximize": False},
        ], lr=0.05)

    assert_tracks_eager(mlp(), nn.functional.mse_loss, make, mlp_batches(10))


def test_adam_and_amsgrad_track_eager():
    def make(model):
        return torch.optim.Adam([
            {"params": model.fc1.parameters(), "amsgrad": True},
            {"params": [*model.fc2.parameters(), *model.fc3.parameters()], "weight_decay": 0.1},
        ], lr=3e-3, betas=(0.8, 0.99))

    assert_tracks_eager(mlp(), nn.functional.mse_loss, make, mlp_batches(10))


def test_scheduler_changes_lr_without_recompiling():
    def schedule(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)

    step, optimizer, _ = assert_tracks_eager(mlp(), nn.functional.mse_loss, sgd_momentum,
                                             mlp_batches(12), scheduler=schedule)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 4)
    assert step.builds == 1


@pytest.mark.parametrize("make_optimizer", [sgd_momentum, adamw], ids=["sgd-momentum", "adamw"])
def test_alternating_kiln_and_eager_steps_continue_one_trajectory(make_optimizer):
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = make_optimizer(model), make_optimizer(reference)
    batches = mlp_batches(10)
    step = kiln.compile_train(model, nn.functional.mse_loss, optimizer, batches[0])
    for i, (x, y) in enumerate(batches):
        if i % 2:
            got = eager_step(model, nn.functional.mse_loss, optimizer, x, y)
        else:
            got = step(x, y).item()
        want = eager_step(reference, nn.functional.mse_loss, ref_optimizer, x, y)
        assert abs(got - want) <= LOSS_TOL * abs(want), f"step {i}: {got} vs {want}"


class WithUnusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(6, 3)
        self.unused = nn.Linear(6, 3)

    def forward(self, x):
        return self.used(x)


def test_params_without_gradient_and_frozen_params_are_left_alone():
    model = WithUnusedLayer()
    model.used.bias.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    step = kiln.compile_train(model, nn.functional.mse_loss, optimizer, (x, y))
    step(x, y)
    assert not torch.equal(model.used.weight, before["used.weight"])
    for name in ("unused.weight", "unused.bias", "used.bias"):
        assert torch.equal(dict(model.named_parameters())[name], before[name]), name
        assert not optimizer.state[dict(model.named_parameters())[name]]  # as eager: no state


def test_update_is_ir_that_passes_see():
    model = mlp()
    optimizer = sgd_momentum(model)
    x, y = mlp_batches(1)[0]
    step = kiln.compile_train(model, nn.functional.mse_loss, optimizer, (x, y), passes="cse,dce")
    names = [v.name for v in step.graph.inputs]
    assert "opt.0.lr" in names and "fc1.weight.momentum_buffer" in names
    assert "fc1.weight.has_momentum_buffer" in names
    assert len(step.graph.outputs) == 1 + 2 * 6  # loss, 6 params, 6 momentum buffers
    assert any(n.loc == "optimizer" for n in step.graph.nodes)
    reference = copy.deepcopy(mlp())
    ref_optimizer = sgd_momentum(reference)
    for _ in range(3):
        got = step(x, y).item()
        want = eager_step(reference, nn.functional.mse_loss, ref_optimizer, x, y)
        assert got == pytest.approx(want, rel=LOSS_TOL)


def test_unsupported_optimizer_is_a_clear_error():
    model = mlp()
    with pytest.raises(KilnError, match=r"does not support the optimizer torch\.optim\.adagrad\.Adagrad"
                                        r".*supported: torch\.optim\.SGD, torch\.optim\.Adam, "
                                        r"torch\.optim\.AdamW"):
        kiln.compile_train(model, nn.functional.mse_loss, torch.optim.Adagrad(model.parameters()),
                           mlp_batches(1)[0])


def test_loss_must_be_a_scalar_and_inputs_are_checked():
    model = mlp()
    optimizer = sgd_momentum(model)
    x, y = mlp_batches(1)[0]
    with pytest.raises(KilnError, match=r"loss_fn must return a floating-point scalar.*f32\[8, 10\]"):
        kiln.compile_train(model, lambda out, t: (out - t) ** 2, optimizer, (x, y))
    step = kiln.compile_train(model, nn.functional.mse_loss, optimizer, (x, y))
    with pytest.raises(InputMismatchError, match=r"argument 0 .* expects f32\[8, 64\]"):
        step(torch.randn(3, 64), y)
    with pytest.raises(InputMismatchError, match=r"takes 2 arguments"):
        step(x)


def test_structural_flag_change_rebuilds_only_the_update():
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = sgd_momentum(model), sgd_momentum(reference)
    batches = mlp_batches(6)
    step = kiln.compile_train(model, nn.functional.mse_loss, optimizer, batches[0])
    for i, (x, y) in enumerate(batches):
        if i == 3:
            for opt in (optimizer, ref_optimizer):
                opt.param_groups[0]["nesterov"] = True
        got = step(x, y).item()
        want = eager_step(reference, nn.functional.mse_loss, ref_optimizer, x, y)
        assert got == pytest.approx(want, rel=LOSS_TOL)
    assert step.builds == 2


# ------------------------------------------------------------------ optimizer IR alone


def _grad_graph(shapes) -> Graph:
    """Params p0.. and inputs g0..: outputs are a dummy loss then g0.. as p0..'s gradients."""
    g = Graph("update")
    grads = [g.add_input(f"g{i}", TensorType(s, DType.float32)) for i, s in enumerate(shapes)]
    params = [g.add_param(f"p{i}", TensorType(s, DType.float32)) for i, s in enumerate(shapes)]
    g.set_outputs([g.op("sum", params[0]), *(g.op("neg", g.op("neg", v)) for v in grads)])
    return g


@pytest.mark.parametrize("kind, flags, make", [
    ("sgd", {"momentum": True, "nesterov": True, "maximize": True},
     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, maximize=True, weight_decay=0.1)),
    ("adam", {"amsgrad": True},
     lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, betas=(0.3, 0.9))),
])
def test_optimizer_ir_matches_torch_step_for_step(kind, flags, make):
    shapes = [(3, 4), (4,)]
    torch.manual_seed(0)
    start = [torch.randn(s) for s in shapes]
    params = [nn.Parameter(t.clone()) for t in start]
    optimizer = make(params)
    graph, layout = append_optimizer(_grad_graph(shapes), [GroupSpec(kind, ("p0", "p1"), **flags)],
                                     {"p0": 1, "p1": 2})
    current = [t.numpy().copy() for t in start]
    state: dict = {}
    for _ in range(4):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        feeds = [g.numpy() for g in grads] + [None] * (len(graph.inputs) - 2)
        group = optimizer.param_groups[0]
        for slot in layout.hypers:
            value = {"beta1": group["betas"][0], "beta2": group["betas"][1]}.get(slot.name) \
                if slot.name.startswith("beta") else group[slot.name]
            feeds[slot.input] = np.float64(value)
        for slot in layout.states:
            shape = () if slot.key == "step" else shapes[int(slot.param[1:])]
            feeds[slot.input] = state.get((slot.param, slot.key), np.zeros(shape, np.float32))
        for name, index in layout.has_buffer.items():
            feeds[index] = np.bool_((name, "momentum_buffer") in state)
        outputs = run_graph(graph, feeds, current)
        current = [outputs[layout.params[f"p{i}"]] for i in range(2)]
        state.update({(s.param, s.key): outputs[s.output] for s in layout.states})
    for got, want in zip(current, params):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_scalar_arithmetic_is_float64_as_in_torch(decoupled):
    """The updates themselves (new minus old param) match ``torch.optim`` to float32
    rounding: the bias corrections ``1 - beta2 ** step`` are computed in float64 as PyTorch
    does (in float32 the rounding of ``0.999 ** 2`` is 1.5e-5 of ``1 - 0.999 ** 2``, which
    scaled every update of a step by one wrong factor: 0.9999968 at the second step)."""
    shapes = [(256, 64)]
    torch.manual_seed(0)
    start = torch.randn(shapes[0])
    param = nn.Parameter(start.clone())
    optimizer = (torch.optim.AdamW if decoupled else torch.optim.Adam)([param], lr=1e-3, weight_decay=0.01)
    graph, layout = append_optimizer(_grad_graph(shapes), [GroupSpec("adam", ("p0",),
                                     decoupled_weight_decay=decoupled)], {"p0": 1})
    state = {}
    for i in range(5):
        grad = torch.randn(shapes[0])
        before = param.detach().clone()
        param.grad = grad.clone()
        optimizer.step()
        feeds = [grad.numpy()] + [None] * (len(graph.inputs) - 1)
        group = optimizer.param_groups[0]
        for slot in layout.hypers:
            feeds[slot.input] = np.float64({"beta1": group["betas"][0], "beta2": group["betas"][1]}
                                           .get(slot.name, group.get(slot.name)))
        for slot in layout.states:
            feeds[slot.input] = state.get(slot.key, np.zeros(() if slot.key == "step" else shapes[0], np.float32))
        outputs = run_graph(graph, feeds, [before.numpy()])
        state = {s.key: outputs[s.output] for s in layout.states}
        got = outputs[layout.params["p0"]].astype(np.float64) - before.numpy()
        want = (param.detach() - before).double().numpy()
        # the updates' common scale (kiln's projected on torch's): float32 rounding of single
        # elements averages out of it, a wrong scalar factor does not
        scale = float(got.ravel() @ want.ravel() / (want.ravel() @ want.ravel()))
        assert abs(scale - 1) < 3e-7, f"step {i}: kiln's update is {scale:.8f} times torch's"


def test_optimizer_ir_rejects_bad_specs():
    graph = _grad_graph([(2,)])
    with pytest.raises(KilnError, match=r"'p9' is not a param"):
        append_optimizer(graph, [GroupSpec("sgd", ("p9",))], {"p9": 1})
    with pytest.raises(KilnError, match=r"gradient output 0 of param 'p0' is f32\[\], expected f32\[2\]"):
        append_optimizer(graph, [GroupSpec("sgd", ("p0",))], {"p0": 0})
    with pytest.raises(KilnError, match=r"nesterov=True needs momentum"):
        GroupSpec("sgd", ("p0",), nesterov=True)


# ------------------------------------------------------------------ against float64
class ChannelsFirstLayerNorm(nn.Module):
    """ConvNeXt's layer norm over the channels of NCHW, written by hand."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = ChannelsFirstLayerNorm(channels)
        self.pw1 = nn.Conv2d(channels, 4 * channels, 1)
        self.pw2 = nn.Conv2d(4 * channels, channels, 1)
        self.gamma = nn.Parameter(1e-6 * torch.ones(channels))  # layer scale

    def forward(self, x):
        h = self.pw2(nn.functional.gelu(self.pw1(self.norm(self.dwconv(x)))))
        return x + self.gamma[:, None, None] * h


class TinyConvNeXt(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 2, stride=2)
        self.stem_norm = ChannelsFirstLayerNorm(channels)
        self.blocks = nn.Sequential(ConvNeXtBlock(channels), ConvNeXtBlock(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem_norm(self.stem(x))).mean((2, 3)))


def convnext_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g))
            for _ in range(steps)]


def assert_matches_float64(model, loss_fn, make_optimizer, batches, **options):
    """kiln's steps against eager float32 and eager float64 (``model.double()``) from the same
    weights, judged by :mod:`kiln.zoo.compare`'s rule: every step's loss and, after the last
    step, every parameter must be within 1e-4 relative of float64 or within 10x of eager
    float32's own error.  A real difference in the compiled step fails; float32 error that
    eager shares (e.g. Adam normalizing a tiny layer-scale gradient) passes and is reported
    as ``by_float32_noise``.  Buffers (batch norm's running statistics) are judged by the same
    rule, integer buffers (``num_batches_tracked``) must be equal.  Returns the step."""
    from kiln.zoo.compare import compare

    eager32, eager64 = copy.deepcopy(model), copy.deepcopy(model).double()
    optimizers = [make_optimizer(m) for m in (model, eager32, eager64)]
    step = kiln.compile_train(model, loss_fn, optimizers[0], batches[0], **options)
    for i, (x, *targets) in enumerate(batches):
        got = step(x, *targets)
        want32 = torch.tensor(eager_step(eager32, loss_fn, optimizers[1], x, *targets))
        want64 = torch.tensor(eager_step(eager64, loss_fn, optimizers[2], x.double(), *targets),
                              dtype=torch.float64)
        verdict = compare(f"loss at step {i}", got, want32, want64)
        assert verdict.ok, verdict
    failures = []
    named = [*model.named_parameters(), *model.named_buffers()]
    for (name, p), q, r in zip(named, [*eager32.parameters(), *eager32.buffers()],
                               [*eager64.parameters(), *eager64.buffers()]):
        if not p.is_floating_point():
            if not torch.equal(p, q):
                failures.append(f"{name}: {p.tolist()} but eager has {q.tolist()}")
            continue
        verdict = compare(name, p, q, r)
        if not verdict.ok:
            failures.append(f"{name}: {verdict.error:.2e} from float64 (eager float32: {verdict.eager_error:.2e})")
    assert not failures, f"after {len(batches)} steps: " + "; ".join(failures)
    return step


def convnext_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def convnext_adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)


@pytest.mark.parametrize("make_optimizer", [convnext_sgd, convnext_adamw], ids=["sgd-momentum", "adamw"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_convnext_steps_match_float64(backend, make_optimizer):
    torch.manual_seed(0)
    assert_matches_float64(TinyConvNeXt(), nn.functional.cross_entropy, make_optimizer, convnext_batches(3),
                           backend=backend)
