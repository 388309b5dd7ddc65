"""Data preparation for kiln's workload models (plain PyTorch; nothing here compiles).

* :func:`adaptive_patches`: a quadtree split of an image into square patches whose size
  follows the image's local detail (adaptive mesh refinement of the patch grid), each
  resampled to one token size, with its normalized position;
* :func:`uniform_patches`: every patch at one size, the same token and position layout;
* :func:`patch_boxes`: the pixel boxes ``(y, x, side)`` of normalized positions.
"""

from .adaptive import MEASURES, adaptive_patches, detail_map, patch_boxes, uniform_patches

__all__ = ["MEASURES", "adaptive_patches", "detail_map", "patch_boxes", "uniform_patches"]
