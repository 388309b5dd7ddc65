"""The seed workloads: models of the research systems kiln is built for, at 2-core sizes.

``python -m benchmarks --models seeds`` runs all of them (``seed-*`` names one).  Each
module defines its models from the papers' descriptions and a ``SPECS`` tuple of
:class:`benchmarks.models.ModelSpec` (none is in a default run):

* :mod:`.vision` -- a long-sequence ViT, an adaptive-patch (AMR) segmentation ViT and a
  SAM-style encoder / prompt encoder / mask decoder;
* :mod:`.points` -- an EdgeConv lidar upsampler with a sliced Wasserstein loss, SoftPool++
  point-cloud completion and a multi-task 3-D CNN for nodule diagnosis.
"""

from __future__ import annotations

import importlib

MODULES = ("vision", "points")


def seed_specs() -> dict:
    """Name -> spec of every seed workload (the modules are imported on first use)."""
    specs = {}
    for module in MODULES:
        for spec in importlib.import_module(f"{__name__}.{module}").SPECS:
            specs[spec.name] = spec
    return specs


__all__ = ["MODULES", "seed_specs"]
