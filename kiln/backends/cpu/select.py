"""Choosing an implementation for every node: a view, a folded constant, a library call, a
generated kernel, a library call with a generated epilogue, or the reference.

A node has a library implementation when the backend's library table has its op
(:data:`kiln.backends.cpu.library.LIBRARY`, keyed by op name), and a generated one when its op
has a compute definition.  The rule
(``select="rule"``, the default):

=====================================  ===============================================
node                                   implementation
=====================================  ===============================================
trait ``view`` (reshape, permute, ...)  ``view``: a zero-copy torch view
trait ``creation`` without operands    ``fold``: computed once at build time
``fused`` of kind ``matmul``/``conv``  ``library+epilogue``: ATen GEMM/convolution into
whose anchor has a library call        a buffer, then one generated kernel for the
                                       elementwise epilogue (bias, activation, residual)
a declared library implementation      ``library`` (tuned GEMM, oneDNN convolution,
                                       fused attention beat naive loops)
anything else                          ``generated`` (lowered, scheduled, compiled C)
=====================================  ===============================================

A node whose lowering or C generation fails at build time falls back to ``reference`` (the
numpy implementation), and the executable's ``info["fallbacks"]`` lists it.

With ``select="generated"`` every node that has a generated implementation uses it (the
library is not called: tests and schedule research use this).  With ``select="time"`` a node with both a library and a generated implementation is built
both ways once, on random inputs of its types, and the faster one is used.  The choice is
remembered per node signature (op, attributes, operand types, machine) in
``selection.json`` of the compile cache folder, so each signature is timed once per machine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.ir import Graph, Node

from .choices import ChoiceStore
from .library import VIEWS, library_name

IMPLEMENTATIONS = ("view", "fold", "library", "library+epilogue", "generated", "reference")
SELECT_MODES = ("rule", "time", "generated")


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


def available(node: Node) -> tuple[str, ...]:
    """The implementations ``node`` may use, best-first by the rule."""
    if node.op.has("view") and node.op_name in VIEWS:
        return ("view",)
    if node.op.has("creation") and not node.inputs:
        return ("fold",)
    if node.op_name == "fused":
        anchor = anchor_of(node.attrs["body"]) if node.attrs["template"] in ("matmul", "conv") else None
        if anchor is not None and library_name(anchor) is not None:
            return ("library+epilogue", "generated", "reference")
        return ("generated", "reference")
    impls: tuple[str, ...] = ()
    if library_name(node) is not None:
        impls += ("library",)
    if node.op.compute is not None:
        impls += ("generated",)
    return impls + ("reference",)


def generated_choice(node: Node) -> Choice:
    """``select="generated"``: generated kernels wherever one exists (tests, research)."""
    impls = available(node)
    if "generated" in impls:
        return Choice("generated", "generated kernels requested")
    return rule_choice(node)


def rule_choice(node: Node) -> Choice:
    """``select="rule"``: the first implementation of :func:`available`."""
    impl = available(node)[0]
    reasons = {
        "view": "zero-copy view", "fold": "constant at build time",
        "library+epilogue": "library anchor with a generated epilogue",
        "library": "declared library implementation", "generated": "generated kernel",
        "reference": "no generated or library implementation",
    }
    return Choice(impl, reasons[impl])


def signature(node: Node) -> str:
    """A text naming the node's computation: op, attributes and operand types."""
    attrs = {k: (str(v) if isinstance(v, Graph) else v) for k, v in node.attrs.items()}
    types = ",".join(str(v.type) for v in node.inputs)
    return f"{node.op_name}({types}) {json.dumps(attrs, sort_keys=True, default=str)}"


class TimedSelector:
    """Choose by timing both implementations once; choices persist in a JSON file.

    ``measure(node, impl) -> seconds`` builds and times one implementation (the backend
    provides it).  ``machine`` (compiler and CPU identity) is part of every key.
    """

    def __init__(self, path: Path | None, machine: str, measure: Callable[[Node, str], float]):
        self.machine = machine
        self.measure = measure
        self.timed = 0
        self._store = ChoiceStore(path, lambda v: v in IMPLEMENTATIONS, ".selection.")

    def choose(self, node: Node) -> Choice:
        impls = available(node)
        candidates = [i for i in impls if i in ("library", "library+epilogue", "generated")]
        if len(candidates) < 2:
            return rule_choice(node)
        key = f"{self.machine}|{signature(node)}"
        known = self._store.get(key)
        if known in candidates:
            return Choice(known, "timed earlier")
        times = {impl: self.measure(node, impl) for impl in candidates}
        best = min(times, key=times.__getitem__)
        self.timed += 1
        self._store.put(key, best)
        detail = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in times.items())
        return Choice(best, f"timed: {detail}")


__all__ = [
    "IMPLEMENTATIONS",
    "SELECT_MODES",
    "Choice",
    "TimedSelector",
    "anchor_of",
    "available",
    "generated_choice",
    "rule_choice",
    "signature",
]
