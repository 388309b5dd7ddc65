"""Array extents inferred from accesses, for arrays a C kernel uses without declaring."""

from __future__ import annotations

import islpy as isl

from ..loops.expr import Binary, Const, Expr, affine_expr, affine_form
from ..loops.program import Program
from .affine import aff_to_expr, isl_name, plain_name
from .model import build_model


def infer_extents(program: Program, names: list[str]) -> dict[str, tuple[Expr, ...]]:
    """For each array in ``names``, the smallest extents covering every access.

    Each extent is ``max(upper) + 1`` where ``upper`` ranges over the pieces of the largest
    accessed index (as functions of the size parameters), so it never under-estimates.
    Raises ``ValueError`` naming the array when an access is not affine or an index can be
    negative.
    """
    model = build_model(program, bound_may_accesses=False)
    out: dict[str, tuple[Expr, ...]] = {}
    for name in names:
        cells: isl.Set | None = None
        for st in model.statements.values():
            for acc in st.accesses:
                if acc.array != name:
                    continue
                if not acc.affine:
                    raise ValueError(f"array '{name}' is accessed as {acc.ref} in {st.name}, which is not "
                                     f"affine, so its extent cannot be inferred; declare it, e.g. "
                                     f"'double {name}{'[N]' * len(acc.ref.indices)};'")
                r = acc.relation.range()
                cells = r if cells is None else cells.union(r)
        rank = program.buffer(name).rank
        if cells is None or cells.is_empty():
            out[name] = (Const(1),) * rank
            continue
        out[name] = tuple(_extent(name, cells, d, model.params) for d in range(rank))
    return out


def _extent(name: str, cells: isl.Set, dim: int, params: tuple[str, ...]) -> Expr:
    nparam = cells.dim(isl.dim_type.param)
    pnames = [plain_name(cells.get_dim_name(isl.dim_type.param, i)) for i in range(nparam)]
    if nparam:
        nonneg = " and ".join(f"{isl_name(p)} >= 0" for p in pnames)
        ctx = isl.Set(f"[{', '.join(isl_name(p) for p in pnames)}] -> {{ : {nonneg} }}")
        cells = cells.intersect_params(ctx)
    lower = cells.dim_min(dim)
    if not lower.neg().pos_set().is_empty():
        raise ValueError(f"array '{name}' is accessed at a negative index in dimension {dim}")
    exprs: list[Expr] = []
    for _, aff in cells.dim_max(dim).coalesce().get_pieces():
        e = Binary("+", aff_to_expr(aff, [], pnames), Const(1))
        form = affine_form(e)
        if form is not None:
            e = affine_expr(form.coeffs, form.const)
        if e not in exprs:
            exprs.append(e)
    out = exprs[0]
    for e in exprs[1:]:
        out = Binary("max", out, e)
    return out
