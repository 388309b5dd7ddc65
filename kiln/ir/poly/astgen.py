"""From a schedule tree back to a loop program, through isl's AST generator.

The tree's time maps are handed to ``isl_ast_build``; the resulting AST (loops, guards,
blocks, statement calls) is translated node by node:

* an AST ``for`` over time position ``k`` becomes a :class:`Loop` named after the band at
  position ``k`` of the statements it contains, with that band's annotation;
* an AST ``if`` becomes an :class:`If`;
* a statement call ``S(e0, e1, ...)`` becomes a copy of ``S`` with its original iterators
  replaced by ``e0, e1, ...`` (affine indices are put in canonical form), wrapped in its
  non-affine guards if it has any.

A statement split into pieces (leaves with domain filters, after index-set splitting) is
handed to isl as one statement per piece (``S__piece1``, ...), so that every loop is named
after the band of the piece it runs; each copy of the statement is labelled ``S``, ``S_1``...

isl division and remainder operators map to ``floordiv``/``floormod`` (their operands are
non-negative where isl uses the C-style ones), except ``zdiv_r`` which keeps C's ``%``.
"""

from __future__ import annotations

import islpy as isl

from ..errors import ScheduleError
from ..loops.expr import (
    Binary, Const, Expr, Load, Select, Unary, Var, add_const, affine_expr, affine_form, loads_of, map_expr, substitute,
)
from ..loops.program import If, Loop, Node, Program, Reduce, Store
from .affine import plain_name
from .model import PolyModel
from .tree import Band, Leaf, TreeNode, leaf_time_maps

_ITER = "kt"

_BINOPS = {
    isl.ast_expr_op_type.add: "+", isl.ast_expr_op_type.sub: "-", isl.ast_expr_op_type.mul: "*",
    isl.ast_expr_op_type.div: "floordiv", isl.ast_expr_op_type.fdiv_q: "floordiv",
    isl.ast_expr_op_type.pdiv_q: "floordiv", isl.ast_expr_op_type.pdiv_r: "floormod",
    isl.ast_expr_op_type.zdiv_r: "%", isl.ast_expr_op_type.eq: "==", isl.ast_expr_op_type.le: "<=",
    isl.ast_expr_op_type.lt: "<", isl.ast_expr_op_type.ge: ">=", isl.ast_expr_op_type.gt: ">",
    isl.ast_expr_op_type.and_: "&&", isl.ast_expr_op_type.and_then: "&&",
    isl.ast_expr_op_type.or_: "||", isl.ast_expr_op_type.or_else: "||",
    isl.ast_expr_op_type.min: "min", isl.ast_expr_op_type.max: "max",
}


def generate(model: PolyModel, tree: TreeNode, name: str | None = None, atomic: bool = True) -> Program:
    """The loop program that runs ``model``'s statements in the order ``tree`` gives.

    With ``atomic`` (the default) isl emits every statement once per loop level, guarding
    partial iterations with ``if``; otherwise it may split loops into separate copies for
    boundary iterations (fewer guards, more code, duplicated statements named ``S0_1``...).
    """
    gen = _AstToLoops(model, tree, atomic)
    body = gen.run()
    used = {b for n, _ in _walk_nodes(body) for b in _buffers_of(n)}
    buffers = tuple(b for b in model.program.buffers if b.scope == "global" or b.name in used)
    return Program(name or model.program.name, model.program.params, buffers, body)


def _walk_nodes(nodes):
    for n in nodes:
        yield n, None
        if isinstance(n, Loop):
            yield from _walk_nodes(n.body)
        elif isinstance(n, If):
            yield from _walk_nodes(n.then)
            yield from _walk_nodes(n.orelse)


def _buffers_of(n: Node) -> set[str]:
    if isinstance(n, (Store, Reduce)):
        return {n.buffer} | {ld.buffer for e in (n.value, *n.indices) for ld in loads_of(e)}
    if isinstance(n, If):
        return {ld.buffer for ld in loads_of(n.cond)}
    return set()


class _AstToLoops:
    def __init__(self, model: PolyModel, tree: TreeNode, atomic: bool):
        self.model = model
        self.tree = tree
        self.atomic = atomic
        self.bands_at: dict[str, list[Band | None]] = {}
        self.piece_of: dict[str, str] = {}
        self.leaf_maps = leaf_time_maps(tree, model)
        self._collect(tree, [])
        reserved = set(model.program.size_params) | {p.name for p in model.program.params} | \
            {b.name for b in model.program.buffers}
        self.iter_names: dict[str, str] = {}
        for stmt_bands in self.bands_at.values():
            for b in stmt_bands:
                if b is not None and b.name not in self.iter_names:
                    n = b.name
                    while n in reserved:
                        n += "_l"
                    self.iter_names[b.name] = n
        self.seen_stmts: dict[str, int] = {}
        self.used_loop_names: set[str] = set()

    def _collect(self, node: TreeNode, prefix: list[Band | None]) -> None:
        if isinstance(node, Leaf):
            key = node.stmt if node.stmt not in self.bands_at else f"{node.stmt}__piece{len(self.piece_of) + 1}"
            self.piece_of[key] = node.stmt
            self.bands_at[key] = prefix
        elif isinstance(node, Band):
            self._collect(node.child, prefix + [node])
        else:
            for c in node.children:
                self._collect(c, prefix + [None])

    def run(self) -> tuple[Node, ...]:
        if not self.model.statements or not self.leaf_maps:
            return ()
        schedule: isl.UnionMap | None = None
        for key, (_, _, m) in zip(self.bands_at, self.leaf_maps):
            if key != self.piece_of[key]:
                m = m.set_tuple_name(isl.dim_type.in_, key)
            um = isl.UnionMap.from_map(m)
            schedule = um if schedule is None else schedule.union(um)
        depth = self.leaf_maps[0][2].dim(isl.dim_type.out)
        build = isl.AstBuild.from_context(self.model.context)
        if depth:
            ids = isl.IdList.alloc(isl.DEFAULT_CONTEXT, depth)
            for k in range(depth):
                ids = ids.add(isl.Id(f"{_ITER}{k}"))
            build = build.set_iterators(ids)
            if self.atomic:
                dims = ", ".join(f"t{k}" for k in range(depth))
                build = build.set_options(isl.UnionMap(f"{{ [{dims}] -> atomic[x] : 0 <= x < {depth} }}"))
        ast = build.node_from_schedule_map(schedule)
        return tuple(self.node(ast, {}))

    # ----------------------------------------------------------------- nodes
    def node(self, n: isl.AstNode, env: dict[str, str]) -> list[Node]:
        t = n.get_type()
        if t == isl.ast_node_type.block:
            kids = n.block_get_children()
            out: list[Node] = []
            for i in range(kids.n_ast_node()):
                out += self.node(kids.get_at(i), env)
            return out
        if t == isl.ast_node_type.for_:
            return [self.for_loop(n, env)]
        if t == isl.ast_node_type.if_:
            cond = self.expr(n.if_get_cond(), env)
            then = tuple(self.node(n.if_get_then_node(), env))
            orelse = tuple(self.node(n.if_get_else_node(), env)) if n.if_has_else_node() else ()
            return [If(cond, then, orelse)]
        if t == isl.ast_node_type.user:
            return [self.user(n.user_get_expr(), env)]
        if t == isl.ast_node_type.mark:
            return self.node(n.mark_get_node(), env)
        raise ScheduleError(f"isl produced an AST node of unexpected type {t}")

    def for_loop(self, n: isl.AstNode, env: dict[str, str]) -> Loop:
        it = n.for_get_iterator().get_id().get_name()
        k = int(it[len(_ITER):])
        stmts = _user_statements(n)
        band = self.bands_at[stmts[0]][k] if stmts and k < len(self.bands_at[stmts[0]]) else None
        base = self.iter_names[band.name] if band is not None else f"t{k}"
        inner_env = dict(env)
        inner_env[it] = base
        lower = self.expr(n.for_get_init(), env)
        upper = self._upper(n.for_get_cond(), it, inner_env)
        step = n.for_get_inc().get_val().to_python()
        body = tuple(self.node(n.for_get_body(), inner_env))
        name = base if base not in self.used_loop_names else ""
        self.used_loop_names.add(base)
        annotation = band.annotation if band is not None else None
        kwargs = {"annotation": annotation} if annotation is not None else {}
        return Loop(base, lower, upper, body, name=name, step=step, **kwargs)

    def _upper(self, cond: isl.AstExpr, it: str, env: dict[str, str]) -> Expr:
        op = cond.op_get_type()
        if op in (isl.ast_expr_op_type.and_, isl.ast_expr_op_type.and_then):
            a = self._upper(cond.op_get_arg(0), it, env)
            b = self._upper(cond.op_get_arg(1), it, env)
            return Binary("min", a, b)
        lhs, rhs = cond.op_get_arg(0), cond.op_get_arg(1)
        if _is_id(lhs, it) and op in (isl.ast_expr_op_type.le, isl.ast_expr_op_type.lt):
            bound = self.expr(rhs, env)
            return _plus_one(bound) if op == isl.ast_expr_op_type.le else bound
        if _is_id(rhs, it) and op in (isl.ast_expr_op_type.ge, isl.ast_expr_op_type.gt):
            bound = self.expr(lhs, env)
            return _plus_one(bound) if op == isl.ast_expr_op_type.ge else bound
        raise ScheduleError(f"isl produced a loop condition of unexpected form: {cond.to_C_str()}")

    def user(self, call: isl.AstExpr, env: dict[str, str]) -> Node:
        key = plain_name(call.op_get_arg(0).get_id().get_name())
        stmt_name = self.piece_of.get(key, key)
        ps = self.model.statements[stmt_name]
        args = [self.expr(call.op_get_arg(i + 1), env) for i in range(call.op_get_n_arg() - 1)]
        mapping = dict(zip(ps.iterators, args))
        s = ps.stmt
        indices = tuple(_canonical(substitute(i, mapping)) for i in s.indices)
        value = _canonical_loads(substitute(s.value, mapping))
        count = self.seen_stmts.get(stmt_name, 0)
        self.seen_stmts[stmt_name] = count + 1
        label = stmt_name if count == 0 else f"{stmt_name}_{count}"
        if isinstance(s, Store):
            out: Node = Store(s.buffer, indices, value, name=label)
        else:
            out = Reduce(s.buffer, indices, s.combiner, value, name=label)
        for g in reversed(ps.guards):
            out = If(_canonical_loads(substitute(g, mapping)), (out,))
        return out

    # ----------------------------------------------------------------- expressions
    def expr(self, e: isl.AstExpr, env: dict[str, str]) -> Expr:
        t = e.get_type()
        if t == isl.ast_expr_type.id:
            name = e.get_id().get_name()
            return Var(env.get(name, plain_name(name)))
        if t == isl.ast_expr_type.int:
            return Const(e.get_val().to_python())
        op = e.op_get_type()
        args = [self.expr(e.op_get_arg(i), env) for i in range(e.op_get_n_arg())]
        if op == isl.ast_expr_op_type.minus:
            a = args[0]
            return Const(-a.value) if isinstance(a, Const) else Unary("-", a)
        if op in (isl.ast_expr_op_type.cond, isl.ast_expr_op_type.select):
            return Select(*args)
        sym = _BINOPS.get(op)
        if sym is None:
            raise ScheduleError(f"isl produced an expression kiln does not translate: {e.to_C_str()}")
        out = args[0]
        for a in args[1:]:
            out = Binary(sym, out, a)
        form = affine_form(out)
        return _canonical(out) if form is not None else out


def _is_id(e: isl.AstExpr, name: str) -> bool:
    return e.get_type() == isl.ast_expr_type.id and e.get_id().get_name() == name


def _plus_one(e: Expr) -> Expr:
    """``e + 1``, pushed into ``min``/``max`` operands so bounds read ``min(N, 4 * t + 4)``."""
    if isinstance(e, Binary) and e.op in ("min", "max"):
        return Binary(e.op, _plus_one(e.lhs), _plus_one(e.rhs))
    return _canonical(add_const(e, 1))


def _user_statements(n: isl.AstNode) -> list[str]:
    out: list[str] = []

    def visit(node: isl.AstNode) -> bool:
        if node.get_type() == isl.ast_node_type.user:
            out.append(plain_name(node.user_get_expr().op_get_arg(0).get_id().get_name()))
        return True

    n.foreach_descendant_top_down(visit)
    return out


def _canonical(e: Expr) -> Expr:
    """Affine expressions in a canonical order: positive terms first, constant last."""
    form = affine_form(e)
    if form is None:
        return e
    terms = sorted(form.coeffs, key=lambda t: t[1] < 0)
    return affine_expr(terms, form.const)


def _canonical_loads(e: Expr) -> Expr:
    return map_expr(e, lambda x: Load(x.buffer, tuple(_canonical(i) for i in x.indices))
                    if isinstance(x, Load) else None)


__all__ = ["generate"]
