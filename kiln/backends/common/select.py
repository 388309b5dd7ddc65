"""Choosing an implementation for every node: a view, a folded constant, a library call, a
generated kernel, a library call with a generated epilogue, or the reference on the host.

What a backend *has* is a :class:`Selection`: its library table (the hook ``has_library``:
does the backend's table have a call for this node?), whether it runs nodes on the host
with their numpy reference (``host_reference``), and the views of
:data:`kiln.backends.common.library.VIEWS`.  A node has a generated implementation when its
op has a compute definition.  The rule (``select="rule"``, the default):

=====================================  ===============================================
node                                   implementation
=====================================  ===============================================
trait ``view`` (reshape, permute, ...)  ``view``: a zero-copy torch view
trait ``creation`` without operands    ``fold``: computed once at build time
``fused`` of template ``matmul``/      ``library+epilogue``: a library GEMM/convolution
``conv`` whose anchor has a library    into a buffer, then one generated kernel for the
call                                   elementwise epilogue (bias, activation, residual)
a library implementation               ``library`` (tuned GEMM, oneDNN convolution,
                                       fused attention beat naive loops)
anything else                          ``generated`` (lowered, scheduled, compiled)
no generated kernel either             ``reference`` when the backend runs the host
                                       reference, else nothing (:meth:`Selection.supports`)
=====================================  ===============================================

A node whose kernel cannot be generated at build time falls back to the backend's kernel
fallback (on the cpu backend the numpy reference), and the executable's
``info["fallbacks"]`` lists it.

With ``select="generated"`` every node that has a generated implementation uses it (the
library is not called: tests and schedule research use this).  With ``select="time"`` a
node with both a library and a generated implementation is built both ways once, on
random inputs of its types, and the faster one is used (:class:`TimedSelector`).  The
choice is remembered per node signature (op, attributes, operand types, machine) in
``selection.json`` of the compile cache folder, so each signature is timed once per machine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path

from kiln.ir import Graph, Node

from .choices import ChoiceStore
from .library import VIEWS

IMPLEMENTATIONS = ("view", "fold", "library", "library+epilogue", "generated", "reference")
SELECT_MODES = ("rule", "time", "generated")

_REASONS = {
    "view": "zero-copy view", "fold": "constant at build time",
    "library+epilogue": "library anchor with a generated epilogue",
    "library": "declared library implementation", "generated": "generated kernel",
    "reference": "no generated or library implementation",
}


@dataclass(frozen=True)
class Choice:
    """The implementation of one node and why it was chosen."""

    impl: str
    reason: str


def anchor_of(body: Graph) -> Node | None:
    """The single matmul/conv node of a fused body whose operands are all body inputs (no
    prologue), else ``None``.  Every other node of the body forms the epilogue."""
    anchors = [n for n in body.nodes if n.op.has("matmul") or n.op.has("conv")]
    if len(anchors) != 1 or any(v.origin != "input" for v in anchors[0].inputs):
        return None
    return anchors[0]


class Selection:
    """The implementations one backend has for a node (see the module docstring).

    ``has_library(node)``: the backend's library table has a call for ``node``;
    ``host_reference``: the backend runs a node with its numpy reference on the host when it
    has nothing better; ``views``: the view ops it runs as zero-copy views.
    """

    def __init__(self, has_library: Callable[[Node], bool], *, host_reference: bool = False,
                 views: Container[str] = VIEWS):
        self.has_library = has_library
        self.host_reference = host_reference
        self.views = views

    def available(self, node: Node) -> tuple[str, ...]:
        """The implementations ``node`` may use, best-first by the rule (empty: none)."""
        if node.op.has("view") and node.op_name in self.views:
            return ("view",)
        if node.op.has("creation") and not node.inputs:
            return ("fold",)
        last = ("reference",) if self.host_reference and node.op.reference is not None else ()
        if node.op_name == "fused":
            anchor = anchor_of(node.attrs["body"]) if node.attrs["template"] in ("matmul", "conv") else None
            if anchor is not None and self.has_library(anchor):
                return ("library+epilogue", "generated", *last)
            return ("generated", *last)
        impls: tuple[str, ...] = ()
        if self.has_library(node):
            impls += ("library",)
        if node.op.compute is not None:
            impls += ("generated",)
        return impls + last

    def supports(self, node: Node) -> bool:
        """Whether the backend can run ``node`` at all."""
        return bool(self.available(node))

    def rule(self, node: Node) -> Choice:
        """``select="rule"``: the first implementation of :meth:`available`."""
        impls = self.available(node)
        if not impls:
            raise ValueError(f"no implementation of op '{node.op_name}' here")
        return Choice(impls[0], _REASONS[impls[0]])

    def generated(self, node: Node) -> Choice:
        """``select="generated"``: generated kernels wherever one exists (tests, research)."""
        if "generated" in self.available(node):
            return Choice("generated", "generated kernels requested")
        return self.rule(node)

    def timed_candidates(self, node: Node) -> list[str]:
        """The implementations of ``node`` that ``select="time"`` builds and times (the
        others -- views, folds, the host reference -- are not timed)."""
        return [i for i in self.available(node) if i in ("library", "library+epilogue", "generated")]


def signature(node: Node) -> str:
    """A text naming the node's computation: op, attributes and operand types."""
    attrs = {k: (str(v) if isinstance(v, Graph) else v) for k, v in node.attrs.items()}
    types = ",".join(str(v.type) for v in node.inputs)
    return f"{node.op_name}({types}) {json.dumps(attrs, sort_keys=True, default=str)}"


class TimedSelector:
    """Choose by timing every candidate once; choices persist in a JSON file.

    The candidates of a node are its selection's :meth:`Selection.timed_candidates`.
    ``measure(node, impl) -> seconds`` builds and times one implementation (the backend
    provides it); a candidate that fails to build or run is not chosen.  ``machine``
    (toolchain and processor identity) is part of every key.
    """

    def __init__(self, selection: Selection, path: Path | None, machine: str,
                 measure: Callable[[Node, str], float]):
        self.selection = selection
        self.machine = machine
        self.measure = measure
        self.timed = 0
        self._store = ChoiceStore(path, lambda v: isinstance(v, str), ".selection.")

    def choose(self, node: Node) -> Choice:
        candidates = self.selection.timed_candidates(node)
        if len(candidates) < 2:
            return self.selection.rule(node)
        key = f"{self.machine}|{signature(node)}"
        known = self._store.get(key)
        if known in candidates:
            return Choice(known, "timed earlier")
        times: dict[str, float] = {}
        for impl in candidates:
            try:
                times[impl] = self.measure(node, impl)
            except Exception:  # noqa: BLE001 - a candidate that fails to build or run is not chosen
                continue
        if not times:
            return self.selection.rule(node)
        best = min(times, key=times.__getitem__)
        self.timed += 1
        self._store.put(key, best)
        detail = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in times.items())
        return Choice(best, f"timed: {detail}")


__all__ = ["IMPLEMENTATIONS", "SELECT_MODES", "Choice", "Selection", "TimedSelector", "anchor_of", "signature"]
