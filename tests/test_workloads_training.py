"""The seed workloads' training steps (benchmarks/workloads/training.py): selection by name,
the losses, and one ``kiln.compile_train`` step per workload against eager's first-step loss
(what ``python -m benchmarks --train`` reports as ``max rel err``).

A step compiles in 3-16 s at benchmark size: the EdgeConv upsampler (kNN by top-k, sliced
Wasserstein loss), the AMR segmentation ViT and the 3-D CNN run in CI, the others are
``-m slow``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import kiln
from benchmarks.train_bench import LEARNING_RATE, TRAIN_WORKLOADS, select_train_workloads
from benchmarks.workloads import training
from benchmarks.workloads.training import SEED_TRAIN_NAMES, chamfer_distance, sam_loss

REL_TOL = 1e-4


def test_seeds_select_every_seed_training_step_and_only_by_name():
    chosen = select_train_workloads(["seeds"])
    assert [w.name for w in chosen] == list(SEED_TRAIN_NAMES)
    assert not any(w.default for w in chosen)
    assert [w.name for w in select_train_workloads(["seed-sam", "mlp"])] == ["mlp", "seed-sam"]
    assert not any(name.startswith("seed-") for name in (w.name for w in select_train_workloads()))
    assert set(SEED_TRAIN_NAMES) <= set(TRAIN_WORKLOADS)
    with pytest.raises(ValueError, match="seed-nope"):
        select_train_workloads(["seed-nope"])


def test_chamfer_distance_is_the_nearest_neighbour_mean_both_ways():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 7, 3, generator=g, dtype=torch.float64), torch.randn(2, 5, 3, generator=g,
                                                                                 dtype=torch.float64)
    d = torch.cdist(x, y) ** 2
    want = d.min(dim=2).values.mean() + d.min(dim=1).values.mean()
    torch.testing.assert_close(chamfer_distance(x, y), want)
    assert chamfer_distance(x, x).abs().item() < 1e-12


def test_sam_loss_is_small_for_confident_right_masks():
    target = torch.zeros(1, 2, 8, 8)
    target[..., 2:6, 2:6] = 1.0
    right = (target * 2 - 1) * 20
    iou = torch.ones(1, 2)
    assert sam_loss((right, iou), target).item() < 1e-3
    assert sam_loss((-right, iou), target).item() > 1.0


def _first_step_losses(name: str) -> tuple[float, float]:
    workload = training.register()[name]
    task, args = workload.task(), workload.args()
    with torch.no_grad():
        want = copy.deepcopy(task)(*args).item()
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=LEARNING_RATE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = kiln.compile_train(task.model, task.loss_fn, optimizer, args, backend="cpu", cache=False)
    return step(*args).item(), want


FAST = ("seed-lidar-edgeconv", "seed-amr-segvit", "seed-nodule3d")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in SEED_TRAIN_NAMES])
def test_one_kiln_step_matches_eager_first_step_loss(name, one_torch_thread):
    got, want = _first_step_losses(name)
    assert abs(got - want) <= REL_TOL * abs(want), (got, want)


@pytest.mark.slow
def test_sam_step_trains_the_decoder_only(one_torch_thread):
    workload = training.register()["seed-sam"]
    task, args = workload.task(), workload.args()
    encoder = [p.detach().clone() for p in task.model.image_encoder.parameters()]
    decoder = [p.detach().clone() for p in task.model.mask_decoder.parameters()]
    optimizer = torch.optim.AdamW(task.model.parameters(), lr=LEARNING_RATE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kiln.compile_train(task.model, task.loss_fn, optimizer, args, backend="cpu", cache=False)(*args)
    assert all(torch.equal(a, p) for a, p in zip(encoder, task.model.image_encoder.parameters()))
    assert any(not torch.equal(a, p) for a, p in zip(decoder, task.model.mask_decoder.parameters()))
