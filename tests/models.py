"""Small, seeded test models shared by kiln's test suite.

Importing this module builds nothing; every model is made by a builder function.
``MODELS`` maps a model name to ``(builder, inputs_fn)``: ``builder()`` returns the model in
eval mode with seeded random weights; ``inputs_fn()`` returns ``(args, kwargs)`` for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


class MLP(nn.Module):
    """64 -> 128 -> 128 -> 10 with ReLU and GELU."""

    def __init__(self, in_features: int = 64, hidden: int = 128, out_features: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = nn.functional.gelu(self.fc2(x))
        return self.fc3(x)


class BasicBlock(nn.Module):
    """The ResNet basic block: two 3x3 convs with batch norm and a residual connection."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """The standard ResNet layout (7x7 stem, max pool, four stages, global average pool)."""

    def __init__(self, layers: tuple[int, int, int, int], num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        planes = [64, 128, 256, 512]
        in_planes = 64
        stages = []
        for i, (width, blocks) in enumerate(zip(planes, layers)):
            stride = 1 if i == 0 else 2
            stage = [BasicBlock(in_planes, width, stride)]
            stage += [BasicBlock(width, width) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
            in_planes = width
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def _randomize_batch_norms(model: nn.Module) -> None:
    """Give batch norms non-trivial statistics so eval-mode normalization is exercised."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c) * 0.1)
            m.running_var.copy_(torch.rand(c) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(c) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(c) * 0.1)


def resnet18(num_classes: int = 10) -> ResNet:
    """ResNet-18 with seeded random weights, eval mode."""
    torch.manual_seed(0)
    model = ResNet((2, 2, 2, 2), num_classes)
    with torch.no_grad():
        _randomize_batch_norms(model)
    return model.eval()


class SmallCNN(nn.Module):
    """conv+bn+relu, max/avg/adaptive pooling, nearest/bilinear upsampling, grouped and
    dilated convs, on a 1x3x32x32 input."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.grouped = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.avgpool = nn.AvgPool2d(2, stride=2)
        self.up_nearest = nn.Upsample(scale_factor=2, mode="nearest")
        self.dilated = nn.Conv2d(32, 32, 3, padding=2, dilation=2, stride=2)
        self.up_bilinear = nn.Upsample(size=(10, 10), mode="bilinear", align_corners=False)
        self.head_pool = nn.AdaptiveAvgPool2d((3, 3))
        self.fc = nn.Linear(32 * 9, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))  # 16x16
        x = self.avgpool(torch.relu(self.grouped(x)))  # 8x8
        x = self.up_nearest(x)  # 16x16
        x = torch.relu(self.dilated(x))  # 8x8
        x = self.up_bilinear(x)  # 10x10
        x = self.head_pool(x)  # 3x3 from 10x10: uneven windows
        return self.fc(torch.flatten(x, 1))


def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP().eval()


def small_cnn() -> SmallCNN:
    torch.manual_seed(0)
    model = SmallCNN()
    with torch.no_grad():
        _randomize_batch_norms(model)
    return model.eval()


def gpt2_small_config_model() -> nn.Module:
    """A 2-layer GPT-2 language model from a small config, random weights, no KV cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256,
                        use_cache=False)
    return GPT2LMHeadModel(config).eval()


def bert_small_model() -> nn.Module:
    """A 2-layer BERT encoder from a small config, random weights."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                        intermediate_size=512, vocab_size=1000)
    return BertModel(config).eval()


def mlp_inputs() -> Inputs:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(4, 64, generator=g),), {}


def resnet18_inputs() -> Inputs:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 3, 64, 64, generator=g),), {}


def small_cnn_inputs() -> Inputs:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 3, 32, 32, generator=g),), {}


def gpt2_inputs() -> Inputs:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 1000, (1, 16), generator=g),), {}


def bert_inputs() -> Inputs:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 1000, (1, 16), generator=g)
    attention_mask = torch.ones(1, 16, dtype=torch.int64)
    attention_mask[0, 12:] = 0
    return (input_ids,), {"attention_mask": attention_mask}


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Inputs]]] = {
    "mlp": (mlp, mlp_inputs),
    "resnet18": (resnet18, resnet18_inputs),
    "cnn": (small_cnn, small_cnn_inputs),
    "gpt2": (gpt2_small_config_model, gpt2_inputs),
    "bert": (bert_small_model, bert_inputs),
}


def first_tensor(out: Any) -> torch.Tensor:
    """The first tensor of a model's output (a tensor, a Hugging Face ``ModelOutput`` or a
    tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        return out.to_tuple()[0]
    return out[0]
