"""C for the cpu backend: all kernels of a graph in one translation unit.

Each kernel is a (scheduled) loop program printed as a ``static`` C function, plus an
exported entry point with one uniform signature, ``void kiln_kN(void *const *args)``, that
receives the raw data pointers of its buffers in a fixed order.  What the printer adds to
:func:`kiln.ir.loops.to_c`'s rules (:class:`KernelPrinter` specializes the loop IR's
:class:`~kiln.ir.loops.cgen.CStylePrinter`, overriding its hooks for loops, statement
targets, buffer parameters, local buffers and types):

* **No user text reaches C.**  Buffers, parameters and iterators are renamed to generated
  identifiers (``b0``, ``v0``) before printing; kernel symbols are generated; comments pass
  through :func:`c_comment`, which keeps only ``[A-Za-z0-9_.%@ ,:-]``.
* **Annotations become OpenMP.**  ``parallel`` -> ``#pragma omp parallel for`` (directly
  nested rectangular parallel loops collapse into one ``collapse(n)`` region; parallel marks
  inside a parallel loop are not nested regions), ``vectorized`` -> ``#pragma omp simd``,
  ``unrolled(f)`` -> ``#pragma GCC unroll f``.
* **Reductions accumulate in registers.**  A loop nest whose statements are all reductions
  into cells that do not depend on the nest's iterators (``out[i] += x[i, k]`` over ``k``)
  is printed with one scalar accumulator per cell, loaded before and stored after the nest;
  innermost loops get ``#pragma omp simd reduction(op: acc)`` (vectorized partial sums).
  When such a nest is not inside a parallel loop and does at least
  :data:`PARALLEL_REDUCTION_WORK` iterations, its outer loop becomes
  ``#pragma omp parallel for reduction(op: acc)``: per-thread partials combined at the end.
  Both change the order of floating-point additions (by design; results stay within
  rounding of the serial order).
* **Loop-invariant math is computed once.**  A floating-point subexpression of a loop
  nest's statements that calls a math function or divides, and that depends on no iterator
  of the nest and no buffer it writes, becomes a ``const`` local before the nest (an
  optimizer's bias corrections, ``pow(beta, step)``, were evaluated once per parameter
  element before).
* **No aliasing.**  Global buffers are ``restrict`` parameters: the memory plan never lets
  a kernel's output share memory with its inputs.
* Small local buffers live on the stack, zero-initialized; large ones are ``calloc``-ed.
* ``f16`` and ``bf16`` memory is ``unsigned short`` holding the bits; values are ``float``
  in between (:class:`kiln.ir.loops.cgen.HalfAsFloat`, with the exact software conversions
  of :data:`~kiln.ir.loops.cgen.HALF_HELPERS`): a load widens, every arithmetic result of a
  half type is rounded to it (as torch and the reference compute, one op at a time), a store
  narrows.  Reductions into registers accumulate in ``float`` and round once, at the store.
* A kernel may start with a GEMM (:mod:`.gemm`) whose result its loops read (the fused
  epilogue of a matmul).
* ``kiln_run(calls, n, ptrs)`` runs a sequence of the unit's kernels from a table in one
  foreign call (:class:`kiln.runtime.call_plan.NativeRunStep`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kiln.ir.loops.cgen import C_TYPES, HALF_HELPERS, HALF_TYPES, BoolAsByte, CStylePrinter, HalfAsFloat
from kiln.ir.loops.expr import Binary, Call, Cast, Const, Expr, Load, Select, Unary, free_vars, walk
from kiln.ir.loops.rename import generated_names
from kiln.ir.loops.program import Buffer, If, Loop, Node, Param, Program, Reduce, Store
from kiln.ir.types import DType

from .gemm import GemmSpec, blas_prelude, gemm_function
from .loop_work import nest_work
from .fast_math import EXP_HELPER, FLOAT_FUNCTIONS
from .speculate import BLEND, BLEND_HELPERS, speculable

PARALLEL_REDUCTION_WORK = 1 << 16
"""Iterations from which a top-level reduction nest is split into per-thread partials."""
STACK_LOCAL_BYTES = 1 << 15
"""Local buffers up to this size are stack arrays; larger ones are heap-allocated."""
_SIMD_REDUCTION = {"+": "+", "*": "*", "max": "max", "min": "min"}
_COMMENT_SAFE = re.compile(r"[^A-Za-z0-9_.%@ ,:\-]")


class UnsupportedKernelError(ValueError):
    """A loop program the C printer cannot express (e.g. a dtype without a C type)."""


def c_comment(text: str) -> str:
    """``text`` made safe inside a C comment: only ``[A-Za-z0-9_.%@ ,:-]``, at most 120 chars."""
    return _COMMENT_SAFE.sub("_", text)[:120]


@dataclass(frozen=True)
class KernelSource:
    """One kernel to print: ``symbol`` (an identifier kiln generated), the program, the
    global buffers passed at run time in call order (``args``), global buffers holding
    constants (``constants``: printed into the C as static arrays), values of the program's
    parameters, and a free-text ``comment`` (sanitized when printed).  With ``gemm`` the
    kernel first runs that GEMM, then the program (its epilogue), if any."""

    symbol: str
    program: Program | None
    args: tuple[str, ...]
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)
    params: Mapping[str, int | float] = field(default_factory=dict)
    comment: str = ""
    gemm: GemmSpec | None = None
    """A GEMM run first on ``args[0]``, ``args[1]`` into ``args[2]`` (:mod:`.gemm`)."""
    size_table: Mapping[str, int] = field(default_factory=dict)
    """Size parameters read at run time: parameter name -> its index in the size table, a
    ``const long *`` passed after the buffers (``args[len(args)]``).  A graph with
    symbolic shapes is compiled once; each call passes its sizes this way."""


# ----------------------------------------------------------------------------- renaming
def sanitize_program(program: Program) -> tuple[Program, dict[str, str]]:
    """``program`` with buffers renamed ``b0, b1, ...`` and parameters and iterators
    ``v0, v1, ...``; returns it and the buffer renaming (old -> new)
    (:func:`kiln.ir.loops.rename.generated_names`)."""
    return generated_names(program)


# ----------------------------------------------------------------------------- analysis
def _statements(body: Sequence[Node]) -> list[Store | Reduce]:
    out: list[Store | Reduce] = []
    for n in body:
        if isinstance(n, Loop):
            out.extend(_statements(n.body))
        elif isinstance(n, If):
            out.extend(_statements(n.then))
            out.extend(_statements(n.orelse))
        else:
            out.append(n)
    return out


def _iterators(body: Sequence[Node]) -> set[str]:
    out: set[str] = set()
    for n in body:
        if isinstance(n, Loop):
            out.add(n.iterator)
            out |= _iterators(n.body)
        elif isinstance(n, If):
            out |= _iterators(n.then) | _iterators(n.orelse)
    return out


def _node_exprs(body: Sequence[Node]) -> list[Expr]:
    out: list[Expr] = []
    for n in body:
        if isinstance(n, Loop):
            out += [n.lower, n.upper, *_node_exprs(n.body)]
        elif isinstance(n, If):
            out += [n.cond, *_node_exprs(n.then), *_node_exprs(n.orelse)]
        else:
            out += [*n.indices, n.value]
    return out


def reduction_cells(loop: Loop) -> list[tuple[str, tuple[Expr, ...], str]] | None:
    """The cells ``(buffer, indices, combiner)`` a pure reduction nest accumulates into, or
    ``None`` when ``loop`` is not one: every statement below must be a reduction whose
    target indices use none of the nest's iterators, the targets must not be read inside,
    and one buffer must be reached through one index tuple and one combiner only."""
    statements = _statements((loop,))
    if not statements or any(not isinstance(s, Reduce) for s in statements):
        return None
    inner = _iterators((loop,))
    cells: dict[tuple[str, tuple[Expr, ...]], str] = {}
    by_buffer: dict[str, tuple[Expr, ...]] = {}
    for s in statements:
        if any(free_vars(i) & inner for i in s.indices):
            return None
        if by_buffer.setdefault(s.buffer, s.indices) != s.indices:
            return None
        if cells.setdefault((s.buffer, s.indices), s.combiner) != s.combiner:
            return None
    targets = set(by_buffer)
    for e in _node_exprs((loop,)):
        if any(isinstance(x, Load) and x.buffer in targets for x in walk(e)):
            return None
    return [(b, idx, comb) for (b, idx), comb in cells.items()]


# ----------------------------------------------------------------------------- printing
class KernelPrinter(HalfAsFloat, BoolAsByte, CStylePrinter):
    """The OpenMP C printer of the cpu backend: :class:`kiln.ir.loops.cgen.CStylePrinter`
    with the hooks of the module docstring (``static`` functions, ``restrict`` buffers,
    stack locals, OpenMP loops, reductions into registers, half types as ``float``, bools as
    bytes)."""

    types = {**C_TYPES, DType.float16: "unsigned short", DType.bfloat16: "unsigned short", DType.bool: "unsigned char"}
    """Memory types: half types as their bits, bool as a byte (:class:`BoolAsByte`)."""
    half_load = {DType.float16: "kiln_f16_load", DType.bfloat16: "kiln_bf16_load"}
    half_store = {DType.float16: "kiln_f16_store", DType.bfloat16: "kiln_bf16_store"}
    half_round = {DType.float16: "kiln_round_f16", DType.bfloat16: "kiln_round_bf16"}
    half_round_ops = True
    function_prefix = "static "
    prelude = CStylePrinter.prelude + BLEND_HELPERS + EXP_HELPER

    def __init__(self, program: Program):
        super().__init__(program)
        self._accs: dict[tuple[str, tuple[Expr, ...]], str] = {}
        self._in_parallel = False
        self._in_simd = False  # inside an omp simd loop: OpenMP allows no parallel region there
        self._collapsed: frozenset[str] = frozenset()
        self._n_accs = 0
        self._hoisted: dict[Expr, str] | None = None
        """Loop-invariant expressions of the loop nest being printed, by their locals."""
        self._n_hoisted = 0

    def math_function(self, fn: str, dtype: DType) -> str:
        """kiln's own ``kiln_expf`` (:mod:`.fast_math`) for ``exp`` on float32 and the half
        types; the C library's functions otherwise."""
        if fn in FLOAT_FUNCTIONS and (dtype == DType.float32 or dtype in HALF_TYPES):
            return FLOAT_FUNCTIONS[fn]
        return super().math_function(fn, dtype)

    @classmethod
    def type_error(cls, dtype: DType) -> Exception:
        return UnsupportedKernelError(f"dtype {dtype.short} has no C type in the cpu backend")

    # ---------------------------------------------------------------- function
    def buffer_param(self, b: Buffer) -> str:
        dims = self.dims(b)
        return f"{self.type_name(b.dtype)} {b.name}[restrict {dims[0]}]" + "".join(f"[{d}]" for d in dims[1:])

    def stack_local(self, b: Buffer) -> bool:
        size = _static_size(b)
        return size is not None and size * b.dtype.itemsize <= STACK_LOCAL_BYTES

    # ---------------------------------------------------------------- loops
    def loop(self, n: Loop, ind: str) -> None:
        outermost = self._hoisted is None
        if outermost:
            self._hoisted = self._hoist_invariants(n, ind)
        try:
            cells = reduction_cells(n) if not self._accs_cover(n) else None
            if cells is not None:
                self._reduction_nest(n, cells, ind)
            else:
                self._plain_loop(n, ind)
        finally:
            if outermost:
                self._hoisted = None

    # ---------------------------------------------------------------- invariants
    def _hoist_invariants(self, n: Loop, ind: str) -> dict[Expr, str]:
        """Before loop nest ``n``: one ``const`` local per distinct floating-point expression
        of its statements that calls a math function or divides and that no iteration
        changes (no iterator of the nest, no buffer the nest writes): the bias corrections
        of an optimizer update (``pow(beta, step)``) are computed once, not per element.
        Float expressions cannot trap, so evaluating one outside its ``if`` is safe."""
        iterators = _iterators((n,))
        written = {s.buffer for s in _statements((n,))}
        found: dict[Expr, str] = {}

        def invariant(e: Expr) -> bool:
            return not (free_vars(e) & iterators) and not any(
                isinstance(x, Load) and x.buffer in written for x in walk(e))

        def worth(e: Expr) -> bool:
            nodes = list(walk(e))
            return any(isinstance(x, Call) or (isinstance(x, Binary) and x.op == "/") for x in nodes) \
                and not self._divides_integers(nodes)

        def visit(e: Expr) -> None:
            if isinstance(e, (Binary, Unary, Call, Cast)) and self.dtype(e).is_floating and invariant(e):
                if worth(e) and e not in found:
                    dtype = self.dtype(e)
                    name = f"inv{len(found)}_{self._n_hoisted}"
                    self.lines.append(f"{ind}const {self._value_type(dtype)} {name} = {self.expr(e)};")
                    found[e] = name
                return
            for child in e.children():
                visit(child)

        self._n_hoisted += 1
        self._hoisted = found  # a later invariant prints the earlier ones inside it by name
        for statement in _statements((n,)):
            visit(statement.value)
        return found

    def _divides_integers(self, nodes: Sequence[Expr]) -> bool:
        """Whether an integer division or remainder is among ``nodes``: it may trap (a zero
        divisor its ``if`` guards), so such an expression is never moved out of place."""
        return any(isinstance(x, Binary) and x.op in ("/", "%", "floordiv", "floormod") and self.dtype(x).is_integer
                   for x in nodes)

    def _value_type(self, dtype: DType) -> str:
        """The C type a value of ``dtype`` is computed in (``float`` for the half types)."""
        return "float" if dtype in HALF_TYPES else self.type_name(dtype)

    def _expr(self, e: Expr) -> tuple[str, int]:
        name = self._hoisted.get(e) if self._hoisted else None
        if name is not None:
            return name, 8
        if isinstance(e, Select) and self.dtype(e) in BLEND and speculable(e, self.dtype):
            args = ", ".join(self.expr(x) for x in (e.cond, e.if_true, e.if_false))
            return f"{BLEND[self.dtype(e)]}({args})", 8
        return super()._expr(e)

    def _accs_cover(self, n: Loop) -> bool:
        """Whether the statements of ``n`` already accumulate into registers (inner loop of a
        nest being printed by :meth:`_reduction_nest`)."""
        return bool(self._accs) and all((s.buffer, s.indices) in self._accs for s in _statements((n,)))

    def _plain_loop(self, n: Loop, ind: str, pragma: str | None = None) -> None:
        """Loop ``n`` with ``pragma``, or the pragmas of :meth:`loop_pragmas`; a parallel
        region it opens closes after its body."""
        state = self._in_parallel, self._in_simd, self._collapsed
        hoisted: list[Expr] = []
        if n.iterator in self._collapsed:
            lines: list[str] = []  # an inner loop of a collapse(n) region: OpenMP allows no pragma between them
        else:
            lines = [pragma] if pragma is not None else self.loop_pragmas(n)
            hoisted = self._hoist_row_invariants(n, ind)
        self.lines += [ind + line for line in lines]
        self.for_loop(n, ind)
        for e in hoisted:
            del self._hoisted[e]
        self._in_parallel, self._in_simd, self._collapsed = state

    def _hoist_row_invariants(self, n: Loop, ind: str) -> list[Expr]:
        """Before an innermost loop ``n`` inside a nest: one ``const`` local per value its
        statements read that ``n`` does not change -- a load whose indices lack ``n``'s
        iterator from a buffer ``n`` does not write (a row's maximum in a softmax), and math
        on such values.  GCC keeps such loads and calls in the loop and then vectorizes
        nothing.  Loads are hoisted only from statements no ``if`` guards, out of loops that
        run at least once, so a hoisted load reads only what the loop would have read."""
        if self._hoisted is None or any(isinstance(c, (Loop, If)) for c in n.body):
            return []
        runs = isinstance(n.lower, Const) and isinstance(n.upper, Const) and n.upper.value > n.lower.value
        written = {st.buffer for st in n.body}
        added: list[Expr] = []

        def candidate(e: Expr) -> bool:
            if n.iterator in free_vars(e) or e in self._hoisted:
                return False
            loads = [x for x in walk(e) if isinstance(x, Load)]
            if any(x.buffer in written for x in loads) or (loads and not runs):
                return False
            if isinstance(e, Load):
                return True
            nodes = list(walk(e))
            return self.dtype(e).is_floating and any(isinstance(x, (Load, Call)) for x in nodes) \
                and not self._divides_integers(nodes)

        def visit(e: Expr) -> None:
            if isinstance(e, (Load, Binary, Unary, Call, Cast)) and candidate(e):
                name = f"row{len(added)}_{self._n_hoisted}"
                self.lines.append(f"{ind}const {self._value_type(self.dtype(e))} {name} = {self.expr(e)};")
                self._hoisted[e] = name
                added.append(e)
                return
            for child in e.children():
                visit(child)

        self._n_hoisted += 1
        for statement in n.body:
            visit(statement.value)
        return added

    def loop_pragmas(self, n: Loop) -> list[str]:
        """OpenMP for ``n``: a parallel loop outside any region opens one (``collapse`` over
        directly nested parallel loops); a vectorized loop, an innermost parallel loop inside
        a region and an innermost loop accumulating into registers get ``omp simd``.  Inside
        an ``omp simd`` loop a parallel mark opens no region (OpenMP forbids one there): the
        loop runs in the vectorized loop's thread."""
        ann = n.annotation
        if ann.mode == "parallel" and not self._in_parallel and not self._in_simd:
            depth = self._collapse_depth(n)
            clause = f" collapse({depth})" if depth > 1 else ""
            inner, cur = set(), n
            for _ in range(depth - 1):
                cur = cur.body[0]
                inner.add(cur.iterator)
            self._in_parallel, self._collapsed = True, self._collapsed | inner
            return [f"#pragma omp parallel for schedule(static){clause}"]
        if ann.mode == "unrolled":
            return super().loop_pragmas(n)
        innermost = self._is_innermost(n)
        if ann.mode == "vectorized" or (innermost and (ann.mode == "parallel" or bool(self._accs))):
            self._in_simd = True
            return [f"#pragma omp simd{self._simd_reduction_clause(n)}"]
        return []

    def _collapse_depth(self, n: Loop) -> int:
        depth, outer, cur = 1, {n.iterator}, n
        while (len(cur.body) == 1 and isinstance(cur.body[0], Loop) and cur.body[0].annotation.mode == "parallel"
               and not ((free_vars(cur.body[0].lower) | free_vars(cur.body[0].upper)) & outer)
               and cur.body[0].step == 1):
            cur = cur.body[0]
            outer.add(cur.iterator)
            depth += 1
        return depth

    @staticmethod
    def _is_innermost(n: Loop) -> bool:
        return not _iterators(n.body)

    def _simd_reduction_clause(self, n: Loop) -> str:
        used: dict[str, list[str]] = {}
        for s in _statements((n,)):
            acc = self._accs.get((s.buffer, s.indices)) if isinstance(s, Reduce) else None
            if acc is None:
                continue
            if self.buf_dtypes[s.buffer] == DType.bool:
                return ""  # OpenMP has no max/min reduction on _Bool; stay scalar
            names = used.setdefault(_SIMD_REDUCTION[s.combiner], [])
            if acc not in names:
                names.append(acc)
        return "".join(f" reduction({op}:{', '.join(accs)})" for op, accs in used.items())

    def _reduction_nest(self, n: Loop, cells: list[tuple[str, tuple[Expr, ...], str]], ind: str) -> None:
        self.lines.append(f"{ind}{{")
        inner = ind + "  "
        names = []
        for buffer, indices, _ in cells:
            acc = f"acc{self._n_accs}"
            self._n_accs += 1
            names.append(acc)
            self.lines.append(f"{inner}{self._value_type(self.buf_dtypes[buffer])} {acc} = "
                              f"{self.load_text(buffer, indices)};")  # half cells accumulate in float
            self._accs[(buffer, indices)] = acc
        pragma = None
        work = nest_work((n,))
        bools = any(self.buf_dtypes[b] == DType.bool for b, _, _ in cells)
        if not self._in_parallel and not self._in_simd and not bools and work is not None \
                and work >= PARALLEL_REDUCTION_WORK \
                and n.annotation.mode in ("serial", "parallel"):
            clause = self._simd_reduction_clause(n)
            pragma = f"#pragma omp parallel for schedule(static){clause}"
            self._in_parallel = True
            self._plain_loop(replace(n, annotation=replace(n.annotation, mode="serial")), inner, pragma)
            self._in_parallel = False
        else:
            self._plain_loop(n, inner)
        for (buffer, indices, _), acc in zip(cells, names):
            self.lines.append(inner + self.store_line(self.ref(buffer, indices), buffer, acc))
            del self._accs[(buffer, indices)]
        self.lines.append(f"{ind}}}")

    # ---------------------------------------------------------------- statements
    def target(self, s: Store | Reduce) -> str:
        """A reduction whose cell accumulates in a register writes the register."""
        acc = self._accs.get((s.buffer, s.indices)) if isinstance(s, Reduce) else None
        return acc if acc is not None else super().target(s)


def _static_size(b: Buffer) -> int | None:
    size = 1
    for d in b.shape:
        if not isinstance(d, Const):
            return None
        size *= int(d.value)
    return size


# ----------------------------------------------------------------------------- units
def kernel_function(kernel: KernelSource) -> str:
    """The C of one kernel: its static functions and its ``void sym(void *const *)`` entry."""
    if not re.fullmatch(r"kiln_[A-Za-z0-9_]+", kernel.symbol):
        raise ValueError(f"kernel symbol {kernel.symbol!r} is not a generated kiln identifier")
    if kernel.program is None and kernel.gemm is None:
        raise ValueError(f"kernel {kernel.symbol} has neither a program nor a GEMM")
    position: dict[str, int | str] = {name: i for i, name in enumerate(kernel.args)}
    comment = f"/* {c_comment(kernel.comment)} */\n" if kernel.comment else ""
    parts = [comment]
    calls = []
    if kernel.gemm is not None:
        if len(kernel.args) < 3:
            raise ValueError(f"kernel {kernel.symbol}: a GEMM needs three args (A, B, C)")
        parts.append(gemm_function(f"{kernel.symbol}_gemm", kernel.gemm))
        sizes = f", (const long *)args[{len(kernel.args)}]" if kernel.gemm.m_expr else ""
        calls.append(f"{kernel.symbol}_gemm(args[0], args[1], args[2]{sizes});")
    if kernel.program is not None:
        parts.append(_program_function(kernel, position, calls))
    body = "\n  ".join(calls)
    parts.append(f"void {kernel.symbol}(void *const *args) {{\n  {body}\n}}\n")
    return "".join(parts)


def _program_function(kernel: KernelSource, position: dict[str, int | str], calls: list[str]) -> str:
    assert kernel.program is not None
    program, _ = sanitize_program(kernel.program)
    globals_ = [b.name for b in kernel.program.buffers if b.scope == "global"]
    operands = set(kernel.args[:2]) if kernel.gemm is not None else set()
    expected = sorted(set(kernel.args) - operands | set(kernel.constants))
    if sorted(globals_) != expected:
        raise ValueError(f"kernel {kernel.symbol}: args {list(kernel.args)} and constants "
                         f"{list(kernel.constants)} do not match the program's global buffers {globals_}")
    lines = []
    for i, (name, data) in enumerate(kernel.constants.items()):
        lines.append(_static_array(f"{kernel.symbol}_c{i}", kernel.program.buffer(name), data))
        position[name] = f"{kernel.symbol}_c{i}"
    body_name = f"{kernel.symbol}_body"
    lines.append(KernelPrinter(program).function(body_name) + "\n")
    sizes = f"((const long *)args[{len(kernel.args)}])"
    call_args = [f"{sizes}[{kernel.size_table[q.name]}]" if q.name in kernel.size_table
                 else _param_literal(q, kernel.params) for q in kernel.program.params if q.dtype.is_integer]
    call_args += [_param_literal(q, kernel.params) for q in kernel.program.params if not q.dtype.is_integer]
    call_args += [f"args[{position[b]}]" if isinstance(position[b], int) else f"(void *){position[b]}"
                  for b in globals_]
    calls.append(f"{body_name}({', '.join(call_args)});")
    return "".join(lines)


def _static_array(name: str, buffer: Buffer, data: np.ndarray) -> str:
    """``static const T name[n] = {...};`` holding ``data`` exactly (hex float literals)."""
    if buffer.dtype in HALF_TYPES:  # the stored bits
        values = np.asarray(data, dtype=buffer.dtype.numpy).reshape(-1).view(np.uint16)
        text = ", ".join(str(int(v)) for v in values.tolist()) or "0"
        return f"static const unsigned short {name}[{max(values.size, 1)}] = {{{text}}};\n"
    values = np.asarray(data, dtype=buffer.dtype.numpy).reshape(-1)
    text = ", ".join(_c_literal(v, buffer.dtype) for v in values.tolist()) or "0"
    return f"static const {KernelPrinter.type_name(buffer.dtype)} {name}[{max(values.size, 1)}] = {{{text}}};\n"


def _c_literal(value: float, dtype: DType) -> str:
    if dtype == DType.bool:
        return "1" if value else "0"
    if dtype.is_integer:
        return f"{int(value)}L" if dtype == DType.int64 else str(int(value))
    f = float(value)
    if math.isnan(f):
        return "NAN"
    if f in (float("inf"), float("-inf")):
        return "INFINITY" if f > 0 else "-INFINITY"
    return f.hex() + ("f" if dtype == DType.float32 else "")


def _param_literal(param: Param, values: Mapping[str, int | float]) -> str:
    if param.name not in values:
        raise ValueError(f"no value for program parameter '{param.name}'")
    value = values[param.name]
    if param.dtype.is_integer:
        return f"{int(value)}L"
    return _c_literal(value, param.dtype)


def translation_unit(kernels: Sequence[KernelSource], declarations: str = "") -> str:
    """One C file holding every kernel (see the module docstring) and ``kiln_run``, which runs
    a sequence of them in one call (kernel ``i`` of the table is ``kernels[i]``);
    ``declarations`` go after the prelude (the vector math declarations of :mod:`.toolchain`)."""
    parts = ["/* generated by kiln's cpu backend */", "#include <string.h>", KernelPrinter.prelude, HALF_HELPERS,
             declarations]
    if any(k.gemm is not None for k in kernels):
        parts.append(blas_prelude())
    parts += [kernel_function(k) for k in kernels]
    parts.append(table_runner([k.symbol for k in kernels]))
    return "\n".join(parts)


def table_runner(symbols: Sequence[str]) -> str:
    """``kiln_run(calls, n, ptrs)``: run ``n`` kernels of the table ``symbols`` in one foreign
    call (:class:`kiln.runtime.call_plan.HostLauncher`); ``kiln_add_kernel(f)`` puts a foreign
    kernel in one of :data:`FOREIGN_ROWS` more rows (once) and returns its row (``-1``: full)."""
    table = ", ".join(symbols) or "0"
    count = max(len(symbols), 1)
    return ("typedef void (*kiln_kernel_fn)(void *const *);\n"
            f"static kiln_kernel_fn kiln_table[{count + FOREIGN_ROWS}] = {{{table}}};\n"
            f"static long kiln_table_rows = {count};\n"
            "long kiln_add_kernel(void *f) {\n"
            f"  for (long i = {count}; i < kiln_table_rows; i++) if ((void *)kiln_table[i] == f) return i;\n"
            f"  if (kiln_table_rows == {count + FOREIGN_ROWS}) return -1;\n"
            "  kiln_table[kiln_table_rows] = (kiln_kernel_fn)f;\n"
            "  return kiln_table_rows++;\n"
            "}\n"
            "void kiln_run(const long *calls, long n, void *const *ptrs) {\n"
            "  for (long i = 0; i < n; i++) kiln_table[calls[2 * i]](ptrs + calls[2 * i + 1]);\n"
            "}\n")


FOREIGN_ROWS = 16
"""Rows of a unit's kernel table for foreign kernels (distinct functions: every kiln
convolution is one, ``kiln_conv_k``)."""


__all__ = [
    "FOREIGN_ROWS",
    "PARALLEL_REDUCTION_WORK",
    "KernelPrinter",
    "KernelSource",
    "UnsupportedKernelError",
    "c_comment",
    "kernel_function",
    "reduction_cells",
    "sanitize_program",
    "table_runner",
    "translation_unit",
]
