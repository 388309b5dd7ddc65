"""Rematerialization: which forward nodes the backward should recompute instead of saving.

Two users of one choice (:func:`choose_recomputation`):

* :func:`kiln.passes.autodiff.split_joint` with ``policy="remat"`` moves the chosen nodes
  into the backward graph of a forward/backward pair;
* the registered pass ``remat`` (:class:`Rematerialize`, :func:`rematerialize`) works inside
  one joint graph (forward, loss, backward and optimizer update, as built by
  :func:`kiln.compile_train`): it inserts a clone of each chosen node right before its first
  backward use and rewires every backward use to the clone, so the original forward value
  dies after its last forward use and a liveness-based memory plan reuses its buffer.
  ``rematerialize(..., recompute=names)`` clones a given set of
  :func:`recomputation_candidates` instead of the cut's choice (the per-site environment
  ``kiln/RematSites-v0`` of :mod:`kiln.tuning.rl.site_kinds` answers each candidate).

The choice is a minimum s-t cut (as in AOTAutograd's partitioner) over the forward nodes
the backward depends on:

* each forward node is split into ``in -> out`` with capacity ``BIG * bytes(results)``
  (cutting it = saving its results);
* a node that may not be recomputed is tied to the source with infinite capacity; a
  recomputable one with capacity 1 (cutting it = recomputing it, a small penalty);
* data edges carry infinite capacity; results the backward reads go to the sink.

``BIG`` exceeds the number of nodes, so the cut minimizes saved bytes first and the number
of recomputed nodes second.  Graph inputs, params and constants are always available to the
backward at no cost.  Recomputable: ops with a trait in :data:`RECOMPUTABLE_TRAITS`
(elementwise, view, pointwise and creation ops, and the ``copy`` ops: cat, pad, flip, tril,
triu, repeat, cast); ``fused`` nodes are not.  Random ops with trait ``replayable``
(``dropout_mask``) are recomputable only inside one joint graph (``random=True``, as
:func:`rematerialize` chooses): their result is a pure function of the seed operand and the
attributes, and within one call of the graph the seed does not change, so a clone draws the
forward's mask bit for bit.  Across a forward/backward pair the seed param is refilled
before every forward call, so a backward graph recomputing a mask could draw another call's
mask: ``split_joint`` saves masks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, KilnError, Node, Value
from kiln.passes.base import Pass, PassResult, register_pass
from kiln.ir.sizes import estimated_nbytes

RECOMPUTABLE_TRAITS = frozenset({"elementwise", "view", "pointwise", "creation", "copy"})
"""Traits of ops cheap and pure enough to recompute (see :attr:`kiln.ir.OpDef.traits`)."""


def is_recomputable(node: Node, *, random: bool = False) -> bool:
    """Cheap and pure: the backward may recompute this node instead of saving its results.
    Random ops only when ``replayable`` and with ``random=True`` (inside one joint graph,
    see the module docstring)."""
    if node.op.has("random"):
        return random and node.op.has("replayable")
    return bool(node.op.traits & RECOMPUTABLE_TRAITS)


def choose_recomputation(forward: Sequence[Node], backward: Sequence[Node],
                         grads: Sequence[Value], *, random: bool = False) -> set[Node]:
    """Forward nodes to recompute in the backward so the saved bytes are minimal.

    ``grads`` are values read after the backward (its outputs).  Values produced outside
    ``forward`` count as always available: they are never recomputed and cost nothing.
    ``random``: random ops may be recomputed (only where backward and forward run in one
    call of one graph).
    """
    import networkx as nx  # imported on first use: most programs never rematerialize

    needed, relevant = _needed_and_relevant(forward, backward, grads)
    if not relevant:
        return set()
    big = len(relevant) + 1
    flow = nx.DiGraph()
    for node in relevant:
        node_in, node_out = ("in", node), ("out", node)
        nbytes = sum(estimated_nbytes(v.type) for v in node.outputs)
        flow.add_edge(node_in, node_out, capacity=big * nbytes)
        if is_recomputable(node, random=random):
            flow.add_edge("source", node_in, capacity=1)
        else:
            flow.add_edge("source", node_in)  # no capacity attribute: infinite
        for v in node.inputs:
            if v.origin == "result" and v.producer in relevant:
                flow.add_edge(("out", v.producer), node_in)
        if any(v in needed for v in node.outputs):
            flow.add_edge(node_out, "sink")
    _, (_, sink_side) = nx.minimum_cut(flow, "source", "sink")
    return _required(needed, {n for n in relevant if ("in", n) in sink_side})


def _needed_and_relevant(forward: Sequence[Node], backward: Sequence[Node],
                         grads: Sequence[Value]) -> tuple[set[Value], set[Node]]:
    """The forward results the backward reads, and the forward nodes they depend on."""
    in_forward = set(forward)
    read = {v for n in backward for v in n.inputs} | set(grads)
    needed = {v for v in read if v.origin == "result" and v.producer in in_forward}
    return needed, _ancestors_within({v.producer for v in needed}, in_forward)


def _ancestors_within(roots: set[Node], allowed: set[Node]) -> set[Node]:
    found: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in found or node not in allowed:
            continue
        found.add(node)
        stack.extend(v.producer for v in node.inputs if v.origin == "result")
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
                     if v.origin == "result" and v.producer in recomputed)
    return keep


# ------------------------------------------------------------------- inside one joint graph
def _split(graph: Graph, loss: int) -> tuple[set[Node], list[Node], list[Node]]:
    """(ancestors of output ``loss``, the forward nodes remat may clone, the backward nodes)."""
    if not 0 <= loss < len(graph.outputs):
        raise KilnError(f"remat: graph @{graph.name} has {len(graph.outputs)} outputs, so loss={loss} "
                        "names none; give the index of the output the forward part computes")
    loss_value = graph.outputs[loss]
    roots = {loss_value.producer} if loss_value.origin == "result" else set()
    forward_set = _ancestors_within(roots, set(graph.nodes))
    outputs = set(graph.outputs)
    forward = [n for n in graph.nodes if n in forward_set and not outputs.intersection(n.outputs)]
    backward = [n for n in graph.nodes if n not in forward_set]
    return forward_set, forward, backward


def _given(forward: Sequence[Node], backward: Sequence[Node], names: set[str]) -> set[Node]:
    """The candidates named in ``names`` (by their first result) that the backward uses."""
    needed, relevant = _needed_and_relevant(forward, backward, ())
    named = {n for n in relevant if is_recomputable(n, random=True) and n.outputs[0].name in names}
    return _required(needed, named)


def recomputation_candidates(graph: Graph, *, loss: int = 0) -> tuple[list[Node], set[Node]]:
    """``(candidates, chosen)`` of a joint graph: the forward nodes :func:`rematerialize` may
    recompute (recomputable, random ones included, and an ancestor of a forward result the
    backward reads), in graph order, and the ones its minimum cut recomputes."""
    _, forward, backward = _split(graph, loss)
    _, relevant = _needed_and_relevant(forward, backward, ())
    candidates = [n for n in graph.nodes if n in relevant and is_recomputable(n, random=True)]
    return candidates, choose_recomputation(forward, backward, (), random=True)


def recomputed_names(graph: Graph, names: Collection[str], *, loss: int = 0) -> set[str]:
    """The names of ``names`` (candidates' first results) that :func:`rematerialize` with
    ``recompute=names`` clones: those the backward uses, directly or through other clones."""
    _, forward, backward = _split(graph, loss)
    return {n.outputs[0].name for n in _given(forward, backward, set(names))}


def rematerialize(graph: Graph, *, loss: int = 0, recompute: Collection[str] | None = None) -> tuple[Graph, int]:
    """Recompute cheap forward values inside a joint graph; returns ``(graph, recomputed)``.

    The forward part is every node the output ``loss`` depends on; every other node is
    backward (gradients, optimizer update).  :func:`choose_recomputation` picks forward nodes
    to recompute (dropout masks included: the clone reads the same seed in the same call, so
    it draws the forward's mask); each gets one clone (results named ``remat.<name>``), placed right before
    its first backward use with the clones it reads before it, and every backward use reads
    the clone.  Forward nodes producing a graph output are never cloned: their results stay
    alive to the end anyway.

    Guarantees: the input graph is not modified; the result has the same inputs, params and
    outputs, computes the same values and keeps nodes in a valid (topological) order;
    ``recomputed`` is the number of clones; with nothing worth recomputing the input graph
    itself is returned with ``0``.

    ``recompute`` (default: the minimum cut's choice) names the forward nodes to recompute
    instead, by their first result, among :func:`recomputation_candidates`; named nodes the
    backward does not use (directly or through another recomputed node) are not cloned.
    """
    g = graph.clone()
    forward_set, forward, backward = _split(g, loss)
    if recompute is None:
        chosen = choose_recomputation(forward, backward, (), random=True)
    else:
        chosen = _given(forward, backward, set(recompute))
    if not chosen:
        return graph, 0
    clones: dict[Value, Value] = {}
    taken = {v.name for v in g.values()}
    order: list[Node] = []
    for node in list(g.nodes):  # clones are appended to g.nodes; ``order`` is the final order
        if node not in forward_set:
            for value in node.inputs:
                if value.origin == "result" and value.producer in chosen and value not in clones:
                    order += _clone_with_operands(g, value.producer, chosen, clones, taken)
            node.inputs = tuple(clones.get(v, v) for v in node.inputs)
        order.append(node)
    g.nodes = order
    return g, len(order) - len(graph.nodes)


def _clone_with_operands(graph: Graph, node: Node, recompute: set[Node], clones: dict[Value, Value],
                         taken: set[str]) -> list[Node]:
    """Clones of ``node`` and of the recomputed nodes it reads that have none yet, operands
    first; ``clones`` maps each original result to its clone's."""
    made: list[Node] = []
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        current, operands_done = stack.pop()
        if current.outputs[0] in clones:
            continue
        if not operands_done:
            stack.append((current, True))
            stack.extend((v.producer, False) for v in current.inputs
                         if v.origin == "result" and v.producer in recompute and v not in clones)
            continue
        names = [_clone_name(v.name, taken) for v in current.outputs]
        copy = graph.add_node(current.op, [clones.get(v, v) for v in current.inputs], current.attrs,
                              names=names, loc=current.loc)
        clones.update(zip(current.outputs, copy.outputs))
        made.append(copy)
    return made


def _clone_name(name: str, taken: set[str]) -> str:
    # a prefix, not a suffix: numeric names ("8") take no suffix ("8.remat" is not a name)
    candidate, n = f"remat.{name}", 1
    while candidate in taken:
        candidate, n = f"remat{n}.{name}", n + 1
    taken.add(candidate)
    return candidate


@register_pass
@dataclass(frozen=True)
class Rematerialize(Pass):
    """``remat``: :func:`rematerialize` as a pass; ``loss`` is the index of the output whose
    ancestors form the forward part (pipeline text ``remat`` or ``remat{loss=1}``).

    Run it after CSE: CSE would merge each clone back into its original."""

    name: ClassVar[str] = "remat"
    loss: int = 0

    def run(self, graph: Graph) -> PassResult:
        result, recomputed = rematerialize(graph, loss=self.loss)
        return PassResult(result, recomputed > 0)


__all__ = ["RECOMPUTABLE_TRAITS", "Rematerialize", "choose_recomputation", "is_recomputable",
           "recomputation_candidates", "recomputed_names", "rematerialize"]
