"""``to_c``: print a loop program as one compilable C99 function.

The function takes the integer size parameters (``long``), then the scalar parameters, then
one pointer per global buffer written as a C99 variably-modified array (``double A[N][M]``);
a 0-d buffer is ``double s[1]``.  Local buffers are ``calloc``-ed and freed inside.  Loops
print their annotations as pragmas: ``parallel`` -> ``#pragma omp parallel for``,
``vectorized`` -> ``#pragma omp simd``, ``unrolled(f)`` -> ``#pragma GCC unroll f``.

The C semantics match the interpreter: ``/``/``%`` are C's, ``floordiv``/``floormod`` round
down, stores convert to the buffer dtype, math calls use the ``f``-suffixed functions in
``float``.
"""

from __future__ import annotations

import math

from ..types import DType
from .expr import (
    CMP_OPS, INDEX, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var, dtype_of,
)
from .program import If, Loop, Node, Program, Reduce, Store

C_TYPES = {DType.float64: "double", DType.float32: "float", DType.int64: "long", DType.int32: "int",
           DType.int8: "signed char", DType.uint8: "unsigned char", DType.bool: "_Bool"}

_PRELUDE = """#include <math.h>
#include <stdlib.h>

#define KILN_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KILN_MAX(a, b) ((a) > (b) ? (a) : (b))
static inline long kiln_floordiv(long a, long b) {
  long q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline long kiln_floormod(long a, long b) {
  long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
"""

_PREC = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4,
         "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_PRAGMAS = {"parallel": "#pragma omp parallel for", "vectorized": "#pragma omp simd"}


def c_type(dtype: DType) -> str:
    try:
        return C_TYPES[dtype]
    except KeyError:
        raise ValueError(f"to_c: dtype {dtype.short} has no C type; use f64, f32 or an integer type") from None


class _CPrinter:
    def __init__(self, program: Program):
        self.program = program
        self.var_dtypes = {p.name: p.dtype for p in program.params}
        self.buf_dtypes = {b.name: b.dtype for b in program.buffers}
        self.lines: list[str] = []

    def function(self, name: str) -> str:
        p = self.program
        args = [f"long {q.name}" for q in p.params if q.dtype.is_integer]
        args += [f"{c_type(q.dtype)} {q.name}" for q in p.params if not q.dtype.is_integer]
        for b in p.buffers:
            if b.scope == "global":
                dims = "".join(f"[{self.expr(d)}]" for d in b.shape) if b.shape else "[1]"
                args.append(f"{c_type(b.dtype)} {b.name}{dims}")
        self.lines.append(f"void {name}({', '.join(args) or 'void'}) {{")
        locals_ = [b for b in p.buffers if b.scope != "global"]
        for b in locals_:
            t = c_type(b.dtype)
            if not b.shape:
                self.lines.append(f"  {t} {b.name}[1] = {{0}};")
                continue
            inner = "".join(f"[{self.expr(d)}]" for d in b.shape[1:])
            self.lines.append(f"  {t} (*{b.name}){inner} = calloc(KILN_MAX({self.expr(b.shape[0])}, 1), "
                              f"sizeof *{b.name});")
        for n in p.body:
            self.node(n, "  ")
        for b in locals_:
            if b.shape:
                self.lines.append(f"  free({b.name});")
        self.lines.append("}")
        return "\n".join(self.lines)

    # ----------------------------------------------------------------- statements
    def node(self, n: Node, ind: str) -> None:
        if isinstance(n, Loop):
            self.loop(n, ind)
        elif isinstance(n, If):
            self.lines.append(f"{ind}if ({self.expr(n.cond)}) {{")
            for c in n.then:
                self.node(c, ind + "  ")
            if n.orelse:
                self.lines.append(f"{ind}}} else {{")
                for c in n.orelse:
                    self.node(c, ind + "  ")
            self.lines.append(f"{ind}}}")
        else:
            self.statement(n, ind)

    def loop(self, n: Loop, ind: str) -> None:
        ann = n.annotation
        if ann.mode in _PRAGMAS:
            self.lines.append(f"{ind}{_PRAGMAS[ann.mode]}")
        elif ann.mode == "unrolled":
            self.lines.append(f"{ind}#pragma GCC unroll {ann.factor}")
        elif ann.mode == "mapped":
            self.lines.append(f"{ind}/* mapped to {ann.axis} */")
        it = n.iterator
        self.var_dtypes[it] = INDEX
        step = f"{it}++" if n.step == 1 else f"{it} += {n.step}"
        self.lines.append(f"{ind}for (long {it} = {self.expr(n.lower)}; {it} < {self.expr(n.upper)}; {step}) {{")
        for c in n.body:
            self.node(c, ind + "  ")
        self.lines.append(f"{ind}}}")

    def statement(self, s: Store | Reduce, ind: str) -> None:
        target = self.ref(s.buffer, s.indices)
        value = self.expr(s.value)
        if isinstance(s, Store):
            self.lines.append(f"{ind}{target} = {value};")
        elif s.combiner in ("+", "*"):
            self.lines.append(f"{ind}{target} {s.combiner}= {value};")
        else:
            macro = "KILN_MAX" if s.combiner == "max" else "KILN_MIN"
            self.lines.append(f"{ind}{target} = {macro}({target}, {value});")

    def ref(self, buffer: str, indices: tuple[Expr, ...]) -> str:
        if not indices:
            return f"{buffer}[0]"
        return buffer + "".join(f"[{self.expr(i)}]" for i in indices)

    # ----------------------------------------------------------------- expressions
    def dtype(self, e: Expr) -> DType:
        return dtype_of(e, self.var_dtypes, self.buf_dtypes)

    def expr(self, e: Expr) -> str:
        text, _ = self._expr(e)
        return text

    def _expr(self, e: Expr) -> tuple[str, int]:
        """C text of ``e`` and its precedence (8: atom, 7: unary)."""
        if isinstance(e, Const):
            return self.const(e)
        if isinstance(e, Var):
            return e.name, 8
        if isinstance(e, Load):
            return self.ref(e.buffer, e.indices), 8
        if isinstance(e, Unary):
            inner, p = self._expr(e.operand)
            return f"{e.op}{inner if p > 7 else f'({inner})'}", 7
        if isinstance(e, Select):
            return f"({self.expr(e.cond)} ? {self.expr(e.if_true)} : {self.expr(e.if_false)})", 8
        if isinstance(e, Cast):
            return f"(({c_type(e.dtype)})({self.expr(e.operand)}))", 8
        if isinstance(e, Call):
            return self.call(e), 8
        return self.binary(e)

    def const(self, c: Const) -> tuple[str, int]:
        v = c.value
        if c.dtype == DType.bool:
            return ("1" if v else "0"), 8
        if c.dtype.is_integer:
            text = str(int(v)) + ("L" if abs(int(v)) > 2**31 - 1 else "")
            if c.dtype != INDEX:
                return f"(({c_type(c.dtype)}){text})", 8
            return text, (7 if v < 0 else 8)
        f = float(v)
        if math.isnan(f):
            return "NAN", 8
        if math.isinf(f):
            return ("INFINITY" if f > 0 else "-INFINITY"), (8 if f > 0 else 7)
        text = repr(f) if c.dtype == DType.float64 else repr(float(c.dtype.numpy.type(f)))
        if not any(ch in text for ch in ".e"):
            text += ".0"
        if c.dtype == DType.float32:
            text += "f"
        return text, (7 if f < 0 or text.startswith("-") else 8)

    def call(self, e: Call) -> str:
        dt = self.dtype(e)
        args = ", ".join(self.expr(a) for a in e.args)
        if e.fn == "abs":
            if dt.is_floating:
                return f"fabs{'f' if dt == DType.float32 else ''}({args})"
            return f"labs({args})"
        return f"{e.fn}{'f' if dt == DType.float32 else ''}({args})"

    def binary(self, e: Binary) -> tuple[str, int]:
        if e.op in ("min", "max"):
            return f"KILN_{e.op.upper()}({self.expr(e.lhs)}, {self.expr(e.rhs)})", 8
        if e.op in ("floordiv", "floormod"):
            ints = self.dtype(e.lhs).is_integer and self.dtype(e.rhs).is_integer
            if ints:
                return f"kiln_{e.op}({self.expr(e.lhs)}, {self.expr(e.rhs)})", 8
            a, b = self.expr(e.lhs), self.expr(e.rhs)
            if e.op == "floordiv":
                return f"floor(({a}) / ({b}))", 8
            return f"(({a}) - ({b}) * floor(({a}) / ({b})))", 8
        if e.op == "%" and not (self.dtype(e.lhs).is_integer and self.dtype(e.rhs).is_integer):
            return f"fmod({self.expr(e.lhs)}, {self.expr(e.rhs)})", 8
        p = _PREC[e.op]
        a, pa = self._expr(e.lhs)
        b, pb = self._expr(e.rhs)
        if pa < p or (pa == p and e.op in CMP_OPS):
            a = f"({a})"
        if pb <= p:
            b = f"({b})"
        return f"{a} {e.op} {b}", p


def to_c(program: Program, name: str | None = None, prelude: bool = True) -> str:
    """C99 source of ``program`` as ``void <name>(...)``; see the module docstring."""
    body = _CPrinter(program).function(name or program.name)
    return (_PRELUDE + "\n" + body + "\n") if prelude else body + "\n"
