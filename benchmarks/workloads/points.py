"""Seed workloads on point clouds and volumes: lidar upsampling with EdgeConv layers and a
sliced-Wasserstein loss, SoftPool++-style point-cloud completion, and a multi-task 3-D CNN
for pulmonary nodule diagnosis with class activation maps.

The models are written from the papers' descriptions at small sizes (random weights,
synthetic inputs); :data:`SPECS` holds their benchmark specs (not part of a default run).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.models import SEED, ModelSpec, Shape

__all__ = ["EdgeConv", "EdgeConvUpsampler", "NoduleNet3D", "SPECS", "SoftPoolNet", "knn_indices",
           "random_projections", "sliced_wasserstein_distance"]


# --------------------------------------------------------------------------- EdgeConv upsampler


def knn_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[B, N, k]`` of each point's ``k`` nearest neighbours (itself included) in
    ``x: [B, N, C]``, from the expanded squared distance ``|a|^2 - 2 a.b + |b|^2``."""
    square = (x * x).sum(-1)
    dist = square.unsqueeze(2) - 2.0 * torch.bmm(x, x.transpose(1, 2)) + square.unsqueeze(1)
    return dist.topk(k, dim=-1, largest=False).indices


def gather_neighbours(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x: [B, N, C]``, ``index: [B, N, k]`` -> the neighbours' features ``[B, N, k, C]``."""
    b, n, c = x.shape
    k = index.shape[-1]
    flat = index.reshape(b, n * k, 1).expand(b, n * k, c)
    return torch.gather(x, 1, flat).reshape(b, n, k, c)


class EdgeConv(nn.Module):
    """One EdgeConv layer (Wang et al., DGCNN): a kNN graph in the input's feature space, a
    shared MLP on each edge's ``concat(x_i, x_j - x_i)``, max over the ``k`` neighbours."""

    def __init__(self, cin: int, cout: int, k: int):
        super().__init__()
        self.k = k
        self.mlp = nn.Sequential(nn.Linear(2 * cin, cout), nn.LeakyReLU(0.2), nn.Linear(cout, cout),
                                 nn.LeakyReLU(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        neighbours = gather_neighbours(x, knn_indices(x, self.k))
        centre = x.unsqueeze(2).expand_as(neighbours)
        edges = torch.cat([centre, neighbours - centre], dim=-1)
        return self.mlp(edges).amax(dim=2)


class EdgeConvUpsampler(nn.Module):
    """Point-cloud upsampling by ``ratio`` with edge-aware (EdgeConv) feature extraction.

    ``points: [B, N, 3]`` (or ``[B, N, 3 + F]``: xyz then per-point features) -> dense points
    ``[B, ratio * N, 3]``.  Two EdgeConv layers (the second builds its graph in feature space,
    as in DGCNN's dynamic graphs) give per-point features; the feature expansion duplicates
    each point's features ``ratio`` times, concatenates one learned code per copy, and a shared
    MLP turns each copy into an offset from its source point.
    """

    def __init__(self, in_features: int = 3, widths: tuple[int, ...] = (32, 32), k: int = 8, ratio: int = 4,
                 code: int = 8, hidden: int = 32):
        super().__init__()
        self.ratio = ratio
        layers, cin = [], in_features
        for width in widths:
            layers.append(EdgeConv(cin, width, k))
            cin = width
        self.edge_convs = nn.ModuleList(layers)
        features = sum(widths)
        self.codes = nn.Parameter(torch.randn(ratio, code))
        self.expand = nn.Sequential(nn.Linear(features + code, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 3))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        b, n, _ = points.shape
        xyz = points[..., :3]
        h, features = points, []
        for layer in self.edge_convs:
            h = layer(h)
            features.append(h)
        h = torch.cat(features, dim=-1)  # [B, N, F]
        f = h.shape[-1]
        copies = h.unsqueeze(2).expand(b, n, self.ratio, f)
        codes = self.codes.unsqueeze(0).unsqueeze(0).expand(b, n, self.ratio, self.codes.shape[-1])
        offsets = self.expand(torch.cat([copies, codes], dim=-1))  # [B, N, r, 3]
        dense = xyz.unsqueeze(2) + offsets
        return dense.reshape(b, n * self.ratio, 3)


def random_projections(num_projections: int, dim: int = 3, generator_seed: int = 0) -> torch.Tensor:
    """``[num_projections, dim]`` unit directions drawn from a generator seeded with
    ``generator_seed``: the same directions on every call with that seed."""
    g = torch.Generator().manual_seed(generator_seed)
    directions = torch.randn(num_projections, dim, generator=g)
    return directions / directions.norm(dim=1, keepdim=True)


def sliced_wasserstein_distance(x: torch.Tensor, y: torch.Tensor, num_projections: int = 64,
                                generator_seed: int = 0, projections: torch.Tensor | None = None) -> torch.Tensor:
    """Sliced Wasserstein distance (squared, averaged) between point sets ``x, y: [B, M, D]``
    (the same number of points ``M``).

    Both sets are projected onto unit directions, each projection is sorted, and the result
    is the mean squared difference of the sorted projections.  The directions are
    ``projections: [L, D]`` when given (so that a compiled graph has no randomness), otherwise
    ``random_projections(num_projections, D, generator_seed)``.
    """
    if projections is None:
        projections = random_projections(num_projections, x.shape[-1], generator_seed).to(x.dtype)
    px = torch.matmul(x, projections.t())  # [B, M, L]
    py = torch.matmul(y, projections.t())
    sx = torch.sort(px, dim=1).values
    sy = torch.sort(py, dim=1).values
    return ((sx - sy) ** 2).mean()


def swd_loss(output: torch.Tensor, target: torch.Tensor, projections: torch.Tensor) -> torch.Tensor:
    """The upsampler's training loss: SWD between predicted and target dense points."""
    return sliced_wasserstein_distance(output, target, projections=projections)


# --------------------------------------------------------------------------- SoftPool++ completion


class SoftPoolNet(nn.Module):
    """Point-cloud completion with soft pooling (SoftPool / SoftPool++, Wang et al.).

    ``points: [B, N, 3]`` -> completed points ``[B, k * up, 3]``.

    * Encoder: a shared point-wise MLP (1x1 ``Conv1d``) giving features ``[B, C1, N]`` and
      ``[B, C, N]``.
    * Soft pooling: ``regions`` learned activations per point; for each region the points are
      sorted by it (descending) and the top ``k`` kept, weighted by the softmax of their sorted
      activations; the gathered, weighted feature vectors of all regions are fused by a 1x1
      conv into the organized feature map ``[B, C, k]``.
    * Decoder: 1x1 convs on the organized map, each slot emitting ``up`` points, with two
      encoder-decoder skip connections through learned transformations: a per-sample ``[C, C]``
      matrix predicted from the global feature (applied with ``bmm``) on the organized map, and
      a learned ``[C, C1]`` matrix on the first encoder layer's features pooled the same way.

    Leaky ReLU is used in the encoder (the paper's ReLU could leave points with all-zero
    features whose ties in the sort make the gradient route depend on tie breaking).
    """

    def __init__(self, widths: tuple[int, int] = (16, 32), regions: int = 4, k: int = 16, up: int = 4):
        super().__init__()
        c1, c = widths
        self.k, self.up, self.regions = k, up, regions
        self.conv1 = nn.Conv1d(3, c1, 1)
        self.conv2 = nn.Conv1d(c1, c, 1)
        # no bias: the softmax weights and the top-k order are invariant to a per-region shift
        self.score = nn.Conv1d(c, regions, 1, bias=False)
        self.fuse = nn.Conv1d(regions * c, c, 1)
        self.transform = nn.Linear(c, c * c)
        nn.init.normal_(self.transform.weight, std=0.02)
        nn.init.zeros_(self.transform.bias)
        self.skip = nn.Parameter(torch.randn(c, c1) / c1 ** 0.5)
        self.dec1 = nn.Conv1d(c, c, 1)
        self.dec2 = nn.Conv1d(c, c, 1)
        self.out = nn.Conv1d(c, 3 * up, 1)

    def soft_pool(self, features: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``features: [B, C, N]``, top-k ``index`` and softmax ``weights`` ``[B, R, k]`` ->
        the regions' weighted feature maps ``[B, R, C, k]``."""
        b, c, n = features.shape
        r, k = index.shape[1:]
        gathered = torch.gather(features.unsqueeze(1).expand(b, r, c, n), 3,
                                index.unsqueeze(2).expand(b, r, c, k))
        return gathered * weights.unsqueeze(2)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        b = points.shape[0]
        x = points.transpose(1, 2)
        e1 = F.leaky_relu(self.conv1(x), 0.2)
        e2 = F.leaky_relu(self.conv2(e1), 0.2)  # [B, C, N]
        activation, index = self.score(e2).topk(self.k, dim=2)  # sorted, descending: [B, R, k]
        weights = torch.softmax(activation, dim=-1) * self.k
        c = e2.shape[1]
        organized = self.fuse(self.soft_pool(e2, index, weights).reshape(b, self.regions * c, self.k))
        pooled1 = self.soft_pool(e1, index, weights).mean(dim=1)  # [B, C1, k]
        glob = organized.amax(dim=2)  # [B, C]
        matrix = torch.eye(c, dtype=points.dtype) + self.transform(glob).reshape(b, c, c)
        h = torch.relu(self.dec1(organized)) + torch.bmm(matrix, organized)
        h = torch.relu(self.dec2(h)) + torch.matmul(self.skip, pooled1)
        out = self.out(h)  # [B, 3 * up, k]
        return out.reshape(b, self.up, 3, self.k).permute(0, 3, 1, 2).reshape(b, self.k * self.up, 3)


# --------------------------------------------------------------------------- nodule diagnosis


NODULE_ATTRIBUTES = ("subtlety", "sphericity", "margin", "lobulation", "spiculation")


class NoduleNet3D(nn.Module):
    """A multi-task 3-D CNN for pulmonary nodule diagnosis: Conv3d-BatchNorm3d-ReLU blocks
    with max pooling, global average pooling, a malignancy head (``malignancy_levels``
    outputs: 1 for binary, 5 for the 5-level rating) and one head per manifestation attribute
    (``attribute_levels`` outputs each).  ``forward`` returns ``(malignancy, *attributes)``.
    """

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32), malignancy_levels: int = 5,
                 attributes: tuple[str, ...] = NODULE_ATTRIBUTES, attribute_levels: int = 5):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 1
        for index, width in enumerate(widths):
            if index:
                layers.append(nn.MaxPool3d(2))
            layers += [nn.Conv3d(cin, width, 3, padding=1, bias=False), nn.BatchNorm3d(width), nn.ReLU()]
            cin = width
        self.body = nn.Sequential(*layers)
        self.tasks = ("malignancy",) + tuple(attributes)
        self.heads = nn.ModuleDict({"malignancy": nn.Linear(cin, malignancy_levels)})
        for name in attributes:
            self.heads[name] = nn.Linear(cin, attribute_levels)
        for module in self.modules():  # non-trivial batch-norm statistics, as after training
            if isinstance(module, nn.BatchNorm3d):
                nn.init.uniform_(module.weight, 0.5, 1.5)
                nn.init.uniform_(module.bias, -0.1, 0.1)
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)

    def features(self, volume: torch.Tensor) -> torch.Tensor:
        """The last conv block's features ``[B, C, d, h, w]``."""
        return self.body(volume)

    def forward(self, volume: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pooled = self.features(volume).mean(dim=(2, 3, 4))
        return tuple(self.heads[name](pooled) for name in self.tasks)

    def class_activation_map(self, volume: torch.Tensor, task: str, index: int, *, upsample: bool = True,
                             features: torch.Tensor | None = None) -> torch.Tensor:
        """Class activation map ``[B, D, H, W]`` of output ``index`` of head ``task``: the last
        conv features weighted by that head's weights (no bias), trilinearly upsampled to the
        volume's size; ``upsample=False`` keeps the feature grid, whose mean is the head's
        logit minus its bias.  ``features`` may be given (e.g. from a compiled ``features``)."""
        if features is None:
            features = self.features(volume)
        weight = self.heads[task].weight[index]  # [C]
        cam = torch.einsum("bcdhw,c->bdhw", features, weight)
        if not upsample:
            return cam
        return F.interpolate(cam.unsqueeze(1), size=tuple(volume.shape[2:]), mode="trilinear",
                             align_corners=False).squeeze(1)


# --------------------------------------------------------------------------- benchmark specs


def _seeded(build):
    def seeded_build() -> nn.Module:
        torch.manual_seed(SEED)
        return build().eval()

    seeded_build.__name__ = f"build_{getattr(build, '__name__', 'model')}"
    return seeded_build


def _points(n: int):
    return lambda shape: (torch.randn(shape.batch, n, 3),)


def _volumes(size: int):
    return lambda shape: (torch.randn(shape.batch, 1, size, size, size),)


SPECS: tuple[ModelSpec, ...] = (
    ModelSpec("seed-lidar-edgeconv", "EdgeConv upsampler (2 EdgeConv layers, k=16, 64 wide), 1024 -> 4096 points",
              _seeded(lambda: EdgeConvUpsampler(widths=(64, 64), k=16, ratio=4, code=8, hidden=64)),
              _points(1024), (Shape(1, quick=True), Shape(4)), default=False),
    ModelSpec("seed-softpool", "SoftPool++-style completion (64/128 wide, 8 regions, top-256), 2048 -> 2048 points",
              _seeded(lambda: SoftPoolNet(widths=(64, 128), regions=8, k=256, up=8)),
              _points(2048), (Shape(1, quick=True), Shape(8)), default=False),
    ModelSpec("seed-nodule3d", "3-D CNN nodule diagnosis (16/32/64 wide), 1x32^3, malignancy + 5 attribute heads",
              _seeded(lambda: NoduleNet3D(widths=(16, 32, 64))),
              _volumes(32), (Shape(1, quick=True), Shape(8)), default=False),
)
