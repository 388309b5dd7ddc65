"""Adaptive patching of an image (a quadtree split), and uniform patching for comparison.

A segmentation transformer on adaptive patches sees few tokens where the image is plain and
many where it has detail.  :func:`adaptive_patches` starts from ``max_patch`` squares tiling
the image and splits a square into its four quadrants while its *detail measure* exceeds a
threshold and it is larger than ``min_patch``.  Every final patch, whatever its size, is
area-averaged down to ``min_patch x min_patch`` pixels and flattened into one token, so the
tokens of one image all have ``C * min_patch**2`` features.

The detail measure (``measure="gradient-variance"``) of a square is the variance, over the
square's pixels, of the image's gradient magnitude.  The gradient magnitude is computed
once for the whole image: ``sqrt(sum over channels of (d/dy)^2 + (d/dx)^2)`` with
``torch.gradient`` (central differences inside, one-sided ones at the border).  A constant
or linear ramp has a constant gradient magnitude, hence variance 0, and is never split;
edges and texture make the magnitude vary and are split down to ``min_patch``.  The
variance of any square is read in O(1) from integral images of the magnitude and its
square (in float64).

Positions are ``(y / H, x / W, side / H)`` per patch, with ``(y, x)`` its top-left pixel
and ``side`` its edge in pixels; :func:`patch_boxes` turns them back into pixels.  The order
is deterministic: the ``max_patch`` squares in raster order, each square's quadrants in the
order top-left, top-right, bottom-left, bottom-right (depth first).

This module is a data-preparation utility: it uses PyTorch only and imports nothing of
kiln's compiler.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

MEASURES = ("gradient-variance",)
"""The detail measures :func:`adaptive_patches` accepts."""


def _as_chw(image: torch.Tensor) -> torch.Tensor:
    if image.dim() == 4:
        if image.shape[0] != 1:
            raise ValueError(f"adaptive patching takes one image: got a batch of {image.shape[0]} "
                             f"(shape {tuple(image.shape)}); patch each image separately")
        image = image[0]
    if image.dim() != 3:
        raise ValueError(f"expected an image [C, H, W] or [1, C, H, W], got shape {tuple(image.shape)}")
    if not image.is_floating_point():
        image = image.float()
    return image


def detail_map(image: torch.Tensor) -> torch.Tensor:
    """The image's gradient magnitude ``[H, W]`` (float64), the quantity whose variance over
    a square is its detail measure."""
    image = _as_chw(image).double()
    if min(image.shape[-2:]) < 2:
        return torch.zeros(image.shape[-2:], dtype=torch.float64)
    gy, gx = torch.gradient(image, dim=(-2, -1))
    return (gy.square() + gx.square()).sum(0).sqrt()


def _integral(values: torch.Tensor) -> torch.Tensor:
    """Summed-area table with a zero first row and column: ``[H + 1, W + 1]``."""
    return F.pad(values.cumsum(0).cumsum(1), (1, 0, 1, 0))


def _box_sum(table: torch.Tensor, y: int, x: int, side: int) -> float:
    return float(table[y + side, x + side] - table[y, x + side] - table[y + side, x] + table[y, x])


def _check_sizes(height: int, width: int, min_patch: int, max_patch: int) -> None:
    if min_patch < 1 or max_patch < min_patch:
        raise ValueError(f"need 1 <= min_patch <= max_patch, got min_patch={min_patch}, max_patch={max_patch}")
    ratio = max_patch // min_patch
    if max_patch % min_patch or ratio & (ratio - 1):
        raise ValueError(f"max_patch ({max_patch}) must be min_patch ({min_patch}) times a power of two: "
                         f"a quadtree halves the side at each split")
    if height % max_patch or width % max_patch:
        raise ValueError(f"the image size {height}x{width} is not divisible by max_patch={max_patch}: "
                         f"the max_patch squares must tile the image exactly (crop or pad it first)")


def _tokens(image: torch.Tensor, boxes: list[tuple[int, int, int]], min_patch: int) -> torch.Tensor:
    """Each box area-averaged to ``min_patch x min_patch`` and flattened (channel-major)."""
    channels, height, width = image.shape
    by_side: dict[int, torch.Tensor] = {}
    tokens = []
    for y, x, side in boxes:
        factor = side // min_patch
        if factor not in by_side:  # one area average per patch size, then plain slicing
            by_side[factor] = image if factor == 1 else F.avg_pool2d(image[None], factor)[0]
        pooled = by_side[factor]
        tokens.append(pooled[:, y // factor:y // factor + min_patch, x // factor:x // factor + min_patch])
    return torch.stack(tokens).reshape(1, len(boxes), channels * min_patch * min_patch)


def _positions(boxes: list[tuple[int, int, int]], height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    scale = torch.tensor([height, width, height], dtype=torch.float64)
    return (torch.tensor(boxes, dtype=torch.float64) / scale).to(dtype)[None]


def adaptive_patches(image: torch.Tensor, min_patch: int, max_patch: int, threshold: float, *,
                     measure: str = "gradient-variance") -> tuple[torch.Tensor, torch.Tensor]:
    """Quadtree patches of ``image``: ``(tokens [1, N, C*min_patch**2], positions [1, N, 3])``.

    Args:
        image: ``[C, H, W]`` or ``[1, C, H, W]``; ``H`` and ``W`` divisible by ``max_patch``.
        min_patch: the smallest patch side, and the side every patch is resampled to.
        max_patch: the side of the initial squares; ``min_patch`` times a power of two.
        threshold: a square larger than ``min_patch`` is split into four while its detail
            measure is above this.
        measure: ``"gradient-variance"``, the variance of the gradient magnitude
            (:func:`detail_map`) over the square's pixels.

    Positions are ``(y / H, x / W, side / H)``: the top-left corner and the side of each
    patch, normalized by the image size.  Tokens keep the image's floating dtype.
    """
    if measure not in MEASURES:
        raise ValueError(f"unknown detail measure {measure!r}; known: {', '.join(MEASURES)}")
    image = _as_chw(image)
    _, height, width = image.shape
    _check_sizes(height, width, min_patch, max_patch)
    magnitude = detail_map(image)
    first, second = _integral(magnitude), _integral(magnitude.square())

    def detail(y: int, x: int, side: int) -> float:
        area = side * side
        mean = _box_sum(first, y, x, side) / area
        return max(_box_sum(second, y, x, side) / area - mean * mean, 0.0)

    boxes: list[tuple[int, int, int]] = []
    for top in range(0, height, max_patch):
        for left in range(0, width, max_patch):
            stack = [(top, left, max_patch)]
            while stack:
                y, x, side = stack.pop()
                if side > min_patch and detail(y, x, side) > threshold:
                    half = side // 2  # pushed in reverse so that the top-left quadrant comes first
                    stack += [(y + half, x + half, half), (y + half, x, half), (y, x + half, half), (y, x, half)]
                else:
                    boxes.append((y, x, side))
    return _tokens(image, boxes, min_patch), _positions(boxes, height, width, image.dtype)


def uniform_patches(image: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every patch at side ``patch``, in raster order, with the layout of
    :func:`adaptive_patches` (``[1, N, C*patch**2]`` tokens, ``[1, N, 3]`` positions)."""
    image = _as_chw(image)
    _, height, width = image.shape
    _check_sizes(height, width, patch, patch)
    boxes = [(y, x, patch) for y in range(0, height, patch) for x in range(0, width, patch)]
    return _tokens(image, boxes, patch), _positions(boxes, height, width, image.dtype)


def patch_boxes(positions: torch.Tensor, image_size: tuple[int, int] | int) -> torch.Tensor:
    """Pixel boxes ``[N, 3]`` (int64 ``y, x, side``) of positions ``[1, N, 3]`` or ``[N, 3]``
    of an image of ``image_size`` (``(H, W)`` or one int for a square)."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    positions = positions.reshape(-1, 3).detach().double()
    scale = torch.tensor([height, width, height], dtype=torch.float64)
    return (positions * scale).round().long()
