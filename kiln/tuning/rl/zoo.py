"""Small PyTorch models of the pass-ordering corpus that ``transformers`` does not provide.

Every constructor seeds nothing itself; :mod:`kiln.tuning.rl.corpus` seeds torch before
building, so each corpus graph is reproducible.
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """``depth`` linear layers of ``width`` with ReLU, tanh-GELU or a SiLU gate between them."""

    def __init__(self, width: int, activation: str = "relu", depth: int = 3):
        super().__init__()
        if activation not in ("relu", "gelu", "gated"):
            raise ValueError(f"activation must be relu, gelu or gated, got {activation!r}")
        self.activation = activation
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.gates = (
            nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth - 1))
            if activation == "gated"
            else nn.ModuleList()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers[:-1]):
            h = layer(x)
            if self.activation == "relu":
                x = torch.relu(h)
            elif self.activation == "gelu":
                x = nn.functional.gelu(h, approximate="tanh")
            else:
                x = nn.functional.silu(h) * self.gates[i](x)
        return self.layers[-1](x)


class ScalarLoss(nn.Module):
    """A model followed by a scalar loss: the mean square of its first output (a model
    output object's first field, e.g. ``logits`` or ``last_hidden_state``), so autodiff has a
    scalar to differentiate."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(*args)
        out = out if isinstance(out, torch.Tensor) else out[0]
        return (out * out).mean()


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + skip)


class ResNet18(nn.Module):
    """ResNet-18: 7x7 stem, max pool, four stages of two basic blocks, average pool, linear."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        blocks, cin = [], 64
        for i, cout in enumerate((64, 128, 256, 512)):
            blocks += [_BasicBlock(cin, cout, 1 if i == 0 else 2), _BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet18() -> ResNet18:
    """Seeded ResNet-18 in eval mode with non-trivial batch-norm statistics."""
    torch.manual_seed(0)
    model = ResNet18()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.75, 1.25)
    return model.eval()


class SmallCNN(nn.Module):
    """conv-bn-relu, pooling, a grouped conv, upsampling and a linear head (32x32 input)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)  # 16x16
        x = nn.functional.avg_pool2d(torch.relu(self.conv2(x)), 2)  # 8x8
        x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")  # 16x16
        x = nn.functional.adaptive_avg_pool2d(torch.relu(self.conv3(x)), 4)  # 4x4
        return self.head(torch.flatten(x, 1))


class _ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)  # channels last for the norm and the MLP
        y = self.pw2(nn.functional.gelu(self.pw1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class _ChannelsFirstNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    """A ConvNeXt-shaped net: patchify stem, stages of ConvNeXt blocks with norm + strided
    conv downsampling between them, global average pool, layer norm, linear head."""

    def __init__(
        self, widths: tuple[int, ...] = (16, 32), depths: tuple[int, ...] = (1, 1), classes: int = 10
    ):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 4, stride=4), _ChannelsFirstNorm(widths[0]))
        layers: list[nn.Module] = []
        for i, (width, depth) in enumerate(zip(widths, depths)):
            if i:
                layers += [_ChannelsFirstNorm(widths[i - 1]), nn.Conv2d(widths[i - 1], width, 2, stride=2)]
            layers += [_ConvNeXtBlock(width) for _ in range(depth)]
        self.stages = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(widths[-1], eps=1e-6)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(self.norm(x.mean(dim=(2, 3))))
