"""Rematerialization: which forward nodes the backward should recompute instead of saving.

Used by :func:`kiln.passes.autodiff.split_joint` with ``policy="remat"``.  The choice is a
minimum s-t cut (as in AOTAutograd's partitioner) over the forward nodes the backward
depends on:

* each forward node is split into ``in -> out`` with capacity ``BIG * bytes(results)``
  (cutting it = saving its results);
* a node that may not be recomputed is tied to the source with infinite capacity; a
  recomputable one with capacity 1 (cutting it = recomputing it, a small penalty);
* data edges carry infinite capacity; results the backward reads go to the sink.

``BIG`` exceeds the number of nodes, so the cut minimizes saved bytes first and the number
of recomputed nodes second.  Graph inputs, params and constants are always available to the
backward at no cost.  Recomputable: elementwise, view, pointwise and creation ops and the
copy-only layout ops (cat, pad, flip, tril, triu, repeat).
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from kiln.ir import Node, Value

COPY_OPS = frozenset({"cat", "pad", "flip", "tril", "triu", "repeat", "cast"})
RECOMPUTABLE_TRAITS = frozenset({"elementwise", "view", "pointwise", "creation"})


def is_recomputable(node: Node) -> bool:
    """Cheap and pure: the backward may recompute this node instead of saving its results."""
    if node.op.has("random"):
        return False
    return node.kind in COPY_OPS or bool(node.op.traits & RECOMPUTABLE_TRAITS)


def choose_recomputation(forward: Sequence[Node], backward: Sequence[Node],
                         grads: Sequence[Value]) -> set[Node]:
    """Forward nodes to recompute in the backward so the saved bytes are minimal."""
    in_forward = set(forward)
    read = {v for n in backward for v in n.inputs} | set(grads)
    needed = {v for v in read if v.kind == "result" and v.producer in in_forward}
    relevant = _ancestors_within({v.producer for v in needed}, in_forward)
    if not relevant:
        return set()
    big = len(relevant) + 1
    flow = nx.DiGraph()
    for node in relevant:
        node_in, node_out = ("in", node), ("out", node)
        nbytes = sum(v.type.nbytes for v in node.outputs)
        flow.add_edge(node_in, node_out, capacity=big * nbytes)
        if is_recomputable(node):
            flow.add_edge("source", node_in, capacity=1)
        else:
            flow.add_edge("source", node_in)  # no capacity attribute: infinite
        for v in node.inputs:
            if v.kind == "result" and v.producer in relevant:
                flow.add_edge(("out", v.producer), node_in)
        if any(v in needed for v in node.outputs):
            flow.add_edge(node_out, "sink")
    _, (_, sink_side) = nx.minimum_cut(flow, "source", "sink")
    return _required(needed, {n for n in relevant if ("in", n) in sink_side})


def _ancestors_within(roots: set[Node], allowed: set[Node]) -> set[Node]:
    found: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in found or node not in allowed:
            continue
        found.add(node)
        stack.extend(v.producer for v in node.inputs if v.kind == "result")
    return found


def _required(needed: set[Value], recomputed: set[Node]) -> set[Node]:
    """The recomputed nodes the backward actually uses: walk back from what it reads through
    recomputed nodes only (a saved node stops the walk)."""
    keep: set[Node] = set()
    stack = [v.producer for v in needed if v.producer in recomputed]
    while stack:
        node = stack.pop()
        if node in keep:
            continue
        keep.add(node)
        stack.extend(v.producer for v in node.inputs
                     if v.kind == "result" and v.producer in recomputed)
    return keep


__all__ = ["COPY_OPS", "RECOMPUTABLE_TRAITS", "choose_recomputation", "is_recomputable"]
