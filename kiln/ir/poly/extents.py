"""Array extents: inferred from accesses for arrays a C kernel uses without declaring them
(:func:`infer_extents`: the bounding box of every access over the whole iteration domain),
and checked against the declaration for the others (:func:`check_extents`)."""

from __future__ import annotations

from dataclasses import dataclass

import islpy as isl

from ..errors import ScheduleError
from ..loops.expr import Binary, Const, Expr, Load, affine_expr, affine_form
from ..loops.program import Program
from .affine import aff_to_expr, isl_name, plain_name, to_isl
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


@dataclass(frozen=True)
class OutOfBounds:
    """An access that leaves its array's declared extents for some sizes: the smallest
    example (parameters first, then the instance)."""

    array: str
    statement: str
    ref: Load
    is_write: bool
    params: tuple[tuple[str, int], ...]
    instance: tuple[tuple[str, int], ...]
    cell: tuple[int, ...]
    declared: tuple[str, ...]
    shape: tuple[int | str, ...]

    def explain(self) -> str:
        verb = "writes" if self.is_write else "reads"
        inst = ", ".join(f"{k}={v}" for k, v in self.instance)
        sizes = f" with {', '.join(f'{k}={v}' for k, v in self.params)}" if self.params else ""
        return (f"{self.ref} in {self.statement} {verb} {self.array}[{', '.join(map(str, self.cell))}] at "
                f"{self.statement}[{inst}]{sizes}, outside the declared extents {self.array}"
                f"[{', '.join(self.declared)}] = ({', '.join(map(str, self.shape))}); fix the subscript or the "
                f"loop bounds, or declare a larger array")


def check_extents(program: Program, names: list[str]) -> list[OutOfBounds]:
    """For each array in ``names``, the affine, unconditional accesses that can leave its
    declared extents for some sizes: non-negative sizes under which the array is not empty
    (every extent at least 1; ``ey[0][j]`` in a ``double ey[NX][NY]`` is fine).

    Accesses with non-affine indices or under non-affine conditions, and dimensions whose
    extent is not affine, are not checked; a program the polyhedral model rejects (loads in
    loop bounds) is not checked at all."""
    try:
        model = build_model(program, bound_may_accesses=False)
    except ScheduleError:
        return []
    sizes = set(model.params)
    out: list[OutOfBounds] = []
    wanted = set(names)
    for st in model.statements.values():
        for acc in st.accesses:
            if acc.array not in wanted or not acc.affine or not acc.exact:
                continue
            bad = _outside(model, program, acc.array, sizes)
            if bad is None:
                continue
            hit = acc.relation.intersect_range(bad[0]).intersect_params(bad[1])
            if hit.is_empty():
                continue
            out.append(_example(model, st, acc, hit))
    return out


def _outside(model, program: Program, array: str, sizes: set[str]) -> tuple[isl.Set, isl.Set] | None:
    """The cells outside ``array``'s declared extents, and the sizes where they are valid."""
    shape = program.buffer(array).shape
    outs = [f"o{k}" for k in range(len(shape))]
    conds, valid = [], [f"{isl_name(p)} >= 0" for p in model.params]
    for o, extent in zip(outs, shape):
        ext = to_isl(extent, sizes)
        if ext is not None:
            conds.append(f"{o} < 0 or {o} >= {ext}")
            valid.append(f"{ext} >= 1")
    if not conds:
        return None
    cells = isl.Set(f"{model.param_prefix}{{ {isl_name(array)}[{', '.join(outs)}] : "
                    f"{' or '.join(f'({c})' for c in conds)} }}")
    return cells, isl.Set(f"{model.param_prefix}{{ : {' and '.join(valid) or '0 = 0'} }}")


def _example(model, st, acc, hit: isl.Map) -> OutOfBounds:
    nparam = hit.dim(isl.dim_type.param)
    pnames = [plain_name(hit.get_dim_name(isl.dim_type.param, i)) for i in range(nparam)]
    n_in, n_out = hit.dim(isl.dim_type.in_), hit.dim(isl.dim_type.out)
    flat = hit.wrap().move_dims(isl.dim_type.set, 0, isl.dim_type.param, 0, nparam)
    try:
        flat = flat.lexmin()
    except isl.Error:
        pass
    pt = flat.sample_point()
    vals = [pt.get_coordinate_val(isl.dim_type.set, i).to_python() for i in range(nparam + n_in + n_out)]
    params = dict(zip(pnames, vals[:nparam]))
    extents = model.program.buffer(acc.array).shape
    return OutOfBounds(acc.array, st.name, acc.ref, acc.is_write, tuple(params.items()),
                       tuple(zip(st.iterators, vals[nparam:nparam + n_in])), tuple(vals[nparam + n_in:]),
                       tuple(str(e) for e in extents), tuple(_value(e, params) for e in extents))


def _value(e: Expr, params: dict[str, int]) -> int | str:
    form = affine_form(e)
    if form is None or any(name not in params for name, _ in form.coeffs):
        return str(e)
    return form.const + sum(c * params[name] for name, c in form.coeffs)
