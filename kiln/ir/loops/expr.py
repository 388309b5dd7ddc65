"""Expressions of the loop IR.

An expression is an immutable tree compared structurally: constants, variables (loop
iterators and program parameters share one namespace), buffer loads, unary and binary
operators, ``select``, casts and math calls.

Operators and their meaning (``a``, ``b`` are the operands):

* ``+ - *`` arithmetic; ``/`` and ``%`` follow C: integer division truncates towards zero
  and ``%`` is its remainder (on floats ``%`` is ``fmod``).
* ``floordiv``/``floormod`` round towards minus infinity; index arithmetic produced by
  schedules uses them, and they stay quasi-affine for the polyhedral analysis.
* ``min``/``max``; comparisons ``< <= == != > >=`` and logical ``&& ||`` yield ``bool``.
* unary ``-`` and ``!``.

Integer expressions have dtype ``i64`` (:data:`INDEX`); binary arithmetic promotes operand
dtypes with :func:`kiln.ir.types.promote`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from ..types import DType, promote

INDEX = DType.int64
"""The dtype of iterators, size parameters and integer literals."""

ARITH_OPS = ("+", "-", "*", "/", "%")
CMP_OPS = ("<", "<=", "==", "!=", ">", ">=")
LOGIC_OPS = ("&&", "||")
FUNC_OPS = ("min", "max", "floordiv", "floormod")
"""Binary operators written in call form, ``min(a, b)``."""
BINARY_OPS = ARITH_OPS + CMP_OPS + LOGIC_OPS + FUNC_OPS
UNARY_OPS = ("-", "!")

MATH_FUNCS: dict[str, int] = {
    "exp": 1, "exp2": 1, "log": 1, "log2": 1, "log10": 1, "sqrt": 1, "sin": 1, "cos": 1,
    "tan": 1, "tanh": 1, "sinh": 1, "cosh": 1, "asin": 1, "acos": 1, "atan": 1, "abs": 1,
    "floor": 1, "ceil": 1, "erf": 1, "pow": 2, "atan2": 2, "fmod": 2,
}
"""Math intrinsics and their arity.  They compute in the promoted floating dtype of their
arguments (``f64`` for integer arguments), except ``abs`` which keeps integer dtypes."""


class Expr:
    """Base class of loop-IR expressions. Python operators build new expressions."""

    __slots__ = ()

    def children(self) -> tuple[Expr, ...]:
        return ()

    def with_children(self, children: tuple[Expr, ...]) -> Expr:
        return self

    def __add__(self, other: ExprLike) -> Expr:
        return Binary("+", self, as_expr(other))

    def __radd__(self, other: ExprLike) -> Expr:
        return Binary("+", as_expr(other), self)

    def __sub__(self, other: ExprLike) -> Expr:
        return Binary("-", self, as_expr(other))

    def __rsub__(self, other: ExprLike) -> Expr:
        return Binary("-", as_expr(other), self)

    def __mul__(self, other: ExprLike) -> Expr:
        return Binary("*", self, as_expr(other))

    def __rmul__(self, other: ExprLike) -> Expr:
        return Binary("*", as_expr(other), self)

    def __truediv__(self, other: ExprLike) -> Expr:
        return Binary("/", self, as_expr(other))

    def __floordiv__(self, other: ExprLike) -> Expr:
        return Binary("floordiv", self, as_expr(other))

    def __mod__(self, other: ExprLike) -> Expr:
        return Binary("floormod", self, as_expr(other))

    def __neg__(self) -> Expr:
        return Unary("-", self)

    def __str__(self) -> str:
        from .text import format_expr

        return format_expr(self)


ExprLike = "Expr | int | float | bool | str"


@dataclass(frozen=True, eq=True, repr=False)
class Const(Expr):
    """A literal of a given dtype (``i64`` for ints and ``f64`` for floats by default)."""

    value: int | float | bool
    dtype: DType = INDEX

    def __post_init__(self) -> None:
        if self.dtype == DType.bool:
            object.__setattr__(self, "value", bool(self.value))
        elif self.dtype.is_integer:
            if isinstance(self.value, float) and not self.value.is_integer():
                raise ValueError(f"integer constant of dtype {self.dtype.short} has value {self.value}")
            object.__setattr__(self, "value", int(self.value))
        else:
            object.__setattr__(self, "value", float(self.value))

    def __repr__(self) -> str:
        return f"Const({self.value!r}, {self.dtype.short})"


@dataclass(frozen=True, repr=False)
class Var(Expr):
    """A loop iterator or a program parameter, by name."""

    name: str

    def __repr__(self) -> str:
        return f"Var({self.name})"


@dataclass(frozen=True, repr=False)
class Load(Expr):
    """``buffer[indices]``; a 0-d buffer has no indices."""

    buffer: str
    indices: tuple[Expr, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(as_expr(i) for i in self.indices))

    def children(self) -> tuple[Expr, ...]:
        return self.indices

    def with_children(self, children: tuple[Expr, ...]) -> Expr:
        return Load(self.buffer, children)

    def __repr__(self) -> str:
        return f"Load({self})"


@dataclass(frozen=True, repr=False)
class Unary(Expr):
    op: str
    operand: Expr

    def __post_init__(self) -> None:
        if self.op not in UNARY_OPS:
            raise ValueError(f"unknown unary operator {self.op!r}; known: {', '.join(UNARY_OPS)}")

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)

    def with_children(self, children: tuple[Expr, ...]) -> Expr:
        return Unary(self.op, children[0])

    def __repr__(self) -> str:
        return f"Unary({self})"


@dataclass(frozen=True, repr=False)
class Binary(Expr):
    op: str
    lhs: Expr
    rhs: Expr

    def __post_init__(self) -> None:
        if self.op not in BINARY_OPS:
            raise ValueError(f"unknown binary operator {self.op!r}; known: {', '.join(BINARY_OPS)}")

    def children(self) -> tuple[Expr, ...]:
        return (self.lhs, self.rhs)

    def with_children(self, children: tuple[Expr, ...]) -> Expr:
        return Binary(self.op, children[0], children[1])

    def __repr__(self) -> str:
        return f"Binary({self})"


@dataclass(frozen=True, repr=False)
class Select(Expr):
    """``cond ? if_true : if_false``; only the chosen operand is evaluated."""

    cond: Expr
    if_true: Expr
    if_false: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.cond, self.if_true, self.if_false)

    def with_children(self, children: tuple[Expr, ...]) -> Expr:
        return Select(*children)

    def __repr__(self) -> str:
        return f"Select({self})"


@dataclass(frozen=True, repr=False)
class Cast(Expr):
    """Conversion to ``dtype``; float to integer truncates towards zero, as in C."""

    dtype: DType
    operand: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.operand,)

    def with_children(self, children: tuple[Expr, ...]) -> Expr:
        return Cast(self.dtype, children[0])

    def __repr__(self) -> str:
        return f"Cast({self})"


@dataclass(frozen=True, repr=False)
class Call(Expr):
    """A math intrinsic from :data:`MATH_FUNCS`."""

    fn: str
    args: tuple[Expr, ...]

    def __post_init__(self) -> None:
        if self.fn not in MATH_FUNCS:
            raise ValueError(f"unknown math function {self.fn!r}; known: {', '.join(MATH_FUNCS)}")
        object.__setattr__(self, "args", tuple(as_expr(a) for a in self.args))
        if len(self.args) != MATH_FUNCS[self.fn]:
            raise ValueError(f"{self.fn} takes {MATH_FUNCS[self.fn]} argument(s), got {len(self.args)}")

    def children(self) -> tuple[Expr, ...]:
        return self.args

    def with_children(self, children: tuple[Expr, ...]) -> Expr:
        return Call(self.fn, children)

    def __repr__(self) -> str:
        return f"Call({self})"


def as_expr(x: Expr | int | float | bool | str) -> Expr:
    """Python literals become constants, strings become variables."""
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool):
        return Const(x, DType.bool)
    if isinstance(x, int):
        return Const(x, INDEX)
    if isinstance(x, float):
        return Const(x, DType.float64)
    if isinstance(x, str):
        return Var(x)
    if type(x).__name__ == "SymDim":  # a symbolic graph size: its size parameters
        return size_expr(x.expr)
    raise TypeError(f"{x!r} is not a loop-IR expression")


SIZE_PREFIX = "size_"
"""Loop programs name the size parameter of graph size ``seq`` ``size_seq``."""


def size_param(name: str) -> str:
    """The loop-IR parameter of the named graph size ``name``."""
    return SIZE_PREFIX + name


def size_expr(e) -> Expr:
    """The integer loop-IR expression of a sympy size expression (sums, products, integer
    powers and ``floor`` of a quotient by a constant); each named size ``n`` becomes the
    parameter ``size_n`` (:func:`size_param`)."""
    if e.is_Integer:
        return Const(int(e))
    if e.is_Symbol:
        return Var(size_param(e.name))
    if e.is_Add or e.is_Mul:
        if e.is_Mul and any(a.is_Rational and not a.is_Integer for a in e.args):
            raise TypeError(f"size {e} is not an integer expression")
        parts = [size_expr(a) for a in e.args]
        out = parts[0]
        for p in parts[1:]:
            out = Binary("+" if e.is_Add else "*", out, p)
        return out
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:
        base = size_expr(e.base)
        out = base
        for _ in range(int(e.exp) - 1):
            out = Binary("*", out, base)
        return out
    if type(e).__name__ == "floor":
        num, den = e.args[0].as_numer_denom()
        if den.is_Integer and int(den) > 0:
            return Binary("floordiv", size_expr(num), Const(int(den)))
    raise TypeError(f"size {e} has no loop-IR form (sums, products and floor(x/c) only)")


# ----------------------------------------------------------------------------- traversal
def walk(expr: Expr) -> Iterator[Expr]:
    """All sub-expressions of ``expr``, pre-order."""
    stack = [expr]
    while stack:
        e = stack.pop()
        yield e
        stack.extend(reversed(e.children()))


def map_expr(expr: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Rebuild ``expr`` bottom-up; ``fn`` returns a replacement or ``None`` to keep a node."""
    kids = expr.children()
    if kids:
        new_kids = tuple(map_expr(k, fn) for k in kids)
        if any(a is not b for a, b in zip(new_kids, kids)):
            expr = expr.with_children(new_kids)
    out = fn(expr)
    return expr if out is None else out


def substitute(expr: Expr, mapping: Mapping[str, Expr]) -> Expr:
    """Replace variables by expressions (simultaneously)."""
    if not mapping:
        return expr
    return map_expr(expr, lambda e: mapping.get(e.name) if isinstance(e, Var) else None)


def free_vars(expr: Expr) -> set[str]:
    return {e.name for e in walk(expr) if isinstance(e, Var)}


def loads_of(expr: Expr) -> list[Load]:
    """Every load in ``expr``, including loads nested in other loads' indices, pre-order."""
    return [e for e in walk(expr) if isinstance(e, Load)]


# ----------------------------------------------------------------------------- typing
def dtype_of(expr: Expr, var_dtypes: Mapping[str, DType], buffer_dtypes: Mapping[str, DType]) -> DType:
    """The dtype of ``expr``; variables missing from ``var_dtypes`` are ``i64``."""
    if isinstance(expr, Const):
        return expr.dtype
    if isinstance(expr, Var):
        return var_dtypes.get(expr.name, INDEX)
    if isinstance(expr, Load):
        try:
            return buffer_dtypes[expr.buffer]
        except KeyError:
            raise ValueError(f"load from unknown buffer '{expr.buffer}'") from None
    if isinstance(expr, Cast):
        return expr.dtype
    if isinstance(expr, Unary):
        inner = dtype_of(expr.operand, var_dtypes, buffer_dtypes)
        return DType.bool if expr.op == "!" else inner
    if isinstance(expr, Select):
        a = dtype_of(expr.if_true, var_dtypes, buffer_dtypes)
        b = dtype_of(expr.if_false, var_dtypes, buffer_dtypes)
        return promote(a, b)
    if isinstance(expr, Call):
        kinds = [dtype_of(a, var_dtypes, buffer_dtypes) for a in expr.args]
        dt = kinds[0]
        for k in kinds[1:]:
            dt = promote(dt, k)
        if expr.fn == "abs" and not dt == DType.bool:
            return dt
        return dt if dt.is_floating else DType.float64
    if isinstance(expr, Binary):
        if expr.op in CMP_OPS or expr.op in LOGIC_OPS:
            return DType.bool
        a = dtype_of(expr.lhs, var_dtypes, buffer_dtypes)
        b = dtype_of(expr.rhs, var_dtypes, buffer_dtypes)
        dt = promote(a, b)
        return INDEX if dt == DType.bool else dt
    raise TypeError(f"not an expression: {expr!r}")


# ----------------------------------------------------------------------------- affine forms
@dataclass(frozen=True)
class Affine:
    """``sum(coeffs[v] * v) + const`` with integer coefficients, in order of first appearance."""

    coeffs: tuple[tuple[str, int], ...]
    const: int

    def coeff(self, name: str) -> int:
        return dict(self.coeffs).get(name, 0)

    @property
    def names(self) -> set[str]:
        return {n for n, c in self.coeffs if c}


def affine_form(expr: Expr) -> Affine | None:
    """``expr`` as an affine combination of variables, or ``None`` when it is not affine."""
    terms = _affine(expr)
    if terms is None:
        return None
    const = terms.pop("", 0)
    return Affine(tuple((k, v) for k, v in terms.items() if v), const)


def _affine(expr: Expr) -> dict[str, int] | None:
    if isinstance(expr, Const):
        if not expr.dtype.is_integer:
            return None
        return {"": int(expr.value)}
    if isinstance(expr, Var):
        return {expr.name: 1}
    if isinstance(expr, Unary) and expr.op == "-":
        inner = _affine(expr.operand)
        return None if inner is None else {k: -v for k, v in inner.items()}
    if not isinstance(expr, Binary) or expr.op not in ("+", "-", "*"):
        return None
    a, b = _affine(expr.lhs), _affine(expr.rhs)
    if a is None or b is None:
        return None
    if expr.op == "*":
        if set(a) <= {""}:
            a, b = b, a
        if not set(b) <= {""}:
            return None
        k = b.get("", 0)
        return {n: v * k for n, v in a.items()}
    sign = 1 if expr.op == "+" else -1
    out = dict(a)
    for n, v in b.items():
        out[n] = out.get(n, 0) + sign * v
    return out


def add_const(e: Expr, c: int) -> Expr:
    """``e + c``, folding ``c`` into a trailing integer constant of ``e``."""
    if c == 0:
        return e
    if isinstance(e, Const) and e.dtype == INDEX:
        return Const(int(e.value) + c)
    if isinstance(e, Binary) and e.op in ("+", "-") and isinstance(e.rhs, Const) and e.rhs.dtype == INDEX:
        total = (int(e.rhs.value) if e.op == "+" else -int(e.rhs.value)) + c
        if total == 0:
            return e.lhs
        return Binary("+" if total > 0 else "-", e.lhs, Const(abs(total)))
    return Binary("+", e, Const(c)) if c > 0 else Binary("-", e, Const(-c))


def affine_expr(coeffs: Mapping[str, int] | tuple[tuple[str, int], ...], const: int = 0) -> Expr:
    """A canonical expression for ``sum(c * v) + const``: terms in the given order, then the
    constant; ``1*v`` prints as ``v`` and negative terms as subtraction."""
    items = list(coeffs.items()) if isinstance(coeffs, Mapping) else list(coeffs)
    out: Expr | None = None
    for name, c in items:
        if c == 0:
            continue
        term: Expr = Var(name) if abs(c) == 1 else Binary("*", Const(abs(c)), Var(name))
        if out is None:
            out = term if c > 0 else Unary("-", term)
        else:
            out = Binary("+" if c > 0 else "-", out, term)
    if out is None:
        return Const(const)
    if const > 0:
        return Binary("+", out, Const(const))
    if const < 0:
        return Binary("-", out, Const(-const))
    return out
