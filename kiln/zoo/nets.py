"""Hand-written ``torch.nn`` zoo entries: shapes users write themselves.

* ``unet``: a two-level UNet with ``GroupNorm``, SiLU, max-pool downsampling,
  ``ConvTranspose2d`` upsampling and skip concatenation.
* ``seq2seq_transformer``: ``nn.Transformer`` (batch first) with token embeddings, a
  source padding mask, a causal target mask and a target padding mask.
* ``conv3d``: a 3-D CNN (``Conv3d``, ``BatchNorm3d``, ``MaxPool3d``, global average pool).
* ``pointnet_knn``: a DGCNN-style point-cloud network: kNN by ``topk`` over pairwise
  distances, neighbour features by ``gather``, edge convolution with max over neighbours,
  then a ``sort`` of the points by a learned score and top-point pooling.
* ``dilated_cnn``: an ASPP-style segmentation head: parallel 3x3 convs with dilations 1, 2,
  4, an image-pooling branch, bilinear upsampling.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .hf_vision import randomize_batch_norms
from .registry import Built, randn, register


class _ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    def __init__(self, cin: int = 3, width: int = 8, classes: int = 2):
        super().__init__()
        self.enc1 = _ConvBlock(cin, width)
        self.enc2 = _ConvBlock(width, 2 * width)
        self.mid = _ConvBlock(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _ConvBlock(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _ConvBlock(2 * width, width)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


@register("unet", "unet", "nn", ("group-norm", "conv-transpose2d", "skip-concat", "max-pool"))
def unet() -> Built:
    torch.manual_seed(0)
    return UNet(), (randn(1, 3, 32, 32),)


class Seq2SeqTransformer(nn.Module):
    """Token embeddings + learned positions + ``nn.Transformer`` + output projection."""

    def __init__(self, vocab: int = 64, d_model: int = 32, heads: int = 4, layers: int = 2, max_len: int = 32):
        super().__init__()
        self.src_embed = nn.Embedding(vocab, d_model)
        self.tgt_embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, dim_feedforward=64, dropout=0.0,
                                          batch_first=True)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_padding: torch.Tensor,
                tgt_padding: torch.Tensor) -> torch.Tensor:
        s = self.src_embed(src) + self.pos(torch.arange(src.shape[1], device=src.device))
        t = self.tgt_embed(tgt) + self.pos(torch.arange(tgt.shape[1], device=tgt.device))
        # a boolean causal mask (True: masked), of the same kind as the padding masks
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=tgt.device).triu(1)
        h = self.transformer(s, t, tgt_mask=causal, src_key_padding_mask=src_padding,
                             tgt_key_padding_mask=tgt_padding, memory_key_padding_mask=src_padding,
                             tgt_is_causal=True)
        return self.out(h)


@register("seq2seq_transformer", "nn.Transformer", "nn", ("padding-mask", "causal-mask", "bool-mask",
                                                          "cross-attention"))
def seq2seq_transformer() -> Built:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 64, (2, 12), generator=g)
    tgt = torch.randint(0, 64, (2, 10), generator=g)
    src_padding = torch.zeros(2, 12, dtype=torch.bool)
    src_padding[1, 9:] = True
    tgt_padding = torch.zeros(2, 10, dtype=torch.bool)
    tgt_padding[1, 8:] = True
    return Seq2SeqTransformer(), (src, tgt, src_padding, tgt_padding)


class Conv3dNet(nn.Module):
    def __init__(self, cin: int = 2, width: int = 8, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv3d(cin, width, 3, padding=1)
        self.bn1 = nn.BatchNorm3d(width)
        self.conv2 = nn.Conv3d(width, 2 * width, 3, padding=1, stride=(1, 2, 2))
        self.bn2 = nn.BatchNorm3d(2 * width)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool3d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool3d(F.relu(self.bn2(self.conv2(x))), kernel_size=(2, 2, 2), stride=(1, 2, 2))
        return self.fc(F.adaptive_avg_pool3d(x, 1).flatten(1))


@register("conv3d", "conv3d", "nn", ("conv3d", "max-pool3d", "batch-norm3d", "adaptive-avg-pool3d"))
def conv3d() -> Built:
    torch.manual_seed(0)
    return randomize_batch_norms(Conv3dNet()), (randn(1, 2, 8, 16, 16),)


class PointNetKNN(nn.Module):
    """Edge convolution over the k nearest neighbours, then sort-based top-point pooling."""

    def __init__(self, k: int = 4, width: int = 16, classes: int = 4, top: int = 8):
        super().__init__()
        self.k = k
        self.top = top
        self.edge = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, width))
        self.score = nn.Linear(width, 1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        b, n, c = points.shape
        dist = torch.cdist(points, points)                                   # (b, n, n)
        _, nbr = torch.topk(-dist, self.k + 1, dim=-1)                        # self + k nearest
        nbr = nbr[..., 1:]                                                    # (b, n, k)
        idx = nbr.reshape(b, n * self.k, 1).expand(b, n * self.k, c)
        neighbours = torch.gather(points, 1, idx).reshape(b, n, self.k, c)
        centre = points.unsqueeze(2).expand(b, n, self.k, c)
        edges = torch.cat([centre, neighbours - centre], dim=-1)              # (b, n, k, 2c)
        feats = self.edge(edges).amax(dim=2)                                  # (b, n, width)
        score = self.score(feats).squeeze(-1)                                 # (b, n)
        _, order = torch.sort(score, dim=-1, descending=True)
        top = torch.gather(feats, 1, order[:, :self.top, None].expand(b, self.top, feats.shape[-1]))
        pooled = torch.cat([feats.amax(dim=1), top.mean(dim=1)], dim=-1)
        return self.head(pooled)


@register("pointnet_knn", "pointnet", "nn", ("topk", "gather", "sort", "cdist"))
def pointnet_knn() -> Built:
    torch.manual_seed(0)
    return PointNetKNN(), (randn(2, 32, 3),)


class DilatedCNN(nn.Module):
    def __init__(self, cin: int = 3, width: int = 8, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv2d(cin, width, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.branches = nn.ModuleList([nn.Conv2d(width, width, 3, padding=d, dilation=d) for d in (1, 2, 4)])
        self.pool_proj = nn.Conv2d(width, width, 1)
        self.project = nn.Conv2d(4 * width, width, 1)
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.stem(x)))
        pooled = self.pool_proj(F.adaptive_avg_pool2d(h, 1)).expand(-1, -1, h.shape[2], h.shape[3])
        h = torch.cat([F.relu(b(h)) for b in self.branches] + [pooled], dim=1)
        h = self.head(F.relu(self.project(h)))
        return F.interpolate(h, size=x.shape[-2:], mode="bilinear", align_corners=False)


@register("dilated_cnn", "dilated-cnn", "conv", ("dilated-conv", "aspp", "bilinear-upsample", "batch-norm"))
def dilated_cnn() -> Built:
    torch.manual_seed(0)
    return randomize_batch_norms(DilatedCNN()), (randn(1, 3, 32, 32),)
