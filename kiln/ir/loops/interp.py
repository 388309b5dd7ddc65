"""A numpy interpreter for loop programs: ``run(program, params, arrays)`` updates arrays in place.

The program is translated once into Python source (cached by its text) and executed.
Loops run in their program order with C semantics, with one shortcut: an innermost loop
whose iterations touch disjoint cells of every buffer they write runs as whole-array numpy
operations, statement by statement.  That is only done when it provably gives the same
result as the sequential loop:

* the body is straight-line statements and no ``select``/``&&``/``||`` guards a load;
* every access to a buffer the loop writes uses one identical index tuple, and some index
  of it is affine in the iterator with a non-zero coefficient (so iterations never share a
  cell), or the buffer is the target of a single reduction whose indices do not involve the
  iterator, which is then folded in program order with ``ufunc.accumulate``.

Kernel constructs: task loops are lowered first (:func:`~kiln.ir.loops.tasks.lower_mappings`),
a vector copy runs lane by lane, ``commit_copies``/``wait_copies`` do nothing (copies complete
at once), and ``shared``/``register`` buffers are allocated like ``local`` ones.  Barriers and
warp shuffles need every thread of a block at once, which a serial loop nest is not: a
program holding them is refused with a :class:`ValueError` that says to run it through
``kiln.ir.loops.emulate.emulate(kernel)`` first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from ..types import DType
from .expr import (
    INDEX, Binary, Call, Cast, Const, Expr, Load, Select, Unary, Var, affine_form, dtype_of, free_vars,
    loads_of, walk,
)
from .program import Barrier, CopyCommit, CopyWait, If, Loop, Node, Program, Reduce, Shuffle, Store, TaskLoop, VectorCopy
from .tasks import lower_mappings

_NUMPY_FN = {
    "exp": "np.exp", "exp2": "np.exp2", "log": "np.log", "log2": "np.log2", "log10": "np.log10",
    "sqrt": "np.sqrt", "sin": "np.sin", "cos": "np.cos", "tan": "np.tan", "tanh": "np.tanh",
    "sinh": "np.sinh", "cosh": "np.cosh", "asin": "np.arcsin", "acos": "np.arccos", "atan": "np.arctan",
    "abs": "np.abs", "floor": "np.floor", "ceil": "np.ceil", "erf": "_erf", "pow": "np.power",
    "atan2": "np.arctan2", "fmod": "np.fmod",
}


def _cdiv(a, b):
    """C integer division (truncates towards zero), for scalars and arrays."""
    q = a // b
    return q + ((a % b != 0) & ((a < 0) != (b < 0)))


def _crem(a, b):
    return a - b * _cdiv(a, b)


def _erf(x):
    import scipy.special

    return scipy.special.erf(x)


def _accumulate(ufunc, init, values, dtype):
    seq = np.concatenate((np.asarray([init], dtype=dtype), np.asarray(values, dtype=dtype).reshape(-1)))
    return ufunc.accumulate(seq)[-1]


class _PyGen:
    """Translates one program into the source of ``def kernel(params, arrays)``."""

    def __init__(self, program: Program | None):
        self.program = program
        self.lines: list[str] = []
        self.consts: dict[str, object] = {}
        self.buf_dtypes = {b.name: b.dtype for b in program.buffers} if program else {}
        self.var_dtypes = {p.name: p.dtype for p in program.params} if program else {}

    def source(self) -> str:
        self.emit(0, "def kernel(params, arrays):")
        for p in self.program.params:
            conv = "int" if p.dtype.is_integer else f"_T_{p.dtype.short}.type"
            self.consts[f"_T_{p.dtype.short}"] = p.dtype.numpy
            self.emit(1, f"v_{p.name} = {conv}(params[{p.name!r}])")
        for b in self.program.buffers:
            self.emit(1, f"b_{b.name} = arrays[{b.name!r}]")
        self.nodes(self.program.body, 1)
        self.emit(1, "return None")
        return "\n".join(self.lines)

    def emit(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    # ----------------------------------------------------------------- structure
    def nodes(self, nodes: tuple[Node, ...], depth: int) -> None:
        if not nodes:
            self.emit(depth, "pass")
        for n in nodes:
            self.node(n, depth)

    def node(self, n: Node, depth: int) -> None:
        if isinstance(n, Loop):
            self.loop(n, depth)
        elif isinstance(n, If):
            self.emit(depth, f"if {self.expr(n.cond, set())}:")
            self.nodes(n.then, depth + 1)
            if n.orelse:
                self.emit(depth, "else:")
                self.nodes(n.orelse, depth + 1)
        elif isinstance(n, VectorCopy):
            for dst, src in n.lanes():
                self.emit(depth, f"b_{dst.buffer}[{self.index(dst, set())}] = {self.expr(src, set())}")
        elif isinstance(n, (CopyCommit, CopyWait)):
            self.emit(depth, "pass")
        elif isinstance(n, (Barrier, Shuffle, TaskLoop)):  # refused by compile_python
            raise AssertionError(f"{type(n).__name__} reached the interpreter's code generator")
        else:
            self.statement(n, depth, set())

    def loop(self, n: Loop, depth: int) -> None:
        lo, hi = self.expr(n.lower, set()), self.expr(n.upper, set())
        it = f"v_{n.iterator}"
        self.var_dtypes[n.iterator] = INDEX
        plan = self.vector_plan(n)
        if plan is None:
            self.emit(depth, f"for {it} in range({lo}, {hi}, {n.step}):")
            self.nodes(n.body, depth + 1)
            return
        self.emit(depth, f"{it} = np.arange({lo}, {hi}, {n.step})")
        self.emit(depth, f"if {it}.size:")
        for stmt in n.body:
            if stmt.name in plan:
                self.folded_reduction(stmt, depth + 1, n.iterator)
            else:
                self.statement(stmt, depth + 1, {n.iterator})

    def statement(self, s: Store | Reduce, depth: int, vec: set[str]) -> None:
        ix = self.index(s.target, vec)
        ref = f"b_{s.buffer}[{ix}]"
        value = self.expr(s.value, vec)
        if isinstance(s, Store):
            self.emit(depth, f"{ref} = {value}")
            return
        self.emit(depth, f"_ix = {ix}")
        acc = f"b_{s.buffer}[_ix]"
        if s.combiner in ("+", "*"):
            self.emit(depth, f"{acc} = {acc} {s.combiner} {value}")
        else:
            fn = ("np.maximum" if s.combiner == "max" else "np.minimum") if vec else s.combiner
            self.emit(depth, f"{acc} = {fn}({acc}, {value})")

    def folded_reduction(self, s: Reduce, depth: int, iterator: str) -> None:
        ufunc = {"+": "np.add", "*": "np.multiply", "max": "np.maximum", "min": "np.minimum"}[s.combiner]
        dt = f"_T_{self.buf_dtypes[s.buffer].short}"
        self.consts[dt] = self.buf_dtypes[s.buffer].numpy
        value = self.expr(s.value, {iterator})
        self.emit(depth, f"_ix = {self.index(s.target, set())}")
        self.emit(depth, f"b_{s.buffer}[_ix] = _accumulate({ufunc}, b_{s.buffer}[_ix], "
                         f"np.broadcast_to({value}, v_{iterator}.shape), {dt})")

    # ----------------------------------------------------------------- vectorization
    def vector_plan(self, loop: Loop) -> set[str] | None:
        """Statement names to fold as reductions, or ``None`` if the loop must run serially."""
        body = loop.body
        k = loop.iterator
        if not body or not all(isinstance(s, (Store, Reduce)) for s in body):
            return None
        accesses: dict[str, list[tuple[str, tuple[Expr, ...], bool]]] = {}
        for s in body:
            for e in (s.value, *s.indices):
                for sub in walk(e):
                    guarded = isinstance(sub, Select) or (isinstance(sub, Binary) and sub.op in ("&&", "||"))
                    if guarded and loads_of(sub):
                        return None
            accesses.setdefault(s.buffer, []).append((s.name, s.indices, True))
            for ld in loads_of(s.value) + [x for i in s.indices for x in loads_of(i)]:
                accesses.setdefault(ld.buffer, []).append((s.name, ld.indices, False))
        folded: set[str] = set()
        for buf, acc in accesses.items():
            writers = [a for a in acc if a[2]]
            if not writers:
                continue
            tuples = {a[1] for a in acc}
            if len(tuples) == 1 and self._injective(next(iter(tuples)), k):
                continue
            stmt = next(s for s in body if s.name == writers[0][0])
            if len(acc) == 1 and isinstance(stmt, Reduce) and self._foldable(stmt, k):
                folded.add(stmt.name)
                continue
            return None
        return folded

    @staticmethod
    def _injective(indices: tuple[Expr, ...], k: str) -> bool:
        for i in indices:
            form = affine_form(i)
            if form is not None and form.coeff(k) != 0:
                return True
        return False

    def _foldable(self, s: Reduce, k: str) -> bool:
        if any(k in free_vars(i) or loads_of(i) for i in s.indices):
            return False
        value_dt = dtype_of(s.value, self.var_dtypes, self.buf_dtypes)
        return value_dt == self.buf_dtypes[s.buffer]

    # ----------------------------------------------------------------- expressions
    def index(self, target: Load, vec: set[str]) -> str:
        if not target.indices:
            return "()"
        parts = [self.expr(i, vec) for i in target.indices]
        return ", ".join(parts) + ("," if len(parts) == 1 else "")

    def dtype(self, e: Expr) -> DType:
        return dtype_of(e, self.var_dtypes, self.buf_dtypes)

    def const(self, c: Const) -> str:
        if c.dtype == INDEX:
            return repr(int(c.value))
        if c.dtype == DType.bool:
            return repr(bool(c.value))
        name = f"_k{len(self.consts)}"
        self.consts[name] = c.dtype.numpy.type(c.value)
        return name

    def expr(self, e: Expr, vec: set[str]) -> str:
        is_vec = bool(vec) and bool(free_vars(e) & vec)
        if isinstance(e, Const):
            return self.const(e)
        if isinstance(e, Var):
            return f"v_{e.name}"
        if isinstance(e, Load):
            return f"b_{e.buffer}[{self.index(e, vec)}]"
        if isinstance(e, Unary):
            inner = self.expr(e.operand, vec)
            if e.op == "-":
                return f"(-{inner})"
            return f"np.logical_not({inner})" if is_vec else f"(not {inner})"
        if isinstance(e, Select):
            c, a, b = (self.expr(x, vec) for x in (e.cond, e.if_true, e.if_false))
            return f"np.where({c}, {a}, {b})" if is_vec else f"({a} if {c} else {b})"
        if isinstance(e, Cast):
            inner = self.expr(e.operand, vec)
            if e.dtype == INDEX and not is_vec:
                return f"int({inner})"
            name = f"_T_{e.dtype.short}"
            self.consts[name] = e.dtype.numpy
            return f"np.asarray({inner}).astype({name})" if is_vec else f"{name}.type({inner})"
        if isinstance(e, Call):
            want = self.dtype(e)
            args = []
            for a in e.args:
                text = self.expr(a, vec)
                if e.fn != "abs" and self.dtype(a) != want:
                    name = f"_T_{want.short}"
                    self.consts[name] = want.numpy
                    text = f"np.asarray({text}, dtype={name})"
                args.append(text)
            return f"{_NUMPY_FN[e.fn]}({', '.join(args)})"
        return self.binary(e, vec, is_vec)

    def binary(self, e: Binary, vec: set[str], is_vec: bool) -> str:
        a, b = self.expr(e.lhs, vec), self.expr(e.rhs, vec)
        op = e.op
        if op in ("+", "-", "*", "<", "<=", "==", "!=", ">", ">="):
            return f"({a} {op} {b})"
        ints = self.dtype(e.lhs).is_integer and self.dtype(e.rhs).is_integer
        if op == "/":
            return f"_cdiv({a}, {b})" if ints else f"({a} / {b})"
        if op == "%":
            return f"_crem({a}, {b})" if ints else f"np.fmod({a}, {b})"
        if op == "floordiv":
            return f"({a} // {b})"
        if op == "floormod":
            return f"({a} % {b})"
        if op in ("min", "max"):
            fn = ("np.minimum" if op == "min" else "np.maximum") if is_vec else op
            return f"{fn}({a}, {b})"
        if op == "&&":
            return f"np.logical_and({a}, {b})" if is_vec else f"({a} and {b})"
        return f"np.logical_or({a}, {b})" if is_vec else f"({a} or {b})"


_CACHE: OrderedDict[str, object] = OrderedDict()
_CACHE_SIZE = 256


def compile_python(program: Program):
    """The program as a Python function ``kernel(params, arrays)`` (cached by program text)."""
    key = str(program)
    fn = _CACHE.get(key)
    if fn is not None:
        _CACHE.move_to_end(key)
        return fn
    gen = _PyGen(runnable(program))
    src = gen.source()
    namespace: dict[str, object] = {"np": np, "_cdiv": _cdiv, "_crem": _crem, "_erf": _erf,
                                    "_accumulate": _accumulate, **gen.consts}
    exec(compile(src, f"<kiln loop program {program.name}>", "exec"), namespace)
    fn = namespace["kernel"]
    fn.__kiln_source__ = src
    _CACHE[key] = fn
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return fn


def runnable(program: Program) -> Program:
    """``program`` with its task loops lowered; ``ValueError`` if it holds a barrier or a
    warp shuffle (they need the threads of a block together: emulate the kernel first)."""
    for n, _ in program.walk():
        if isinstance(n, (Barrier, Shuffle)):
            what = "a barrier" if isinstance(n, Barrier) else f"the warp shuffle {n.name}"
            raise ValueError(f"program '{program.name}' holds {what}, which the threads of a block run "
                             f"together; the serial interpreter cannot run it: run "
                             f"kiln.ir.loops.emulate.emulate(kernel) first and interpret the program it "
                             f"returns")
    if any(isinstance(n, TaskLoop) for n, _ in program.walk()):
        return lower_mappings(program)
    return program


def buffer_shape(program: Program, name: str, params: Mapping[str, int]) -> tuple[int, ...]:
    """The concrete shape of buffer ``name`` for the given size parameters."""
    buf = program.buffer(name)
    return tuple(int(eval_index(d, params)) for d in buf.shape)


def eval_index(expr: Expr, env: Mapping[str, int]) -> int:
    """Evaluate an integer expression without loads (shapes, bounds)."""
    gen = _PyGen(None)
    src = gen.expr(expr, set())
    scope = {f"v_{k}": v for k, v in env.items()}
    return eval(src, {"np": np, "_cdiv": _cdiv, "_crem": _crem, **gen.consts}, scope)


def run(program: Program, params: Mapping[str, int | float], arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute ``program`` in place on ``arrays`` (one per global buffer, exact shape and dtype).

    Local, shared and register buffers are allocated (zero-filled) by the interpreter, one
    copy for the whole run; they are returned in a dict so tests can inspect them.  Task
    loops run as :func:`~kiln.ir.loops.tasks.lower_mappings` lowers them; barriers and
    shuffles are refused (:func:`runnable`).
    """
    missing = [p.name for p in program.params if p.name not in params]
    if missing:
        raise ValueError(f"run({program.name}): missing parameter(s) {missing}")
    unknown = sorted(set(params) - {p.name for p in program.params})
    if unknown:
        raise ValueError(f"run({program.name}): unknown parameter(s) {unknown}; "
                         f"parameters: {[p.name for p in program.params]}")
    sizes = {p.name: int(params[p.name]) for p in program.params if p.dtype.is_integer}
    bound: dict[str, np.ndarray] = {}
    locals_: dict[str, np.ndarray] = {}
    for b in program.buffers:
        shape = buffer_shape(program, b.name, sizes)
        if b.scope != "global":
            locals_[b.name] = bound[b.name] = np.zeros(shape, dtype=b.dtype.numpy)
            continue
        if b.name not in arrays:
            raise ValueError(f"run({program.name}): no array for buffer '{b.name}' "
                             f"({b.dtype.short}{list(shape)})")
        arr = arrays[b.name]
        if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != b.dtype.numpy:
            got = (f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray)
                   else f"a {type(arr).__module__}.{type(arr).__name__} (not an ndarray)")
            raise ValueError(f"run({program.name}): buffer '{b.name}' needs a numpy array "
                             f"{b.dtype.short}{list(shape)}, got {got}")
        bound[b.name] = arr
    extra = sorted(set(arrays) - {b.name for b in program.buffers})
    if extra:
        raise ValueError(f"run({program.name}): unknown array(s) {extra}")
    kernel = compile_python(program)
    with np.errstate(all="ignore"):
        kernel(params, bound)
    return locals_
