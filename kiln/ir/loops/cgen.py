"""C printing of loop programs: :class:`CStylePrinter`, the base of every C-family printer,
and ``to_c``, its plainest use.

``to_c`` prints a loop program as one compilable C99 function.  The function takes the
integer size parameters (``long``), then the scalar parameters, then one pointer per global
buffer written as a C99 variably-modified array (``double A[N][M]``); a 0-d buffer is
``double s[1]``.  Local buffers are ``calloc``-ed and freed inside.  Loops print their
annotations as pragmas: ``parallel`` -> ``#pragma omp parallel for``, ``vectorized`` ->
``#pragma omp simd``, ``unrolled(f)`` -> ``#pragma GCC unroll f``.

The C semantics match the interpreter: ``/``/``%`` are C's, ``floordiv``/``floormod`` round
down, stores convert to the buffer dtype, math calls use the ``f``-suffixed functions in
``float``.  ``f16`` and ``bf16`` are spelled ``_Float16`` and ``__bf16`` (GCC and Clang;
arithmetic on ``__bf16`` needs GCC 13 or Clang 17): their literals are casts of ``float``
literals, their math calls are the ``float`` functions, and the compiler evaluates their
arithmetic in ``float`` and rounds at every store and cast (``FLT_EVAL_METHOD``), where the
interpreter rounds after every operation.

:class:`CStylePrinter` holds everything C-family dialects share -- statements, expressions
with C precedence, reductions, ``if``, loop nests -- and exposes what differs as hooks, in the
spirit of tinygrad's ``CStyleLanguage``:

==========================  ===========================================================
hook                        what it decides (default: plain C99)
==========================  ===========================================================
``types``, ``type_name``    the spelling of each dtype (``float``, ``_Float16``)
``type_error``              the error for a dtype the dialect cannot spell
``const``, ``float_literal``  literals (``1.5f``, ``((_Float16)1.5f)``, ``INFINITY``)
``cast``                    conversions (``((float)(x))``)
``math_function``           the function a math call names (``expf``, ``fabs``, ``labs``)
``loop_pragmas``            lines above a loop (``#pragma omp simd``)
``loop_header``             the ``for (...) {`` line
``function_prefix``         qualifiers before ``void`` (``static``)
``params``, ``buffer_param``  the kernel signature (``double A[N][M]``)
``declare_local``,          the prologue: local buffers (stack array or ``calloc``,
``stack_local``             freed at the end)
``target``                  where a statement writes (an accumulator register)
``ref``                     how a buffer element is addressed (``A[i][j]``)
``prelude``                 text before the functions (includes, ``KILN_MIN``)
==========================  ===========================================================

:class:`HalfAsFloat` is a mixin for dialects that keep float16/bfloat16 values in ``float``:
memory holds the half type (``unsigned short`` bits with the software conversions of
:data:`HALF_HELPERS`, or a native half type), loads widen, stores and casts round to nearest
even, and with ``half_round_ops`` every arithmetic result rounds too.

The cpu backend's OpenMP printer (:class:`kiln.backends.cpu.codegen.KernelPrinter`, with
:class:`HalfAsFloat`) overrides ``loop``/``loop_pragmas`` (collapsed parallel regions, reductions in registers),
``target``, ``function_prefix``, ``buffer_param`` (``restrict``), ``stack_local`` and the
types.  A CUDA C printer would override ``types`` (``half``, ``__nv_bfloat16``),
``float_literal`` and ``math_function`` for them (``__float2half``, ``hexp``),
``function_prefix`` (``extern "C" __global__``), ``buffer_param`` and ``ref`` (flat
``float *__restrict__`` pointers indexed by row-major offsets: C++ has no variably-modified
arrays), ``loop_header`` (a loop mapped to ``blockIdx.x``/``threadIdx.x`` becomes an index
computation and a bounds check), ``declare_local`` (``__shared__`` buffers), and
``prelude`` (``cuda_fp16.h`` instead of ``math.h``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

from ..types import DType
from .expr import (
    CMP_OPS, INDEX, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var, dtype_of,
)
from .program import Buffer, If, Loop, Node, Program, Reduce, Store

C_TYPES: Mapping[DType, str] = {
    DType.float64: "double", DType.float32: "float", DType.float16: "_Float16", DType.bfloat16: "__bf16",
    DType.int64: "long", DType.int32: "int", DType.int8: "signed char", DType.uint8: "unsigned char",
    DType.bool: "_Bool",
}
"""The C spelling of every dtype ``to_c`` prints."""

C_PRELUDE = """#include <math.h>
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
"""Includes and helpers every C-family function printed here relies on."""

_PREC = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4,
         "+": 5, "-": 5, "*": 6, "/": 6, "%": 6}
_PRAGMAS = {"parallel": "#pragma omp parallel for", "vectorized": "#pragma omp simd"}


class CStylePrinter:
    """Prints one loop program as one C-family function; see the module docstring for the
    hooks a dialect overrides.  ``CStylePrinter(program).function(name)`` is the function's
    text (``to_c`` adds :attr:`prelude`)."""

    types: ClassVar[Mapping[DType, str]] = C_TYPES
    prelude: ClassVar[str] = C_PRELUDE
    function_prefix: ClassVar[str] = ""

    def __init__(self, program: Program):
        self.program = program
        self.var_dtypes = {p.name: p.dtype for p in program.params}
        self.buf_dtypes = {b.name: b.dtype for b in program.buffers}
        self.lines: list[str] = []

    # ----------------------------------------------------------------- types
    @classmethod
    def type_name(cls, dtype: DType) -> str:
        """The dialect's spelling of ``dtype``; raises :meth:`type_error` when it has none."""
        try:
            return cls.types[dtype]
        except KeyError:
            raise cls.type_error(dtype) from None

    @classmethod
    def type_error(cls, dtype: DType) -> Exception:
        """The error for a dtype without a spelling in :attr:`types`."""
        return ValueError(f"to_c: dtype {dtype.short} has no C type; use a float or an integer type")

    # ----------------------------------------------------------------- the function
    def function(self, name: str) -> str:
        """The whole function ``name``: signature, prologue, body, frees."""
        self.lines.append(self.signature(name))
        heap = [b for b in self.program.buffers if b.scope != "global" and self.declare_local(b)]
        for n in self.program.body:
            self.node(n, "  ")
        for b in heap:
            self.lines.append(f"  free({b.name});")
        self.lines.append("}")
        return "\n".join(self.lines)

    def signature(self, name: str) -> str:
        """``<prefix>void name(params) {``."""
        return f"{self.function_prefix}void {name}({', '.join(self.params()) or 'void'}) {{"

    def params(self) -> list[str]:
        """Parameter declarations: sizes (``long``), scalars, then the global buffers."""
        p = self.program
        out = [f"long {q.name}" for q in p.params if q.dtype.is_integer]
        out += [f"{self.type_name(q.dtype)} {q.name}" for q in p.params if not q.dtype.is_integer]
        return out + [self.buffer_param(b) for b in p.buffers if b.scope == "global"]

    def dims(self, b: Buffer) -> list[str]:
        """The extents of ``b`` as C text (``["1"]`` for a 0-d buffer)."""
        return [self.expr(d) for d in b.shape] or ["1"]

    def buffer_param(self, b: Buffer) -> str:
        """A global buffer as a variably-modified array parameter: ``double A[N][M]``."""
        return f"{self.type_name(b.dtype)} {b.name}" + "".join(f"[{d}]" for d in self.dims(b))

    def stack_local(self, b: Buffer) -> bool:
        """Whether local buffer ``b`` is a stack array (default: 0-d buffers only)."""
        return not b.shape

    def declare_local(self, b: Buffer) -> bool:
        """Declare local buffer ``b`` zero-initialized; True when it is heap-allocated (the
        function frees it at the end)."""
        t, dims = self.type_name(b.dtype), self.dims(b)
        if self.stack_local(b):
            self.lines.append(f"  {t} {b.name}{''.join(f'[{d}]' for d in dims)} = {{0}};")
            return False
        inner = "".join(f"[{d}]" for d in dims[1:])
        self.lines.append(f"  {t} (*{b.name}){inner} = calloc(KILN_MAX({dims[0]}, 1), sizeof *{b.name});")
        return True

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
        """The pragmas of ``n`` (:meth:`loop_pragmas`), then the loop (:meth:`for_loop`)."""
        self.lines += [ind + line for line in self.loop_pragmas(n)]
        self.for_loop(n, ind)

    def loop_pragmas(self, n: Loop) -> list[str]:
        """Lines printed above loop ``n``: its annotation as a pragma (or a comment)."""
        ann = n.annotation
        if ann.mode in _PRAGMAS:
            return [_PRAGMAS[ann.mode]]
        if ann.mode == "unrolled":
            return [f"#pragma GCC unroll {ann.factor}"]
        if ann.mode == "mapped":
            return [f"/* mapped to {ann.axis} */"]
        return []

    def loop_header(self, n: Loop) -> str:
        """``for (long i = lo; i < hi; i++) {``."""
        it = n.iterator
        step = f"{it}++" if n.step == 1 else f"{it} += {n.step}"
        return f"for (long {it} = {self.expr(n.lower)}; {it} < {self.expr(n.upper)}; {step}) {{"

    def for_loop(self, n: Loop, ind: str) -> None:
        """Loop ``n`` without pragmas: header, body, closing brace."""
        self.var_dtypes[n.iterator] = INDEX
        self.lines.append(ind + self.loop_header(n))
        for c in n.body:
            self.node(c, ind + "  ")
        self.lines.append(f"{ind}}}")

    def target(self, s: Store | Reduce) -> str:
        """What statement ``s`` writes: the buffer element it names."""
        return self.ref(s.buffer, s.indices)

    def statement(self, s: Store | Reduce, ind: str) -> None:
        target = self.target(s)
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
            return self.cast(e.dtype, self.expr(e.operand)), 8
        if isinstance(e, Call):
            return self.call(e), 8
        return self.binary(e)

    def cast(self, dtype: DType, text: str) -> str:
        """``text`` converted to ``dtype``."""
        return f"(({self.type_name(dtype)})({text}))"

    def const(self, c: Const) -> tuple[str, int]:
        v = c.value
        if c.dtype == DType.bool:
            return ("1" if v else "0"), 8
        if c.dtype.is_integer:
            text = str(int(v)) + ("L" if abs(int(v)) > 2**31 - 1 else "")
            if c.dtype != INDEX:
                return f"(({self.type_name(c.dtype)}){text})", 8
            return text, (7 if v < 0 else 8)
        f = float(v)
        if math.isnan(f):
            return "NAN", 8
        if math.isinf(f):
            return ("INFINITY" if f > 0 else "-INFINITY"), (8 if f > 0 else 7)
        text = repr(f) if c.dtype == DType.float64 else repr(float(c.dtype.numpy.type(f)))
        if not any(ch in text for ch in ".e"):
            text += ".0"
        return self.float_literal(text, c.dtype)

    def float_literal(self, text: str, dtype: DType) -> tuple[str, int]:
        """The literal of finite value ``text`` (exact in ``dtype``) and its precedence:
        ``1.5`` (f64), ``1.5f`` (f32), ``((_Float16)1.5f)`` (a cast for narrower types)."""
        if dtype == DType.float64:
            return text, (7 if text.startswith("-") else 8)
        if dtype == DType.float32:
            return text + "f", (7 if text.startswith("-") else 8)
        return f"(({self.type_name(dtype)}){text}f)", 8

    def math_function(self, fn: str, dtype: DType) -> str:
        """The C function of math call ``fn`` on ``dtype``: ``fabs``/``labs`` for ``abs``,
        the ``f``-suffixed ``float`` functions for f32 (and for f16/bf16, computed in
        ``float``)."""
        suffix = "f" if dtype == DType.float32 or dtype in HALF_TYPES else ""
        if fn == "abs":
            return f"fabs{suffix}" if dtype.is_floating else "labs"
        return fn + suffix

    def call(self, e: Call) -> str:
        args = ", ".join(self.expr(a) for a in e.args)
        return f"{self.math_function(e.fn, self.dtype(e))}({args})"

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


HALF_TYPES = (DType.float16, DType.bfloat16)

HALF_HELPERS = """typedef union { unsigned u; float f; } kiln_bits;
static inline float kiln_bf16_load(unsigned short h) { kiln_bits v; v.u = (unsigned)h << 16; return v.f; }
static inline unsigned short kiln_bf16_store(float x) {
  kiln_bits v; v.f = x;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((v.u >> 16) | 0x40u);
  return (unsigned short)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
static inline float kiln_f16_load(unsigned short h) {
  kiln_bits o, magic; magic.u = 113u << 23;
  const unsigned shifted_exp = 0x7c00u << 13;
  o.u = (unsigned)(h & 0x7fffu) << 13;
  unsigned exp = shifted_exp & o.u;
  o.u += (127u - 15u) << 23;
  if (exp == shifted_exp) o.u += (128u - 16u) << 23;
  else if (exp == 0) { o.u += 1u << 23; o.f -= magic.f; }
  o.u |= (unsigned)(h & 0x8000u) << 16;
  return o.f;
}
static inline unsigned short kiln_f16_store(float x) {
  kiln_bits f, infty, max16, denorm;
  infty.u = 255u << 23; max16.u = (127u + 16u) << 23; denorm.u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  unsigned short o;
  f.f = x;
  unsigned sign = f.u & 0x80000000u;
  f.u ^= sign;
  if (f.u >= max16.u) o = (f.u > infty.u) ? 0x7e00 : 0x7c00;
  else if (f.u < (113u << 23)) { f.f += denorm.f; o = (unsigned short)(f.u - denorm.u); }
  else {
    unsigned odd = (f.u >> 13) & 1u;
    f.u += ((unsigned)(15 - 127) << 23) + 0xfffu;
    f.u += odd;
    o = (unsigned short)(f.u >> 13);
  }
  return (unsigned short)(o | (sign >> 16));
}
static inline float kiln_round_f16(float x) { return kiln_f16_load(kiln_f16_store(x)); }
static inline float kiln_round_bf16(float x) { return kiln_bf16_load(kiln_bf16_store(x)); }
"""
"""Exact float <-> float16/bfloat16 conversions (round to nearest even, NaN kept NaN), in
software: memory of a half type is ``unsigned short`` holding its bits, so no compiler
support for half types is needed (:class:`HalfAsFloat` printers use them)."""



class HalfAsFloat:
    """Printer hooks for float16/bfloat16 (a mixin before a :class:`CStylePrinter`): values of
    half dtypes are held in ``float``; memory keeps the half type.  ``half_load[dtype]`` and
    ``half_store[dtype]`` name the conversions (to float; to the memory type, rounding to
    nearest even) and ``half_round[dtype]`` rounds a float to the half type's precision."""

    half_load: Mapping[DType, str] = {}
    half_store: Mapping[DType, str] = {}
    half_round: Mapping[DType, str] = {}
    half_round_ops: bool = False
    """Round every arithmetic result of a half dtype too (as torch and kiln's interpreter do,
    one operation at a time), not only stores and casts."""

    def _is_half(self, buffer: str) -> bool:
        return self.buf_dtypes[buffer] in HALF_TYPES  # type: ignore[attr-defined]

    def load_text(self, buffer: str, indices: tuple[Expr, ...]) -> str:
        ref = self.ref(buffer, indices)  # type: ignore[attr-defined]
        return f"{self.half_load[self.buf_dtypes[buffer]]}({ref})" if self._is_half(buffer) else ref  # type: ignore

    def _expr(self, e: Expr) -> tuple[str, int]:
        if isinstance(e, Load):
            return self.load_text(e.buffer, e.indices), 8
        text, precedence = super()._expr(e)  # type: ignore[misc]
        if self.half_round_ops and isinstance(e, (Binary, Unary, Call)):
            dtype = self.dtype(e)  # type: ignore[attr-defined]
            if dtype in HALF_TYPES:
                return f"{self.half_round[dtype]}({text})", 8
        return text, precedence

    def cast(self, dtype: DType, text: str) -> str:
        if dtype in HALF_TYPES:
            return f"{self.half_round[dtype]}((float)({text}))"
        return super().cast(dtype, text)  # type: ignore[misc]

    def float_literal(self, text: str, dtype: DType) -> tuple[str, int]:
        if dtype in HALF_TYPES:  # exact in the half type, hence in float
            return text + "f", (7 if text.startswith("-") else 8)
        return super().float_literal(text, dtype)  # type: ignore[misc]

    def store_line(self, target: str, buffer: str, value: str) -> str:
        """``target = value;`` converting into the memory type of ``buffer``."""
        if self._is_half(buffer):
            return f"{target} = {self.half_store[self.buf_dtypes[buffer]]}({value});"  # type: ignore[attr-defined]
        return f"{target} = {value};"

    def statement(self, s: Store | Reduce, ind: str) -> None:
        target = self.target(s)  # type: ignore[attr-defined]
        value = self.expr(s.value)  # type: ignore[attr-defined]
        if not (target == self.ref(s.buffer, s.indices) and self._is_half(s.buffer)):  # type: ignore
            super().statement(s, ind)  # type: ignore[misc]
            return
        current = self.load_text(s.buffer, s.indices)
        if isinstance(s, Store):
            combined = value
        elif s.combiner in ("+", "*"):
            combined = f"{current} {s.combiner} ({value})"
        else:
            combined = f"KILN_{s.combiner.upper()}({current}, {value})"
        self.lines.append(ind + self.store_line(target, s.buffer, combined))  # type: ignore[attr-defined]


class BoolAsByte:
    """Printer hooks for bool memory as bytes (a mixin before a :class:`CStylePrinter` whose
    ``types`` spell bool as a byte type, ``unsigned char``): GCC vectorizes no load of
    ``_Bool``, and an attention mask is a bool buffer.  Values still convert through
    ``_Bool``: a cast to bool prints ``(_Bool)``, and a store into a bool buffer converts its
    value, so every byte holds 0 or 1 as a ``_Bool`` would."""

    def cast(self, dtype: DType, text: str) -> str:
        if dtype == DType.bool:
            return f"((_Bool)({text}))"
        return super().cast(dtype, text)  # type: ignore[misc]

    def statement(self, s: Store | Reduce, ind: str) -> None:
        if isinstance(s, Store) and self.buf_dtypes.get(s.buffer) == DType.bool:  # type: ignore[attr-defined]
            s = Store(s.buffer, s.indices, Cast(DType.bool, s.value), s.name)
        super().statement(s, ind)  # type: ignore[misc]


def c_type(dtype: DType) -> str:
    """The C spelling of ``dtype`` (:data:`C_TYPES`); ``ValueError`` when it has none."""
    return CStylePrinter.type_name(dtype)


def to_c(program: Program, name: str | None = None, prelude: bool = True) -> str:
    """C99 source of ``program`` as ``void <name>(...)``; see the module docstring."""
    body = CStylePrinter(program).function(name or program.name)
    return (CStylePrinter.prelude + "\n" + body + "\n") if prelude else body + "\n"


__all__ = ["C_PRELUDE", "C_TYPES", "HALF_HELPERS", "HALF_TYPES", "BoolAsByte", "CStylePrinter", "HalfAsFloat", "c_type",
           "to_c"]
