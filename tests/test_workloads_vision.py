"""The vision seed workloads (``benchmarks/workloads/vision.py``) through kiln, and the
adaptive patching they feed on (``kiln.workloads``).

* LongViT, the adaptive-patch segmentation ViT and the SAM-style model compile with
  ``strict=True`` on the cpu backend; outputs (SAM: mask logits and IoU) match eager, and so
  does the gradient of every parameter through the compiled module;
* ``adaptive_patches``: the patches tile the image exactly once, a constant image keeps the
  largest patches, a detailed region gets the smallest ones, and an image with one detailed
  quadrant needs fewer tokens than uniform patching at the smallest size;
* the segmentation ViT compiled once with a symbolic token count runs three images of three
  token counts with one build, matching eager.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim
from torch.nn import functional as F

import kiln
from benchmarks.workloads.vision import SPECS, AdaptivePatchSegViT, LongViT, SamLike, paint, synthetic_image
from kiln.workloads import adaptive_patches, patch_boxes, uniform_patches

REL_TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _check_forward_and_gradients(model: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
    """Compiled forward and every parameter gradient of ``sum(out * fixed_random)`` against eager.

    A gradient that is zero analytically (an attention key bias: softmax ignores a per-row
    constant) is float32 rounding noise on both sides; its error is measured against
    ``1e-3`` of the largest gradient instead of against itself."""
    fast = kiln.compile(model, args, backend="cpu", cache=False, strict=True)
    got, want = _outputs(fast(*args)), _outputs(model(*args))
    assert len(got) == len(want)
    for index, (out, ref) in enumerate(zip(got, want)):
        assert out.shape == ref.shape
        assert _rel(out, ref) <= REL_TOL, f"output {index}: max relative error {_rel(out, ref):.2e}"
    g = torch.Generator().manual_seed(1234)
    weights = [torch.randn(ref.shape, generator=g) for ref in want]
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), params)
    refs = torch.autograd.grad(sum((r * w).sum() for r, w in zip(want, weights)), params)
    floor = 1e-3 * max(float(r.abs().max()) for r in refs)
    for name, grad, ref in zip(names, grads, refs):
        err = _rel(grad, ref, floor)
        assert err <= REL_TOL, f"gradient of {name}: max relative error {err:.2e}"


# --------------------------------------------------------------------------- models through kiln


def test_longvit_forward_and_gradients_match_eager():
    torch.manual_seed(0)
    model = LongViT(image_size=16, patch=4, width=32, depth=1, heads=2, num_classes=5)
    _check_forward_and_gradients(model, (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),))


def test_adaptive_patch_segvit_forward_and_gradients_match_eager():
    torch.manual_seed(0)
    model = AdaptivePatchSegViT(patch=2, width=32, depth=1, heads=2, num_classes=3, pos_hidden=16)
    tokens, positions = adaptive_patches(synthetic_image(16, seed=1, detail=0.5), 2, 8, 1e-3)
    assert 2 < tokens.shape[1] < 64
    _check_forward_and_gradients(model, (tokens, positions))


def _sam(image: int = 16) -> SamLike:
    torch.manual_seed(0)
    return SamLike(image_size=image, patch=4, encoder_width=32, encoder_depth=1, encoder_heads=2, dim=16,
                   decoder_depth=2, decoder_heads=2, decoder_mlp=32, num_masks=2)


def _sam_inputs():
    g = torch.Generator().manual_seed(2)
    images = torch.randn(2, 3, 16, 16, generator=g)
    points = torch.rand(2, 2, 2, generator=g) * 16
    labels = torch.tensor([[1, 0], [0, 1]])
    boxes = torch.tensor([[1.0, 2.0, 9.0, 12.0], [3.0, 3.0, 14.0, 10.0]])
    return images, points, labels, boxes


def test_sam_like_masks_and_iou_match_eager():
    model = _sam().eval()
    fast = kiln.compile(model, _sam_inputs(), backend="cpu", cache=False, strict=True)
    with torch.no_grad():
        got, want = fast(*_sam_inputs()), model(*_sam_inputs())
    for index, (out, ref) in enumerate(zip(got, want)):
        assert out.shape == ref.shape and _rel(out, ref) <= REL_TOL, f"output {index}"


@pytest.mark.slow  # every parameter, the image encoder's too: about 20 s
def test_sam_like_masks_iou_and_gradients_match_eager():
    model = _sam()
    masks, iou = model(*_sam_inputs())
    assert masks.shape == (2, 2, 16, 16) and iou.shape == (2, 2)
    _check_forward_and_gradients(model, _sam_inputs())


@pytest.mark.slow  # about 17 s (some 400 kernels to compile)
def test_sam_like_decoder_fine_tuning_gradients_match_eager():
    """The paper's fine-tuning: the image encoder frozen, the prompt encoder and the light
    mask decoder trained (only their gradients are derived)."""
    model = _sam().freeze_encoder()
    masks, iou = model(*_sam_inputs())
    assert masks.shape == (2, 2, 16, 16) and iou.shape == (2, 2)
    _check_forward_and_gradients(model, _sam_inputs())


def test_sam_like_decoder_parameters_leave_out_the_encoder():
    model = _sam()
    encoder = {id(p) for p in model.image_encoder.parameters()}
    light = model.decoder_parameters()
    assert light and not encoder & {id(p) for p in light}
    assert {id(p) for p in light} | encoder == {id(p) for p in model.parameters()}
    assert len(model.decoder_parameters(prompt_encoder=False)) == len(list(model.mask_decoder.parameters()))
    assert not any(p.requires_grad for p in model.freeze_encoder().image_encoder.parameters())


def test_specs_are_seeded_and_outside_the_default_run():
    assert [s.name for s in SPECS] == ["seed-longvit", "seed-amr-segvit", "seed-sam"]
    assert not any(s.default or s.in_quick for s in SPECS)
    a, b = SPECS[1].build(), SPECS[1].build()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not a.training


# --------------------------------------------------------------------------- adaptive patching


def _coverage(positions: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How many patches cover each pixel, and the side of the (last) patch covering it."""
    count = torch.zeros(size, size, dtype=torch.long)
    side_map = torch.zeros(size, size, dtype=torch.long)
    for y, x, side in patch_boxes(positions, size).tolist():
        count[y:y + side, x:x + side] += 1
        side_map[y:y + side, x:x + side] = side
    return count, side_map


def _quadrant_image(size: int = 64) -> torch.Tensor:
    image = torch.full((3, size, size), 0.25)
    half = size // 2
    image[:, :half, :half] = torch.rand(3, half, half, generator=torch.Generator().manual_seed(5))
    return image


def test_adaptive_patches_tile_the_image_exactly_once():
    image = _quadrant_image()
    tokens, positions = adaptive_patches(image, 4, 16, threshold=1e-3)
    assert tokens.shape == (1, positions.shape[1], 3 * 16) and positions.shape[2] == 3
    boxes = patch_boxes(positions, 64)
    assert int((boxes[:, 2] ** 2).sum()) == 64 * 64
    count, _ = _coverage(positions, 64)
    assert bool((count == 1).all()), "a pixel is covered by no patch or by several"
    again = adaptive_patches(image[None], 4, 16, threshold=1e-3)
    assert torch.equal(again[0], tokens) and torch.equal(again[1], positions)  # deterministic, batch-1 input


def test_adaptive_patches_keep_a_constant_image_at_the_largest_size():
    tokens, positions = adaptive_patches(torch.full((3, 64, 32), 0.7), 4, 16, threshold=0.0)
    boxes = patch_boxes(positions, (64, 32))
    assert tokens.shape == (1, 8, 48) and bool((boxes[:, 2] == 16).all())
    assert torch.allclose(tokens, torch.full_like(tokens, 0.7))


def test_adaptive_patches_split_a_detailed_region_to_the_smallest_size():
    image = _quadrant_image()
    tokens, positions = adaptive_patches(image, 4, 16, threshold=1e-3)
    _, side_map = _coverage(positions, 64)
    assert bool((side_map[:32, :32] == 4).all()), "the textured quadrant is not at min_patch everywhere"
    assert bool((side_map[40:, 40:] == 16).all()), "the plain region far from the texture was split"
    # every token is its patch area-averaged to 4x4, channel-major
    for (y, x, side), token in zip(patch_boxes(positions, 64).tolist(), tokens[0]):
        want = F.adaptive_avg_pool2d(image[:, y:y + side, x:x + side], 4).reshape(-1)
        torch.testing.assert_close(token, want)
    n_adaptive = tokens.shape[1]
    n_uniform = uniform_patches(image, 4)[0].shape[1]
    assert n_adaptive < n_uniform, f"adaptive patching: {n_adaptive} tokens, uniform at 4 px: {n_uniform}"
    assert n_uniform == 256 and n_adaptive <= 128, f"adaptive {n_adaptive} tokens, uniform {n_uniform}"


def test_uniform_patches_are_the_patchify_layout():
    image = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(0))
    tokens, positions = uniform_patches(image, 4)
    want = F.unfold(image[None], 4, stride=4).transpose(1, 2)
    torch.testing.assert_close(tokens, want)
    assert torch.allclose(positions[0, 1], torch.tensor([0.0, 4 / 12, 4 / 8]))


def test_adaptive_patches_refuse_sizes_that_do_not_tile():
    with pytest.raises(ValueError, match="not divisible by max_patch=16"):
        adaptive_patches(torch.zeros(3, 40, 48), 4, 16, 0.1)
    with pytest.raises(ValueError, match="power of two"):
        adaptive_patches(torch.zeros(3, 48, 48), 4, 12, 0.1)
    with pytest.raises(ValueError, match="unknown detail measure"):
        adaptive_patches(torch.zeros(3, 48, 48), 4, 16, 0.1, measure="entropy")
    with pytest.raises(ValueError, match="one image"):
        adaptive_patches(torch.zeros(2, 3, 48, 48), 4, 16, 0.1)


def test_adaptive_module_imports_torch_only():
    import ast
    from pathlib import Path

    import kiln.workloads.adaptive as adaptive

    tree = ast.parse(Path(adaptive.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert imported <= {"__future__", "torch"}, f"kiln.workloads.adaptive imports {sorted(imported)}"


def test_paint_renders_each_patch_class_over_its_area():
    tokens, positions = adaptive_patches(_quadrant_image(), 4, 16, threshold=1e-3)
    logits = torch.randn(1, tokens.shape[1], 3, generator=torch.Generator().manual_seed(0))
    mask = paint(logits, positions, 64)
    assert mask.shape == (64, 64) and bool((mask >= 0).all())
    for (y, x, side), label in zip(patch_boxes(positions, 64).tolist(), logits[0].argmax(-1).tolist()):
        assert bool((mask[y:y + side, x:x + side] == label).all())


# --------------------------------------------------------------------------- dynamic token counts


def test_segvit_on_adaptive_patches_builds_once_for_every_token_count(builds):
    torch.manual_seed(0)
    model = AdaptivePatchSegViT(patch=2, width=32, depth=1, heads=2, num_classes=3, pos_hidden=16).eval()
    images = [adaptive_patches(synthetic_image(32, seed=i, detail=d), 2, 8, 1e-3)
              for i, d in enumerate((0.0, 0.25, 0.5))]
    counts = [tokens.shape[1] for tokens, _ in images]
    assert len(set(counts)) == 3, f"token counts {counts}"
    tokens = Dim("tokens", min=2, max=1024)
    with torch.no_grad():
        fast = kiln.compile(model, images[1], backend="cpu", cache=False, strict=True,
                            dynamic_shapes=({1: tokens}, {1: tokens}))
        for args, n in zip(images, counts):
            out, ref = fast(*args), model(*args)
            assert out.shape == (1, n, 3)
            assert _rel(out, ref) <= REL_TOL, f"{n} tokens: max relative error {_rel(out, ref):.2e}"
    assert builds["count"] == 1, f"{builds['count']} builds for token counts {counts}"
