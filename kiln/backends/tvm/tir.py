"""kiln loop programs as TVM TensorIR PrimFuncs.

Two forms, one expression translator (:class:`Translator`):

* **kiln's schedule** (:func:`scheduled_func`): the program as kiln scheduled it, loop for
  loop.  Each loop becomes a TIR ``For`` with the same iterator, bounds and order;
  annotations map to loop kinds: ``parallel`` -> ``T.parallel`` (the outermost one of a
  nest; TVM runs no nested parallel regions, so parallel loops inside it are serial, as
  the cpu backend's OpenMP printer does), ``vectorized`` -> ``T.vectorized`` when the
  extent is a constant and no statement below reduces into a cell the loop does not index
  (else serial: LLVM still vectorizes it), ``unrolled(f)`` -> ``T.unroll`` when the
  extent is a constant of at most ``f`` (else serial).  The function takes one pointer
  (``T.handle``) per global buffer and declares its buffer over it, so the call plan passes
  data pointers (roots plus byte offsets) and a call costs about 2 us; local buffers come
  last, as scratch pointers the launcher allocates per workspace.
* **blocks** (:func:`block_func`): the unscheduled program with every statement in a
  ``T.sblock`` whose iteration variables are its enclosing loops (spatial when the written
  cell uses them, reduction otherwise); an initializing store directly followed by the
  reduction nest into the same cell becomes the block's ``T.init``; ``if`` conditions
  become block predicates.  This is the form TVM's own schedules (dlight, MetaSchedule)
  read.  Its parameters are buffers; :func:`pointer_params` turns a scheduled one into
  the pointer form.

Expressions follow the loop IR's meaning (``kiln/ir/loops/expr.py``): operands are cast
to the promoted dtype (TIR has no implicit promotion), integer ``/`` and ``%`` truncate
(``truncdiv``/``truncmod``), ``floordiv``/``floormod`` round down, ``select`` evaluates
only the chosen operand (``T.if_then_else``), a conversion to ``bool`` is ``!= 0`` and a
store converts its value to the buffer's dtype.  Local buffers are allocated in the
function and zero-filled first, as the loop IR's interpreter and the C printers do (in
block form only those a reduction without ``T.init`` accumulates into: a second writer
would hide the reduction from TVM's schedules).
Programs with parameters, ``f16``/``bf16`` buffers or GPU constructs are refused with
:class:`UnsupportedProgramError` (the kernel then falls back to the host reference).
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.ir.loops.expr import (
    CMP_OPS, INDEX, LOGIC_OPS, Binary, affine_form, Call, Cast, Const, Expr, Load, Select, Unary, Var, dtype_of, free_vars,
)
from kiln.ir.loops.program import If, Loop, Node, Program, Reduce, Store
from kiln.ir.types import DType, promote

from .compat import tirx, tvm


class UnsupportedProgramError(ValueError):
    """A loop program this translator cannot express in TensorIR."""


TIR_DTYPES = {DType.float64: "float64", DType.float32: "float32", DType.int64: "int64", DType.int32: "int32",
              DType.int8: "int8", DType.uint8: "uint8", DType.bool: "bool"}
"""kiln dtypes with a TIR spelling here (half types are refused, as in the cpu backend)."""

_MATH = {"exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "log10": "log10", "sqrt": "sqrt",
         "sin": "sin", "cos": "cos", "tan": "tan", "tanh": "tanh", "sinh": "sinh", "cosh": "cosh", "asin": "asin",
         "acos": "acos", "atan": "atan", "abs": "abs", "floor": "floor", "ceil": "ceil", "erf": "erf",
         "pow": "pow", "atan2": "atan2", "fmod": "fmod"}


def tir_dtype(dtype: DType) -> str:
    try:
        return TIR_DTYPES[dtype]
    except KeyError:
        raise UnsupportedProgramError(f"dtype {dtype.short} has no TensorIR type in the tvm backend") from None


def i64(value: int):
    return tirx.IntImm("int64", int(value))


class Translator:
    """Buffers and expressions of one program (module docstring)."""

    def __init__(self, program: Program):
        if program.params:
            raise UnsupportedProgramError(f"program '{program.name}' has parameters; the tvm backend translates "
                                          f"programs of static shapes only")
        self.program = program
        self.buf_dtypes = {b.name: b.dtype for b in program.buffers}
        self.buffers = {}
        for b in program.buffers:
            if b.scope not in ("global", "local"):
                raise UnsupportedProgramError(f"buffer '{b.name}' has scope {b.scope}; the tvm backend translates "
                                              f"host loop programs")
            shape = [self.index(d) for d in b.shape]
            self.buffers[b.name] = tirx.decl_buffer(shape, tir_dtype(b.dtype), name=b.name)
        self.vars: dict[str, object] = {}
        self.accumulated: set[str] = set()
        """Buffers a block-form reduction without ``T.init`` accumulates into (zero-filled first)."""

    # ----------------------------------------------------------------- expressions
    def dtype(self, e: Expr) -> DType:
        return dtype_of(e, {}, self.buf_dtypes)

    def index(self, e: Expr):
        return self.cast(e, INDEX)

    def cast(self, e: Expr, to: DType):
        """``e`` converted to ``to`` (C conversion rules; ``bool`` is ``!= 0``)."""
        value, have = self.expr(e), self.dtype(e)
        return convert(value, have, to)

    def expr(self, e: Expr):
        if isinstance(e, Const):
            if e.dtype == DType.bool:
                return tirx.const(bool(e.value), "bool")
            if e.dtype.is_integer:
                return tirx.IntImm(tir_dtype(e.dtype), int(e.value))
            return tirx.FloatImm(tir_dtype(e.dtype), float(e.value))
        if isinstance(e, Var):
            try:
                return self.vars[e.name]
            except KeyError:
                raise UnsupportedProgramError(f"variable '{e.name}' is not a loop iterator") from None
        if isinstance(e, Load):
            return tirx.BufferLoad(self.buffers[e.buffer], [self.index(i) for i in e.indices])
        if isinstance(e, Cast):
            return self.cast(e.operand, e.dtype)
        if isinstance(e, Unary):
            if e.op == "!":
                return tirx.Not(self.cast(e.operand, DType.bool))
            dt = self.dtype(e)
            x = self.cast(e.operand, dt)
            return tirx.Sub(zero(dt), x)
        if isinstance(e, Select):
            dt = self.dtype(e)
            return tirx.if_then_else(self.cast(e.cond, DType.bool), self.cast(e.if_true, dt),
                                     self.cast(e.if_false, dt))
        if isinstance(e, Call):
            dt = self.dtype(e)
            args = [self.cast(a, dt) for a in e.args]
            return getattr(tirx, _MATH[e.fn])(*args)
        if isinstance(e, Binary):
            return self.binary(e)
        raise UnsupportedProgramError(f"expression {e!r} has no TensorIR form here")

    def binary(self, e: Binary):
        op = e.op
        if op in LOGIC_OPS:
            a, b = self.cast(e.lhs, DType.bool), self.cast(e.rhs, DType.bool)
            return tirx.And(a, b) if op == "&&" else tirx.Or(a, b)
        if op in CMP_OPS:
            dt = promote(self.dtype(e.lhs), self.dtype(e.rhs))
            a, b = self.cast(e.lhs, dt), self.cast(e.rhs, dt)
            return {"<": tirx.LT, "<=": tirx.LE, "==": tirx.EQ, "!=": tirx.NE, ">": tirx.GT, ">=": tirx.GE}[op](a, b)
        dt = self.dtype(e)
        a, b = self.cast(e.lhs, dt), self.cast(e.rhs, dt)
        return arith(op, a, b, dt)


def arith(op: str, a, b, dt: DType):
    """``a op b`` in dtype ``dt`` with the loop IR's meaning."""
    floating = dt.is_floating
    if op == "+":
        return tirx.Add(a, b)
    if op == "-":
        return tirx.Sub(a, b)
    if op == "*":
        return tirx.Mul(a, b)
    if op == "/":
        return tirx.Div(a, b) if floating else tirx.truncdiv(a, b)
    if op == "%":
        return tirx.fmod(a, b) if floating else tirx.truncmod(a, b)
    if op == "floordiv":
        return tirx.floor(tirx.Div(a, b)) if floating else tirx.floordiv(a, b)
    if op == "floormod":
        return tirx.Sub(a, tirx.Mul(b, tirx.floor(tirx.Div(a, b)))) if floating else tirx.floormod(a, b)
    if op == "min":
        return tirx.Min(a, b)
    if op == "max":
        return tirx.Max(a, b)
    raise UnsupportedProgramError(f"operator {op!r} has no TensorIR form here")


def zero(dt: DType):
    if dt == DType.bool:
        return tirx.const(False, "bool")
    return tirx.IntImm(tir_dtype(dt), 0) if not dt.is_floating else tirx.FloatImm(tir_dtype(dt), 0.0)


def convert(value, have: DType, to: DType):
    if have == to:
        return value
    if to == DType.bool:
        return tirx.NE(value, zero(have))
    return tirx.Cast(tir_dtype(to), value)


def combine(combiner: str, current, value, dtype: DType):
    """The new value of a reduction cell (``bool`` cells: ``+``/``max`` are or, ``*``/``min`` and)."""
    if dtype == DType.bool:
        return tirx.Or(current, value) if combiner in ("+", "max") else tirx.And(current, value)
    if combiner == "+":
        return tirx.Add(current, value)
    if combiner == "*":
        return tirx.Mul(current, value)
    return tirx.Max(current, value) if combiner == "max" else tirx.Min(current, value)


def statement(t: Translator, s: Store | Reduce):
    """The ``BufferStore`` of a store or reduction."""
    buf, dt = t.buffers[s.buffer], t.buf_dtypes[s.buffer]
    idx = [t.index(i) for i in s.indices]
    value = t.cast(s.value, dt)
    if isinstance(s, Reduce):
        value = combine(s.combiner, tirx.BufferLoad(buf, idx), value, dt)
    return tirx.BufferStore(buf, value, idx)


def seq(stmts: list):
    if not stmts:
        return tirx.Evaluate(i64(0))
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def const_extent(loop: Loop) -> int | None:
    """The trip count of ``loop`` when ``upper - lower`` is a constant (tiles: ``[32 t, 32 t + 32)``)."""
    width = affine_form(Binary("-", loop.upper, loop.lower))
    if width is None or width.coeffs:
        return None
    return max(0, -(-int(width.const) // loop.step))


# ------------------------------------------------------------------------------ kiln's schedule
def _statements(nodes: Sequence[Node]) -> list[Store | Reduce]:
    out: list[Store | Reduce] = []
    for n in nodes:
        if isinstance(n, Loop):
            out += _statements(n.body)
        elif isinstance(n, If):
            out += _statements(n.then) + _statements(n.orelse)
        elif isinstance(n, (Store, Reduce)):
            out.append(n)
        else:
            raise UnsupportedProgramError(f"{type(n).__name__} nodes (GPU kernels) have no host TensorIR form")
    return out


def loop_kind(loop: Loop, in_parallel: bool) -> str:
    """The TIR loop kind of ``loop`` (module docstring): ``parallel``, ``vectorized``,
    ``unrolled`` or ``serial``."""
    mode, extent = loop.annotation.mode, const_extent(loop)
    if mode == "parallel":
        return "serial" if in_parallel else "parallel"
    if mode == "vectorized":
        carried = any(isinstance(s, Reduce) and loop.iterator not in set().union(*map(free_vars, s.indices))
                      for s in _statements(loop.body))
        return "vectorized" if extent is not None and extent > 0 and not carried else "serial"
    if mode == "unrolled":
        return "unrolled" if extent is not None and extent <= (loop.annotation.factor or 0) else "serial"
    if mode == "mapped":
        raise UnsupportedProgramError(f"loop '{loop.name}' is mapped to {loop.annotation.axis}; the tvm backend "
                                      f"translates host loop programs")
    return "serial"


_KINDS = {"serial": "SERIAL", "parallel": "PARALLEL", "vectorized": "VECTORIZED", "unrolled": "UNROLLED"}


def _for(t: Translator, loop: Loop, kind: str, body_fn):
    var = tirx.Var(loop.iterator, "int64")
    outer = t.vars.get(loop.iterator)
    t.vars[loop.iterator] = var
    try:
        body = body_fn()
    finally:
        if outer is None:
            t.vars.pop(loop.iterator)
        else:
            t.vars[loop.iterator] = outer
    lower, upper = t.index(loop.lower), t.index(loop.upper)
    extent = tirx.Max(tirx.Sub(upper, lower), i64(0)) if const_extent(loop) is None else i64(
        const_extent(loop) * loop.step)
    step = None if loop.step == 1 else i64(loop.step)
    return tirx.For(var, lower, extent, getattr(tirx.ForKind, _KINDS[kind]), body, step=step)


def _scheduled_nodes(t: Translator, nodes: Sequence[Node], in_parallel: bool) -> list:
    out = []
    for n in nodes:
        if isinstance(n, Loop):
            kind = loop_kind(n, in_parallel)
            inner = in_parallel or kind == "parallel"
            out.append(_for(t, n, kind, lambda n=n, inner=inner: seq(_scheduled_nodes(t, n.body, inner))))
        elif isinstance(n, If):
            then = seq(_scheduled_nodes(t, n.then, in_parallel))
            orelse = seq(_scheduled_nodes(t, n.orelse, in_parallel)) if n.orelse else None
            out.append(tirx.IfThenElse(t.cast(n.cond, DType.bool), then, orelse))
        elif isinstance(n, (Store, Reduce)):
            out.append(statement(t, n))
        else:
            raise UnsupportedProgramError(f"{type(n).__name__} nodes (GPU kernels) have no host TensorIR form")
    return out


def _zero_fill(t: Translator, name: str) -> list:
    """Loops setting local buffer ``name`` to zero."""
    buf, b = t.buffers[name], t.program.buffer(name)
    vars_ = [tirx.Var(f"z{d}", "int64") for d in range(b.rank)]
    stmt = tirx.BufferStore(buf, zero(b.dtype), list(vars_))
    for d in reversed(range(b.rank)):
        stmt = tirx.For(vars_[d], i64(0), t.index(b.shape[d]), tirx.ForKind.SERIAL, stmt)
    return [stmt]


def _locals(t: Translator) -> list[str]:
    return [b.name for b in t.program.buffers if b.scope == "local"]


def scheduled_func(program: Program, args: Sequence[str], symbol: str):
    """The PrimFunc ``symbol`` of ``program`` as scheduled, taking one data pointer per name of
    ``args`` (the program's global buffers in call order) and then one per local buffer
    (scratch the launcher allocates); and the scratch buffers' ``(shape, dtype)``."""
    t = Translator(program)
    _check_args(program, args)
    body = []
    for name in _locals(t):
        body += _zero_fill(t, name)
    body += _scheduled_nodes(t, program.body, False)
    scratch = [t.buffers[name] for name in _locals(t)]
    return _pointer_func([t.buffers[name] for name in args] + scratch, seq(body), symbol), specs(scratch)


def _check_args(program: Program, args: Sequence[str]) -> None:
    globals_ = sorted(b.name for b in program.buffers if b.scope == "global")
    if sorted(args) != globals_:
        raise UnsupportedProgramError(f"kernel args {list(args)} do not match the program's global buffers {globals_}")


def specs(buffers: list) -> list[tuple[list[int], str]]:
    """``(shape, dtype)`` of scratch buffers (static shapes)."""
    out = []
    for buf in buffers:
        shape = []
        for d in buf.shape:
            if not isinstance(d, tirx.IntImm):
                raise UnsupportedProgramError(f"scratch buffer {buf.name} has a symbolic shape")
            shape.append(int(d.value))
        out.append((shape, str(buf.dtype)))
    return out


def _pointer_func(buffers: list, body, symbol: str):
    """A PrimFunc taking one data pointer per buffer of ``buffers``, declared over it.

    Local buffers are passed in as scratch too: a function allocating them would ask TVM's
    runtime for workspace memory by device, which pointer parameters do not carry."""
    params, decls = [], []
    for buf in buffers:
        ptr = tirx.Var(f"p_{buf.name}", tvm.ir.PointerType(tvm.ir.PrimType(buf.dtype)))
        params.append(ptr)
        decls.append(tirx.DeclBuffer(buf, data=ptr))
    func = tirx.PrimFunc(params, seq(decls + [body]))
    return func.with_attr("global_symbol", symbol).with_attr("tirx.noalias", True)


def pointer_params(func, symbol: str):
    """A buffer-parameter PrimFunc in block form (as TVM's schedules leave it) taking data
    pointers instead, its root block's allocations passed in as scratch; and their specs."""
    from .compat import s_tir  # noqa: PLC0415

    body = func.body
    scratch: list = []
    if isinstance(body, s_tir.SBlockRealize) and body.block.alloc_buffers:
        block = body.block
        scratch = list(block.alloc_buffers)
        root = s_tir.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, block.body, block.init,
                            [], block.match_buffers, block.annotations)
        body = s_tir.SBlockRealize(body.iter_values, body.predicate, root)
    return _pointer_func(list(func.params) + scratch, body, symbol), specs(scratch)


# ------------------------------------------------------------------------------ blocks
def block_func(program: Program, args: Sequence[str], symbol: str):
    """The PrimFunc ``symbol`` of the unscheduled ``program`` in block form, its parameters
    the buffers of ``args`` (module docstring)."""
    from .compat import s_tir  # noqa: PLC0415

    t = Translator(program)
    _check_args(program, args)
    counter = [0]
    body = _block_nodes(t, program.body, [], [], counter, s_tir)
    zero = []
    for name in _locals(t):
        if name in t.accumulated:
            zero += _zero_block(t, name, counter, s_tir)
    body = zero + body
    root = s_tir.SBlock([], [], [], "root", seq(body), alloc_buffers=[t.buffers[n] for n in _locals(t)])
    realize = s_tir.SBlockRealize([], True, root)
    func = tirx.PrimFunc([t.buffers[name] for name in args], realize)
    return func.with_attr("global_symbol", symbol).with_attr("tirx.noalias", True)


def _zero_block(t: Translator, name: str, counter: list, s_tir) -> list:
    b = t.program.buffer(name)
    loops = [Loop(f"z{d}", 0, b.shape[d], ()) for d in range(b.rank)]
    for d, lp in enumerate(loops):
        t.vars[lp.iterator] = tirx.Var(lp.iterator, "int64")
    store = Store(name, tuple(Var(lp.iterator) for lp in loops), Const(0, b.dtype) if b.dtype != DType.bool
                  else Const(False, DType.bool))
    stmt = _block(t, store, loops, [], None, counter, s_tir)
    for lp in reversed(loops):
        stmt = tirx.For(t.vars.pop(lp.iterator), i64(0), t.index(lp.upper), tirx.ForKind.SERIAL, stmt)
    return [stmt]


def _init_of(nodes: Sequence[Node], k: int) -> Loop | None:
    """The reduction nest that ``nodes[k]`` (a store) initializes: the next node, a perfect
    nest of loops around one reduction into the same cell."""
    s = nodes[k]
    if not isinstance(s, Store) or k + 1 >= len(nodes) or not isinstance(nodes[k + 1], Loop):
        return None
    cur = nodes[k + 1]
    while isinstance(cur, Loop) and len(cur.body) == 1:
        cur = cur.body[0]
    if isinstance(cur, Reduce) and cur.buffer == s.buffer and cur.indices == s.indices and isinstance(s.value, Const):
        return nodes[k + 1]
    return None


def _block_nodes(t: Translator, nodes: Sequence[Node], loops: list[Loop], conds: list, counter: list, s_tir) -> list:
    out = []
    skip_init: Store | None = None
    for k, n in enumerate(nodes):
        if isinstance(n, Loop):
            init = skip_init if k > 0 and nodes[k - 1] is skip_init else None
            out.append(_for(t, n, "serial", lambda n=n, init=init: seq(
                _block_nodes_init(t, n.body, [*loops, n], conds, counter, s_tir, init))))
        elif isinstance(n, If):
            cond = t.cast(n.cond, DType.bool)
            out += _block_nodes(t, n.then, loops, [*conds, cond], counter, s_tir)
            if n.orelse:
                out += _block_nodes(t, n.orelse, loops, [*conds, tirx.Not(cond)], counter, s_tir)
        elif isinstance(n, (Store, Reduce)):
            if isinstance(n, Store) and _init_of(nodes, k) is not None:
                skip_init = n
                continue
            out.append(_block(t, n, loops, conds, None, counter, s_tir))
        else:
            raise UnsupportedProgramError(f"{type(n).__name__} nodes (GPU kernels) have no host TensorIR form")
    return out


def _block_nodes_init(t, nodes, loops, conds, counter, s_tir, init: Store | None) -> list:
    if init is None:
        return _block_nodes(t, nodes, loops, conds, counter, s_tir)
    n = nodes[0]
    if isinstance(n, Loop):
        return [_for(t, n, "serial", lambda: seq(_block_nodes_init(t, n.body, [*loops, n], conds, counter, s_tir,
                                                                     init)))]
    return [_block(t, n, loops, conds, init, counter, s_tir)]


def _block(t: Translator, s: Store | Reduce, loops: list[Loop], conds: list, init: Store | None, counter: list,
           s_tir):
    """One statement as a block over its enclosing loops (module docstring)."""
    written = set().union(*map(free_vars, s.indices)) if s.indices else set()
    outer = dict(t.vars)
    iter_vars, values = [], []
    for lp in loops:
        if not isinstance(lp.lower, Const) or const_extent(lp) is None or lp.step != 1:
            raise UnsupportedProgramError(f"loop '{lp.name}' has bounds that depend on other loops; the block form "
                                          f"needs rectangular nests")
        v = tirx.Var(f"v_{lp.iterator}", "int64")
        reduce = isinstance(s, Reduce) and lp.iterator not in written
        dom = tvm.ir.Range.from_min_extent(i64(int(lp.lower.value)), i64(const_extent(lp)))
        iter_vars.append(tirx.IterVar(dom, v, tirx.IterVar.CommReduce if reduce else tirx.IterVar.DataPar))
        values.append(outer[lp.iterator])
        t.vars[lp.iterator] = v
    predicate = True
    try:
        body = statement(t, s)
        init_stmt = statement(t, init) if init is not None else None
        for c in conds:
            predicate = c if predicate is True else tirx.And(predicate, c)
    finally:
        t.vars.clear()
        t.vars.update(outer)
    if isinstance(s, Reduce) and init is None:
        t.accumulated.add(s.buffer)
    name = f"s{counter[0]}"
    counter[0] += 1
    block = s_tir.SBlock(iter_vars, [], [], name, body, init=init_stmt)
    reads, writes = s_tir.analysis.get_sblock_read_write_region(block, {b: b for b in t.buffers.values()})
    block = s_tir.SBlock(iter_vars, reads, writes, name, body, init=init_stmt)
    return s_tir.SBlockRealize(values, predicate, block)


__all__ = ["TIR_DTYPES", "Translator", "UnsupportedProgramError", "block_func", "loop_kind", "pointer_params",
           "scheduled_func", "tir_dtype"]
