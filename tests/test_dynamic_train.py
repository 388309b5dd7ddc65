"""Gradients and training steps on symbolic shapes: built once, exact at every size in range.

* ``kiln.compile(..., dynamic_shapes=)`` on a model whose parameters need gradients: the
  forward/backward pair is differentiated once, symbolically, and every parameter gradient
  matches eager at several sequence lengths;
* ``kiln.compile_train(..., dynamic_shapes=)``: one step graph (forward, backward and the
  optimizer update) serves every length; losses and updated parameters match eager, and a
  length outside the range is refused with the range in the message;
* dropout masks with symbolic shapes draw the same bits on the reference and cpu backends;
* a static view of a symbolic tensor (``h[:, 0]`` of ``[b, seq, d]``) fed to a GEMM: its
  leading dimension depends on ``seq`` and is read at each call;
* the same tensor given twice as an example (input and target) is captured as two inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.export import Dim

import kiln


def _gpt2_lm() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=64, vocab_size=96, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _Logits(GPT2LMHeadModel(config))


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _ids(batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_gradients_of_a_symbolic_gpt2_match_eager_at_every_length(builds):
    backend = "cpu"
    model = _gpt2_lm()
    params = list(model.parameters())
    seq = Dim("seq", min=2, max=64)
    fast = kiln.compile(model, (_ids(2, 16, 0),), dynamic_shapes=({1: seq},), backend=backend, cache=False,
                        strict=True)
    for n in (16, 5, 33):
        ids = _ids(2, n, n)
        out, ref = fast(ids), model(ids)
        assert _rel(out, ref) <= 1e-4
        weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(100 + n))
        got = torch.autograd.grad((out * weights).sum(), params)
        want = torch.autograd.grad((ref * weights).sum(), params)
        for (name, _), g, w in zip(model.named_parameters(), got, want):
            assert _rel(g, w) <= 1e-4, f"gradient of {name} at seq={n}: max relative error {_rel(g, w):.2e}"
    # inference, forward and backward: each built once for all three lengths
    assert builds["count"] == 3, f"{builds['count']} builds for three lengths"


def test_compile_train_with_a_sequence_range_builds_one_step(builds):
    model = _gpt2_lm()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    seq = Dim("seq", min=2, max=64)
    ids = _ids(2, 16, 0)
    step = kiln.compile_train(model, _lm_loss, optimizer, (ids, ids), backend="cpu", cache=False,
                              dynamic_shapes=({1: seq}, {1: seq}))
    assert str(step.forward_graph.inputs[0].type) == "i64[2, seq]"
    for n in (16, 5, 64):
        ids, targets = _ids(2, n, n), _ids(2, n, 1000 + n)
        loss = step(ids, targets)
        eager_optimizer.zero_grad()
        want = _lm_loss(reference(ids), targets)
        want.backward()
        eager_optimizer.step()
        assert abs(loss.item() - want.item()) <= 1e-4 * abs(want.item()), f"loss at seq={n}"
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert _rel(p.detach(), q.detach()) <= 1e-4, f"{name} after the step at seq={n}"
    assert step.builds == 1 and builds["count"] == 1
    with pytest.raises(kiln.KilnError, match=r"seq = 65 is outside its range \[2, 64\]"):
        step(_ids(2, 65, 1), _ids(2, 65, 2))
    with pytest.raises(kiln.KilnError, match="one entry per positional argument"):
        kiln.compile_train(model, _lm_loss, optimizer, (ids, ids), dynamic_shapes=({1: seq},))


class _TokenMLP(nn.Module):
    """Per-token layers with three dropouts on ``[batch, seq, width]`` activations."""

    def __init__(self, p: float):
        super().__init__()
        self.net = nn.Sequential(nn.Dropout(p), nn.Linear(16, 32), nn.GELU(), nn.Dropout(p), nn.Linear(32, 16),
                                 nn.Dropout(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_symbolic_dropout_masks_are_the_same_on_reference_and_cpu():
    losses = {}
    seq = Dim("seq", min=2, max=64)
    for backend in ("reference", "cpu"):
        torch.manual_seed(0)
        model = _TokenMLP(0.5).train()
        step = kiln.compile_train(model, _mse, torch.optim.SGD(model.parameters(), lr=0.1),
                                  (torch.randn(2, 8, 16), torch.randn(2, 8, 16)), backend=backend, cache=False,
                                  dynamic_shapes=({1: seq}, {1: seq}))
        nodes = [n for n in step.graph.nodes if n.op_name == "dropout_mask"]
        assert len(nodes) == 3 and all(not n.outputs[0].type.is_static for n in nodes)
        offsets = [str(n.attrs["offset"]) for n in nodes]
        assert offsets[0] == "0" and len(set(offsets)) == 3, f"masks share a counter stream: {offsets}"
        torch.manual_seed(7)
        data = torch.Generator().manual_seed(1)
        losses[backend] = [step(torch.randn(2, n, 16, generator=data), torch.randn(2, n, 16, generator=data)).item()
                           for n in (8, 41, 41)]
    assert losses["reference"] == pytest.approx(losses["cpu"], rel=1e-5)
    # dropout is on: the same step without it gives other losses
    torch.manual_seed(0)
    model = _TokenMLP(0.0).train()
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 8, 16, generator=data), torch.randn(2, 8, 16, generator=data)
    assert _mse(model(x), y).item() != pytest.approx(losses["cpu"][0], rel=1e-3)


class _FirstToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, 0])


def test_gemm_of_a_static_view_of_a_symbolic_tensor_reads_its_stride_per_call():
    torch.manual_seed(0)
    model = _FirstToken().eval()
    fast = kiln.compile(model, (torch.randn(2, 9, 64),), dynamic_shapes=({1: Dim("seq", min=2, max=64)},),
                        backend="cpu", cache=False, strict=True)
    with torch.no_grad():
        for n in (9, 3, 40):
            x = torch.randn(2, n, 64)
            assert _rel(fast(x), model(x)) <= 1e-4, f"seq={n}"


def test_one_tensor_given_as_input_and_target_is_captured_twice():
    model = _gpt2_lm()
    reference = copy.deepcopy(model)
    ids = _ids(2, 8, 0)
    step = kiln.compile_train(model, _lm_loss, torch.optim.SGD(model.parameters(), lr=0.0), (ids, ids),
                              backend="reference", cache=False)
    targets = _ids(2, 8, 5)
    assert step(ids, targets).item() == pytest.approx(_lm_loss(reference(ids), targets).item(), rel=1e-5)


def test_means_and_variances_over_a_symbolic_axis_train_like_eager():
    def loss_fn(out, target):  # the counts of both reductions are symbolic: 2*seq*16 and seq
        return _mse(out, target) + out.var(dim=1).mean()

    torch.manual_seed(0)
    model = _TokenMLP(0.0)
    reference = copy.deepcopy(model)
    seq = Dim("seq", min=2, max=64)
    step = kiln.compile_train(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.5),
                              (torch.randn(2, 8, 16), torch.randn(2, 8, 16)), backend="cpu", cache=False,
                              dynamic_shapes=({1: seq}, {1: seq}))
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(3)
    for n in (8, 2, 41):
        x, y = torch.randn(2, n, 16, generator=data), torch.randn(2, n, 16, generator=data)
        loss = step(x, y)
        eager_optimizer.zero_grad()
        want = loss_fn(reference(x), y)
        want.backward()
        eager_optimizer.step()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert _rel(p, q) <= 1e-5, f"{name} after the step at seq={n}"
