"""The benchmark models, at benchmark sizes, with seeded random weights.

These are deliberately separate from ``tests/models.py`` (which holds small test sizes):
the benchmark must not change when a test model does.

A :class:`ModelSpec` says how to build a model and its inputs; a :class:`Workload` is one
model at one input size (batch, sequence length), the unit every system is timed on.
Each model has a latency shape (batch 1) and one throughput batch.  ``--quick`` runs the
quick shapes of the quick models (the MLP) unless models are named, then their quick shapes.

Hugging Face models are wrapped so that they return their ``last_hidden_state`` only: every
system then computes and returns the same single tensor, and no system is charged for (or
allowed to drop) outputs another one skips.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

SEED = 0


@dataclass(frozen=True)
class Shape:
    """One input size of a model; ``seq`` is ``None`` for models without a sequence axis."""

    batch: int
    seq: int | None = None
    quick: bool = False  # part of the ``--quick`` subset

    def label(self) -> str:
        return f"b{self.batch}" if self.seq is None else f"s{self.seq}-b{self.batch}"


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model (eval mode, seeded weights) and inputs of a given shape."""

    name: str
    description: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[Shape], tuple[torch.Tensor, ...]]
    shapes: tuple[Shape, ...]
    default: bool = True  # part of a run that names no models
    in_quick: bool = False  # part of a ``--quick`` run that names no models


@dataclass(frozen=True)
class Workload:
    """One model at one shape: ``name`` is e.g. ``"gpt2-s128-b1"``."""

    spec: ModelSpec
    shape: Shape

    @property
    def name(self) -> str:
        return f"{self.spec.name}-{self.shape.label()}"

    @property
    def model(self) -> str:
        return self.spec.name

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """Seeded example inputs; the same tensors on every call."""
        torch.manual_seed(SEED + 1)
        return self.spec.make_inputs(self.shape)


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    """``in -> hidden -> in`` with GELU: the transformer feed-forward shape."""

    def __init__(self, features: int = 1024, hidden: int = 4096):
        super().__init__()
        self.up = nn.Linear(features, hidden)
        self.down = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def seeded_build() -> nn.Module:
        torch.manual_seed(SEED)
        return build().eval()

    seeded_build.__name__ = f"build_{getattr(build, '__name__', 'model')}"
    return seeded_build


def _features(features: int) -> Callable[[Shape], tuple[torch.Tensor, ...]]:
    return lambda shape: (torch.randn(shape.batch, features),)


# --------------------------------------------------------------------------- ResNet-18


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual connection."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (He et al. 2016): 7x7 stem, max pool, four stages of two basic blocks,
    global average pool, 1000-way classifier."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        stages, in_planes = [], 64
        for index, planes in enumerate((64, 128, 256, 512)):
            stride = 1 if index == 0 else 2
            stages.append(nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes)))
            in_planes = planes
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(512, num_classes)
        for module in self.modules():  # non-trivial batch-norm statistics, as after training
            if isinstance(module, nn.BatchNorm2d):
                nn.init.uniform_(module.weight, 0.5, 1.5)
                nn.init.uniform_(module.bias, -0.1, 0.1)
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _images(size: int) -> Callable[[Shape], tuple[torch.Tensor, ...]]:
    return lambda shape: (torch.randn(shape.batch, 3, size, size),)


# --------------------------------------------------------------------------- MobileNet-style


class InvertedResidual(nn.Module):
    """MobileNetV3's block without squeeze-excite: 1x1 expansion, k x k depthwise, 1x1
    projection, each with batch norm; ReLU or hardswish; a residual when shapes allow."""

    def __init__(self, cin: int, expand: int, cout: int, kernel: int, stride: int, hardswish: bool):
        super().__init__()
        act = nn.Hardswish if hardswish else nn.ReLU
        layers: list[nn.Module] = []
        if expand != cin:
            layers += [nn.Conv2d(cin, expand, 1, bias=False), nn.BatchNorm2d(expand), act()]
        layers += [nn.Conv2d(expand, expand, kernel, stride, kernel // 2, groups=expand, bias=False),
                   nn.BatchNorm2d(expand), act(),
                   nn.Conv2d(expand, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


# MobileNetV3-Small's blocks (kernel, expansion, out, hardswish, stride), squeeze-excite left out
_MOBILENET_BLOCKS = ((3, 16, 16, False, 2), (3, 72, 24, False, 2), (3, 88, 24, False, 1), (5, 96, 40, True, 2),
                     (5, 240, 40, True, 1), (5, 240, 40, True, 1), (5, 120, 48, True, 1), (5, 144, 48, True, 1),
                     (5, 288, 96, True, 2), (5, 576, 96, True, 1), (5, 576, 96, True, 1))


class MobileNet(nn.Module):
    """A MobileNetV3-Small-style network: depthwise separable inverted residuals, batch
    norm with non-trivial statistics, hardswish and ReLU, 1000 classes."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish()]
        cin = 16
        for kernel, expand, cout, hardswish, stride in _MOBILENET_BLOCKS:
            layers.append(InvertedResidual(cin, expand, cout, kernel, stride, hardswish))
            cin = cout
        layers += [nn.Conv2d(cin, 576, 1, bias=False), nn.BatchNorm2d(576), nn.Hardswish()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, num_classes))
        for module in self.modules():
            if isinstance(module, nn.BatchNorm2d):
                nn.init.uniform_(module.weight, 0.5, 1.5)
                nn.init.uniform_(module.bias, -0.1, 0.1)
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


# --------------------------------------------------------------------------- ViT


class ViTBlock(nn.Module):
    """Pre-norm transformer encoder block: multi-head self-attention (SDPA) and a GELU MLP."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    """ViT-Tiny/16 (Dosovitskiy et al. 2021; 192 wide, 12 blocks, 3 heads): a 16x16
    patchify convolution, learned position embeddings, global average pooling of the
    tokens (the paper's GAP variant; no class token), 1000 classes."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 192, depth: int = 12, heads: int = 3,
                 num_classes: int = 1000):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image // patch) ** 2
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.blocks = nn.Sequential(*(ViTBlock(dim, heads, 4 * dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


# --------------------------------------------------------------------------- transformers


class HiddenStates(nn.Module):
    """A Hugging Face encoder/decoder stack returning only ``last_hidden_state``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.model(*inputs).last_hidden_state


def build_gpt2() -> nn.Module:
    """GPT-2 small (``GPT2Config()`` defaults: 12 layers, 768 wide, 12 heads), no KV cache."""
    from transformers import GPT2Config, GPT2Model

    return HiddenStates(GPT2Model(GPT2Config(use_cache=False)))


def build_bert() -> nn.Module:
    """BERT-base encoder (``BertConfig()`` defaults: 12 layers, 768 wide, 12 heads)."""
    from transformers import BertConfig, BertModel

    return HiddenStates(BertModel(BertConfig(), add_pooling_layer=False))


def _token_ids(vocab: int) -> Callable[[Shape], tuple[torch.Tensor, ...]]:
    return lambda shape: (torch.randint(0, vocab, (shape.batch, shape.seq or 1)),)


def _bert_inputs(shape: Shape) -> tuple[torch.Tensor, ...]:
    """Token ids and an attention mask; every row after the first is padded by a quarter."""
    seq = shape.seq or 1
    ids = torch.randint(0, 30522, (shape.batch, seq))
    mask = torch.ones(shape.batch, seq, dtype=torch.long)
    mask[1:, seq - seq // 4:] = 0
    return ids, mask


# --------------------------------------------------------------------------- the table

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec("mlp", "MLP 1024 -> 4096 -> 1024, GELU", _seeded(MLP), _features(1024),
              (Shape(1, quick=True), Shape(64, quick=True)), in_quick=True),
    ModelSpec("resnet18", "ResNet-18, 3x224x224 images, 1000 classes", _seeded(ResNet18), _images(224),
              (Shape(1, quick=True), Shape(8))),
    ModelSpec("mobilenet", "MobileNetV3-Small-style (no squeeze-excite), 3x224x224, 1000 classes",
              _seeded(MobileNet), _images(224), (Shape(1, quick=True), Shape(8))),
    ModelSpec("vit", "ViT-Tiny/16 (5.7M), 3x224x224, 1000 classes", _seeded(ViT), _images(224),
              (Shape(1, quick=True), Shape(8))),
    ModelSpec("gpt2", "GPT-2 small (124M), random weights, last hidden state", _seeded(build_gpt2),
              _token_ids(50257), (Shape(1, 128, quick=True), Shape(4, 128), Shape(1, 512), Shape(4, 512))),
    ModelSpec("bert", "BERT-base encoder (110M), random weights, padded attention mask", _seeded(build_bert),
              _bert_inputs, (Shape(1, 128, quick=True), Shape(8, 128))),
    ModelSpec("tiny-mlp", "MLP 64 -> 128 -> 64 (smoke tests only)", _seeded(lambda: MLP(64, 128)),
              _features(64), (Shape(1, quick=True), Shape(16, quick=True)), default=False),
)}


SEEDS = "seeds"
"""The name that selects every seed workload (``benchmarks/workloads``)."""


def select_workloads(models: list[str] | None = None, *, quick: bool = False) -> list[Workload]:
    """The workloads of ``models`` in table order; without names, the default models (with
    ``quick``: the quick models).  ``quick`` keeps each model's quick shapes (a named model
    without any keeps its first shape).  ``seeds`` names every seed workload, ``seed-<name>``
    one of them."""
    table = dict(MODELS)
    if models and any(m == SEEDS or m.startswith("seed-") for m in models):
        from .workloads import seed_specs

        seeds = seed_specs()
        table.update(seeds)
        models = [name for m in models for name in (seeds if m == SEEDS else [m])]
    unknown = sorted(set(models or ()) - set(table))
    if unknown:
        raise ValueError(f"unknown benchmark model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}, "
                         f"{SEEDS} and the seed-* workloads")
    if models:
        chosen = [spec for spec in table.values() if spec.name in models]
    else:
        chosen = [spec for spec in MODELS.values() if (spec.in_quick if quick else spec.default)]
    workloads: list[Workload] = []
    for spec in chosen:
        shapes = [shape for shape in spec.shapes if shape.quick] if quick else list(spec.shapes)
        workloads += [Workload(spec, shape) for shape in shapes or spec.shapes[:1]]
    return workloads
