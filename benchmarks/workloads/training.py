"""Training steps of the seed workloads: each seed model with the loss its paper trains with.

``python -m benchmarks --train --models seeds`` runs all six (``seed-<name>`` runs one, the
same names as the inference workloads); :func:`register` adds them to
:data:`benchmarks.train_bench.TRAIN_WORKLOADS` (``default=False``: a run that names no
models leaves them out).  The models are built by the inference specs (``seed_specs()``,
same seeded weights) and trained in training mode:

=======================  ==================================================================
workload                 what one step trains
=======================  ==================================================================
``seed-longvit``         classification, cross-entropy over 10 classes, batch 2 of 1024 tokens
``seed-amr-segvit``      per-patch segmentation, cross-entropy of every adaptive patch (484)
``seed-sam``             decoder fine-tuning (``freeze_encoder()``: the image encoder runs,
                         frozen): SAM's focal + dice mask loss (20:1) and the MSE of the
                         predicted IoU against the IoU of the thresholded masks
``seed-lidar-edgeconv``  upsampling, sliced Wasserstein distance to a dense target cloud
                         (64 fixed projections, an argument of the step)
``seed-softpool``        completion, symmetric Chamfer distance to a 2048-point target
``seed-nodule3d``        multi-task: cross-entropy of the malignancy head plus the five
                         attribute heads (batch norm in training mode), batch 4
=======================  ==================================================================

Targets are synthetic (seeded): the point is the step's cost, not what it learns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from benchmarks.models import Shape
from benchmarks.train_bench import TRAIN_WORKLOADS, TrainWorkload
from benchmarks.workloads import seed_specs
from benchmarks.workloads.points import NODULE_ATTRIBUTES, random_projections, swd_loss

__all__ = ["SEED_TRAIN_NAMES", "chamfer_distance", "classification_loss", "nodule_loss", "register",
           "sam_loss", "seed_train_workloads", "segmentation_loss"]


# --------------------------------------------------------------------------- losses


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, K]`` against class ids ``labels [B]``."""
    return F.cross_entropy(logits, labels)


def segmentation_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every patch: ``logits [B, N, K]``, ``labels [B, N]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def sam_loss(outputs: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """SAM's training loss for ``(mask logits [B, M, H, W], iou [B, M])`` against binary
    masks ``target [B, M, H, W]``: ``20 * focal + dice`` on the masks (focal with
    ``alpha=0.25, gamma=2``), plus the mean squared error of the IoU prediction against the
    IoU of the predicted masks thresholded at 0 (not differentiated)."""
    masks, iou = outputs
    p = torch.sigmoid(masks)
    ce = F.binary_cross_entropy_with_logits(masks, target, reduction="none")
    p_t = p * target + (1 - p) * (1 - target)
    alpha_t = 0.25 * target + 0.75 * (1 - target)
    focal = (alpha_t * (1 - p_t) ** 2 * ce).mean()
    inter = (p * target).sum(dim=(-2, -1))
    dice = (1 - (2 * inter + 1) / (p.sum(dim=(-2, -1)) + target.sum(dim=(-2, -1)) + 1)).mean()
    hard = (masks > 0).to(masks.dtype)
    hard_inter = (hard * target).sum(dim=(-2, -1))
    union = hard.sum(dim=(-2, -1)) + target.sum(dim=(-2, -1)) - hard_inter
    actual = (hard_inter / union.clamp_min(1.0)).detach()
    return 20 * focal + dice + F.mse_loss(iou, actual)


def chamfer_distance(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Symmetric Chamfer distance between point sets ``x [B, N, 3]`` and ``y [B, M, 3]``:
    the mean squared distance from each point to its nearest point of the other set, both
    ways (SoftPool++'s completion loss)."""
    sx, sy = (x * x).sum(-1), (y * y).sum(-1)
    dist = sx.unsqueeze(2) - 2.0 * torch.bmm(x, y.transpose(1, 2)) + sy.unsqueeze(1)  # [B, N, M]
    return dist.amin(dim=2).mean() + dist.amin(dim=1).mean()


def nodule_loss(outputs: tuple[torch.Tensor, ...], malignancy: torch.Tensor, attributes: torch.Tensor) -> torch.Tensor:
    """Multi-task loss of :class:`~benchmarks.workloads.points.NoduleNet3D`: cross-entropy of
    the malignancy logits plus that of each attribute head (``attributes [B, 5]``)."""
    loss = F.cross_entropy(outputs[0], malignancy)
    for index, logits in enumerate(outputs[1:]):
        loss = loss + F.cross_entropy(logits, attributes[:, index])
    return loss


# --------------------------------------------------------------------------- workloads

SEED_TRAIN_NAMES = ("seed-longvit", "seed-amr-segvit", "seed-sam", "seed-lidar-edgeconv", "seed-softpool",
                    "seed-nodule3d")
"""The training workloads, in table order (the names of the inference workloads)."""

_LONGVIT_BATCH, _AMR_TEXTURE, _SAM_BATCH, _NODULE_BATCH = 2, 25, 2, 4
_SWD_PROJECTIONS, _LONGVIT_CLASSES, _AMR_CLASSES, _LEVELS = 64, 10, 5, 5


def _inputs(name: str, shape: Shape) -> Callable[[], tuple[torch.Tensor, ...]]:
    make = seed_specs()[name].make_inputs
    return lambda: make(shape)


def _longvit_args() -> tuple[torch.Tensor, ...]:
    (images,) = _inputs("seed-longvit", Shape(_LONGVIT_BATCH))()
    return images, torch.randint(0, _LONGVIT_CLASSES, (_LONGVIT_BATCH,))


def _amr_args() -> tuple[torch.Tensor, ...]:
    tokens, positions = _inputs("seed-amr-segvit", Shape(1, _AMR_TEXTURE))()
    return tokens, positions, torch.randint(0, _AMR_CLASSES, tuple(tokens.shape[:2]))


def _sam_args() -> tuple[torch.Tensor, ...]:
    """The inference inputs (images, two points, labels, a box) and, per image, the box's
    inside as the target of every mask (at the mask resolution)."""
    images, points, labels, boxes = _inputs("seed-sam", Shape(_SAM_BATCH))()
    size = images.shape[-1]
    with torch.no_grad():
        masks, _ = seed_specs()["seed-sam"].build()(images, points, labels, boxes)
    m, h = masks.shape[1], masks.shape[-1]
    centre = (torch.arange(h, dtype=torch.float32) + 0.5) * (size / h)
    x0, y0, x1, y1 = (boxes[:, i].reshape(-1, 1, 1) for i in range(4))
    inside = ((centre.reshape(1, 1, h) >= x0) & (centre.reshape(1, 1, h) < x1)
              & (centre.reshape(1, h, 1) >= y0) & (centre.reshape(1, h, 1) < y1))
    target = inside.unsqueeze(1).expand(-1, m, -1, -1).to(torch.float32).contiguous()
    return images, points, labels, boxes, target


def _edgeconv_args() -> tuple[torch.Tensor, ...]:
    (points,) = _inputs("seed-lidar-edgeconv", Shape(1))()
    model = seed_specs()["seed-lidar-edgeconv"].build()
    dense = torch.randn(points.shape[0], points.shape[1] * model.ratio, 3)
    return points, dense, random_projections(_SWD_PROJECTIONS, 3, 0)


def _softpool_args() -> tuple[torch.Tensor, ...]:
    (points,) = _inputs("seed-softpool", Shape(1))()
    model = seed_specs()["seed-softpool"].build()
    return points, torch.randn(points.shape[0], model.k * model.up, 3)


def _nodule_args() -> tuple[torch.Tensor, ...]:
    (volumes,) = _inputs("seed-nodule3d", Shape(_NODULE_BATCH))()
    return (volumes, torch.randint(0, _LEVELS, (_NODULE_BATCH,)),
            torch.randint(0, _LEVELS, (_NODULE_BATCH, len(NODULE_ATTRIBUTES))))


def _build(name: str, frozen_encoder: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = seed_specs()[name].build()
        return model.freeze_encoder() if frozen_encoder else model

    build.__name__ = f"build_{name.replace('-', '_')}"
    return build


def seed_train_workloads() -> tuple[TrainWorkload, ...]:
    """The six seed training workloads (``default=False``)."""
    return (
        TrainWorkload("seed-longvit", "LongViT classifier, 256x256 images (1024 tokens), 10 classes",
                      "cross-entropy", _LONGVIT_BATCH, 1024, _build("seed-longvit"), classification_loss,
                      _longvit_args, default=False),
        TrainWorkload("seed-amr-segvit", "segmentation ViT on the adaptive patches of a 512x512 image (484), "
                      "5 classes per patch", "per-patch cross-entropy", 1, 484, _build("seed-amr-segvit"),
                      segmentation_loss, _amr_args, num_inputs=2, default=False),
        TrainWorkload("seed-sam", "SAM-style decoder fine-tuning (image encoder frozen), 128x128 images, "
                      "2 points + a box, 4 masks", "focal + dice + IoU MSE", _SAM_BATCH, None,
                      _build("seed-sam", frozen_encoder=True), sam_loss, _sam_args, num_inputs=4, default=False),
        TrainWorkload("seed-lidar-edgeconv", "EdgeConv upsampler, 1024 -> 4096 points (kNN by top-16)",
                      "sliced Wasserstein (64 projections)", 1, 1024, _build("seed-lidar-edgeconv"), swd_loss,
                      _edgeconv_args, default=False),
        TrainWorkload("seed-softpool", "SoftPool++ completion, 2048 -> 2048 points (top-256 of 8 regions)",
                      "Chamfer distance", 1, 2048, _build("seed-softpool"), chamfer_distance, _softpool_args,
                      default=False),
        TrainWorkload("seed-nodule3d", "3-D CNN nodule diagnosis, 1x32^3 volumes, malignancy + 5 attribute heads",
                      "6-task cross-entropy", _NODULE_BATCH, None, _build("seed-nodule3d"), nodule_loss,
                      _nodule_args, default=False),
    )


def register() -> dict[str, TrainWorkload]:
    """Add the seed training workloads to ``TRAIN_WORKLOADS`` (once); returns them by name."""
    workloads = {w.name: w for w in seed_train_workloads()}
    for name, workload in workloads.items():
        TRAIN_WORKLOADS.setdefault(name, workload)
    return {name: TRAIN_WORKLOADS[name] for name in workloads}
