"""The default pipeline that :func:`kiln.compile` runs.

:data:`DEFAULT_PIPELINE` is the single place where the default pass order is written down;
adding a pass to the default is a one-line change here (its module must be imported by
``kiln/passes/__init__.py`` so that it is registered).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.ir import Graph
from kiln.passes.base import Pass
from kiln.passes.manager import PassManager

GraphTransform = Callable[[Graph], Graph]

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


def resolve_passes(passes: Any) -> GraphTransform | None:
    """Turn the ``passes`` argument into ``Graph -> Graph`` (``None`` when there are none).

    Text and sequences become a :class:`kiln.passes.manager.PassManager`; any other object
    must have ``run(graph)`` returning a Graph or a result with ``.graph``.
    """
    if passes is None:
        return None
    if passes == "default":
        passes = default_pipeline()
    elif passes == "learned":
        from kiln.passes import learned_pipeline

        passes = learned_pipeline()
    elif isinstance(passes, (str, list, tuple)):
        passes = PassManager(passes)
    run = getattr(passes, "run", None)
    if not callable(run):
        raise TypeError(f"passes must be pipeline text, a list of passes or an object with .run(graph); "
                        f"got {type(passes).__name__}")

    return PassTransform(run, _pipeline_identity(passes))


class PassTransform:
    """A resolved ``passes`` argument: called on a graph, returns the transformed graph.

    ``identity`` is the pipeline as text (with its iteration options) when its result is a
    function of the input graph and that text alone -- a :class:`PassManager` of registered
    passes without an IR dump folder -- so results can be cached; ``None`` otherwise.
    """

    def __init__(self, run: Callable[[Graph], Any], identity: str | None):
        self._run = run
        self.identity = identity

    def __call__(self, graph: Graph) -> Graph:
        result = self._run(graph)
        return result if isinstance(result, Graph) else result.graph


def _pipeline_identity(passes: Any) -> str | None:
    if not isinstance(passes, PassManager) or passes.dump_dir is not None:
        return None
    if not all(isinstance(p, Pass) for p in passes.passes):
        return None
    return f"{passes.spec()} fixpoint={passes.fixpoint} max_iterations={passes.max_iterations}"
