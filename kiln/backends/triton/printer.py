"""Loop-IR expressions printed as Triton (``triton.language``) expressions.

:class:`ExprPrinter` turns an expression of a lowered loop program into Triton text in a
:class:`Scope` that says what iterators, registers and buffers mean where it is printed.
Guarantees:

* **Loads** become ``tl.load(<pointer> + <row-major offset>, mask=..., other=0)``; the mask
  is the scope's (lanes and block lanes in range, enclosing conditions) and, inside a
  ``select``, ``&&`` or ``||``, the condition under which the operand is evaluated: a load
  the loop program would not execute (the padding of a convolution) reads nothing.
  Registers (:mod:`.analysis`) print as their variable; a cell stored earlier in the same
  vector nest prints as the stored value.
* **Semantics of the loop IR**: integer ``/`` and ``%`` truncate (C), which is Triton's
  integer ``//`` and ``%``; ``floordiv``/``floormod`` round down -- plain ``//``/``%`` when
  the operands are provably non-negative, else the prelude's ``_kiln_floordiv`` /
  ``_kiln_floormod``; comparisons and ``&& || !`` give ``int1``; casts are ``.to(...)``
  (float to integer truncates, to bool compares with 0); math calls compute in the
  promoted floating dtype (``f64`` for integer arguments, as the IR says).
* **Constants** fold: operations whose operands are all literals are computed here
  (``select`` with a literal condition keeps one branch), so the text holds tensors and
  Python literals only where Triton accepts them.
* **Math functions**: on a GPU, ``tl.*`` for Triton's own (``exp``, ``sqrt_rn``, ...) and
  ``libdevice`` for the rest; in the interpreter (which has no ``libdevice``) the
  prelude's helpers built from ``tl`` operations (:data:`INTERPRETER_MATH`).  ``pow`` with
  a small integer exponent is repeated multiplication, with exponent ``0.5`` a square root.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from kiln.ir.loops import Expr, Load, Var
from kiln.ir.loops.expr import CMP_OPS, INDEX, LOGIC_OPS, Binary, Call, Cast, Const, Select, Unary
from kiln.ir.loops.program import Buffer
from kiln.ir.ops.compute import simplify_index
from kiln.ir.types import DType, promote

from .analysis import Ranges, nonnegative

TL_DTYPES = {
    DType.float64: "tl.float64", DType.float32: "tl.float32", DType.float16: "tl.float16",
    DType.bfloat16: "tl.bfloat16", DType.int64: "tl.int64", DType.int32: "tl.int32", DType.int8: "tl.int8",
    DType.uint8: "tl.uint8", DType.bool: "tl.int1",
}

GPU_MATH = {
    "exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2", "log10": "libdevice.log10",
    "sqrt": "tl.sqrt_rn", "sin": "tl.sin", "cos": "tl.cos", "tan": "libdevice.tan", "tanh": "libdevice.tanh",
    "sinh": "libdevice.sinh", "cosh": "libdevice.cosh", "asin": "libdevice.asin", "acos": "libdevice.acos",
    "atan": "libdevice.atan", "abs": "tl.abs", "floor": "tl.floor", "ceil": "tl.ceil", "erf": "tl.erf",
    "pow": "libdevice.pow", "atan2": "libdevice.atan2", "fmod": "libdevice.fmod",
}
"""Math functions on a GPU."""

INTERPRETER_MATH = {
    **{k: v for k, v in GPU_MATH.items() if v.startswith("tl.")},
    **{k: f"_kiln_{k}" for k, v in GPU_MATH.items() if v.startswith("libdevice.")},
}
"""Math functions in the interpreter: ``_kiln_<name>`` helpers of the prelude (:mod:`.source`)."""


class PrintError(ValueError):
    """An expression with no Triton translation."""


@dataclass(frozen=True)
class Printed:
    """Triton text of an expression, its loop-IR dtype, its class (:class:`Scope`) and its
    value when it is a literal."""

    text: str
    dtype: DType
    literal: object = None
    cls: int = 0

    @property
    def is_literal(self) -> bool:
        return self.literal is not None


Guard = tuple[str, int] | None
"""A condition under which an operand is evaluated: its text and class."""


@dataclass
class Scope:
    """What names mean where an expression is printed.

    Every value has a *class*: 0 -- one value for the program (literals, iterators of
    sequential loops), 1 -- one per lane (band iterators, registers), 2 -- one per lane and
    block lane of a vector nest.  ``vars``: iterator -> (Triton text, class);
    ``pointers``: buffer -> pointer argument; ``registers``: register local -> variable;
    ``forwarded``: ``(buffer, indices)`` -> variable holding the value stored there earlier
    in this vector nest; ``lane_mask`` / ``mask``: the masks of class-1 and class-2 memory
    accesses here (``None``: none); ``pads``: class -> a zero tensor of that block shape,
    added to a pointer of a lower class so that it matches its mask; ``ranges``: iterator
    value ranges (for proofs of non-negative operands).
    """

    vars: dict[str, tuple[str, int]]
    buffers: Mapping[str, Buffer]
    pointers: Mapping[str, str]
    registers: Mapping[str, str] = field(default_factory=dict)
    forwarded: dict[tuple[str, tuple[Expr, ...]], str] = field(default_factory=dict)
    lane_mask: str | None = None
    mask: str | None = None
    pads: Mapping[int, str] = field(default_factory=dict)
    ranges: Ranges = field(default_factory=dict)

    def child(self, **changes) -> Scope:
        return replace(self, **changes)


def conj(*masks: str | None) -> str | None:
    """``a & b & ...`` of the masks that are given."""
    parts = [m for m in masks if m]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else " & ".join(_paren(m) for m in parts)


def guard_and(guard: Guard, text: str, cls: int) -> Guard:
    """``guard`` and the condition ``text`` (of class ``cls``)."""
    if guard is None:
        return (text, cls)
    return (conj(guard[0], text), max(guard[1], cls))


def literal_text(value: object, dtype: DType) -> str:
    """A Python literal of ``value`` (``float("inf")`` for infinities)."""
    if dtype == DType.bool:
        return "True" if value else "False"
    if dtype.is_integer:
        return str(int(value))
    v = float(value)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


class ExprPrinter:
    """Prints expressions (module docstring); ``interpret`` picks the math functions."""

    def __init__(self, interpret: bool):
        self.math = INTERPRETER_MATH if interpret else GPU_MATH
        self.helpers: set[str] = set()
        """Prelude helpers the printed text calls (``_kiln_floordiv``, ``_kiln_tanh``, ...)."""
        self.hoisted: list[tuple[str, str]] | None = None
        self._loads: dict[str, str] = {}
        self._count = 0

    def begin_statement(self) -> None:
        """From now on every distinct load is given a variable (:meth:`end_statement`
        returns their definitions), so a statement that reads a cell several times loads it
        once."""
        self.hoisted, self._loads = [], {}

    def end_statement(self) -> list[tuple[str, str]]:
        """The ``(variable, load)`` definitions since :meth:`begin_statement`, in order."""
        found, self.hoisted, self._loads = self.hoisted or [], None, {}
        return found

    def _hoist(self, text: str) -> str:
        if self.hoisted is None:
            return text
        var = self._loads.get(text)
        if var is None:
            self._count += 1
            var = self._loads[text] = f"_x{self._count}"
            self.hoisted.append((var, text))
        return var

    # ------------------------------------------------------------------ entry points
    def expr(self, e: Expr, scope: Scope, guard: Guard = None) -> Printed:
        """``e`` in ``scope``; ``guard`` is the condition under which it is evaluated."""
        if isinstance(e, Const):
            return Printed(literal_text(e.value, e.dtype), e.dtype, _literal_value(e))
        if isinstance(e, Var):
            try:
                text, cls = scope.vars[e.name]
            except KeyError:
                raise PrintError(f"iterator '{e.name}' is not bound here") from None
            return Printed(text, INDEX, None, cls)
        if isinstance(e, Load):
            return self.load(e, scope, guard)
        if isinstance(e, Unary):
            return self.unary(e, scope, guard)
        if isinstance(e, Binary):
            return self.binary(e, scope, guard)
        if isinstance(e, Select):
            return self.select(e, scope, guard)
        if isinstance(e, Cast):
            return self.cast(self.expr(e.operand, scope, guard), e.dtype)
        if isinstance(e, Call):
            return self.call(e, scope, guard)
        raise PrintError(f"no Triton translation for the expression {e}")

    @staticmethod
    def offset(buffer: Buffer, indices: tuple[Expr, ...]) -> Expr:
        """The row-major element offset of ``indices`` in ``buffer`` (static shape)."""
        shape = [int(d.value) for d in buffer.shape]
        flat: Expr = Const(0)
        stride = 1
        for e, n in reversed(list(zip(indices, shape))):
            flat = Binary("+", flat, e if stride == 1 else Binary("*", e, Const(stride)))
            stride *= n
        return simplify_index(flat)

    def access(self, buffer: str, indices: tuple[Expr, ...], scope: Scope,
               guard: Guard) -> tuple[str, str | None, int]:
        """The pointer, mask and class of an access to a cell: a pointer of class <= 1 under
        a guard of class <= 1 goes with the lane mask, anything else with the full mask, and
        the pointer is padded to its mask's class."""
        try:
            buf, ptr = scope.buffers[buffer], scope.pointers[buffer]
        except KeyError:
            raise PrintError(f"buffer '{buffer}' has no pointer here") from None
        off = self.expr(self.offset(buf, indices), scope, guard)
        text = ptr if off.literal == 0 else f"{ptr} + {_paren(off.text)}"
        need = max(off.cls, guard[1] if guard else 0)
        if need <= 1:
            mask = conj(scope.lane_mask, guard[0] if guard else None)
            need = 1 if mask else need
        else:
            mask = conj(scope.mask, guard[0] if guard else None)
        if off.cls < need and need in scope.pads:
            text = f"{text} + {scope.pads[need]}"
        return text, mask, max(off.cls, need if need in scope.pads else off.cls)

    def load(self, e: Load, scope: Scope, guard: Guard) -> Printed:
        buf = scope.buffers.get(e.buffer)
        if buf is None:
            raise PrintError(f"load from unknown buffer '{e.buffer}'")
        if e.buffer in scope.registers:
            return Printed(scope.registers[e.buffer], buf.dtype, None, 1)
        forwarded = scope.forwarded.get((e.buffer, e.indices))
        if forwarded is not None:
            return Printed(forwarded, buf.dtype, None, 2)
        ptr, mask, cls = self.access(e.buffer, e.indices, scope, guard)
        text = f"tl.load({ptr})" if mask is None else f"tl.load({ptr}, mask={mask}, other=0)"
        return Printed(self._hoist(text), buf.dtype, None, cls)

    # ------------------------------------------------------------------ operators
    def unary(self, e: Unary, scope: Scope, guard: Guard) -> Printed:
        a = self.expr(e.operand, scope, guard)
        if e.op == "!":
            if a.is_literal:
                return _lit(not a.literal, DType.bool)
            return Printed(f"({self.truth(a)} == 0)", DType.bool, None, a.cls)
        if a.is_literal:
            return _lit(-a.literal, a.dtype)
        return Printed(f"(-{_paren(a.text)})", a.dtype, None, a.cls)

    @staticmethod
    def truth(p: Printed) -> str:
        """``p`` as an ``int1`` text."""
        return p.text if p.dtype == DType.bool else f"({p.text} != 0)"

    def binary(self, e: Binary, scope: Scope, guard: Guard) -> Printed:
        op = e.op
        a = self.expr(e.lhs, scope, guard)
        if op in LOGIC_OPS:
            if a.is_literal:  # short-circuit on a literal left operand
                if bool(a.literal) == (op == "||"):
                    return _lit(op == "||", DType.bool)
                b = self.expr(e.rhs, scope, guard)
                return b if b.dtype == DType.bool else Printed(self.truth(b), DType.bool, None, b.cls)
            cond = self.truth(a)
            b = self.expr(e.rhs, scope, guard_and(guard, cond if op == "&&" else f"{_paren(cond)} == 0", a.cls))
            if b.is_literal:
                if bool(b.literal) == (op == "||"):
                    return _lit(op == "||", DType.bool)
                return Printed(cond, DType.bool, None, a.cls)
            return Printed(f"({cond} {'&' if op == '&&' else '|'} {self.truth(b)})", DType.bool, None,
                           max(a.cls, b.cls))
        b = self.expr(e.rhs, scope, guard)
        cls = max(a.cls, b.cls)
        if op in CMP_OPS:
            if a.is_literal and b.is_literal:
                return _lit(_compare(op, a.literal, b.literal), DType.bool)
            return Printed(f"({a.text} {op} {b.text})", DType.bool, None, cls)
        dtype = promote(a.dtype, b.dtype)
        dtype = INDEX if dtype == DType.bool else dtype
        if a.is_literal and b.is_literal:
            return _lit(_fold(op, a.literal, b.literal, dtype), dtype)
        at, bt = self._operand(a, dtype), self._operand(b, dtype)
        if op in ("+", "-", "*"):
            return Printed(f"({at} {op} {bt})", dtype, None, cls)
        if op == "/":
            return Printed(f"({at} {'/' if dtype.is_floating else '//'} {bt})", dtype, None, cls)
        if op == "%":
            text = f"({at} % {bt})" if not dtype.is_floating else f"{self.math_fn('fmod')}({at}, {bt})"
            return Printed(text, dtype, None, cls)
        if op in ("min", "max"):
            return Printed(f"tl.{'minimum' if op == 'min' else 'maximum'}({at}, {bt})", dtype, None, cls)
        if op in ("floordiv", "floormod"):
            if dtype.is_floating:
                q = f"tl.floor({at} / {bt})"
                return Printed(q if op == "floordiv" else f"({at} - {q} * {bt})", dtype, None, cls)
            if nonnegative(e.lhs, scope.ranges) and nonnegative(e.rhs, scope.ranges):
                return Printed(f"({at} {'//' if op == 'floordiv' else '%'} {bt})", dtype, None, cls)
            name = f"_kiln_{op}"
            self.helpers.add(name)
            return Printed(f"{name}({at}, {bt})", dtype, None, cls)
        raise PrintError(f"no Triton translation for the operator {op!r}")

    @staticmethod
    def _operand(p: Printed, dtype: DType) -> str:
        """``p`` as an operand of arithmetic in ``dtype`` (bools become integers, so that
        ``True + True`` is 2 as in the IR)."""
        if p.dtype == DType.bool and not p.is_literal and dtype != DType.bool:
            return f"{_paren(p.text)}.to({TL_DTYPES[dtype]})"
        return p.text

    def select(self, e: Select, scope: Scope, guard: Guard) -> Printed:
        c = self.expr(e.cond, scope, guard)
        if c.is_literal:
            return self.expr(e.if_true if c.literal else e.if_false, scope, guard)
        cond = self.truth(c)
        a = self.expr(e.if_true, scope, guard_and(guard, cond, c.cls))
        b = self.expr(e.if_false, scope, guard_and(guard, f"{_paren(cond)} == 0", c.cls))
        dtype = promote(a.dtype, b.dtype)
        at = a.text if a.dtype == dtype or a.is_literal else f"{_paren(a.text)}.to({TL_DTYPES[dtype]})"
        bt = b.text if b.dtype == dtype or b.is_literal else f"{_paren(b.text)}.to({TL_DTYPES[dtype]})"
        return Printed(f"tl.where({cond}, {at}, {bt})", dtype, None, max(a.cls, b.cls, c.cls))

    def cast(self, a: Printed, dtype: DType) -> Printed:
        if a.dtype == dtype:
            return a
        if a.is_literal:
            with np.errstate(all="ignore"):
                value = np.asarray(a.literal, dtype=a.dtype.numpy).astype(dtype.numpy)[()]
            return _lit(value.item() if hasattr(value, "item") else value, dtype)
        if dtype == DType.bool:
            return Printed(f"({a.text} != 0)", dtype, None, a.cls)
        return Printed(f"{_paren(a.text)}.to({TL_DTYPES[dtype]})", dtype, None, a.cls)

    def call(self, e: Call, scope: Scope, guard: Guard) -> Printed:
        args = [self.expr(a, scope, guard) for a in e.args]
        dtype = args[0].dtype
        for a in args[1:]:
            dtype = promote(dtype, a.dtype)
        if e.fn == "abs" and dtype != DType.bool and not dtype.is_floating:
            result = dtype
        else:
            result = dtype if dtype.is_floating else DType.float64
        if all(a.is_literal for a in args):
            return _lit(_fold_call(e.fn, [a.literal for a in args], result), result)
        cls = max(a.cls for a in args)
        if e.fn == "pow" and args[1].is_literal:
            special = self._pow(args[0], float(args[1].literal), result)
            if special is not None:
                return special
        texts = [self.cast(a, result).text for a in args]
        return Printed(f"{self.math_fn(e.fn)}({', '.join(texts)})", result, None, cls)

    def _pow(self, base: Printed, exponent: float, dtype: DType) -> Printed | None:
        x = self.cast(base, dtype)
        if exponent == 0.5:
            return Printed(f"{self.math_fn('sqrt')}({x.text})", dtype, None, x.cls)
        if exponent.is_integer() and 0 < abs(exponent) <= 8:
            product = " * ".join([_paren(x.text)] * int(abs(exponent)))
            return Printed(f"({product})" if exponent > 0 else f"(1.0 / ({product}))", dtype, None, x.cls)
        return None

    def math_fn(self, name: str) -> str:
        fn = self.math.get(name)
        if fn is None:
            raise PrintError(f"math function '{name}' has no Triton translation")
        if fn.startswith("_kiln_"):
            self.helpers.add(fn)
        return fn


def as_tensor(p: Printed, shape: str) -> str:
    """``p`` as a tensor of (at least) ``shape``: a literal becomes ``tl.full``."""
    if not p.is_literal:
        return p.text
    return f"tl.full({shape}, {p.text}, {TL_DTYPES[p.dtype]})"


# ------------------------------------------------------------------------------ folding
def _literal_value(c: Const) -> object:
    return bool(c.value) if c.dtype == DType.bool else c.value


def _lit(value: object, dtype: DType) -> Printed:
    if dtype == DType.bool:
        value = bool(value)
    elif dtype.is_integer:
        value = int(value)
    else:
        value = float(dtype.numpy.type(value)) if dtype != DType.float64 else float(value)
    return Printed(literal_text(value, dtype), dtype, value)


def _compare(op: str, a: object, b: object) -> bool:
    return {"<": a < b, "<=": a <= b, "==": a == b, "!=": a != b, ">": a > b, ">=": a >= b}[op]


def _fold(op: str, a, b, dtype: DType):
    if dtype.is_integer:
        a, b = int(a), int(b)
        if op in ("/", "%", "floordiv", "floormod") and b == 0:
            raise PrintError(f"integer division by zero in a constant ({a} {op} {b})")
        return {"+": a + b, "-": a - b, "*": a * b, "/": _trunc_div(a, b),
                "%": int(math.fmod(a, b)), "floordiv": a // b, "floormod": a % b, "min": min(a, b),
                "max": max(a, b)}[op]
    a, b = float(a), float(b)
    with np.errstate(all="ignore"):
        return float({"+": np.add, "-": np.subtract, "*": np.multiply, "/": np.divide, "%": np.fmod,
                      "floordiv": lambda x, y: np.floor(np.divide(x, y)),
                      "floormod": lambda x, y: x - np.floor(np.divide(x, y)) * y,
                      "min": np.minimum, "max": np.maximum}[op](dtype.numpy.type(a), dtype.numpy.type(b)))


def _trunc_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _fold_call(fn: str, args: list, dtype: DType):
    values = [dtype.numpy.type(a) for a in args]
    numpy_fn = {"abs": np.abs, "erf": np.vectorize(math.erf), "pow": np.power, "atan2": np.arctan2,
                "fmod": np.fmod, "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan}.get(fn, getattr(np, fn, None))
    if numpy_fn is None:
        raise PrintError(f"math function '{fn}' has no constant folding")
    with np.errstate(all="ignore"):
        return np.asarray(numpy_fn(*values)).astype(dtype.numpy).item()


def _paren(text: str) -> str:
    """``text`` parenthesized unless it is a name, a call or already parenthesized."""
    if text.replace("_", "").replace(".", "").isalnum() or _balanced_group(text):
        return text
    return f"({text})"


def _balanced_group(text: str) -> bool:
    """Whether ``text`` is one parenthesized group or a call ``f(...)``."""
    start = text.find("(")
    if start < 0 or not text.endswith(")"):
        return False
    head = text[:start]
    if head and not head.replace("_", "").replace(".", "").isalnum():
        return False
    depth = 0
    for k, ch in enumerate(text[start:], start):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and k != len(text) - 1:
            return False
    return True


__all__ = ["GPU_MATH", "INTERPRETER_MATH", "TL_DTYPES", "ExprPrinter", "Guard", "PrintError", "Printed", "Scope",
           "as_tensor", "conj", "guard_and", "literal_text"]
