"""Schedule primitives as pure functions ``tree -> tree`` on schedule trees.

Each function checks its structural preconditions and raises
:class:`~kiln.ir.errors.ScheduleError` with a message saying what is wrong and what to do;
it never checks dependences (that is :class:`~kiln.passes.schedule.Schedule`'s job).
Affine changes of bands (skew, transforms, scaling, shifts, index-set splitting) are in
:mod:`.band_ops`.
"""

from __future__ import annotations

from dataclasses import replace

import islpy as isl

from kiln.ir.errors import ScheduleError
from kiln.ir.loops.program import Annotation
from kiln.ir.names import unique_name
from kiln.ir.poly.model import PolyModel
from kiln.ir.poly.tree import (
    Band, Leaf, Path, Sequence, TreeNode, bands, is_split, make_sequence, merge_funcs, node_at, replace_at,
    statements_under, subtree_domains,
)


# ----------------------------------------------------------------------------- lookup
def loop_names(tree: TreeNode) -> list[str]:
    return [b.name for b, _ in bands(tree)]


def find_band(tree: TreeNode, name: str, primitive: str) -> tuple[Band, Path]:
    if not isinstance(name, str):
        raise ScheduleError(f"{primitive}: a loop is named by a string, got {name!r}")
    for b, p in bands(tree):
        if b.name == name:
            return b, p
    raise ScheduleError(f"{primitive}: unknown loop '{name}'; loops: {', '.join(loop_names(tree)) or 'none'}")


def fresh_name(tree: TreeNode, base: str, also_taken: set[str] | None = None) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : a loop name not used in ``tree``."""
    return unique_name(base, set(loop_names(tree)) | (also_taken or set()))


def _describe(node: TreeNode) -> str:
    if isinstance(node, Leaf):
        return f"statement {node.stmt}"
    if isinstance(node, Band):
        return f"loop '{node.name}'"
    return "a sequence of " + ", ".join(_describe(c).split(" ", 1)[1] for c in node.children)


def perfect_chain(tree: TreeNode, names: list[str], primitive: str) -> tuple[list[Band], Path]:
    """The bands ``names``, which must be perfectly nested in this order (each the only child
    of the previous); returns them and the path of the first."""
    found = [find_band(tree, n, primitive) for n in names]
    if len(set(names)) != len(names):
        raise ScheduleError(f"{primitive}: loop names repeat in {names}")
    for (outer, op), (inner, ip) in zip(found, found[1:]):
        if ip != op + (0,) or not isinstance(node_at(tree, op), Band) or node_at(tree, op).child is not inner:
            raise ScheduleError(f"{primitive}: loops '{outer.name}' and '{inner.name}' are not perfectly nested: "
                                f"'{outer.name}' directly contains {_describe(outer.child)}; list directly nested "
                                f"loops from outer to inner (use fission to separate statements first)")
    return [b for b, _ in found], found[0][1]


# ----------------------------------------------------------------------------- loop order
def interchange(tree: TreeNode, a: str, b: str) -> TreeNode:
    ba, pa = find_band(tree, a, "interchange")
    bb, pb = find_band(tree, b, "interchange")
    if a == b:
        raise ScheduleError(f"interchange: both loops are '{a}'; name two different loops")
    if len(pb) < len(pa):
        (ba, pa), (bb, pb) = (bb, pb), (ba, pa)
    if pb[:len(pa)] != pa:
        raise ScheduleError(f"interchange: loops '{ba.name}' and '{bb.name}' are not nested in each other")
    for depth in range(len(pa), len(pb)):
        mid = node_at(tree, pb[:depth])
        if not isinstance(mid, Band):
            raise ScheduleError(f"interchange: loops '{ba.name}' and '{bb.name}' are not perfectly nested: "
                                f"between them is {_describe(mid)}; use fission to separate statements first")
    out = replace_at(tree, pb, Band(ba.name, ba.funcs, bb.child, ba.annotation))
    inner_old = node_at(out, pa)
    return replace_at(out, pa, Band(bb.name, bb.funcs, inner_old.child, bb.annotation))


def tile(tree: TreeNode, loops: list[str], sizes: list[int]) -> TreeNode:
    loops, sizes = list(loops), list(sizes)
    if not loops or len(loops) != len(sizes):
        raise ScheduleError(f"tile: give one size per loop, got loops {loops} and sizes {sizes}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ScheduleError(f"tile: sizes must be positive integers, got {sizes}")
    chain, path = perfect_chain(tree, loops, "tile")
    names: list[str] = []
    for b in chain:
        names.append(fresh_name(tree, f"{b.name}_tile", set(names)))
    inner: TreeNode = chain[-1].child
    for b in reversed(chain):
        inner = Band(b.name, b.funcs, inner, b.annotation)
    for b, s, n in reversed(list(zip(chain, sizes, names))):
        funcs = {k: v.scale_down_val(isl.Val(s)).floor() for k, v in b.funcs.items()}
        inner = Band(n, funcs, inner)
    return replace_at(tree, path, inner)


def split(tree: TreeNode, loop: str, factor: int) -> TreeNode:
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ScheduleError(f"split: the factor must be a positive integer, got {factor!r}")
    b, path = find_band(tree, loop, "split")
    outer_name = fresh_name(tree, f"{loop}_o")
    inner_name = fresh_name(tree, f"{loop}_i", {outer_name})
    inner = Band(inner_name, {k: v.mod_val(isl.Val(factor)) for k, v in b.funcs.items()}, b.child, b.annotation)
    outer = Band(outer_name, {k: v.scale_down_val(isl.Val(factor)).floor() for k, v in b.funcs.items()}, inner)
    return replace_at(tree, path, outer)


def reverse(tree: TreeNode, loop: str) -> TreeNode:
    b, path = find_band(tree, loop, "reverse")
    return replace_at(tree, path, replace(b, funcs={k: v.neg() for k, v in b.funcs.items()}))


# ----------------------------------------------------------------------------- structure
def fuse(tree: TreeNode, a: str, b: str) -> TreeNode:
    """Merge loop ``b`` into loop ``a``, a later sibling of it in one sequence: the fused loop
    takes ``a``'s place and runs ``b``'s body after ``a``'s in each iteration (children
    between the two now run after the fused loop)."""
    ba, pa = find_band(tree, a, "fuse")
    bb, pb = find_band(tree, b, "fuse")
    parent_path = pa[:-1]
    parent = node_at(tree, parent_path) if pa else None
    if not pa or not isinstance(parent, Sequence) or pb[:-1] != parent_path or pb[-1] <= pa[-1]:
        raise ScheduleError(f"fuse: loop '{b}' must follow loop '{a}' in the same sequence (sibling loops, "
                            f"'{a}' first)")
    ann = ba.annotation if ba.annotation == bb.annotation else Annotation()
    fused = Band(a, merge_funcs(ba.funcs, bb.funcs), make_sequence([ba.child, bb.child]), ann)
    kids = list(parent.children)
    i, j = pa[-1], pb[-1]
    new_parent = make_sequence(kids[:i] + [fused] + kids[i + 1:j] + kids[j + 1:])
    return replace_at(tree, parent_path, new_parent)


def full_fuse(tree: TreeNode, loop: str) -> TreeNode:
    """Fuse every loop of the sequence ``loop`` belongs to into one loop named after the
    first (Tadashi's ``full_fuse``); every child of that sequence must be a loop."""
    _, path = find_band(tree, loop, "full_fuse")
    parent = node_at(tree, path[:-1]) if path else None
    if not isinstance(parent, Sequence):
        raise ScheduleError(f"full_fuse: loop '{loop}' is not in a sequence; there is nothing to fuse it with")
    if not all(isinstance(c, Band) for c in parent.children):
        raise ScheduleError(f"full_fuse: the sequence of loop '{loop}' holds {_describe(parent)}; every child must "
                            f"be a loop (use fuse for some of them)")
    kids = parent.children
    funcs: dict = {}
    for c in kids:
        funcs = merge_funcs(funcs, c.funcs)
    same = all(c.annotation == kids[0].annotation for c in kids)
    fused = Band(kids[0].name, funcs, make_sequence([c.child for c in kids]), kids[0].annotation if same
                 else Annotation())
    return replace_at(tree, path[:-1], fused)


def fission(tree: TreeNode, loop: str, split_before_child: int | str, model: PolyModel | None = None) -> TreeNode:
    b, path = find_band(tree, loop, "fission")
    if not isinstance(b.child, Sequence):
        raise ScheduleError(f"fission: loop '{loop}' directly contains {_describe(b.child)}; "
                            f"there is nothing to split")
    kids = list(b.child.children)
    k = _child_index(kids, split_before_child, loop)
    parts = [make_sequence(kids[:k]), make_sequence(kids[k:])]
    return _split_band(tree, b, path, parts, model)


def full_split(tree: TreeNode, loop: str, model: PolyModel | None = None) -> TreeNode:
    """One copy of ``loop`` per child of the sequence it holds (Tadashi's ``full_split``):
    ``for i {S; T; U}`` -> ``for i {S} for i_b {T} for i_b_1 {U}``."""
    b, path = find_band(tree, loop, "full_split")
    if not isinstance(b.child, Sequence):
        raise ScheduleError(f"full_split: loop '{loop}' directly contains {_describe(b.child)}; "
                            f"there is nothing to split")
    return _split_band(tree, b, path, list(b.child.children), model)


def _split_band(tree: TreeNode, b: Band, path: Path, parts: list[TreeNode], model: PolyModel | None) -> TreeNode:
    """``b`` replaced by one copy per part (the first keeps the name, the others
    ``<name>_b``, ``<name>_b_1``, ...), spliced into the parent sequence."""
    copies: list[TreeNode] = []
    taken: set[str] = set()
    for n, part in enumerate(parts):
        under = statements_under(part)
        pieces = subtree_domains(part, model) if model is not None else {}
        funcs = {s: (f.intersect_domain(pieces[s]) if is_split(b, s) and s in pieces else f)
                 for s, f in b.funcs.items() if s in under}
        name = b.name if n == 0 else fresh_name(tree, f"{b.name}_b", taken)
        taken.add(name)
        copies.append(Band(name, funcs, part, b.annotation))
    if path and isinstance(node_at(tree, path[:-1]), Sequence):
        parent = node_at(tree, path[:-1])
        siblings = list(parent.children)
        i = path[-1]
        return replace_at(tree, path[:-1], make_sequence(siblings[:i] + copies + siblings[i + 1:]))
    return replace_at(tree, path, Sequence(tuple(copies)))


def _child_index(kids: list[TreeNode], split: int | str, loop: str) -> int:
    names = [c.stmt if isinstance(c, Leaf) else c.name if isinstance(c, Band) else None for c in kids]
    if isinstance(split, str):
        if split not in names:
            raise ScheduleError(f"fission: '{split}' is not a direct child of loop '{loop}'; its children are "
                                f"{', '.join(n or '<sequence>' for n in names)}")
        k = names.index(split)
    elif isinstance(split, int) and not isinstance(split, bool):
        k = split
    else:
        raise ScheduleError(f"fission: split_before_child is a child index or name, got {split!r}")
    if not 1 <= k < len(kids):
        raise ScheduleError(f"fission: split position {split!r} of loop '{loop}' must leave children on both sides "
                            f"(1 to {len(kids) - 1}); children: {', '.join(n or '<sequence>' for n in names)}")
    return k


def annotate(tree: TreeNode, loop: str, annotation: Annotation, primitive: str) -> TreeNode:
    b, path = find_band(tree, loop, primitive)
    if annotation.mode == "vectorized" and not _innermost(b):
        raise ScheduleError(f"vectorize: loop '{loop}' is not innermost: it contains {_describe(b.child)}")
    return replace_at(tree, path, replace(b, annotation=annotation))


def _innermost(b: Band) -> bool:
    child = b.child
    kids = child.children if isinstance(child, Sequence) else (child,)
    return all(isinstance(c, Leaf) for c in kids)


def remove_statement(tree: TreeNode, stmt: str) -> TreeNode | None:
    """The tree without ``stmt``; bands and sequences left empty disappear."""
    if isinstance(tree, Leaf):
        return None if tree.stmt == stmt else tree
    if isinstance(tree, Band):
        child = remove_statement(tree.child, stmt)
        if child is None:
            return None
        return replace(tree, funcs={k: v for k, v in tree.funcs.items() if k != stmt}, child=child)
    kids = [c for c in (remove_statement(c, stmt) for c in tree.children) if c is not None]
    return make_sequence(kids) if kids else None
