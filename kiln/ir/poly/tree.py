"""Schedule trees: when each statement instance runs.

A tree has three kinds of nodes:

* :class:`Band` -- one loop: a name, an annotation, and for every statement below it a
  quasi-affine function (an isl ``PwAff``) of that statement's original iterators and the
  size parameters, giving the loop's iteration in which the instance runs;
* :class:`Sequence` -- children run one after the other;
* :class:`Leaf` -- one statement, or a *piece* of it: ``domain`` (an isl set, ``None`` for
  every instance) says which of its instances this leaf runs.  Index-set splitting puts the
  pieces of one statement in different leaves; the pieces of a statement are disjoint and
  cover its domain, and a band's function for a statement is defined exactly on the pieces
  below that band.

The time of an instance is the vector read along its root-to-leaf path: a band contributes
its function's value, a sequence the index of the child the path enters.  Vectors are
padded with zeros to one length ``D``, and instances run in lexicographic order of their
times.  A band's position ``k`` in that vector is the same for all statements below it,
which is what the parallelism check relies on.

Trees are immutable; schedule primitives build new trees and reuse the ``PwAff`` objects
they do not change (the legality checker's memo relies on that identity).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import islpy as isl

from ..loops.program import SERIAL, Annotation
from .model import LoopShape, PolyModel


@dataclass(frozen=True, eq=False)
class Leaf:
    stmt: str
    domain: isl.Set | None = None


@dataclass(frozen=True, eq=False)
class Band:
    name: str
    funcs: dict[str, isl.PwAff]
    child: TreeNode
    annotation: Annotation = SERIAL


@dataclass(frozen=True, eq=False)
class Sequence:
    children: tuple[TreeNode, ...] = field(default_factory=tuple)


TreeNode = Band | Sequence | Leaf
Path = tuple[int, ...]


# ----------------------------------------------------------------------------- building
def initial_tree(model: PolyModel) -> TreeNode:
    """The tree of the program as written: one band per loop, sequences in textual order."""
    return _seq([_from_shape(model, s) for s in model.shape])


def _from_shape(model: PolyModel, shape: LoopShape | str) -> TreeNode:
    if isinstance(shape, str):
        return Leaf(shape)
    child = _seq([_from_shape(model, c) for c in shape.children])
    funcs = {}
    for stmt in statements_under(child):
        ps = model.statements[stmt]
        pos = ps.iterators.index(shape.iterator)
        funcs[stmt] = iterator_function(ps.domain, pos)
    return Band(shape.name, funcs, child, shape.annotation)


def iterator_function(domain: isl.Set, pos: int) -> isl.PwAff:
    """The PwAff ``S[i0, ..] -> [i_pos]`` on ``domain``."""
    aff = isl.Aff.var_on_domain(isl.LocalSpace.from_space(domain.get_space()), isl.dim_type.set, pos)
    return isl.PwAff.from_aff(aff).intersect_domain(domain)


def _seq(children: list[TreeNode]) -> TreeNode:
    flat: list[TreeNode] = []
    for c in children:
        if isinstance(c, Sequence):
            flat += list(c.children)
        else:
            flat.append(c)
    return flat[0] if len(flat) == 1 else Sequence(tuple(flat))


make_sequence = _seq


# ----------------------------------------------------------------------------- queries
def statements_under(node: TreeNode) -> list[str]:
    """The statements with a leaf under ``node``, each once, in tree order."""
    return list(dict.fromkeys(leaf.stmt for leaf, _ in leaves(node)))


def leaves(node: TreeNode, path: Path = ()) -> Iterator[tuple[Leaf, Path]]:
    """Every leaf under ``node`` with its path, in tree order."""
    if isinstance(node, Leaf):
        yield node, path
    elif isinstance(node, Band):
        yield from leaves(node.child, path + (0,))
    else:
        for i, c in enumerate(node.children):
            yield from leaves(c, path + (i,))


def is_split(node: TreeNode, stmt: str) -> bool:
    """Whether ``stmt`` runs in pieces (leaves with a domain filter) under ``node``."""
    return any(leaf.domain is not None for leaf, _ in leaves(node) if leaf.stmt == stmt)


def walk_tree(node: TreeNode, path: Path = ()) -> Iterator[tuple[TreeNode, Path]]:
    """Every node with its path (child indices from the root; a band's child is index 0)."""
    yield node, path
    if isinstance(node, Band):
        yield from walk_tree(node.child, path + (0,))
    elif isinstance(node, Sequence):
        for i, c in enumerate(node.children):
            yield from walk_tree(c, path + (i,))


def bands(node: TreeNode) -> list[tuple[Band, Path]]:
    return [(n, p) for n, p in walk_tree(node) if isinstance(n, Band)]


def node_at(node: TreeNode, path: Path) -> TreeNode:
    for i in path:
        node = node.child if isinstance(node, Band) else node.children[i]
    return node


def replace_at(node: TreeNode, path: Path, new: TreeNode) -> TreeNode:
    """A copy of the tree with the node at ``path`` replaced by ``new``."""
    if not path:
        return new
    i, rest = path[0], path[1:]
    if isinstance(node, Band):
        return replace(node, child=replace_at(node.child, rest, new))
    kids = list(node.children)
    kids[i] = replace_at(kids[i], rest, new)
    return Sequence(tuple(kids))


def band_dim(path: Path) -> int:
    """The time-vector position of the node at ``path``: one per ancestor."""
    return len(path)


# ----------------------------------------------------------------------------- pieces
def merge_funcs(a: dict[str, isl.PwAff], b: dict[str, isl.PwAff]) -> dict[str, isl.PwAff]:
    """The band functions of ``a`` and ``b`` together; a statement in both (two pieces of
    it, on disjoint domains) gets the union of its two functions."""
    out = dict(a)
    for s, f in b.items():
        out[s] = out[s].union_add(f) if s in out else f
    return out


def restrict(node: TreeNode, domains: dict[str, isl.Set]) -> TreeNode | None:
    """``node`` running only the instances in ``domains`` of the statements named there
    (other statements are kept whole).  Leaves left without instances disappear, and so do
    bands and sequences left empty; ``None`` if nothing is left."""
    if isinstance(node, Leaf):
        dom = domains.get(node.stmt)
        if dom is None:
            return node
        dom = dom if node.domain is None else node.domain.intersect(dom)
        return None if dom.is_empty() else Leaf(node.stmt, dom.coalesce())
    if isinstance(node, Band):
        child = restrict(node.child, domains)
        if child is None:
            return None
        under = set(statements_under(child))
        funcs = {s: (f.intersect_domain(domains[s]).coalesce() if s in domains else f)
                 for s, f in node.funcs.items() if s in under}
        return replace(node, funcs=funcs, child=child)
    kids = [k for k in (restrict(c, domains) for c in node.children) if k is not None]
    return make_sequence(kids) if kids else None


def subtree_domains(node: TreeNode, model: PolyModel) -> dict[str, isl.Set]:
    """Per statement under ``node``, the instances its leaves there run."""
    out: dict[str, isl.Set] = {}
    for leaf, _ in leaves(node):
        dom = model.statements[leaf.stmt].domain if leaf.domain is None else leaf.domain
        out[leaf.stmt] = out[leaf.stmt].union(dom) if leaf.stmt in out else dom
    return out


# ----------------------------------------------------------------------------- time maps
Component = Band | int
"""One entry of a leaf's time vector: the band it reads, or a sequence position."""


def leaf_vectors(node: TreeNode) -> list[tuple[Leaf, Path, tuple[Component, ...]]]:
    """Every leaf with its path and its unpadded time vector (bands and sequence positions)."""
    out: list[tuple[Leaf, Path, tuple[Component, ...]]] = []

    def visit(n: TreeNode, path: Path, prefix: tuple[Component, ...]) -> None:
        if isinstance(n, Leaf):
            out.append((n, path, prefix))
        elif isinstance(n, Band):
            visit(n.child, path + (0,), prefix + (n,))
        else:
            for i, c in enumerate(n.children):
                visit(c, path + (i,), prefix + (i,))

    visit(node, (), ())
    return out


def time_dims(node: TreeNode) -> dict[str, list[isl.PwAff | int]]:
    """Per statement, the unpadded time vector of its first leaf: ints for sequence
    positions, PwAffs for bands."""
    out: dict[str, list[isl.PwAff | int]] = {}
    for leaf, _, vec in leaf_vectors(node):
        out.setdefault(leaf.stmt, [d.funcs[leaf.stmt] if isinstance(d, Band) else d for d in vec])
    return out


def vector_map(stmt: str, vec: tuple[Component, ...], domain: isl.Set, depth: int) -> isl.Map:
    """The map from ``domain`` (instances of ``stmt``) to time vectors padded to ``depth``."""
    space = domain.get_space()
    m: isl.Map | None = None
    for d in list(vec) + [0] * (depth - len(vec)):
        if isinstance(d, Band):
            pa = d.funcs[stmt]
        else:
            pa = isl.PwAff.from_aff(isl.Aff.zero_on_domain(isl.LocalSpace.from_space(space))
                                    .add_constant_val(isl.Val(d))).intersect_domain(domain)
        piece = isl.Map.from_pw_aff(pa)
        m = piece if m is None else m.flat_range_product(piece)
    if m is None:
        m = isl.Map.from_domain_and_range(domain, isl.Set.universe(isl.Space.set_alloc(space.get_ctx(), 0, 0)))
    return m.intersect_domain(domain)


def leaf_time_maps(node: TreeNode, model: PolyModel) -> list[tuple[Leaf, Path, isl.Map]]:
    """Every leaf with the (padded) time map of the instances it runs."""
    vecs = leaf_vectors(node)
    depth = max((len(v) for _, _, v in vecs), default=0)
    out = []
    for leaf, path, vec in vecs:
        dom = model.statements[leaf.stmt].domain if leaf.domain is None else leaf.domain
        out.append((leaf, path, vector_map(leaf.stmt, vec, dom, depth)))
    return out


def time_maps(node: TreeNode, model: PolyModel) -> dict[str, isl.Map]:
    """Per statement, the map from its instances to their (padded) time vectors."""
    out: dict[str, isl.Map] = {}
    for leaf, _, m in leaf_time_maps(node, model):
        out[leaf.stmt] = out[leaf.stmt].union(m) if leaf.stmt in out else m
    return out


def union_time_map(maps: dict[str, isl.Map]) -> isl.UnionMap:
    out: isl.UnionMap | None = None
    for m in maps.values():
        um = isl.UnionMap.from_map(m)
        out = um if out is None else out.union(um)
    return out


def depth_of(node: TreeNode) -> int:
    """The length ``D`` of the padded time vectors."""
    return max((len(v) for _, _, v in leaf_vectors(node)), default=0)


# ----------------------------------------------------------------------------- printing
def format_tree(node: TreeNode, indent: str = "") -> str:
    """A readable outline of the tree, one node per line."""
    if isinstance(node, Leaf):
        if node.domain is None:
            return f"{indent}{node.stmt}"
        return f"{indent}{node.stmt} {_set_text(node.domain)}"
    if isinstance(node, Sequence):
        lines = [f"{indent}sequence"] + [format_tree(c, indent + "  ") for c in node.children]
        return "\n".join(lines)
    funcs = "; ".join(f"{s}: {_pw_text(pa)}" for s, pa in node.funcs.items())
    ann = "" if node.annotation.mode == "serial" else f" @{node.annotation.mode}"
    return f"{indent}band {node.name}{ann} [{funcs}]\n" + format_tree(node.child, indent + "  ")


def _pw_text(pa: isl.PwAff) -> str:
    text = str(pa.gist(pa.domain()))
    body = text[text.index("{") + 1:text.rindex("}")].strip()
    return body.split("->", 1)[1].strip() if "->" in body else body


def _set_text(s: isl.Set) -> str:
    text = str(s)
    return text[text.index("{"):text.rindex("}") + 1]


__all__ = ["Band", "Component", "Leaf", "Sequence", "TreeNode", "bands", "band_dim", "depth_of", "format_tree",
           "initial_tree", "is_split", "iterator_function", "leaf_time_maps", "leaf_vectors", "leaves",
           "make_sequence", "merge_funcs", "node_at", "replace_at", "restrict", "statements_under",
           "subtree_domains", "time_dims", "time_maps", "union_time_map", "vector_map", "walk_tree"]
