"""How a kiln training step stores its new parameters and optimizer state.

On the compiled backends the step writes the new values into spare buffers and swaps the
storages of parameters and state tensors that own their storage alone (no copy); tensors
whose storage anyone else can see (a view, a tied or flat-buffer parameter) get a copy, so
views follow the update exactly as in eager.  Either way every step matches eager AdamW.
The cpu backend is told which weights the step updates and reads them without packed
copies (a packed copy would be made again at every step).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.runtime.tensors import sole_owner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 4


class TwoLayer(nn.Module):
    def __init__(self, width: int = 24):
        super().__init__()
        self.up = nn.Linear(16, width)
        self.down = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _pair(model: nn.Module):
    twin = copy.deepcopy(model)
    return (model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
            twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1))


def _eager_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _assert_same_state(model, optimizer, twin, twin_optimizer):
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[p][key], twin_optimizer.state[q][key], rtol=1e-5, atol=1e-7)


def test_storages_swap_and_every_step_matches_eager():
    torch.manual_seed(0)
    model, opt, twin, twin_opt = _pair(TwoLayer())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    step = kiln.compile_train(model, F.mse_loss, opt, (x, y), backend="cpu", cache=False)
    weight = model.up.weight
    pointers = []
    for _ in range(STEPS):
        loss = step(x, y)
        torch.testing.assert_close(loss, _eager_step(twin, twin_opt, x, y), rtol=1e-5, atol=0)
        pointers.append(weight.data_ptr())
        _assert_same_state(model, opt, twin, twin_opt)
    assert model.up.weight is weight and isinstance(weight, nn.Parameter) and weight.requires_grad
    assert len(set(pointers[1:])) == 2, "after the first step the storage alternates between two buffers"
    exp_avg = opt.state[weight]["exp_avg"]
    step(x, y)
    _eager_step(twin, twin_opt, x, y)
    assert opt.state[weight]["exp_avg"] is exp_avg  # the state tensors keep their identity too
    # the model still trains eagerly afterwards, from the same trajectory
    _eager_step(model, opt, x, y)
    _eager_step(twin, twin_opt, x, y)
    twin_loss = _eager_step(twin, twin_opt, x, y)
    torch.testing.assert_close(step(x, y), twin_loss, rtol=1e-5, atol=0)


def test_a_view_kept_by_the_user_follows_every_step():
    torch.manual_seed(1)
    model, opt, twin, twin_opt = _pair(TwoLayer())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    step = kiln.compile_train(model, F.mse_loss, opt, (x, y), backend="cpu", cache=False)
    step(x, y)
    _eager_step(twin, twin_opt, x, y)
    view = model.up.weight.view(-1)          # shares the storage: the step must copy into it
    data = model.down.weight.data
    assert not sole_owner(model.up.weight)
    for _ in range(STEPS):
        step(x, y)
        _eager_step(twin, twin_opt, x, y)
        assert torch.equal(view, model.up.weight.view(-1)) and torch.equal(data, model.down.weight)
    _assert_same_state(model, opt, twin, twin_opt)


def test_parameters_in_one_flat_buffer_are_copied_into():
    torch.manual_seed(2)
    model = TwoLayer()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    offset = 0
    for module, name in ((model.up, "weight"), (model.up, "bias"), (model.down, "weight"), (model.down, "bias")):
        p = getattr(module, name)
        n = p.numel()
        setattr(module, name, nn.Parameter(flat[offset: offset + n].view_as(p)))
        offset += n
    model, opt, twin, twin_opt = _pair(model)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    step = kiln.compile_train(model, F.mse_loss, opt, (x, y), backend="cpu", cache=False)
    for _ in range(STEPS):
        step(x, y)
        _eager_step(twin, twin_opt, x, y)
    _assert_same_state(model, opt, twin, twin_opt)
    assert model.up.weight.data_ptr() == flat.data_ptr()  # still a view of the flat buffer
    torch.testing.assert_close(flat[: model.up.weight.numel()], model.up.weight.reshape(-1))


def test_the_reference_backend_copies_and_matches_too():
    torch.manual_seed(3)
    model, opt, twin, twin_opt = _pair(TwoLayer(8))
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    step = kiln.compile_train(model, F.mse_loss, opt, (x, y), backend="reference")
    pointer = model.up.weight.data_ptr()
    for _ in range(STEPS):
        step(x, y)
        _eager_step(twin, twin_opt, x, y)
    assert model.up.weight.data_ptr() == pointer  # an executable without `out`: copies
    _assert_same_state(model, opt, twin, twin_opt)


def test_updated_weights_are_not_packed_but_frozen_ones_are():
    torch.manual_seed(4)
    model = TwoLayer(256)
    model.down.weight.requires_grad_(False)   # frozen: the step reads it unchanged every call
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.1)
    x, y = torch.randn(64, 16), torch.randn(64, 16)
    step = kiln.compile_train(model, F.mse_loss, opt, (x, y), backend="cpu", cache=False)
    for _ in range(3):
        torch.testing.assert_close(step(x, y), _eager_step(twin, twin_opt, x, y), rtol=1e-5, atol=0)
    packed = [label for label in step._executable.plan.workspace().labels if label.startswith("PackStep")]
    assert not any("up.weight" in label for label in packed), packed
    torch.testing.assert_close(model.up.weight, twin.up.weight, rtol=1e-5, atol=1e-6)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)


def _adam_amsgrad(params):
    return torch.optim.Adam(params, lr=1e-2, amsgrad=True)


def _adamw_groups(params):
    params = list(params)
    return torch.optim.AdamW([{"params": params[:2], "lr": 2e-2}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2)


@pytest.mark.parametrize("make", [_sgd, _adam_amsgrad, _adamw_groups], ids=["sgd-nesterov", "adam-amsgrad", "adamw-groups"])
def test_kiln_and_eager_steps_alternate_on_one_trajectory(make):
    """Swapped storages and the optimizer's own in-place updates mix: kiln, eager, kiln..."""
    torch.manual_seed(5)
    model = TwoLayer()
    model.down.bias.requires_grad_(False)  # frozen: no state, never written
    twin = copy.deepcopy(model)
    opt, twin_opt = make(p for p in model.parameters() if p.requires_grad), make(
        p for p in twin.parameters() if p.requires_grad)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    step = kiln.compile_train(model, F.mse_loss, opt, (x, y), backend="cpu", cache=False)
    frozen = model.down.bias.data_ptr()
    for i in range(6):
        want = _eager_step(twin, twin_opt, x, y)
        got = step(x, y) if i % 3 != 1 else _eager_step(model, opt, x, y)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for key, value in twin_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=1e-7)
    assert model.down.bias.data_ptr() == frozen and not opt.state[model.down.bias]


def test_a_float16_step_skipped_for_overflow_leaves_everything_unchanged():
    torch.manual_seed(6)
    model = TwoLayer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    step = kiln.compile_train(model, F.mse_loss, opt, (x, y), backend="cpu", cache=False, amp="float16")
    step(x, y)
    step(x, y)  # the spare buffers are in use from here on
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    skipped = step.skipped_steps
    step(x * 1e30, y)  # overflows in float16: skipped
    assert step.skipped_steps == skipped + 1
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and torch.equal(opt.state[p]["exp_avg"], moments[n]), n
    step(x, y)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
