"""Training loops over compiled steps: sample hiding (:func:`hide_samples`).

Sample hiding trains on fewer samples per epoch by leaving out, for one epoch, the samples
the model has already learned well, and taking them back when it forgets them (KAKURENBO,
Nguyen et al., NeurIPS 2023).  The importance of a sample is its loss at its last forward
pass, so ranking costs nothing: the compiled step computes per-sample losses and
confidences in the same forward that trains on them (a ``loss_fn`` returning
``(loss, per_sample_loss, confidence)``; see :func:`kiln.compile_train`).

Each epoch ``e``:

1. the *candidates* are the ``fraction_e`` of the samples with the lowest last-seen loss
   (samples never seen yet are never candidates);
2. a candidate is *moved back* into the epoch unless it is learned: its confidence (the
   probability the model gave the true class, at its last forward) is at least
   ``threshold``.  With ``threshold > 0.5`` a learned sample is also correctly classified;
3. the remaining candidates are hidden for this epoch: no forward, no backward, and their
   recorded loss and confidence stay as they were;
4. the learning rate of every param group is scaled by ``1 / (1 - hidden / N)`` for the
   epoch (``scale_lr``), so an epoch moves the weights about as far as a full one.

``fraction_e`` is ``fraction`` for every epoch, or ``fraction(e)`` for a callable, and the
last epoch always trains on every sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kiln.ir import KilnError


@dataclass
class EpochRecord:
    """What one epoch of :func:`hide_samples` did."""

    epoch: int
    trained: int
    """Samples that went through the step (whole batches only)."""
    hidden: int
    moved_back: int
    """Candidates taken back because they were not learned yet."""
    lr_scale: float
    mean_loss: float


@dataclass
class HidingReport:
    """The result of :func:`hide_samples`: one :class:`EpochRecord` per epoch."""

    samples: int
    epochs: list[EpochRecord] = field(default_factory=list)

    @property
    def trained(self) -> int:
        """Samples processed by the step over all epochs."""
        return sum(e.trained for e in self.epochs)

    @property
    def saved(self) -> float:
        """The share of sample-steps saved against training on every sample every epoch."""
        full = self.samples * len(self.epochs)
        return 1.0 - self.trained / full if full else 0.0


def hide_samples(step: Callable[..., Sequence[torch.Tensor]], dataset: Sequence[torch.Tensor], fraction: float
                 | Callable[[int], float], *, epochs: int, batch_size: int, threshold: float = 0.7,
                 scale_lr: bool = True, optimizer: torch.optim.Optimizer | None = None,
                 seed: int = 0) -> HidingReport:
    """Train for ``epochs`` epochs over ``dataset`` with sample hiding (module docstring).

    Args:
        step: a compiled training step (:func:`kiln.compile_train`) whose ``loss_fn`` returns
            ``(loss, per_sample_loss, confidence)``, the last two of shape ``[batch]``.
        dataset: tensors with the samples on axis 0, in the step's argument order (model
            inputs, then targets).
        fraction: the largest share of samples hidden in an epoch, in ``[0, 1)``, or a
            function of the epoch index giving it.
        epochs, batch_size: the loop.  Batches are whole: the last ``len % batch_size``
            samples of an epoch's shuffled order are left for a later epoch, as with
            ``drop_last=True`` (a step compiled with a dynamic batch size takes the rest too).
        threshold: the confidence from which a candidate counts as learned.
        scale_lr: scale the learning rate by ``1 / (1 - hidden / N)`` during an epoch.
        optimizer: the step's optimizer (default ``step.optimizer``), for ``scale_lr``.
        seed: the shuffling seed (one permutation per epoch).
    """
    tensors = list(dataset)
    if not tensors:
        raise KilnError("hide_samples: the dataset has no tensors")
    n = int(tensors[0].shape[0])
    if any(int(t.shape[0]) != n for t in tensors):
        raise KilnError(f"hide_samples: the dataset's tensors have different sample counts "
                        f"{[int(t.shape[0]) for t in tensors]}")
    if batch_size < 1 or batch_size > n:
        raise KilnError(f"hide_samples: batch_size={batch_size} must be between 1 and the {n} samples")
    optimizer = optimizer if optimizer is not None else getattr(step, "optimizer", None)
    if scale_lr and optimizer is None:
        raise KilnError("hide_samples: scale_lr=True needs the step's optimizer (pass optimizer=)")
    losses = torch.full((n,), float("inf"))
    confidence = torch.zeros(n)
    generator = torch.Generator().manual_seed(seed)
    report = HidingReport(n)
    for epoch in range(epochs):
        share = fraction(epoch) if callable(fraction) else float(fraction)
        if not 0.0 <= share < 1.0:
            raise KilnError(f"hide_samples: the hidden fraction of epoch {epoch} is {share}; it must be in [0, 1)")
        if epoch == epochs - 1:
            share = 0.0
        hidden, moved_back = _choose_hidden(losses, confidence, share, threshold)
        visible = torch.nonzero(~hidden).flatten()
        order = visible[torch.randperm(len(visible), generator=generator)]
        lr_scale = n / (n - int(hidden.sum())) if scale_lr else 1.0
        saved_lrs = _scale_lrs(optimizer, lr_scale) if scale_lr else []
        trained, total = 0, 0.0
        try:
            for start in range(0, len(order) - batch_size + 1, batch_size):
                index = order[start:start + batch_size]
                loss, per_sample, conf = _outputs(step(*(t[index] for t in tensors)))
                losses[index] = per_sample.detach().float().reshape(-1)
                confidence[index] = conf.detach().float().reshape(-1)
                trained += len(index)
                total += float(loss.detach()) * len(index)
        finally:
            _restore_lrs(optimizer, saved_lrs)
        report.epochs.append(EpochRecord(epoch, trained, int(hidden.sum()), moved_back, lr_scale,
                                         total / trained if trained else float("nan")))
    return report


def _choose_hidden(losses: torch.Tensor, confidence: torch.Tensor, share: float,
                   threshold: float) -> tuple[torch.Tensor, int]:
    """The samples hidden this epoch (a bool mask) and how many candidates moved back."""
    n = len(losses)
    hidden = torch.zeros(n, dtype=torch.bool)
    seen = torch.isfinite(losses)
    count = min(int(share * n), int(seen.sum()))
    if count == 0:
        return hidden, 0
    ranked = torch.nonzero(seen).flatten()
    candidates = ranked[torch.argsort(losses[ranked], stable=True)[:count]]
    learned = confidence[candidates] >= threshold
    hidden[candidates[learned]] = True
    return hidden, int((~learned).sum())


def _outputs(result: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise KilnError("hide_samples: the step must return (loss, per_sample_loss, confidence); make its "
                        "loss_fn return that tuple (kiln.compile_train differentiates the first only)")
    return result[0], result[1], result[2]


def _scale_lrs(optimizer: torch.optim.Optimizer, scale: float) -> list[float]:
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    return saved


def _restore_lrs(optimizer: torch.optim.Optimizer | None, saved: list[float]) -> None:
    if optimizer is None:
        return
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr


__all__ = ["EpochRecord", "HidingReport", "hide_samples"]
