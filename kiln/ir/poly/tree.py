"""Schedule trees: when each statement instance runs.

A tree has three kinds of nodes:

* :class:`Band` -- one loop: a name, an annotation, and for every statement below it a
  quasi-affine function (an isl ``PwAff``) of that statement's original iterators and the
  size parameters, giving the loop's iteration in which the instance runs;
* :class:`Sequence` -- children run one after the other;
* :class:`Leaf` -- one statement.

The time of an instance is the vector read along its root-to-leaf path: a band contributes
its function's value, a sequence the index of the child the path enters.  Vectors are
padded with zeros to one length ``D``, and instances run in lexicographic order of their
times.  A band's position ``k`` in that vector is the same for all statements below it,
which is what the parallelism check relies on.

Trees are immutable; schedule primitives build new trees.
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
    if isinstance(node, Leaf):
        return [node.stmt]
    if isinstance(node, Band):
        return statements_under(node.child)
    return [s for c in node.children for s in statements_under(c)]


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


# ----------------------------------------------------------------------------- time maps
def time_dims(node: TreeNode) -> dict[str, list[isl.PwAff | int]]:
    """Per statement, the unpadded time vector: ints for sequence positions, PwAffs for bands."""
    out: dict[str, list[isl.PwAff | int]] = {}

    def visit(n: TreeNode, prefix: list) -> None:
        if isinstance(n, Leaf):
            out[n.stmt] = prefix
        elif isinstance(n, Band):
            visit(n.child, prefix + [n])
        else:
            for i, c in enumerate(n.children):
                visit(c, prefix + [i])

    visit(node, [])
    return {s: [d.funcs[s] if isinstance(d, Band) else d for d in dims] for s, dims in out.items()}


def time_maps(node: TreeNode, model: PolyModel) -> dict[str, isl.Map]:
    """Per statement, the map from its instances to their (padded) time vectors."""
    dims = time_dims(node)
    depth = max((len(d) for d in dims.values()), default=0)
    out: dict[str, isl.Map] = {}
    for stmt, vec in dims.items():
        ps = model.statements[stmt]
        space = ps.domain.get_space()
        m: isl.Map | None = None
        for d in vec + [0] * (depth - len(vec)):
            if isinstance(d, int):
                d = isl.PwAff.from_aff(isl.Aff.zero_on_domain(isl.LocalSpace.from_space(space))
                                       .add_constant_val(isl.Val(d))).intersect_domain(ps.domain)
            piece = isl.Map.from_pw_aff(d)
            m = piece if m is None else m.flat_range_product(piece)
        if m is None:
            m = isl.Map.from_domain_and_range(ps.domain, isl.Set.universe(isl.Space.set_alloc(space.get_ctx(), 0, 0)))
        out[stmt] = m.intersect_domain(ps.domain)
    return out


def union_time_map(maps: dict[str, isl.Map]) -> isl.UnionMap:
    out: isl.UnionMap | None = None
    for m in maps.values():
        um = isl.UnionMap.from_map(m)
        out = um if out is None else out.union(um)
    return out


# ----------------------------------------------------------------------------- printing
def format_tree(node: TreeNode, indent: str = "") -> str:
    """A readable outline of the tree, one node per line."""
    if isinstance(node, Leaf):
        return f"{indent}{node.stmt}"
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


__all__ = ["Band", "Leaf", "Sequence", "TreeNode", "bands", "band_dim", "format_tree", "initial_tree",
           "iterator_function", "make_sequence", "node_at", "replace_at", "statements_under",
           "time_dims", "time_maps", "union_time_map", "walk_tree"]
