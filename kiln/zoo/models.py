"""The zoo: every registered entry (transformers families and hand-written ``torch.nn`` nets).

::

    from kiln.zoo.models import ZOO, select
    model, inputs = ZOO["llama"].build()
    for entry in select(["llama", "swin"]): ...

Entries live in :mod:`kiln.zoo.hf_text` (decoder LMs, encoders, encoder-decoders),
:mod:`kiln.zoo.hf_vision` (vision transformers, conv nets, speech, segmentation, two-tower)
and :mod:`kiln.zoo.nets` (hand-written nets); :mod:`kiln.zoo.registry` defines
:class:`ZooEntry`.  Importing this module builds nothing; transformers is imported by the
builders.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import hf_text, hf_vision, nets  # noqa: F401  (they register their entries)
from .registry import ZOO, KeywordAdapter, ZooEntry

FAST = ("llama", "bert", "t5", "swin", "convnext", "wav2vec2", "clip", "unet", "pointnet_knn",
        "seq2seq_transformer")
"""The CI subset (``tests/zoo``): GQA + rotary decoder, encoder, encoder-decoder, shifted-window
attention, depthwise convs, speech front end, two towers and three hand-written nets."""


def select(names: Iterable[str] | None = None) -> list[ZooEntry]:
    """The entries named (all of them, in registration order, for ``None``)."""
    if names is None:
        return list(ZOO.values())
    chosen = []
    for name in names:
        if name not in ZOO:
            raise KeyError(f"no zoo entry {name!r}; known entries: {', '.join(ZOO)}")
        chosen.append(ZOO[name])
    return chosen


__all__ = ["FAST", "ZOO", "KeywordAdapter", "ZooEntry", "select"]
