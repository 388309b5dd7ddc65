"""``compute_at`` and ``inline``: moving or substituting a producer statement into its consumers.

``compute_at(S, loop)`` keeps every instance of ``S`` exactly once and moves the loop nest
of ``S`` inside ``loop``: each instance runs in the earliest iteration of ``loop`` (and of the
loops between the common sequence and ``loop``) in which a statement inside ``loop`` reads
what it wrote; instances nobody there reads run at iteration 0.  The placement is the
lexicographic minimum of the consumers' times over the flow dependences, computed by isl,
so it may be piecewise (``max(i - 1, 0)``).

``inline(S)`` replaces every read of the buffer ``S`` stores to by ``S``'s expression, with
``S``'s iterators replaced by the producing instance (``T[x] -> S[i]`` must be an affine
bijection), and removes ``S``.  It is legal when, under the current schedule, every read
instance runs after the instance it reads from, and nothing ``S`` reads is overwritten in
between -- otherwise the recomputed value would differ.
"""

from __future__ import annotations

from dataclasses import replace

import islpy as isl

from kiln.ir.errors import IllegalTransformError, ScheduleError
from kiln.ir.loops.expr import Cast, Expr, Load, dtype_of, loads_of, map_expr, substitute
from kiln.ir.loops.program import If, Loop, Node, Reduce, Store
from kiln.ir.poly.affine import pw_aff_to_expr
from kiln.ir.poly.deps import Dependence, Dependences
from kiln.ir.poly.legality import describe, smallest_pair
from kiln.ir.poly.model import PolyModel, access_relation, build_model
from kiln.ir.poly.tree import Band, Leaf, TreeNode, make_sequence, node_at, replace_at, statements_under, walk_tree

from .tree_ops import find_band, remove_statement


# ----------------------------------------------------------------------------- compute_at
def compute_at(model: PolyModel, deps: Dependences, tree: TreeNode, stmt: str, loop: str) -> TreeNode:
    model.statement(stmt)
    band_l, pl = find_band(tree, loop, "compute_at")
    leaf = next(p for n, p in walk_tree(tree) if isinstance(n, Leaf) and n.stmt == stmt)
    if leaf[:len(pl)] == pl:
        raise ScheduleError(f"compute_at: statement {stmt} is already inside loop '{loop}'")
    top = leaf
    while top and isinstance(node_at(tree, top[:-1]), Band):
        top = top[:-1]
    seq_path, i = top[:-1], top[-1]
    if pl[:len(seq_path)] != seq_path or len(pl) == len(seq_path):
        raise ScheduleError(f"compute_at: loop '{loop}' is not a sibling nest of statement {stmt}'s own loops; "
                            f"{stmt} must sit in loops that contain only it, next to the nest holding '{loop}'")
    if pl[len(seq_path)] < i:
        raise ScheduleError(f"compute_at: loop '{loop}' runs before statement {stmt}; compute_at moves a "
                            f"producer into a later consumer loop")
    chain_paths = [pl[:d] for d in range(len(seq_path) + 1, len(pl) + 1) if isinstance(node_at(tree, pl[:d]), Band)]
    chain = [node_at(tree, p) for p in chain_paths]
    consumers = set(statements_under(band_l))
    flows = [d for d in deps.records if d.kind == "flow" and d.source == stmt and d.sink in consumers]
    if not flows:
        raise ScheduleError(f"compute_at: no statement inside loop '{loop}' reads what {stmt} writes")
    placed: isl.Map | None = None
    for d in flows:
        prefix = None
        for b in chain:
            m = isl.Map.from_pw_aff(b.funcs[d.sink])
            prefix = m if prefix is None else prefix.flat_range_product(m)
        m = d.relation.apply_range(prefix)
        placed = m if placed is None else placed.union(m)
    pma = placed.lexmin_pw_multi_aff()
    # Instances nobody inside the loop reads (for some sizes) run at iteration 0; the
    # legality check decides whether that is acceptable.
    missing = model.statements[stmt].domain.subtract(pma.domain())
    out = tree
    for q, (path, band) in enumerate(zip(chain_paths, chain)):
        placement = pma.get_pw_aff(q)
        if not missing.is_empty():
            zero = isl.PwAff.zero_on_domain(isl.LocalSpace.from_space(missing.get_space())).intersect_domain(missing)
            placement = placement.union_add(zero)
        funcs = {**band.funcs, stmt: placement.coalesce()}
        node = node_at(out, path)
        child = make_sequence([node_at(tree, top), node.child]) if path == pl else node.child
        out = replace_at(out, path, replace(node, funcs=funcs, child=child))
    seq = node_at(out, seq_path)
    kids = list(seq.children)
    del kids[i]
    return replace_at(out, seq_path, make_sequence(kids))


# ----------------------------------------------------------------------------- inline
def inline(model: PolyModel, tree: TreeNode, times: dict[str, isl.Map], stmt: str,
           enforce: bool = True) -> tuple[PolyModel, TreeNode]:
    """The model and tree after inlining ``stmt``; raises ``ScheduleError`` when inlining
    does not apply and, if ``enforce``, ``IllegalTransformError`` when it would change results."""
    ps = model.statement(stmt)
    s = ps.stmt
    program = model.program
    if not isinstance(s, Store) or ps.guards:
        raise ScheduleError(f"inline: {stmt} must be an unconditional plain store, not a reduction")
    buf = program.buffer(s.buffer)
    if buf.scope == "global":
        raise ScheduleError(f"inline: {stmt} stores to global buffer '{buf.name}', which would no longer be "
                            f"written; only local buffers (declared inside the kernel) can be inlined")
    if any(ld.buffer == buf.name for ld in loads_of(s.value)):
        raise ScheduleError(f"inline: {stmt} reads the buffer '{buf.name}' it writes")
    write = access_relation(model, stmt, s.target)
    if write is None or not write.is_injective():
        raise ScheduleError(f"inline: {stmt} must write each cell of '{buf.name}' once through affine indices")
    for other in model.statements.values():
        if other.name != stmt and any(a.array == buf.name for a in other.writes):
            raise ScheduleError(f"inline: {other.name} also writes '{buf.name}'; {stmt} must be its only writer")
    dt = buf.dtype
    value = s.value
    var_dt = {p.name: p.dtype for p in program.params}
    buf_dt = {b.name: b.dtype for b in program.buffers}
    if dtype_of(value, var_dt, buf_dt) != dt:
        value = Cast(dt, value)
    new_bodies: dict[str, Store | Reduce] = {}
    for c in model.statements.values():
        if c.name == stmt:
            continue
        refs = [ld for e in (c.stmt.value, *c.stmt.indices) for ld in loads_of(e) if ld.buffer == buf.name]
        if not refs:
            continue
        replacements: dict[Load, Expr] = {}
        for ref in dict.fromkeys(refs):
            replacements[ref] = _inlined_value(model, times, stmt, value, write, c.name, ref, enforce)
        new_bodies[c.name] = _replace_loads(c.stmt, replacements)
    if not new_bodies:
        raise ScheduleError(f"inline: no statement reads '{buf.name}'")
    new_program = program.replace(body=_rewrite(program.body, stmt, new_bodies))
    new_tree = remove_statement(tree, stmt)
    return build_model(new_program), new_tree


def _inlined_value(model: PolyModel, times: dict[str, isl.Map], stmt: str, value: Expr, write: isl.Map,
                   consumer: str, ref: Load, enforce: bool) -> Expr:
    ps, pc = model.statements[stmt], model.statements[consumer]
    read = access_relation(model, consumer, ref)
    if read is None:
        raise ScheduleError(f"inline: {consumer} reads {ref}, which is not affine")
    producer_of = read.apply_range(write.reverse())  # consumer instance -> producer instance
    uncovered = pc.domain.subtract(producer_of.domain())
    if not uncovered.is_empty():
        raise ScheduleError(f"inline: {consumer} reads cells of '{ref.buffer}' that {stmt} never writes "
                            f"(e.g. at {uncovered.sample_point()})")
    pma = producer_of.lexmin_pw_multi_aff()
    try:
        args = [pw_aff_to_expr(pma.get_pw_aff(q), list(pc.iterators), list(model.params))
                for q in range(len(ps.iterators))]
    except ValueError:
        raise ScheduleError(f"inline: the instance of {stmt} read by {ref} in {consumer} is not one affine "
                            f"function of {consumer}'s iterators") from None
    result = substitute(value, dict(zip(ps.iterators, args)))
    if enforce:
        _check_inline(model, times, stmt, consumer, ref, producer_of, write, read)
    return result


def _check_inline(model: PolyModel, times: dict[str, isl.Map], stmt: str, consumer: str, ref: Load,
                  producer_of: isl.Map, write: isl.Map, read: isl.Map) -> None:
    ps, pc = model.statements[stmt], model.statements[consumer]
    tc, tp = times[consumer], times[stmt]
    early = producer_of.intersect(tc.lex_le_map(tp))
    if not early.is_empty():
        dep = Dependence("flow", ref.buffer, stmt, consumer, early.reverse(), write, read, True)
        v = describe(model, dep, early.reverse(), times)
        raise IllegalTransformError(f"inline {stmt} is illegal: {v.sink} reads {v.array}"
                                    f"[{', '.join(map(str, v.cell))}] no later than {v.source} writes it in the "
                                    f"current schedule: {v.explain()}", v)
    for acc in ps.reads:
        for w in model.statements.values():
            writes = [a.relation for a in w.writes if a.array == acc.array]
            if not writes:
                continue
            ww = writes[0]
            for extra in writes[1:]:
                ww = ww.union(extra)
            tw = times[w.name]
            p_then_w = acc.relation.apply_range(ww.reverse()).intersect(tp.lex_lt_map(tw))
            c_after_w = producer_of.apply_range(p_then_w).intersect(tw.lex_lt_map(tc).reverse())
            if c_after_w.is_empty():
                continue
            pairs = producer_of.reverse().apply_range(c_after_w).intersect(p_then_w)
            dep = Dependence("anti", acc.array, stmt, w.name, pairs, acc.relation, ww, acc.exact)
            v = describe(model, dep, pairs, times)
            params, c_pt, _ = smallest_pair(c_after_w)
            raise IllegalTransformError(
                f"inline {stmt} is illegal: {v.sink} overwrites {v.array}[{', '.join(map(str, v.cell))}] after "
                f"{v.source} reads it and before {pc.instance_text(c_pt)} would recompute {stmt}'s value; "
                f"{v.explain()}", v)


def _replace_loads(s: Store | Reduce, replacements: dict[Load, Expr]) -> Store | Reduce:
    def fix(e: Expr) -> Expr:
        return map_expr(e, lambda x: replacements.get(x) if isinstance(x, Load) else None)

    return replace(s, indices=tuple(fix(i) for i in s.indices), value=fix(s.value))


def _rewrite(nodes: tuple[Node, ...], drop: str, bodies: dict[str, Store | Reduce]) -> tuple[Node, ...]:
    out: list[Node] = []
    for n in nodes:
        if isinstance(n, Loop):
            out.append(replace(n, body=_rewrite(n.body, drop, bodies)))
        elif isinstance(n, If):
            out.append(replace(n, then=_rewrite(n.then, drop, bodies), orelse=_rewrite(n.orelse, drop, bodies)))
        elif n.name != drop:
            out.append(bodies.get(n.name, n))
    return tuple(out)


__all__ = ["compute_at", "inline"]
