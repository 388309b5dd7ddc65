"""Fusion partitioning: group nodes into kernels, each group one ``fused`` node.

Every node falls in one class, read from its op's traits (never from its name):

===============  =====================================================================
class            ops
===============  =====================================================================
``fused``        an existing ``fused`` node: a finished kernel, never regrouped
``opaque``       impure ops (trait ``random``) and ops without one of the traits below
``view``         trait ``view`` (reshape, permute, expand, slice, select)
``creation``     trait ``creation`` (arange, full)
``matmul``       trait ``matmul``
``conv``         trait ``conv``
``reduction``    trait ``reduction`` or ``normalization`` (softmax, layer norm: reduce
                 along axes, then broadcast back to the input shape)
``elementwise``  trait ``elementwise`` or ``pointwise`` (inference batch norm)
===============  =====================================================================

``matmul``, ``conv`` and ``reduction`` nodes are *anchors*.  Groups grow greedily: nodes
are visited in topological order and each node is merged with the groups of its operands'
producers (anchor groups first) whenever the merged group stays legal:

* no cycle: no path leaves the merged group and re-enters it (checked on the graph of
  groups, so the graph of kernels stays acyclic);
* at most ``max_nodes`` nodes (creation nodes and constants copied into a body not counted);
* anchors: either none, or one ``matmul``/``conv``, or reductions that all reduce the same
  axes of same-shaped inputs (e.g. the two means of a decomposed layer norm);
* a ``matmul``/``conv`` group holds only its epilogue: every other node is reached from the
  anchor inside the group (bias add, activation, residual add; no prologue);
* the ``strategy`` allows it:

  - ``"greedy"`` (default): the rules above;
  - ``"elementwise-only"``: anchors are never grouped, only elementwise and view chains;
  - ``"none-across-reductions"``: a reduction ends its group: it takes an elementwise
    prologue but nothing inside the group consumes its result, one reduction per group.

*Expansions* (:func:`_expansions`: an elementwise result at least :data:`EXPANSION_RATIO`
times larger than each of its operands, such as the one-hot of a cross-entropy gradient)
merge with their consumers instead of their producers, so the large tensor is recomputed
inside the kernel that reads it rather than stored; an expansion that no consumer takes
joins its producers after the walk, as any other node would have.

Views join groups freely while they connect group members; views left at a group's border
are moved back out (they cost nothing there).  A group becomes a ``fused`` node only if it
holds at least two non-view nodes and a result used outside it (dead code is left to
``dce``); other groups stay plain nodes.  Inside a body, scalar
and small constants (at most :data:`INLINE_CONSTANT_ELEMENTS` elements) and operand-free
creation nodes are copied; everything else defined outside becomes an operand.  A group's
results used outside it (or returned) become the fused node's results and keep their
names; the body's name is ``<kind>_<n>``.

Guarantees: the input graph is untouched; the output computes the same values; the graph
of kernels is acyclic and topologically sorted; the pass is idempotent (``fused`` nodes are
never regrouped, and nodes left alone have no legal partner the second time either).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import Graph, Node, Value
from kiln.ir.printer import INLINE_LIMIT
from kiln.ir.types import normalize_dim
from kiln.passes.base import Pass, PassResult, register_pass

STRATEGIES = ("greedy", "elementwise-only", "none-across-reductions")
INLINE_CONSTANT_ELEMENTS = INLINE_LIMIT
"""Constants up to this many elements are copied into bodies instead of passed in."""

EXPANSION_RATIO = 16
"""An elementwise result this many times larger than each of its operands is an expansion."""
EXPANSION_MIN_ELEMENTS = 1 << 14
"""Smaller results are never expansions (storing them costs little)."""

ANCHORS = frozenset({"matmul", "conv", "reduction"})
FREE = frozenset({"view", "creation"})
_GROUPABLE = frozenset({"elementwise", "view"}) | ANCHORS
_TRAIT_CLASSES = (
    ("view", "view"), ("creation", "creation"), ("matmul", "matmul"), ("conv", "conv"),
    ("reduction", "reduction"), ("normalization", "reduction"), ("elementwise", "elementwise"),
    ("pointwise", "elementwise"),
)


def node_class(node: Node) -> str:
    """The fusion class of ``node`` (see the module docstring)."""
    if node.op_name == "fused":
        return "fused"
    if node.op.has("random"):
        return "opaque"
    for trait, cls in _TRAIT_CLASSES:
        if node.op.has(trait):
            return cls
    return "opaque"


def kernel_count(graph: Graph) -> int:
    """Number of kernels a backend launches for ``graph``.

    Counts every node except free ones: views (which only re-index memory) and creation
    ops (which constant folding turns into constants).  A ``fused`` node counts once.
    """
    return sum(1 for n in graph.nodes if node_class(n) not in FREE)


# ------------------------------------------------------------------------------ partition
class _Partition:
    """Union of nodes into groups, with the legality checks of the module docstring."""

    def __init__(self, graph: Graph, max_nodes: int, strategy: str):
        self.max_nodes = max_nodes
        self.strategy = strategy
        self.pos = {n: i for i, n in enumerate(graph.nodes)}
        self.cls = {n: node_class(n) for n in graph.nodes}
        self.users: dict[Node, list[Node]] = {n: [] for n in graph.nodes}
        for n in graph.nodes:
            for p in _producers(n):
                self.users[p].append(n)
        self.group_of: dict[Node, int] = {n: i for i, n in enumerate(graph.nodes)}
        self.members: dict[int, list[Node]] = {i: [n] for i, n in enumerate(graph.nodes)}
        self.lo: dict[int, int] = {i: i for i in range(len(graph.nodes))}
        """Position of each group's first node."""

    # -- queries
    def groups(self) -> list[list[Node]]:
        """Groups in order of their first node, members in graph order."""
        out = [sorted(m, key=self.pos.__getitem__) for m in self.members.values()]
        return sorted(out, key=lambda m: self.pos[m[0]])

    def groupable(self, node: Node) -> bool:
        cls = self.cls[node]
        if cls not in _GROUPABLE:
            return False
        return not (self.strategy == "elementwise-only" and cls in ANCHORS)

    # -- merging
    def try_merge(self, producer: Node, consumer: Node) -> bool:
        if not self.can_merge(producer, consumer):
            return False
        self.merge(producer, consumer)
        return True

    def can_merge(self, producer: Node, consumer: Node) -> bool:
        """Whether merging the groups of ``producer`` and ``consumer`` is legal now."""
        a, b = self.group_of[producer], self.group_of[consumer]
        if a == b:
            return False
        merged = self.members[a] + self.members[b]
        return self._size_ok(merged) and self._anchors_ok(merged) and self._acyclic(a, b)

    def merge(self, producer: Node, consumer: Node) -> None:
        """Merge the consumer's group into the producer's (the caller checked :meth:`can_merge`)."""
        a, b = self.group_of[producer], self.group_of[consumer]
        merged = self.members[a] + self.members[b]
        for n in self.members[b]:
            self.group_of[n] = a
        self.members[a] = merged
        self.lo[a] = min(self.lo[a], self.lo.pop(b))
        del self.members[b]

    def _size_ok(self, merged: list[Node]) -> bool:
        return len(merged) <= self.max_nodes

    def _anchors_ok(self, merged: list[Node]) -> bool:
        anchors = [n for n in merged if self.cls[n] in ANCHORS]
        if not anchors:
            return True
        if self.strategy == "elementwise-only":
            return False
        kinds = {self.cls[n] for n in anchors}
        if kinds & {"matmul", "conv"}:
            return len(anchors) == 1 and self._all_reached_from(anchors[0], merged)
        if self.strategy == "none-across-reductions":
            members = set(merged)
            return len(anchors) == 1 and not any(u in members for u in self.users[anchors[0]])
        return len({_reduction_signature(n) for n in anchors}) == 1

    def _all_reached_from(self, anchor: Node, merged: list[Node]) -> bool:
        members = set(merged)
        seen = {anchor}
        stack = [anchor]
        while stack:
            for u in self.users[stack.pop()]:
                if u in members and u not in seen:
                    seen.add(u)
                    stack.append(u)
        return len(seen) == len(members)

    def _acyclic(self, a: int, b: int) -> bool:
        """False if some path leaves groups ``a``/``b`` and re-enters one of them.

        Merges happen while visiting consumers in graph order, so every group holding a node
        after the merged groups' last node is a singleton whose successors come later still:
        such groups cannot lead back and are not searched.
        """
        inside = {a, b}
        limit = max(self.pos[n] for g in inside for n in self.members[g])
        frontier = [g for g in self._successor_groups(inside)
                    if g not in inside and self.lo[g] < limit]
        seen = set(frontier)
        while frontier:
            for g in self._successor_groups({frontier.pop()}):
                if g in inside:
                    return False
                if g not in seen and self.lo[g] < limit:
                    seen.add(g)
                    frontier.append(g)
        return True

    def _successor_groups(self, groups: set[int]) -> set[int]:
        out: set[int] = set()
        for g in groups:
            for n in self.members[g]:
                out.update(self.group_of[u] for u in self.users[n])
        return out


def _producers(node: Node) -> list[Node]:
    """Distinct producers of ``node``'s operands, in operand order."""
    out: list[Node] = []
    for v in node.inputs:
        if v.producer is not None and v.producer not in out:
            out.append(v.producer)
    return out


def _reduction_signature(node: Node) -> tuple:
    """(input shape, reduced axes) of a reduction; unknown axes make it unique."""
    shape = node.inputs[0].shape if node.inputs else ()
    rank = len(shape)
    attrs = node.attrs
    if "dims" in attrs:
        axes = tuple(sorted({normalize_dim(d, rank) for d in attrs["dims"]})) or tuple(range(rank))
    elif "dim" in attrs:
        dim = attrs["dim"]
        axes = tuple(range(rank)) if dim is None else (normalize_dim(dim, rank),)
    elif "normalized_rank" in attrs:
        axes = tuple(range(rank - attrs["normalized_rank"], rank))
    else:
        return (id(node),)
    return (shape, axes)


def _check_options(max_nodes: int, strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"fuse: unknown strategy {strategy!r}; "
                         f"choose one of {', '.join(STRATEGIES)}")
    if max_nodes < 1:
        raise ValueError(f"fuse: max_nodes must be at least 1, got {max_nodes}")


def partition(graph: Graph, max_nodes: int = 32, strategy: str = "greedy",
              decide: Callable[[Node, Node], bool] | None = None) -> list[list[Node]]:
    """The groups ``fuse`` would turn into ``fused`` nodes (each in graph order).

    Only groups of at least two non-view nodes are returned, and only groups with a result
    used outside them (dead code is left to ``dce``); see the module docstring.

    ``decide(producer, consumer)``, when given, is asked before each *legal* merge (a merge
    site: the two nodes' groups differ and merging them passes every check above), in the
    order the greedy walk meets them; the merge happens only if it returns true.  Without
    it every legal merge happens (what ``fuse`` does).  Declining a merge changes which
    later sites are legal, so an agent deciding per site (:mod:`kiln.tuning.rl.sites`)
    sees the sites one at a time.
    """
    _check_options(max_nodes, strategy)
    part = _Partition(graph, max_nodes, strategy)
    expanded = _expansions(graph, part.cls)

    def visit(node: Node, only: set[Node] | None = None) -> None:
        producers = [p for p in _producers(node) if part.groupable(p) and (only is None or p in only)]
        producers.sort(key=lambda p: part.cls[p] not in ANCHORS)  # anchor epilogues first
        for p in producers:
            if decide is None:
                part.try_merge(p, node)
            elif part.can_merge(p, node) and decide(p, node):
                part.merge(p, node)

    for node in graph.nodes:
        if part.groupable(node):
            visit(node, expanded if node in expanded else None)
    for node in graph.nodes:  # expansions no consumer took join their producers after all
        if node in expanded and all(m in expanded for m in part.members[part.group_of[node]]):
            visit(node)
    returned = {v.producer for v in graph.outputs}
    out = []
    for members in part.groups():
        members = _trim_border_views(members, part.cls)
        inside = set(members)
        live = any(n in returned or any(u not in inside for u in part.users[n])
                   for n in members)
        if live and sum(part.cls[n] != "view" for n in members) >= 2:
            out.append(members)
    return out


def _expansions(graph: Graph, cls: dict[Node, str]) -> set[Node]:
    """Elementwise nodes whose result is at least :data:`EXPANSION_RATIO` times larger than
    each operand that is not itself an expansion (a one-hot ``where(eq(target[:, None],
    iota), -1/n, 0)``, an outer sum): cheap to recompute, costly to store.  :func:`partition`
    lets their consumers take them, rather than their producers, so the large tensor stays
    inside one kernel; only when no consumer takes them do they join their producers."""
    out: set[Node] = set()
    for n in graph.nodes:
        if cls[n] != "elementwise" or len(n.outputs) != 1:
            continue
        size = _static_numel(n.outputs[0])
        if size is None or size < EXPANSION_MIN_ELEMENTS:
            continue
        small = [v.producer in out or ((k := _static_numel(v)) is not None and k * EXPANSION_RATIO <= size)
                 for v in n.inputs]
        if small and all(small):
            out.add(n)
    return out


def _static_numel(value: Value) -> int | None:
    return value.type.numel if value.type.is_static else None


def _trim_border_views(members: list[Node], cls: dict[Node, str]) -> list[Node]:
    """Drop views that do not sit between two members (removing one keeps the DAG acyclic)."""
    group = list(members)
    while True:
        inside = set(group)
        used_inside = {v for n in group for v in n.inputs}
        border = [
            n for n in group
            if cls[n] == "view" and (
                not any(v.producer in inside for v in n.inputs)
                or not any(v in used_inside for v in n.outputs)
            )
        ]
        if not border:
            return group
        group = [n for n in group if n not in border]


# ---------------------------------------------------------------------------------- build
def _group_kind(members: Iterable[Node]) -> str:
    classes = {node_class(n) for n in members}
    for kind in ("matmul", "conv", "reduction"):
        if kind in classes:
            return kind
    return "elementwise"


def _is_copyable_creation(value: Value) -> bool:
    node = value.producer
    return node is not None and node_class(node) == "creation" and not node.inputs


def _build_body(graph: Graph, members: Sequence[Node],
                name: str) -> tuple[Graph, list[Value], list[Value]]:
    """The body graph of a group, its outer operands and the outer values it returns."""
    inside = set(members)
    body = Graph(name)
    vmap: dict[Value, Value] = {}
    operands: list[Value] = []

    def inner(v: Value) -> Value:
        if v in vmap:
            return vmap[v]
        if v.origin == "const" and v.type.numel <= INLINE_CONSTANT_ELEMENTS:
            vmap[v] = body.add_constant(v.data, dtype=v.dtype, name=v.name)
        elif _is_copyable_creation(v):
            src = v.producer
            names = [o.name for o in src.outputs]
            copy = body.add_node(src.op, (), src.attrs, names=names, loc=src.loc)
            vmap.update(zip(src.outputs, copy.outputs))
        else:
            vmap[v] = body.add_input(v.name, v.type)
            operands.append(v)
        return vmap[v]

    for n in members:
        ins = [vmap[v] if v.producer in inside else inner(v) for v in n.inputs]
        copy = body.add_node(n.op, ins, n.attrs, names=[o.name for o in n.outputs], loc=n.loc)
        vmap.update(zip(n.outputs, copy.outputs))
    used_outside = {v for n in graph.nodes if n not in inside for v in n.inputs}
    used_outside.update(graph.outputs)
    escaping = [v for n in members for v in n.outputs if v in used_outside]
    body.set_outputs(vmap[v] for v in escaping)
    return body, operands, escaping


def fuse_groups(graph: Graph, groups: Sequence[Sequence[Node]]) -> Graph:
    """A copy of ``graph`` with each group (nodes of ``graph``) replaced by one ``fused`` node.

    The caller guarantees the groups are disjoint and that fusing them keeps the graph
    acyclic (as :func:`partition` does).
    """
    g, vmap = graph.clone_with_map()
    node_map = {n: vmap[n.outputs[0]].producer for n in graph.nodes if n.outputs}
    counter = sum(1 for n in g.nodes if n.op_name == "fused")
    copied_creations: set[Node] = set()
    for group in groups:
        members = [node_map[n] for n in group]
        kind = _group_kind(members)
        body, operands, escaping = _build_body(g, members, f"{kind}_{counter}")
        counter += 1
        copied_creations.update(v.producer for n in members for v in n.inputs
                                if _is_copyable_creation(v))
        anchor = next((n for n in members if node_class(n) in ANCHORS), members[0])
        names = [v.name for v in escaping]
        for n in members:
            g.remove_node(n)
        fused = g.add_node("fused", operands, {"template": kind, "body": body}, names=names,
                           loc=anchor.loc)
        for old, new in zip(escaping, fused.outputs):
            g.replace_all_uses(old, new)
    used = {v for n in g.nodes for v in n.inputs} | set(g.outputs)
    for n in copied_creations:
        if not any(v in used for v in n.outputs):
            g.remove_node(n)
    g.remove_unused_constants()
    g.sort()
    return g


@register_pass
@dataclass(frozen=True)
class Fuse(Pass):
    """Partition the graph into kernels; each multi-node group becomes one ``fused`` node.

    Options: ``max_nodes`` (largest group), ``strategy`` (one of :data:`STRATEGIES`).
    Guarantees are listed in the module docstring of :mod:`kiln.passes.fusion`.  Constants
    and creation nodes left without users once their users moved into bodies are dropped.
    """

    name: ClassVar[str] = "fuse"
    max_nodes: int = 32
    strategy: str = "greedy"

    def __post_init__(self) -> None:
        _check_options(self.max_nodes, self.strategy)

    def run(self, graph: Graph) -> PassResult:
        groups = partition(graph, self.max_nodes, self.strategy)
        if not groups:
            return PassResult(graph, False)
        return PassResult(fuse_groups(graph, groups), True)


__all__ = ["Fuse", "STRATEGIES", "fuse_groups", "kernel_count", "node_class", "partition"]
