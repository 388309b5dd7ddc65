"""Affine changes of bands as pure functions ``tree -> tree``: skew (either nesting order),
unimodular transforms, scaling, shifts by constants, iterators and parameters, and
index-set splitting.

Each function checks its structural preconditions and raises
:class:`~kiln.ir.errors.ScheduleError` with a message saying what is wrong and what to do;
none checks dependences.  Functions of statements a primitive does not change are kept as
the same objects (the legality checker's memo keys on them).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import islpy as isl

from kiln.ir.errors import ParseError, ScheduleError
from kiln.ir.loops.text import parse_expr
from kiln.ir.poly.affine import isl_name, to_isl
from kiln.ir.poly.model import PolyModel
from kiln.ir.poly.tree import Band, Path, Sequence, TreeNode, is_split, make_sequence, node_at, replace_at, restrict

from .tree_ops import fresh_name, find_band, loop_names, perfect_chain


def _int(value, primitive: str, what: str, nonzero: bool = True) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (nonzero and value == 0):
        raise ScheduleError(f"{primitive}: {what} must be a {'non-zero ' if nonzero else ''}integer, got {value!r}")
    return value


def _add_on(v: isl.PwAff, w: isl.PwAff, whole: bool) -> isl.PwAff:
    """``v + w`` where ``w`` is defined, ``v`` elsewhere (``whole``: same domains)."""
    if whole:
        return v.add(w)
    dom = w.domain()
    return v.intersect_domain(dom).add(w).union_add(v.subtract_domain(dom))


# ----------------------------------------------------------------------------- skew
def skew(tree: TreeNode, target: str, source: str, factor: int) -> TreeNode:
    """``target``'s schedule ``+= factor * source``, for the statements under both loops.

    ``source`` may enclose ``target`` (the classic wavefront skew of an inner loop) or be
    enclosed by it (the outer loop's schedule changes for the statements under the inner
    loop); either way the change is unimodular on the band."""
    factor = _int(factor, "skew", "the factor")
    bt, pt = find_band(tree, target, "skew")
    bs, ps = find_band(tree, source, "skew")
    if target == source:
        raise ScheduleError(f"skew: the target and source are both '{target}'; name two loops on one path")
    scaled = {k: bs.funcs[k].scale_val(isl.Val(factor)) for k in bs.funcs if k in bt.funcs}
    if not (ps == pt[:len(ps)] or pt == ps[:len(pt)]):
        raise ScheduleError(f"skew: loops '{target}' and '{source}' are not on one path (neither encloses the "
                            f"other); skew a loop by an enclosing or an enclosed loop")
    funcs = dict(bt.funcs)
    for k, w in scaled.items():
        funcs[k] = _add_on(funcs[k], w, len(ps) < len(pt) or not is_split(bt, k))
    return replace_at(tree, pt, replace(bt, funcs=funcs))


# ----------------------------------------------------------------------------- unimodular transforms
def determinant(matrix: list[list[int]]) -> int:
    """The exact determinant of an integer matrix."""
    m = [[Fraction(x) for x in row] for row in matrix]
    n, det = len(m), Fraction(1)
    for c in range(n):
        pivot = next((r for r in range(c, n) if m[r][c] != 0), None)
        if pivot is None:
            return 0
        if pivot != c:
            m[c], m[pivot] = m[pivot], m[c]
            det = -det
        det *= m[c][c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            m[r] = [a - f * b for a, b in zip(m[r], m[c])]
    return int(det)


def transform(tree: TreeNode, loops: list[str], matrix: list[list[int]]) -> TreeNode:
    """Replace the perfectly nested ``loops`` (outer to inner) by the band ``matrix * loops``.

    Row ``r`` gives the new ``r``-th loop's schedule as an integer combination of the old
    loops'.  The matrix must be unimodular (determinant 1 or -1) so that every instance
    keeps its own time and the new loops have unit steps.  A row that is a (signed) unit
    vector keeps that loop's name and annotation; other rows take the remaining names,
    position first."""
    loops = list(loops)
    chain, path = perfect_chain(tree, loops, "transform")
    n = len(chain)
    rows = _matrix(matrix, n)
    det = determinant(rows)
    if abs(det) != 1:
        raise ScheduleError(f"transform: the matrix {rows} has determinant {det}; only unimodular matrices "
                            f"(determinant 1 or -1) keep one instance per time point -- use scale or tile "
                            f"for non-unimodular changes")
    names: list[str | None] = [None] * n
    for r, row in enumerate(rows):
        nonzero = [c for c, x in enumerate(row) if x]
        if len(nonzero) == 1 and abs(row[nonzero[0]]) == 1:
            names[r] = loops[nonzero[0]]
    free = [x for x in loops if x not in names]
    for r in range(n):
        if names[r] is None:
            names[r] = loops[r] if loops[r] in free else free[0]
            free.remove(names[r])
    by_name = {b.name: b for b in chain}
    stmts = list(chain[0].funcs)
    inner: TreeNode = chain[-1].child
    for r in reversed(range(n)):
        funcs = {}
        for s in stmts:
            total: isl.PwAff | None = None
            for c, x in enumerate(rows[r]):
                if x:
                    term = chain[c].funcs[s] if x == 1 else chain[c].funcs[s].scale_val(isl.Val(x))
                    total = term if total is None else total.add(term)
            funcs[s] = total
        inner = Band(names[r], funcs, inner, by_name[names[r]].annotation)
    return replace_at(tree, path, inner)


def _matrix(matrix, n: int) -> list[list[int]]:
    try:
        rows = [[x for x in row] for row in matrix]
    except TypeError:
        raise ScheduleError(f"transform: the matrix must be a list of {n} rows of {n} integers, got {matrix!r}") \
            from None
    if len(rows) != n or any(len(r) != n for r in rows) or \
            any(isinstance(x, bool) or not isinstance(x, int) for r in rows for x in r):
        raise ScheduleError(f"transform: the matrix must be {n} x {n} integers (one row and one column per loop), "
                            f"got {matrix!r}")
    return rows


def scale(tree: TreeNode, loop: str, factor: int) -> TreeNode:
    """Multiply ``loop``'s schedule by ``factor``: the loop runs with stride ``|factor|``
    (backwards for a negative factor), which leaves room to interleave shifted statements."""
    factor = _int(factor, "scale", "the factor")
    b, path = find_band(tree, loop, "scale")
    return replace_at(tree, path, replace(b, funcs={k: v.scale_val(isl.Val(factor)) for k, v in b.funcs.items()}))


# ----------------------------------------------------------------------------- shifts
def offset_function(model: PolyModel, stmt: str, offset: int | str, primitive: str) -> isl.PwAff:
    """``offset`` (an integer, or affine text over ``stmt``'s iterators and the size
    parameters, e.g. ``"2 * j + N"``) as a function on ``stmt``'s instances."""
    ps = model.statement(stmt)
    if isinstance(offset, bool) or not isinstance(offset, (int, str)):
        raise ScheduleError(f"{primitive}: the offset must be an integer or an affine expression (text), "
                            f"got {offset!r}")
    text = str(offset) if isinstance(offset, int) else offset
    try:
        expr = parse_expr(text)
    except ParseError as e:
        raise ScheduleError(f"{primitive}: cannot read the offset {offset!r}: {e}") from None
    allowed = set(ps.iterators) | set(model.params)
    affine = to_isl(expr, allowed)
    if affine is None:
        raise ScheduleError(f"{primitive}: the offset {offset!r} is not affine in {stmt}'s iterators "
                            f"({', '.join(ps.iterators) or 'none'}) and the size parameters "
                            f"({', '.join(model.params) or 'none'})")
    space = f"{isl_name(stmt)}[{', '.join(isl_name(i) for i in ps.iterators)}]"
    return isl.PwAff(f"{model.param_prefix}{{ {space} -> [({affine})] }}")


def shift(tree: TreeNode, model: PolyModel, loop: str, statement: str | None, offset: int | str) -> TreeNode:
    """Delay ``statement``'s instances (every statement's when ``None``) by ``offset``
    iterations of ``loop``; ``offset`` may depend on the statement's iterators and on size
    parameters (Tadashi's partial/full shifts by value, variable and parameter)."""
    b, path = find_band(tree, loop, "shift")
    if statement is not None and statement not in b.funcs:
        raise ScheduleError(f"shift: statement '{statement}' is not inside loop '{loop}'; "
                            f"it contains {', '.join(b.funcs)}")
    funcs = dict(b.funcs)
    for s in ([statement] if statement is not None else list(b.funcs)):
        if isinstance(offset, int) and not isinstance(offset, bool):
            funcs[s] = funcs[s].add_constant_val(isl.Val(offset))
        else:
            funcs[s] = funcs[s].add(offset_function(model, s, offset, "shift"))
    return replace_at(tree, path, replace(b, funcs=funcs))


# ----------------------------------------------------------------------------- index-set splitting
def split_at(tree: TreeNode, model: PolyModel, loop: str, value: int | str) -> TreeNode:
    """Index-set splitting: the iterations of ``loop`` below ``value`` run in a first copy of
    the loop (named ``loop``), the others in a second one after it (``<loop>_b``, its inner
    loops renamed ``<name>_b`` alike).  ``value`` is an integer or affine text over the
    statements' iterators and the size parameters (``"N - 2"``)."""
    b, path = find_band(tree, loop, "split_at")
    lo, hi = {}, {}
    for s, f in b.funcs.items():
        v = offset_function(model, s, value, "split_at")
        lo[s] = f.lt_set(v).coalesce()
        hi[s] = f.ge_set(v).coalesce()
    first, second = restrict(b, lo), restrict(b, hi)
    if first is None or second is None:
        side = "at or after" if first is None else "before"
        raise ScheduleError(f"split_at: every iteration of loop '{loop}' runs {side} {value!r} for every size; "
                            f"there is nothing to split")
    second = _rename(second, set(loop_names(tree)))
    return _splice(tree, path, [first, second])


def _rename(node: TreeNode, taken: set[str]) -> TreeNode:
    if isinstance(node, Band):
        name = fresh_name(node, f"{node.name}_b", taken)
        taken.add(name)
        return replace(node, name=name, child=_rename(node.child, taken))
    if isinstance(node, Sequence):
        return Sequence(tuple(_rename(c, taken) for c in node.children))
    return node


def _splice(tree: TreeNode, path: Path, nodes: list[TreeNode]) -> TreeNode:
    """Replace the node at ``path`` by ``nodes`` in order (in its parent sequence if any)."""
    if path and isinstance(node_at(tree, path[:-1]), Sequence):
        parent = node_at(tree, path[:-1])
        kids = list(parent.children)
        i = path[-1]
        return replace_at(tree, path[:-1], make_sequence(kids[:i] + nodes + kids[i + 1:]))
    return replace_at(tree, path, make_sequence(nodes))


__all__ = ["determinant", "offset_function", "scale", "shift", "skew", "split_at", "transform"]
