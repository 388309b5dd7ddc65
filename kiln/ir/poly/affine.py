"""Conversions between loop-IR expressions and isl's textual and object forms.

``to_isl`` accepts quasi-affine expressions: integer constants, variables from an allowed
set, ``+``, ``-``, multiplication by a constant, ``floordiv``/``floormod`` by a positive
constant, ``min`` and ``max``.  Everything else (loads, C ``/`` and ``%``, products of
variables) is not affine and yields ``None``; callers then fall back to conservative
may-accesses or reject the construct with a clear message.
"""

from __future__ import annotations

import islpy as isl

from ..loops.expr import CMP_OPS, Binary, Const, Expr, Unary, Var, affine_expr, affine_form

_RESERVED = {"and", "or", "not", "mod", "floor", "ceil", "min", "max", "exists", "infty", "true",
             "false", "implies", "xor", "floord", "NaN", "nan", "inf"}


def isl_name(name: str) -> str:
    """``name`` made safe for isl's parser (isl keywords get a suffix)."""
    return name + "__k" if name in _RESERVED else name


def plain_name(name: str) -> str:
    """The inverse of :func:`isl_name`."""
    return name[:-3] if name.endswith("__k") and name[:-3] in _RESERVED else name


def const_value(e: Expr) -> int | None:
    form = affine_form(e)
    if form is None or form.coeffs:
        return None
    return form.const


def to_isl(e: Expr, allowed: set[str]) -> str | None:
    """isl text of a quasi-affine expression over ``allowed`` variables, or ``None``."""
    if isinstance(e, Const):
        return f"({int(e.value)})" if e.dtype.is_integer else None
    if isinstance(e, Var):
        return isl_name(e.name) if e.name in allowed else None
    if isinstance(e, Unary) and e.op == "-":
        inner = to_isl(e.operand, allowed)
        return None if inner is None else f"(-{inner})"
    if not isinstance(e, Binary):
        return None
    if e.op == "*":
        ca, cb = const_value(e.lhs), const_value(e.rhs)
        if ca is None and cb is None:
            return None
        other = e.rhs if ca is not None else e.lhs
        inner = to_isl(other, allowed)
        return None if inner is None else f"({ca if ca is not None else cb} * {inner})"
    if e.op in ("floordiv", "floormod"):
        d = const_value(e.rhs)
        inner = to_isl(e.lhs, allowed)
        if d is None or d <= 0 or inner is None:
            return None
        return f"floor({inner}/{d})" if e.op == "floordiv" else f"({inner} mod {d})"
    if e.op in ("+", "-", "min", "max"):
        a, b = to_isl(e.lhs, allowed), to_isl(e.rhs, allowed)
        if a is None or b is None:
            return None
        return f"({a} {e.op} {b})" if e.op in ("+", "-") else f"{e.op}({a}, {b})"
    return None


_NEGATE = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def cond_to_isl(e: Expr, allowed: set[str], negate: bool = False) -> str | None:
    """isl constraint text of an affine condition (``negate`` gives its complement)."""
    if isinstance(e, Const) and e.dtype.name == "bool":
        return "(0 = 0)" if bool(e.value) != negate else "(1 = 0)"
    if isinstance(e, Unary) and e.op == "!":
        return cond_to_isl(e.operand, allowed, not negate)
    if not isinstance(e, Binary):
        return None
    if e.op in ("&&", "||"):
        a, b = cond_to_isl(e.lhs, allowed, negate), cond_to_isl(e.rhs, allowed, negate)
        if a is None or b is None:
            return None
        joiner = "and" if (e.op == "&&") != negate else "or"
        return f"({a} {joiner} {b})"
    if e.op not in CMP_OPS:
        return None
    a, b = to_isl(e.lhs, allowed), to_isl(e.rhs, allowed)
    if a is None or b is None:
        return None
    op = _NEGATE[e.op] if negate else e.op
    if op == "==":
        return f"({a} = {b})"
    if op == "!=":
        return f"({a} < {b} or {a} > {b})"
    return f"({a} {op} {b})"


# ----------------------------------------------------------------------------- isl -> IR
def aff_to_expr(aff: isl.Aff, in_names: list[str], param_names: list[str]) -> Expr:
    """An integer-valued isl affine expression as a loop-IR expression.

    ``in_names``/``param_names`` name the input and parameter dimensions; integer divisions
    become ``floordiv``.  Raises ``ValueError`` for a rational (non-integral) expression.
    """
    if aff.get_denominator_val().to_python() != 1:
        raise ValueError(f"isl expression {aff} is not integral")
    terms: list[tuple[str, int]] = []
    for kind, names in ((isl.dim_type.in_, in_names), (isl.dim_type.param, param_names)):
        for pos, name in enumerate(names):
            c = aff.get_coefficient_val(kind, pos).to_python()
            if c:
                terms.append((name, c))
    out: Expr | None = affine_expr(terms, 0) if terms else None
    for pos in range(aff.dim(isl.dim_type.div)):
        c = aff.get_coefficient_val(isl.dim_type.div, pos).to_python()
        if not c:
            continue
        div = aff.get_div(pos)
        d = div.get_denominator_val().to_python()
        term: Expr = Binary("floordiv", aff_to_expr(div.scale_val(isl.Val(d)), in_names, param_names), Const(d))
        if c != 1:
            term = Binary("*", Const(c), term)
        out = term if out is None else Binary("+", out, term)
    const = aff.get_constant_val().to_python()
    if out is None:
        return Const(const)
    if const > 0:
        return Binary("+", out, Const(const))
    if const < 0:
        return Binary("-", out, Const(-const))
    return out


def pw_aff_to_expr(pa: isl.PwAff, in_names: list[str], param_names: list[str]) -> Expr:
    """A single-piece isl expression as a loop-IR expression; ``ValueError`` otherwise."""
    pieces = pa.coalesce().get_pieces()
    if len(pieces) != 1:
        raise ValueError(f"{pa} has {len(pieces)} pieces; only single-piece expressions convert")
    return aff_to_expr(pieces[0][1], in_names, param_names)
