"""The zoo's registry: named entries, each building a small seeded model and its inputs.

An entry's ``build()`` returns ``(model, example_inputs)``: an ``nn.Module`` taking
positional tensors only (transformers models are wrapped by :class:`KeywordAdapter`, which
calls them with keyword arguments, so ``kiln.compile_train`` can pass inputs positionally)
and a tuple of example tensors.  Models have random weights from ``torch.manual_seed``, no
dropout (so train-mode runs are deterministic) and are tiny: a sweep of every entry runs
in minutes on a laptop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model: ``build()`` returns ``(model, example_inputs)``."""

    name: str
    family: str
    """The architecture family (``"llama"``, ``"swin"``, ``"unet"``)."""
    kind: str
    """decoder, encoder, encoder-decoder, vision, conv, speech, segmentation, two-tower, nn."""
    build: Callable[[], Built]
    features: tuple[str, ...] = field(default=())
    """What the entry exercises (``"gqa"``, ``"rotary"``, ``"alibi"``, ``"group-norm"``)."""


ZOO: dict[str, ZooEntry] = {}


def register(name: str, family: str, kind: str, features: Sequence[str] = ()) -> Callable[
        [Callable[[], Built]], Callable[[], Built]]:
    """Decorator adding the builder as a :data:`ZOO` entry."""

    def add(build: Callable[[], Built]) -> Callable[[], Built]:
        if name in ZOO:
            raise ValueError(f"zoo entry {name!r} is registered twice")
        ZOO[name] = ZooEntry(name, family, kind, build, tuple(features))
        return build

    return add


class KeywordAdapter(nn.Module):
    """Calls ``model(**dict(zip(names, args)), **fixed)``: positional inputs for a model
    whose forward is called with keywords (``attention_mask=``, ``decoder_input_ids=``)."""

    def __init__(self, model: nn.Module, names: Sequence[str], **fixed: Any):
        super().__init__()
        self.model = model
        self.names = tuple(names)
        self.fixed = fixed

    def forward(self, *args: torch.Tensor) -> Any:
        return self.model(**dict(zip(self.names, args)), **self.fixed)


def generator(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def token_ids(vocab: int, length: int = 16, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=generator(seed))


def padding_mask(length: int = 16, batch: int = 1, padded: int = 4) -> torch.Tensor:
    """An int64 attention mask whose last ``padded`` positions are padding."""
    mask = torch.ones(batch, length, dtype=torch.int64)
    if padded:
        mask[:, length - padded:] = 0
    return mask


def randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed))
