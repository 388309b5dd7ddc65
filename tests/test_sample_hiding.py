"""Sample hiding (``kiln.train.hide_samples``) on a compiled step with auxiliary outputs.

* ``compile_train`` with a ``loss_fn`` returning ``(loss, per_sample_loss, confidence)``:
  the step returns all three, computed by its forward, and trains like eager on the loss;
* on a small classification task, hiding reaches plain training's accuracy within 3 points
  with a third fewer samples processed, hides only learned samples, moves the others back, and
  trains on everything in the last epoch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kiln
from kiln.train import _choose_hidden, hide_samples


def _loss_with_stats(logits: torch.Tensor, labels: torch.Tensor):
    per_sample = nn.functional.cross_entropy(logits, labels, reduction="none")
    confidence = torch.softmax(logits, -1).gather(1, labels[:, None])[:, 0]
    return per_sample.mean(), per_sample, confidence


def _blobs(n: int, seed: int, spread: float = 1.0):
    """Four Gaussian classes in 8 dimensions (the same centers for every seed), overlapping."""
    centers = torch.randn(4, 8, generator=torch.Generator().manual_seed(100))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    return centers[labels] + spread * torch.randn(n, 8, generator=g), labels


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


def test_a_step_returns_its_auxiliary_outputs_and_trains_on_the_loss():
    model = _model()
    reference = copy.deepcopy(model)
    x, y = _blobs(16, 0)
    step = kiln.compile_train(model, _loss_with_stats, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                              backend="cpu", cache=False)
    assert step.aux_outputs == 2
    loss, per_sample, confidence = step(x, y)
    want_loss, want_per_sample, want_confidence = _loss_with_stats(reference(x), y)
    torch.testing.assert_close(per_sample, want_per_sample.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(confidence, want_confidence.detach(), rtol=1e-5, atol=1e-6)
    want_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_hiding_reaches_plain_accuracy_with_fewer_samples():
    x, y = _blobs(512, 1)
    test_x, test_y = _blobs(512, 2)
    results = {}
    # epoch 1 asks for 90%: more than the model has learned, so candidates move back
    for name, fraction in (("plain", 0.0), ("hiding", lambda epoch: 0.9 if epoch == 1 else 0.4)):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        step = kiln.compile_train(model, _loss_with_stats, optimizer, (x[:32], y[:32]), backend="cpu", cache=False)
        report = hide_samples(step, (x, y), fraction, epochs=8, batch_size=32, seed=3)
        results[name] = (_accuracy(model, test_x, test_y), report)
        assert optimizer.param_groups[0]["lr"] == 0.2, "the epoch's learning-rate scaling was not undone"
    (plain_acc, plain), (hide_acc, hiding) = results["plain"], results["hiding"]
    assert plain.trained == 512 * 8 and plain.saved == 0.0
    assert hiding.trained < plain.trained, "nothing was hidden"
    assert hiding.epochs[0].hidden == 0 and hiding.epochs[-1].hidden == 0
    assert [e.hidden for e in hiding.epochs[2:-1]] == [int(0.4 * 512)] * 5, "the learned 40% were not all hidden"
    assert hiding.epochs[1].moved_back > 0 and hiding.epochs[1].hidden + hiding.epochs[1].moved_back == int(0.9 * 512)
    assert all(e.lr_scale == pytest.approx(512 / (512 - e.hidden)) for e in hiding.epochs)
    assert hiding.saved > 0.3
    assert hide_acc >= plain_acc - 0.03, f"accuracy {hide_acc:.3f} with hiding against {plain_acc:.3f} plain " \
                                         f"({hiding.saved:.0%} of the sample-steps saved)"


def test_only_learned_low_loss_samples_are_hidden():
    losses = torch.tensor([0.1, 0.2, 0.3, 2.0, float("inf"), 0.05])
    confidence = torch.tensor([0.9, 0.5, 0.95, 0.1, 0.0, 0.99])
    hidden, moved_back = _choose_hidden(losses, confidence, 0.5, 0.7)
    # candidates: the 3 lowest losses among seen samples (5, 0, 1); sample 1 is not learned
    assert hidden.tolist() == [True, False, False, False, False, True]
    assert moved_back == 1


def test_bad_steps_and_datasets_are_refused():
    model = _model()
    x, y = _blobs(32, 0)
    plain = kiln.compile_train(model, nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                               (x[:8], y[:8]), backend="reference", cache=False)
    with pytest.raises(kiln.KilnError, match=r"must return \(loss, per_sample_loss, confidence\)"):
        hide_samples(plain, (x, y), 0.2, epochs=1, batch_size=8)
    with pytest.raises(kiln.KilnError, match="different sample counts"):
        hide_samples(plain, (x, y[:5]), 0.2, epochs=1, batch_size=8)
    with pytest.raises(kiln.KilnError, match=r"must be in \[0, 1\)"):
        hide_samples(plain, (x, y), 1.0, epochs=2, batch_size=8)
