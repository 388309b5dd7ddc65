"""The default pipeline that :func:`kiln.compile` runs.

:data:`DEFAULT_PIPELINE` is the single place where the default pass order is written down;
adding a pass to the default is a one-line change here (its module must be imported by
``kiln/passes/__init__.py`` so that it is registered).
"""

from __future__ import annotations

from kiln.passes.manager import PassManager

DEFAULT_PIPELINE = ",".join([
    "inline-custom-vjp",  # torch.autograd.Function nodes: their forward, once autodiff ran
    "canonicalize",
    "simplify",
    "fold",
    "cse",
    "sink-views",
    "simplify",
    "composites",
    "sink-views",  # composites (e.g. tanh-GELU) can leave reshape pairs that now cancel
    "simplify",
    "cse",
    "dce",
    "fuse",
])
"""Pass order of :func:`default_pipeline`, as pipeline text."""


def default_pipeline(*, verify: bool = True, fixpoint: bool = True, max_iterations: int = 4,
                     fuse: bool = True, **options) -> PassManager:
    """The :class:`PassManager` that ``kiln.compile`` uses: :data:`DEFAULT_PIPELINE`,
    repeated until nothing changes (at most ``max_iterations`` times); with ``fuse=False``
    without its final ``fuse`` (for callers that rewrite the graph before fusing it).

    Extra keyword options go to :class:`PassManager` (e.g. ``dump_dir``).
    """
    text = DEFAULT_PIPELINE if fuse else DEFAULT_PIPELINE.removesuffix(",fuse")
    return PassManager(text, verify=verify, fixpoint=fixpoint,
                       max_iterations=max_iterations, **options)
