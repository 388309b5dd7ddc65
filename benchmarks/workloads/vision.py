"""Vision seed workloads: a long-sequence ViT, a segmentation ViT on adaptive patches, and a
SAM-style promptable segmenter, at sizes that run on a small CPU (random weights).

* :class:`LongViT`: a ViT classifier for long token sequences (many small patches of a
  large image): stride-``patch`` patchify convolution, learned or fixed 2-D sin-cos
  position embeddings, pre-norm transformer blocks whose attention is an :class:`SDPA`
  module (``torch.nn.functional.scaled_dot_product_attention``), mean-pooled tokens, linear
  head.  :mod:`benchmarks.workloads.longseq` runs it at 16K tokens.
* :class:`AdaptivePatchSegViT`: segmentation at patch granularity on adaptive (quadtree,
  AMR) patches.  Its input is one image's patch tokens ``[1, N, C*p*p]`` (each patch
  area-resampled to ``p x p``) and their positions ``[1, N, 3]`` (``y, x, side``,
  normalized), as :func:`kiln.workloads.adaptive_patches` makes them; ``N`` differs from
  image to image.  It predicts one class per patch, ``[1, N, num_classes]``; a dense mask
  is rendered by painting each patch's class over its area (:func:`paint`).
* :class:`SamLike`: the Segment Anything structure: a ViT image encoder with a convolutional
  neck producing an image embedding ``[B, D, H/p, W/p]``; a prompt encoder (random Fourier
  features of point and box-corner coordinates plus learned label embeddings, and a learned
  "no mask" dense embedding); a light mask decoder (two-way attention layers between the
  prompt and output tokens and the image tokens, transposed-convolution upscaling, and per
  mask a hypernetwork MLP whose output is dotted with the upscaled features) that returns
  mask logits and an IoU estimate per mask.

``SPECS`` holds their benchmark specs (``default=False``: not part of a run that names no
models).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.models import ModelSpec, Shape, _seeded
from kiln.workloads import adaptive_patches, patch_boxes

# --------------------------------------------------------------------------- shared blocks


class SDPA(nn.Module):
    """Core attention ``softmax(q k^T / sqrt(d)) v`` on ``[batch, heads, seq, dim]`` tensors
    (``torch.nn.functional.scaled_dot_product_attention``), as a module of its own so a
    schedule can find it: ``kiln.schedule``'s ``.sequence_parallel()`` on it exchanges
    ``q``, ``k``, ``v`` to full sequence and a slice of the heads, and the result back."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v)


class Block(nn.Module):
    """Pre-norm transformer block: multi-head self-attention (:class:`SDPA`), then a GELU MLP."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attn = SDPA()
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.attn(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def sincos_2d(grid_h: int, grid_w: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embeddings ``[1, grid_h * grid_w, dim]`` (raster order):
    half the channels encode the row, half the column, each as sines and cosines of
    geometrically spaced frequencies."""
    if dim % 4:
        raise ValueError(f"sin-cos position embeddings need a width divisible by 4, got {dim}")
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    ys, xs = torch.meshgrid(torch.arange(grid_h, dtype=torch.float64), torch.arange(grid_w, dtype=torch.float64),
                            indexing="ij")
    parts = []
    for coord in (ys.reshape(-1), xs.reshape(-1)):
        angle = coord[:, None] * omega[None]
        parts += [angle.sin(), angle.cos()]
    return torch.cat(parts, dim=1).float()[None]


# --------------------------------------------------------------------------- LongViT


class LongViT(nn.Module):
    """ViT classifier for long token sequences.

    ``(image_size // patch) ** 2`` tokens (a 256x256 image with 8x8 patches: 1024 tokens);
    ``pos="learned"`` (a parameter) or ``"sincos"`` (a fixed buffer, :func:`sincos_2d`);
    ``depth`` pre-norm blocks; final layer norm; mean over tokens; linear head.
    """

    def __init__(self, image_size: int = 128, patch: int = 8, in_chans: int = 3, width: int = 64, depth: int = 2,
                 heads: int = 4, mlp_ratio: float = 4.0, num_classes: int = 10, pos: str = "learned"):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not divisible by the patch size {patch}")
        grid = image_size // patch
        self.patchify = nn.Conv2d(in_chans, width, patch, stride=patch)
        if pos == "learned":
            self.pos = nn.Parameter(torch.randn(1, grid * grid, width) * 0.02)
        elif pos == "sincos":
            self.register_buffer("pos", sincos_2d(grid, grid, width))
        else:
            raise ValueError(f"pos must be 'learned' or 'sincos', got {pos!r}")
        self.blocks = nn.Sequential(*(Block(width, heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patchify(images).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.norm(self.blocks(x)).mean(dim=1))


# --------------------------------------------------------------------------- adaptive patches


class AdaptivePatchSegViT(nn.Module):
    """Segmentation ViT on adaptive patches: ``(tokens [1, N, C*p*p], positions [1, N, 3])``
    to per-patch class logits ``[1, N, num_classes]``.

    A token is embedded by a linear layer, its position ``(y, x, side)`` by a two-layer GELU
    MLP of the three features (the patch size is a position feature, so patches of different
    sizes are told apart); the sum goes through ``depth`` pre-norm blocks, a layer norm and a
    linear classifier.  No operation mixes a fixed number of tokens, so one compiled graph
    with a symbolic ``N`` serves every image.  :func:`paint` renders the dense mask.
    """

    def __init__(self, patch: int = 8, in_chans: int = 3, width: int = 64, depth: int = 2, heads: int = 4,
                 mlp_ratio: float = 4.0, num_classes: int = 5, pos_hidden: int = 64):
        super().__init__()
        self.patch = patch
        self.embed = nn.Linear(in_chans * patch * patch, width)
        self.pos_mlp = nn.Sequential(nn.Linear(3, pos_hidden), nn.GELU(), nn.Linear(pos_hidden, width))
        self.blocks = nn.Sequential(*(Block(width, heads, mlp_ratio) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos_mlp(positions)
        return self.head(self.norm(self.blocks(x)))


def paint(logits: torch.Tensor, positions: torch.Tensor, image_size: tuple[int, int] | int) -> torch.Tensor:
    """Dense mask ``[H, W]`` (int64 class ids) from per-patch logits ``[1, N, K]``: each patch's
    arg-max class painted over its area (positions as :func:`kiln.workloads.adaptive_patches`
    makes them).  Plain PyTorch; pixels no patch covers are ``-1``."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    classes = logits.detach().reshape(-1, logits.shape[-1]).argmax(-1)
    mask = torch.full((height, width), -1, dtype=torch.long)
    for (y, x, side), label in zip(patch_boxes(positions, (height, width)).tolist(), classes.tolist()):
        mask[y:y + side, x:x + side] = label
    return mask


# --------------------------------------------------------------------------- SAM-style


class LayerNorm2d(nn.Module):
    """Layer norm over the channels of ``[B, C, H, W]``, per pixel."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).square().mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class MLP(nn.Module):
    """``layers`` linear layers with ReLU between them."""

    def __init__(self, dim_in: int, hidden: int, dim_out: int, layers: int):
        super().__init__()
        dims = [dim_in] + [hidden] * (layers - 1) + [dim_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                x = F.relu(x)
        return x


class ImageEncoder(nn.Module):
    """ViT encoder with a neck: ``[B, C, H, W]`` to ``[B, out_dim, H/p, W/p]``.  Blocks use
    global attention (the paper's windowed attention is left out at this size); the neck is
    a 1x1 convolution, a channel layer norm, a 3x3 convolution and another channel norm."""

    def __init__(self, image_size: int, patch: int, in_chans: int, width: int, depth: int, heads: int,
                 out_dim: int):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not divisible by the patch size {patch}")
        self.grid = image_size // patch
        self.patchify = nn.Conv2d(in_chans, width, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, self.grid * self.grid, width) * 0.02)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        self.neck = nn.Sequential(nn.Conv2d(width, out_dim, 1, bias=False), LayerNorm2d(out_dim),
                                  nn.Conv2d(out_dim, out_dim, 3, padding=1, bias=False), LayerNorm2d(out_dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.patchify(images).flatten(2).transpose(1, 2) + self.pos)
        b, n, d = x.shape
        return self.neck(x.transpose(1, 2).reshape(b, d, self.grid, self.grid))


class PromptEncoder(nn.Module):
    """Sparse prompt tokens from points (and boxes), and the dense embedding.

    A coordinate ``(x, y)`` in pixels is scaled to ``[0, 1]``, mapped to ``[-1, 1]`` and
    encoded by random Fourier features ``[sin(2 pi c G), cos(2 pi c G)]`` with a fixed
    Gaussian matrix ``G`` ``[2, D/2]``.  A point's token adds the learned embedding of its
    label (0 background, 1 foreground); a box gives two tokens, its corners, each with a
    learned corner embedding.  With no mask prompt, the dense embedding is a learned
    "no mask" vector at every image-embedding position.  The dense positional encoding of
    the image embedding's grid uses the same Fourier features at the cell centres.
    """

    def __init__(self, dim: int, image_size: int, grid: int, scale: float = 1.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"the prompt width must be even, got {dim}")
        self.image_size = image_size
        self.grid = grid
        self.register_buffer("gaussian", scale * torch.randn(2, dim // 2))
        self.point_labels = nn.Embedding(2, dim)  # background, foreground
        self.box_corners = nn.Embedding(2, dim)  # top-left, bottom-right
        self.no_mask = nn.Parameter(torch.randn(dim) * 0.02)

    def fourier(self, coords: torch.Tensor) -> torch.Tensor:
        """``[..., 2]`` coordinates in ``[0, 1]`` to ``[..., D]`` features."""
        projected = 2 * math.pi * ((2 * coords - 1) @ self.gaussian)
        return torch.cat([projected.sin(), projected.cos()], dim=-1)

    def dense_pe(self) -> torch.Tensor:
        """``[1, D, grid, grid]``: the encoding of each grid cell's centre."""
        centres = (torch.arange(self.grid, dtype=self.gaussian.dtype) + 0.5) / self.grid
        ys, xs = torch.meshgrid(centres, centres, indexing="ij")
        return self.fourier(torch.stack([xs, ys], dim=-1)).permute(2, 0, 1)[None]

    def forward(self, points: torch.Tensor, labels: torch.Tensor, boxes: torch.Tensor | None = None) -> torch.Tensor:
        """``points [B, P, 2]`` (x, y pixels), ``labels [B, P]`` int64 in {0, 1}, ``boxes [B, 4]``
        (x0, y0, x1, y1 pixels) or ``None``: sparse tokens ``[B, P (+2), D]``."""
        tokens = self.fourier((points + 0.5) / self.image_size) + self.point_labels(labels)
        if boxes is not None:
            corners = (boxes.reshape(-1, 2, 2) + 0.5) / self.image_size
            tokens = torch.cat([tokens, self.fourier(corners) + self.box_corners.weight], dim=1)
        return tokens


class Attention(nn.Module):
    """Multi-head attention with separate q/k/v inputs and an internal width
    ``dim // downsample`` (the decoder's cross attention is narrower)."""

    def __init__(self, dim: int, heads: int, downsample: int = 1):
        super().__init__()
        inner = dim // downsample
        if inner % heads:
            raise ValueError(f"attention width {inner} is not divisible by {heads} heads")
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.out = nn.Linear(inner, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        return x.reshape(b, n, self.heads, c // self.heads).transpose(1, 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.q(q)), self._split(self.k(k)), self._split(self.v(v))
        out = F.scaled_dot_product_attention(q, k, v)
        b, h, n, c = out.shape
        return self.out(out.transpose(1, 2).reshape(b, n, h * c))


class TwoWayLayer(nn.Module):
    """Tokens self-attend, tokens attend to the image, a token MLP, the image attends to the
    tokens; positional encodings are added to queries and keys at every attention (the
    first layer's self-attention replaces the tokens instead of adding to them), each step
    followed by a layer norm."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, downsample: int, first: bool):
        super().__init__()
        self.first = first
        self.self_attn = Attention(dim, heads)
        self.cross_token_to_image = Attention(dim, heads, downsample)
        self.mlp = MLP(dim, mlp_dim, dim, 2)
        self.cross_image_to_token = Attention(dim, heads, downsample)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(4))

    def forward(self, tokens, image, token_pe, image_pe):
        if self.first:
            tokens = self.self_attn(tokens, tokens, tokens)
        else:
            q = tokens + token_pe
            tokens = tokens + self.self_attn(q, q, tokens)
        tokens = self.norms[0](tokens)
        tokens = self.norms[1](tokens + self.cross_token_to_image(tokens + token_pe, image + image_pe, image))
        tokens = self.norms[2](tokens + self.mlp(tokens))
        image = self.norms[3](image + self.cross_image_to_token(image + image_pe, tokens + token_pe, tokens))
        return tokens, image


class MaskDecoder(nn.Module):
    """The light mask decoder.

    Output tokens (one IoU token, ``num_masks`` mask tokens) are prepended to the prompt
    tokens; ``depth`` two-way layers and a final token-to-image attention update them.  The
    image tokens are upscaled 4x by two stride-2 transposed convolutions (channel norm and
    GELU between, GELU after) to ``D/8`` channels; each mask token goes through its own
    3-layer MLP to ``D/8`` dynamic weights, and a mask's logits are their dot product with
    the upscaled features at every pixel.  A 3-layer MLP of the IoU token predicts each
    mask's IoU.
    """

    def __init__(self, dim: int, heads: int = 4, depth: int = 2, mlp_dim: int = 128, num_masks: int = 4,
                 downsample: int = 2):
        super().__init__()
        if dim % 8:
            raise ValueError(f"the decoder width must be divisible by 8, got {dim}")
        self.num_masks = num_masks
        self.iou_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.mask_tokens = nn.Parameter(torch.randn(1, num_masks, dim) * 0.02)
        self.layers = nn.ModuleList(TwoWayLayer(dim, heads, mlp_dim, downsample, first=i == 0) for i in range(depth))
        self.final_attn = Attention(dim, heads, downsample)
        self.final_norm = nn.LayerNorm(dim)
        self.up1 = nn.ConvTranspose2d(dim, dim // 4, 2, stride=2)
        self.up_norm = LayerNorm2d(dim // 4)
        self.up2 = nn.ConvTranspose2d(dim // 4, dim // 8, 2, stride=2)
        self.hypernets = nn.ModuleList(MLP(dim, dim, dim // 8, 3) for _ in range(num_masks))
        self.iou_head = MLP(dim, mlp_dim, num_masks, 3)

    def forward(self, embedding: torch.Tensor, image_pe: torch.Tensor, sparse: torch.Tensor,
                dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, d, h, w = embedding.shape
        output = torch.cat([self.iou_token, self.mask_tokens], dim=1).expand(b, -1, -1)
        tokens = torch.cat([output, sparse], dim=1)
        token_pe = tokens
        image = (embedding + dense).flatten(2).transpose(1, 2)
        pe = image_pe.flatten(2).transpose(1, 2)
        for layer in self.layers:
            tokens, image = layer(tokens, image, token_pe, pe)
        tokens = self.final_norm(tokens + self.final_attn(tokens + token_pe, image + pe, image))
        upscaled = self.up1(image.transpose(1, 2).reshape(b, d, h, w))
        upscaled = F.gelu(self.up2(F.gelu(self.up_norm(upscaled))))
        weights = torch.stack([net(tokens[:, 1 + i]) for i, net in enumerate(self.hypernets)], dim=1)
        c, uh, uw = upscaled.shape[1:]
        masks = (weights @ upscaled.reshape(b, c, uh * uw)).reshape(b, self.num_masks, uh, uw)
        return masks, self.iou_head(tokens[:, 0])


class SamLike(nn.Module):
    """A Segment-Anything-style promptable segmenter.

    ``forward(images [B, C, S, S], points [B, P, 2], labels [B, P], boxes [B, 4] | None)``
    returns ``(mask logits [B, M, 4S/p, 4S/p], iou [B, M])`` with ``M = num_masks`` (the
    paper's three multimask outputs and the single-mask output).  The image encoder runs
    once per image (:meth:`encode_image`); :meth:`decode` takes its embedding and any number
    of prompt sets, so interactive use and decoder fine-tuning
    (:meth:`decoder_parameters`) need not re-run the encoder.
    """

    def __init__(self, image_size: int = 64, patch: int = 8, in_chans: int = 3, encoder_width: int = 64,
                 encoder_depth: int = 2, encoder_heads: int = 4, dim: int = 32, decoder_depth: int = 2,
                 decoder_heads: int = 4, decoder_mlp: int = 64, num_masks: int = 4):
        super().__init__()
        self.image_encoder = ImageEncoder(image_size, patch, in_chans, encoder_width, encoder_depth, encoder_heads,
                                          dim)
        self.prompt_encoder = PromptEncoder(dim, image_size, image_size // patch)
        self.mask_decoder = MaskDecoder(dim, decoder_heads, decoder_depth, decoder_mlp, num_masks)

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """The image embedding ``[B, D, S/p, S/p]``."""
        return self.image_encoder(images)

    def decode(self, embedding: torch.Tensor, points: torch.Tensor, labels: torch.Tensor,
               boxes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mask logits and IoU estimates of prompts on an image embedding."""
        sparse = self.prompt_encoder(points, labels, boxes)
        dense = self.prompt_encoder.no_mask[None, :, None, None]
        return self.mask_decoder(embedding, self.prompt_encoder.dense_pe(), sparse, dense)

    def forward(self, images: torch.Tensor, points: torch.Tensor, labels: torch.Tensor,
                boxes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode(self.encode_image(images), points, labels, boxes)

    def decoder_parameters(self, prompt_encoder: bool = True) -> list[nn.Parameter]:
        """The parameters of the light part, to fine-tune with the image encoder frozen: the
        mask decoder's, and the prompt encoder's unless ``prompt_encoder=False``."""
        params = list(self.mask_decoder.parameters())
        return params + list(self.prompt_encoder.parameters()) if prompt_encoder else params

    def freeze_encoder(self) -> SamLike:
        """Stop gradients to the image encoder's parameters; returns ``self``."""
        for p in self.image_encoder.parameters():
            p.requires_grad_(False)
        return self


# --------------------------------------------------------------------------- benchmark specs


def synthetic_image(size: int, seed: int, detail: float = 0.5, channels: int = 3) -> torch.Tensor:
    """A ``[channels, size, size]`` image: a smooth ramp, with random texture in a centred
    square covering ``detail`` of the side (0: no texture)."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 1, size)
    image = (ramp[None, :, None] + ramp[None, None, :]).expand(channels, size, size) * 0.5
    image = image.clone()
    side = int(size * detail)
    if side:
        start = (size - side) // 2
        image[:, start:start + side, start:start + side] += torch.rand(channels, side, side, generator=g)
    return image


_LONGVIT_IMAGE, _AMR_PATCH, _SAM_IMAGE = 256, 8, 128


def _longvit_inputs(shape: Shape) -> tuple[torch.Tensor, ...]:
    return (torch.randn(shape.batch, 3, _LONGVIT_IMAGE, _LONGVIT_IMAGE),)


def _amr_inputs(shape: Shape) -> tuple[torch.Tensor, ...]:
    """The adaptive patches of a synthetic 512x512 image, detailed over ``shape.seq`` percent
    of its side (batch 1 always: each image has its own token count)."""
    image = synthetic_image(512, seed=shape.seq or 0, detail=(shape.seq or 0) / 100)
    return adaptive_patches(image, _AMR_PATCH, 8 * _AMR_PATCH, threshold=1e-3)


def _sam_inputs(shape: Shape) -> tuple[torch.Tensor, ...]:
    b = shape.batch
    points = torch.rand(b, 2, 2) * _SAM_IMAGE
    labels = torch.tensor([[1, 0]]).expand(b, 2).contiguous()
    corner = torch.rand(b, 2) * _SAM_IMAGE / 2
    boxes = torch.cat([corner, corner + _SAM_IMAGE / 2], dim=1)
    return torch.randn(b, 3, _SAM_IMAGE, _SAM_IMAGE), points, labels, boxes


SPECS = (
    ModelSpec("seed-longvit", f"LongViT, {_LONGVIT_IMAGE}x{_LONGVIT_IMAGE} images, 8x8 patches (1024 tokens), "
              "64 wide, 2 blocks, 4 heads", _seeded(lambda: LongViT(_LONGVIT_IMAGE, 8)), _longvit_inputs,
              (Shape(1, quick=True), Shape(4)), default=False),
    ModelSpec("seed-amr-segvit", "segmentation ViT on adaptive patches of a 512x512 image (8..64 px quadtree), "
              "64 wide, 2 blocks; seq = textured percent of the side",
              _seeded(lambda: AdaptivePatchSegViT(_AMR_PATCH)), _amr_inputs,
              (Shape(1, 25, quick=True), Shape(1, 75)), default=False),
    ModelSpec("seed-sam", f"SAM-style: ViT encoder on {_SAM_IMAGE}x{_SAM_IMAGE} (16x16 embedding), 2 points + "
              "a box, 2 two-way layers, 4 masks + IoU", _seeded(lambda: SamLike(_SAM_IMAGE, 8)), _sam_inputs,
              (Shape(1, quick=True), Shape(4)), default=False),
)
