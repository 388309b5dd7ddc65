"""What a pass is: a named, registered, functional transformation ``Graph -> Graph``.

Passes never edit the graph they are given.  ``run`` clones it, edits the clone, and
returns ``PassResult(graph, changed)``; when nothing changed it may return the input graph
itself.  Options are dataclass fields, so a pass is configured as ``Fuse(max_nodes=16)`` or,
in pipeline text, ``"fuse{max_nodes=16}"``.

A new pass::

    @register_pass
    @dataclass(frozen=True)
    class MyPass(Pass):
        name: ClassVar[str] = "my-pass"

        def run(self, graph: Graph) -> PassResult:
            g = graph.clone()
            ...
            return PassResult(g, changed)

A pass is found by name once its module is imported, and :func:`load_passes` imports every
module directly in the ``kiln/passes/`` folder the first time the registry is read
(``kiln.passes`` does so on import), so a new pass module needs no import elsewhere.  To
run it in the default pipeline too, give it ``default_before = "<pass>"`` (see
:mod:`kiln.passes.pipeline`).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kiln.ir import Graph


@dataclass(frozen=True)
class PassResult:
    graph: Graph
    changed: bool


@dataclass(frozen=True)
class Pass:
    """Base class. Subclasses are frozen dataclasses whose fields are the pass options."""

    name: ClassVar[str] = ""
    default_before: ClassVar[str | None] = None
    """The pass before whose first run the default pipeline also runs this one (``None``:
    not in the default pipeline unless :data:`kiln.passes.pipeline.DEFAULT_ORDER` names it)."""

    def run(self, graph: Graph) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, graph: Graph) -> PassResult:
        return self.run(graph)

    @property
    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """Pipeline-text form of this pass with its non-default options."""
        shown = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.default is not dataclasses.MISSING and v == f.default:
                continue
            shown.append(f"{f.name}={_fmt(v)}")
        return self.name + ("{" + ",".join(shown) + "}" if shown else "")


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    if isinstance(v, str) and (not _BARE_STRING.fullmatch(v) or v.lower() in ("true", "false", "none")):
        return json.dumps(v)  # pipeline text reads double-quoted strings back with JSON escapes
    return str(v)


_BARE_STRING = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


_PASSES: dict[str, type[Pass]] = {}
_LOADED = False


def load_passes() -> None:
    """Import every module directly in the ``kiln/passes/`` folder, once, so that every pass
    registered there is in the registry whichever module was imported first.

    Safe to call while those modules are being imported (a module that reads the registry
    at import, such as :mod:`kiln.passes.pipeline`, calls it): the imports already under
    way are skipped and the others run.
    """
    global _LOADED
    if _LOADED:
        return
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if not info.ispkg and not info.name.startswith("_"):
            importlib.import_module(f"{__package__}.{info.name}")
    _LOADED = True


def register_pass(cls: type[Pass]) -> type[Pass]:
    """Class decorator adding a pass to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _PASSES and _PASSES[cls.name] is not cls:
        raise ValueError(f"pass '{cls.name}' is registered twice")
    _PASSES[cls.name] = cls
    return cls


def get_pass(name: str, **options: Any) -> Pass:
    """The pass registered as ``name``, configured with ``options``."""
    load_passes()
    try:
        cls = _PASSES[name]
    except KeyError:
        raise KeyError(f"unknown pass '{name}'; registered: {', '.join(sorted(_PASSES))}") from None
    return cls(**options)


def registered_passes() -> dict[str, type[Pass]]:
    """Every registered pass by name (the modules of ``kiln/passes/`` loaded first)."""
    load_passes()
    return dict(_PASSES)
