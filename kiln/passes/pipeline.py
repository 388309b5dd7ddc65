"""The default pipeline that :func:`kiln.compile` runs.

:data:`DEFAULT_ORDER` writes down the default order of kiln's passes, and
:data:`DEFAULT_PIPELINE` is that order as pipeline text, with any pass that declares
``default_before = "<pass>"`` in its own module run right before the first ``<pass>``::

    @register_pass
    @dataclass(frozen=True)
    class MyCleanup(Pass):
        name: ClassVar[str] = "my-cleanup"
        default_before: ClassVar[str] = "fuse"   # the default pipeline: ...,dce,my-cleanup,fuse

So adding a pass to the default takes its module alone (every module in ``kiln/passes/``
is loaded by :func:`kiln.passes.base.load_passes`); ``print(DEFAULT_PIPELINE)`` shows the
whole order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kiln.ir import Graph
from kiln.passes.base import Pass, load_passes, registered_passes
from kiln.passes.manager import PassManager

GraphTransform = Callable[[Graph], Graph]

DEFAULT_ORDER: tuple[str, ...] = (
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
)
"""The written default order of kiln's passes (a pass may appear more than once)."""


def compose_order(order: Sequence[str], passes: Iterable[type[Pass]]) -> str:
    """``order`` as pipeline text, with each of ``passes`` whose ``default_before`` is set
    inserted right before the first occurrence of that pass (several before one pass: by
    name).  A ``default_before`` naming no pass of ``order``, or set on a pass that ``order``
    names itself, is an error."""
    before: dict[str, list[str]] = {}
    for cls in sorted(passes, key=lambda c: c.name):
        anchor = cls.default_before
        if anchor is None:
            continue
        if cls.name in order:
            raise ValueError(f"pass {cls.name!r} is in the written default order and also declares "
                             f"default_before={anchor!r}: keep one of the two")
        if anchor not in order:
            raise ValueError(f"pass {cls.name!r} asks to run before {anchor!r} in the default pipeline, "
                             f"which has no such pass: {','.join(order)}")
        before.setdefault(anchor, []).append(cls.name)
    text: list[str] = []
    for name in order:
        text += before.pop(name, [])
        text.append(name)
    return ",".join(text)


load_passes()  # the declarations of every pass module, before the order is composed
DEFAULT_PIPELINE = compose_order(DEFAULT_ORDER, registered_passes().values())
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
