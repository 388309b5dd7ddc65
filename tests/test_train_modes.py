"""kiln.compile_train with training-mode ops: batch norm's running statistics and dropout.

Batch norm: losses, parameters and buffers (``running_mean``/``running_var`` by the float64
rule of :mod:`kiln.zoo.compare`, ``num_batches_tracked`` exactly) against eager after a few
steps, on a ResNet-style block and on batch-norm models from transformers.  Dropout: kiln
draws its own masks (not eager's bits), so the checks are that each step draws a new mask,
that ``torch.manual_seed`` reproduces a run, that ``remat`` (which recomputes masks in the
backward) changes nothing, that ``p=0`` is eager's step, and -- replaying kiln's masks in
eager -- that forward and backward of every step use one mask.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from test_train import assert_matches_float64, eager_step
from torch import nn

import kiln
from kiln.ir.ops.random import dropout_mask
from kiln.runtime.module import draw_seed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------ batch norm
class BasicBlock(nn.Module):
    """ResNet's basic block: conv-BN-ReLU-conv-BN plus a projection shortcut with its own BN."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, momentum=0.3)
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = BasicBlock(8, 16, stride=2)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3)))


def image_batches(steps: int, shape=(4, 3, 12, 12), classes: int = 5):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g))
            for _ in range(steps)]


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)


@pytest.mark.parametrize("backend, make_optimizer", [("reference", sgd), ("reference", adamw), ("cpu", adamw)],
                         ids=["reference-sgd-momentum", "reference-adamw", "cpu-adamw"])
def test_batch_norm_resnet_block_matches_eager(backend, make_optimizer):
    model = TinyResNet().train()
    step = assert_matches_float64(model, nn.functional.cross_entropy, make_optimizer, image_batches(4),
                                  backend=backend)
    assert model.block.bn1.num_batches_tracked.item() == 4
    updated = [v.name for v in step.graph.outputs if v.name.startswith("buffer_update.")]
    assert "buffer_update.block.bn2.running_var" in updated and len(updated) == 4 * 3


def test_batch_norm_buffers_receive_no_gradient_and_eager_steps_continue():
    """Running statistics are not params of the update (no gradient flows into them); kiln and
    eager steps alternate on one model and stay on eager's trajectory, buffers included."""
    model = TinyResNet().train()
    reference = copy.deepcopy(model)
    optimizer, ref_optimizer = sgd(model), sgd(reference)
    batches = image_batches(4)
    step = kiln.compile_train(model, nn.functional.cross_entropy, optimizer, batches[0], backend="reference")
    assert not any("running" in name for group in step._group_specs() for name in group.params)
    for i, (x, y) in enumerate(batches):
        got = step(x, y).item() if i % 2 == 0 else eager_step(model, nn.functional.cross_entropy,
                                                                  optimizer, x, y)
        want = eager_step(reference, nn.functional.cross_entropy, ref_optimizer, x, y)
        assert got == pytest.approx(want, rel=1e-4), f"step {i}"
    for (name, b), ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b, ref, rtol=1e-4, atol=1e-5, msg=name)


def _hf_loss(output, labels):
    return nn.functional.cross_entropy(output.logits, labels)


def _hf_resnet():
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=3))


def _hf_mobilenet_v2():
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    # output_stride=8 keeps the last stages at 2x2 (dilated), so no batch norm normalizes a
    # single pixel per image, which would make float32 and float64 eager part at step 3
    return MobileNetV2ForImageClassification(MobileNetV2Config(
        num_channels=3, image_size=32, depth_multiplier=0.25, output_stride=8, num_labels=3,
        classifier_dropout_prob=0.0))


def _hf_regnet():
    from transformers import RegNetConfig, RegNetForImageClassification

    return RegNetForImageClassification(RegNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
        num_labels=3))


@pytest.mark.parametrize("make_model, image, backend", [
    (_hf_resnet, 16, "reference"), (_hf_regnet, 16, "reference"),
    pytest.param(_hf_mobilenet_v2, 16, "reference", marks=pytest.mark.slow)],  # 52 BNs: ~15-35 s
    ids=["resnet", "regnet", "mobilenet_v2"])
def test_transformers_batch_norm_models_match_eager(make_model, image, backend):
    torch.manual_seed(0)
    model = make_model().train()
    batches = image_batches(3, shape=(4, 3, image, image), classes=3)
    assert_matches_float64(model, _hf_loss, adamw, batches, backend=backend)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(m.num_batches_tracked.item() == 3 for m in bns)


# ------------------------------------------------------------------ dropout
class Block(nn.Module):
    """A pre-norm transformer block with explicit attention and three dropouts."""

    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.attn_drop, self.drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = self.attn_drop(torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), -1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)))))  # drop used twice


class TinyTransformer(nn.Module):
    def __init__(self, p: float = 0.2, d: int = 16, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.Sequential(Block(d, 2, p), Block(d, 2, p))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.blocks(self.drop(self.embed(x))).mean(1))


def token_batches(steps: int):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 6, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]


def _run_dropout_steps(make_optimizer, batches, seed=7, **options):
    model = TinyTransformer().train()
    step = kiln.compile_train(model, nn.functional.cross_entropy, make_optimizer(model), batches[0], **options)
    torch.manual_seed(seed)
    losses = [step(x, y).item() for x, y in batches]
    return losses, model, step


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_dropout_draws_a_new_mask_per_step_reproducibly(backend):
    x, y = token_batches(1)[0]  # one batch, and lr=0: only the masks change the loss
    model = TinyTransformer().train()
    step = kiln.compile_train(model, nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0),
                              (x, y), backend=backend)

    def losses(seed):
        torch.manual_seed(seed)
        return [step(x, y).item() for _ in range(4)]

    first = losses(7)
    assert all(math.isfinite(loss) for loss in first)
    assert len(set(first)) == 4, f"every step must draw a new mask: {first}"
    assert losses(7) == first  # same torch.manual_seed, same masks, same losses
    assert losses(8) != first


def test_dropout_with_remat_recomputes_the_same_masks():
    batches = token_batches(4)
    plain, model, _ = _run_dropout_steps(adamw, batches, backend="cpu")
    again, remat_model, step = _run_dropout_steps(adamw, batches, backend="cpu", remat=True)
    masks = [n for n in step.graph.nodes if n.op.name == "dropout_mask"]
    captured = [n for n in step.forward_graph.nodes if n.op.name == "dropout_mask"]
    assert len(masks) > len(captured) == 7  # remat cloned masks into the backward
    np.testing.assert_allclose(again, plain, rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), remat_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=name)


class _Replay(nn.Module):
    """Dropout that multiplies by masks given in advance (kiln's, in the order drawn)."""

    def __init__(self, masks: list, p: float):
        super().__init__()
        self.masks, self.scale = masks, 1.0 / (1.0 - p)

    def forward(self, x):
        return x * self.masks.pop(0).to(x.dtype) * self.scale


def _replaying(model: nn.Module, masks: list) -> nn.Module:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(module, child_name, _Replay(masks, child.p))
    return model


@pytest.mark.parametrize("backend, remat", [("reference", False), ("cpu", True)])
def test_dropout_forward_and_backward_use_one_mask(backend, remat):
    """Eager float32 and float64 replaying the masks kiln drew reproduce kiln's losses and
    weights (the float64 rule): the forward and the backward of every step used one mask."""
    from kiln.zoo.compare import compare

    model = TinyTransformer().train()
    masks32, masks64 = [], []
    eager32 = _replaying(copy.deepcopy(model), masks32)
    eager64 = _replaying(copy.deepcopy(model).double(), masks64)
    optimizers = [adamw(m) for m in (model, eager32, eager64)]
    batches = token_batches(3)
    step = kiln.compile_train(model, nn.functional.cross_entropy, optimizers[0], batches[0],
                              backend=backend, remat=remat)
    draws = sorted((n for n in step.forward_graph.nodes if n.op.name == "dropout_mask"),
                   key=lambda n: n.attrs["offset"])
    for i, (x, y) in enumerate(batches):
        torch.manual_seed(100 + i)
        got = step(x, y)
        torch.manual_seed(100 + i)
        seed = np.int64(draw_seed())  # the seed the step drew
        drawn = [torch.from_numpy(dropout_mask(seed, **n.attrs)) for n in draws]
        assert 0.7 < float(torch.cat([m.flatten() for m in drawn]).float().mean()) < 0.9
        masks32[:], masks64[:] = drawn, list(drawn)
        want32 = torch.tensor(eager_step(eager32, nn.functional.cross_entropy, optimizers[1], x, y))
        want64 = torch.tensor(eager_step(eager64, nn.functional.cross_entropy, optimizers[2], x.double(), y),
                              dtype=torch.float64)
        assert not masks32 and not masks64  # eager used every mask exactly once
        verdict = compare(f"loss at step {i}", got, want32, want64)
        assert verdict.ok, verdict
    for (name, p), q, r in zip(model.named_parameters(), eager32.parameters(), eager64.parameters()):
        verdict = compare(name, p, q, r)
        assert verdict.ok, verdict


def test_dropout_p0_is_eager_step():
    model = TinyTransformer(p=0.0).train()
    step = assert_matches_float64(model, nn.functional.cross_entropy, adamw, token_batches(3),
                                  backend="reference")
    assert "dropout_mask" not in step.graph.op_histogram()
