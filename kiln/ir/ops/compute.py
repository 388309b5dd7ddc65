"""Compute definitions: each op's element expression over its output index space.

As in tensor-expression languages (TVM ``te.compute``, Halide funcs), an op's *compute
rule* says what one element of its result is, in terms of elements of its operands::

    @defcompute("add")
    def _add(ctx, a, b):          # out[i...] = a[bcast(i)] + b[bcast(i)]
        t = compute_dtype(ctx.out.dtype)
        return ctx.tensor(ctx.out.shape, ctx.out.dtype,
                          lambda i: a.at(broadcast_index(i, a.shape), t) + b.at(broadcast_index(i, b.shape), t))

A rule receives a :class:`ComputeContext` and one :class:`Tensor` per operand (attributes as
keywords) and returns one :class:`Tensor` per result, with exactly the result's shape and
dtype.  A :class:`Tensor` is an element function ``index -> expression`` of the loop IR
(:mod:`kiln.ir.loops`): reading an element of an elementwise producer *inlines* the
producer's expression, so chains of elementwise and view ops become one expression.  What
cannot be inlined is a *stage* that the context records as a loop nest over a ``local``
buffer: reductions (:meth:`ComputeContext.reduce`, with an identity-initialized accumulator
and the reduced axes innermost) and values stored on purpose
(:meth:`ComputeContext.materialize`).  Multi-stage ops (softmax, layer norm, attention)
chain stages, each reading the previous ones' buffers.

Expression dtypes follow the loop IR (binary arithmetic promotes like the graph IR; stores
convert to the buffer's dtype).  Rules compute float16/bfloat16 in float32 and round once
(:func:`compute_dtype`), as the numpy references do.

:mod:`kiln.passes.lower` turns a node into a loop program with these rules; this module
imports nothing outside :mod:`kiln.ir`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import registry
from ..errors import KilnError
from ..loops.expr import (
    INDEX,
    MATH_FUNCS,
    Binary,
    Call,
    Cast,
    Const,
    Expr,
    Load,
    Select,
    Unary,
    Var,
    affine_expr,
    affine_form,
    as_expr,
    dtype_of,
    map_expr,
)
from ..loops.program import Buffer, Loop, Node, Reduce, Store
from ..names import unique_name
from .ramp import ramp_of
from ..types import DType, TensorType

if TYPE_CHECKING:
    from ..graph import Graph

Index = tuple[Expr, ...]
ComputeRule = Callable[..., "Tensor | tuple[Tensor, ...]"]

INLINE_COST = 40
"""A value read by several consumers is stored in a local buffer when its element expression
has more nodes than this (recomputing it would cost more than a store and loads)."""
OPERAND_COST = 8
"""Operands of contractions (matmul, conv, attention) are stored first when their element
expression has more nodes than this: a contraction reads each element many times."""


class LoweringError(KilnError):
    """A node cannot be lowered to a loop program; the message says why and what to do."""


# ================================================================== expression helpers
_HALF = (DType.float16, DType.bfloat16)


def compute_dtype(dtype: DType) -> DType:
    """The dtype arithmetic for ``dtype`` runs in: float32 for float16/bfloat16, else itself."""
    return DType.float32 if dtype in _HALF else dtype


def float_compute_dtype(dtype: DType) -> DType:
    """Floating-point math on ``dtype``: float32 for integers, bools and half precision."""
    return dtype if dtype in (DType.float32, DType.float64) else DType.float32


def const(value: Any, dtype: DType) -> Const:
    """A literal of ``dtype``: floats round to the dtype, integers truncate toward zero."""
    if dtype == DType.bool:
        return Const(bool(value), dtype)
    if dtype.is_integer:
        return Const(math.trunc(value), dtype)
    return Const(float(dtype.numpy.type(value)), dtype)


def size_value(n: Any, dtype: DType) -> Expr:
    """A size (an int, or a symbolic size read from the kernel's size parameters) as a
    value of ``dtype``: a literal for a static size, a cast of the size expression else."""
    if type(n).__name__ == "SymDim":
        return Cast(dtype, as_expr(n))
    return const(n, dtype)


def convert(e: Expr, src: DType, dst: DType) -> Expr:
    """``e`` (of dtype ``src``) as ``dst``; constants are converted in place."""
    if src == dst:
        return e
    if isinstance(e, Const) and (not dst.is_integer or math.isfinite(float(e.value))):
        with np.errstate(all="ignore"):
            value = np.asarray(e.value, dtype=src.numpy).astype(dst.numpy)[()]
        return const(float(value) if dst.is_floating else value, dst)
    return Cast(dst, e)


def call(fn: str, *args: Expr) -> Expr:
    """A math intrinsic (see :data:`kiln.ir.loops.expr.MATH_FUNCS`)."""
    return Call(fn, tuple(args))


def select(cond: Expr, if_true: Expr, if_false: Expr) -> Expr:
    return Select(as_expr(cond), as_expr(if_true), as_expr(if_false))


def cmp(op: str, a: Expr | int, b: Expr | int) -> Expr:
    """A comparison (``<``, ``==``, ...) or logical operator (``&&``, ``||``)."""
    return Binary(op, as_expr(a), as_expr(b))


def maximum(a: Expr | int, b: Expr | int) -> Expr:
    return Binary("max", as_expr(a), as_expr(b))


def minimum(a: Expr | int, b: Expr | int) -> Expr:
    return Binary("min", as_expr(a), as_expr(b))


def floordiv(a: Expr | int, b: Expr | int) -> Expr:
    return Binary("floordiv", as_expr(a), as_expr(b))


def floormod(a: Expr | int, b: Expr | int) -> Expr:
    return Binary("floormod", as_expr(a), as_expr(b))


def all_of(conds: Sequence[Expr]) -> Expr | None:
    """``c0 && c1 && ...``, or ``None`` for no conditions."""
    out: Expr | None = None
    for c in conds:
        out = c if out is None else Binary("&&", out, c)
    return out


def identity(combiner: str, dtype: DType) -> Const:
    """The neutral element of a reduction combiner in ``dtype`` (``max``: -inf, ...)."""
    return const(Reduce("_", (), combiner, Const(0)).identity(dtype), dtype)


def simplify_index(e: Expr) -> Expr:
    """``e`` with its integer arithmetic in canonical affine form (``2 * i + r - 1``) and
    constant divisions folded; other parts are unchanged."""
    def fold(s: Expr) -> Expr | None:
        if not isinstance(s, Binary):
            return None
        if s.op in ("+", "-", "*"):
            form = affine_form(s)
            return None if form is None else affine_expr(form.coeffs, form.const)
        if s.op in ("floordiv", "floormod") and isinstance(s.rhs, Const) and s.rhs.dtype == INDEX:
            if isinstance(s.lhs, Const) and s.lhs.dtype == INDEX and s.rhs.value:
                q, r = divmod(int(s.lhs.value), int(s.rhs.value))
                return Const(q if s.op == "floordiv" else r)
            if s.rhs.value == 1:
                return s.lhs if s.op == "floordiv" else Const(0)
        return None

    return map_expr(e, fold)


# ======================================================================= index spaces
def broadcast_index(index: Index, shape: Sequence[int]) -> Index:
    """The element of an operand of ``shape`` that numpy broadcasting pairs with ``index``
    of the (larger or equal) result: leading result axes dropped, size-1 axes read at 0."""
    lead = len(index) - len(shape)
    if lead < 0:
        raise LoweringError(f"broadcast_index: index of rank {len(index)} for shape {list(shape)}")
    return tuple(Const(0) if n == 1 else index[lead + d] for d, n in enumerate(shape))


def reshape_index(index: Index, out_shape: Sequence[int], in_shape: Sequence[int]) -> Index:
    """The element of a row-major array of ``in_shape`` at the position of ``index`` in the
    same elements viewed as ``out_shape``.  Axes are matched in groups of equal products, so
    only split or merged axes get ``floordiv``/``floormod`` arithmetic."""
    if math.prod(in_shape) == 0:
        return tuple(Const(0) for _ in in_shape)
    out_axes = [d for d, n in enumerate(out_shape) if n != 1]
    in_axes = [d for d, n in enumerate(in_shape) if n != 1]
    result: list[Expr] = [Const(0)] * len(in_shape)
    o = i = 0
    while o < len(out_axes) or i < len(in_axes):
        group_out, group_in = [out_axes[o]], [in_axes[i]]
        o, i = o + 1, i + 1
        p_out, p_in = out_shape[group_out[0]], in_shape[group_in[0]]
        while p_out != p_in:
            if p_out < p_in:
                group_out.append(out_axes[o])
                p_out *= out_shape[out_axes[o]]
                o += 1
            else:
                group_in.append(in_axes[i])
                p_in *= in_shape[in_axes[i]]
                i += 1
        flat: Expr = Const(0)
        for d in group_out:
            flat = flat * out_shape[d] + index[d]
        stride = p_in
        for k, d in enumerate(group_in):
            stride //= in_shape[d]
            part = flat if k == 0 else floormod(flat, stride * in_shape[d])
            result[d] = simplify_index(part if stride == 1 else floordiv(part, stride))
    return tuple(result)


def drop_axes(index: Index, axes: Sequence[int]) -> Index:
    """``index`` without the positions in ``axes``."""
    return tuple(e for d, e in enumerate(index) if d not in axes)


def linear_index(index: Index, shape: Sequence[int]) -> Expr:
    """Row-major position of ``index`` in ``shape``."""
    flat: Expr = Const(0)
    for e, n in zip(index, shape):
        flat = flat * n + e
    return simplify_index(flat)


# ============================================================================= tensors
@dataclass(frozen=True)
class Tensor:
    """A tensor seen element by element: ``t[index]`` is an expression of dtype ``dtype``.

    ``buffer`` names the buffer when ``t[index]`` is exactly a load of it at ``index``.
    """

    shape: tuple[int, ...]
    dtype: DType
    fn: Callable[[Index], Expr]
    buffer: str | None = None

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __getitem__(self, index: Sequence[Expr | int] | Expr | int) -> Expr:
        if not isinstance(index, (tuple, list)):
            index = (index,)
        if len(index) != len(self.shape):
            raise LoweringError(f"tensor {list(self.shape)} indexed with {len(index)} indices")
        return self.fn(tuple(as_expr(e) for e in index))

    def at(self, index: Sequence[Expr | int], dtype: DType) -> Expr:
        """The element at ``index`` converted to ``dtype``."""
        return convert(self[tuple(index)], self.dtype, dtype)


def expression_size(e: Expr, limit: int = 10_000) -> int:
    """Nodes of ``e`` that compute values (load indices not counted), counting shared
    subexpressions once per use, up to ``limit``."""
    count, stack = 0, [e]
    while stack and count <= limit:
        s = stack.pop()
        count += 1
        if not isinstance(s, Load):
            stack.extend(s.children())
    return count


def element_cost(t: Tensor) -> int:
    """:func:`expression_size` of a generic element of ``t``."""
    return expression_size(t[tuple(Var(f"i{d}") for d in range(t.rank))])


# ====================================================================== kernel builder
_C_KEYWORDS = frozenset({
    "auto", "break", "case", "char", "const", "continue", "default", "do", "double", "else", "enum",
    "extern", "float", "for", "goto", "if", "inline", "int", "long", "register", "restrict", "return",
    "short", "signed", "sizeof", "static", "struct", "switch", "typedef", "union", "unsigned", "void",
    "volatile", "while", "_Bool", "bool", "true", "false", "main", "calloc", "free", "malloc", "fabs",
    "fabsf", "labs", "NAN", "INFINITY", "kiln_floordiv", "kiln_floormod", "KILN_MIN", "KILN_MAX",
    "min", "max", "select", "floordiv", "floormod",
})
_C_RESERVED = (_C_KEYWORDS | frozenset(MATH_FUNCS) | frozenset(f + "f" for f in MATH_FUNCS)
               | frozenset(d.short for d in DType))
_ITERATOR = re.compile(r"^[ir][0-9]+$")


def sanitize(name: str) -> str:
    """A C identifier for a graph value name, clear of keywords, math functions and the
    loop iterators ``i0, i1, ... r0, r1, ...`` that lowering uses."""
    text = re.sub(r"[^A-Za-z0-9_]", "_", name) or "v"
    if not re.match(r"[A-Za-z_]", text):
        text = "v" + text
    if text in _C_RESERVED or _ITERATOR.match(text):
        text += "_"
    return text


class KernelBuilder:
    """Records the buffers and loop nests of one kernel, in order.

    ``nests`` are plain loop nests (one per stage, serial); :mod:`kiln.passes.lower`
    assembles them into a :class:`~kiln.ir.loops.Program`.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, Buffer] = {}
        self.nests: list[Node] = []
        self.constants: dict[str, np.ndarray] = {}
        self.dims: dict[str, tuple] = {}
        """Each buffer's shape as graph dims (ints, or symbolic sizes)."""

    # ----------------------------------------------------------------- buffers
    def declare(self, hint: str, shape: Sequence[int], dtype: DType, scope: str = "local") -> str:
        """A new buffer named after ``hint`` (sanitized, made unique); returns its name."""
        base = sanitize(hint)
        name = unique_name(base, self.buffers)
        dims = tuple(_dim(n) for n in shape)
        self.buffers[name] = Buffer(name, dims, dtype, scope)
        self.dims[name] = dims
        return name

    def tensor_of(self, name: str) -> Tensor:
        """The buffer ``name`` read element by element."""
        buf = self.buffers[name]
        shape = self.dims.get(name) or tuple(int(d.value) for d in buf.shape)
        return Tensor(shape, buf.dtype, lambda i: Load(name, tuple(simplify_index(e) for e in i)), name)

    def constant(self, data: np.ndarray, type: TensorType, hint: str) -> Tensor:
        """A constant: one element is inlined as a literal, a ramp (:mod:`.ramp`) is index
        arithmetic, others become a global buffer listed in ``constants``."""
        shape = static_shape(type, f"constant %{hint}")
        if data.size == 1:
            literal = const(np.asarray(data).reshape(-1)[0].item(), type.dtype)
            return Tensor(shape, type.dtype, lambda i: literal)
        if (ramp := ramp_of(data, type.dtype)) is not None:  # index arithmetic, no buffer (.ramp)
            axis, start, step = ramp
            return Tensor(shape, type.dtype, lambda i: convert(
                const(start, DType.int64) + const(step, DType.int64) * i[axis], DType.int64, type.dtype))
        name = self.declare(hint, shape, type.dtype, "global")
        self.constants[name] = np.ascontiguousarray(data, dtype=type.dtype.numpy)
        return self.tensor_of(name)

    def dtype_of(self, e: Expr) -> DType:
        return dtype_of(e, {}, {n: b.dtype for n, b in self.buffers.items()})

    def cast(self, e: Expr, dtype: DType) -> Expr:
        return convert(e, self.dtype_of(e), dtype)

    # ------------------------------------------------------------------ stages
    def store(self, name: str, t: Tensor) -> None:
        """Emit a loop nest writing every element of ``t`` into buffer ``name``."""
        index, loops = index_space(t.shape)
        value = simplify_index(self.cast(t[index], t.dtype))
        self.nests.extend(wrap_loops(loops, [Store(name, index, value)]))

    def materialize(self, t: Tensor, hint: str) -> Tensor:
        """``t`` stored into a local buffer (unless it already is a buffer)."""
        if t.buffer is not None:
            return t
        name = self.declare(hint, t.shape, t.dtype)
        self.store(name, t)
        return self.tensor_of(name)

    def reduce(self, shape: Sequence[int], dtype: DType, combiner: str,
               axes: Sequence[int] | Callable[[Index], Sequence[tuple[Expr | int, Expr | int]]],
               body: Callable[[Index, Index], Expr], hint: str, init: Any = None) -> Tensor:
        """A local buffer of ``shape`` where element ``i`` combines ``body(i, r)`` over the
        reduction domain with ``combiner`` (``+ * max min``), starting from ``init`` (the
        combiner's identity by default; a constant, or a function of ``i``).  ``axes`` gives the extent of each reduced axis,
        or per axis ``(lower, upper)`` bounds as a function of ``i``.  The reduced loops run
        innermost, in increasing order."""
        name = self.declare(hint, shape, dtype)
        index, loops = index_space(shape)
        bounds = axes(index) if callable(axes) else [(0, n) for n in axes]
        red: list[Expr] = []
        red_loops: list[tuple[str, Expr, Expr]] = []
        for j, (lo, hi) in enumerate(bounds):
            lo, hi = simplify_index(as_expr(lo)), simplify_index(as_expr(hi))
            if lo == Const(0) and hi == Const(1):
                red.append(Const(0))
                continue
            red.append(Var(f"r{j}"))
            red_loops.append((f"r{j}", lo, hi))
        if init is None:
            start: Expr = identity(combiner, dtype)
        else:
            start = simplify_index(self.cast(init(index), dtype)) if callable(init) else const(init, dtype)
        value = simplify_index(self.cast(body(index, tuple(red)), dtype))
        inner: list[Node] = [Reduce(name, index, combiner, value)]
        for it, lo, hi in reversed(red_loops):
            inner = [Loop(it, lo, hi, tuple(inner))]
        self.nests.extend(wrap_loops(loops, [Store(name, index, start), *inner]))
        return self.tensor_of(name)


def index_space(shape: Sequence[int]) -> tuple[Index, list[tuple[str, int]]]:
    """The element index of a loop nest over ``shape`` (``i<d>`` for axis ``d``; size-1
    axes are the constant 0 and get no loop) and the loops ``(iterator, extent)``."""
    index: list[Expr] = []
    loops: list[tuple[str, int]] = []
    for d, n in enumerate(shape):
        if n == 1:
            index.append(Const(0))
            continue
        index.append(Var(f"i{d}"))
        loops.append((f"i{d}", _dim(n)))
    return tuple(index), loops


def _dim(n: Any) -> Any:
    """A graph dim for loop extents and buffer shapes: an int, or a symbolic size (which
    the loop IR turns into an expression of its size parameters)."""
    return n if type(n).__name__ == "SymDim" else int(n)


def kernel_shape(type: TensorType) -> tuple:
    """``type``'s shape for lowering: static sizes as ints, symbolic ones as they are (the
    kernel takes them as size parameters, :func:`kiln.ir.loops.expr.size_param`)."""
    return tuple(_dim(d) for d in type.shape)


def wrap_loops(loops: Sequence[tuple[str, int]], body: list[Node]) -> list[Node]:
    for it, n in reversed(loops):
        body = [Loop(it, 0, n, tuple(body))]
    return body


def static_shape(type: TensorType, what: str) -> tuple[int, ...]:
    if not type.is_static:
        raise LoweringError(f"{what} has symbolic shape {type}; lowering needs static sizes "
                            "(specialize the graph to concrete shapes first)")
    return tuple(int(d) for d in type.shape)


@dataclass
class ComputeContext:
    """What a compute rule sees besides its operands: the node's result types and the
    kernel being built.  Local buffers of the node are named ``<hint>_<suffix>``."""

    builder: KernelBuilder
    outs: tuple[TensorType, ...]
    hint: str

    @property
    def out(self) -> TensorType:
        return self.outs[0]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return kernel_shape(self.outs[0])

    def tensor(self, shape: Sequence[int], dtype: DType, fn: Callable[[Index], Expr]) -> Tensor:
        """A lazy tensor; its expressions are converted to ``dtype`` where they differ."""
        cast = self.builder.cast
        return Tensor(tuple(shape), dtype, lambda i: cast(fn(i), dtype))

    def convert(self, t: Tensor, dtype: DType) -> Tensor:
        """``t`` converted to ``dtype`` (``t`` itself when it already has it)."""
        if t.dtype == dtype:
            return t
        return Tensor(t.shape, dtype, lambda i: convert(t[i], t.dtype, dtype))

    def reduce(self, shape: Sequence[int], dtype: DType, combiner: str, axes, body, suffix: str,
               init: Any = None) -> Tensor:
        """:meth:`KernelBuilder.reduce` with a buffer named after the node."""
        return self.builder.reduce(shape, dtype, combiner, axes, body, f"{self.hint}_{suffix}", init)

    def materialize(self, t: Tensor, suffix: str) -> Tensor:
        return self.builder.materialize(t, f"{self.hint}_{suffix}")

    def operand(self, t: Tensor, suffix: str) -> Tensor:
        """``t`` for a contraction: stored first when its elements are costly to recompute."""
        if t.buffer is None and element_cost(t) > OPERAND_COST:
            return self.materialize(t, suffix)
        return t

    def reduce_axes(self, shape: Sequence[int], axes: Sequence[int], keepdim: bool, combiner: str,
                    dtype: DType, value: Callable[[Index], Expr], suffix: str) -> Tensor:
        """Combine ``value(full_index)`` over ``axes`` of an index space of ``shape``; the
        result has ``shape`` without ``axes`` (or with them as size 1 when ``keepdim``)."""
        axes = tuple(sorted(axes))
        kept = tuple(1 if d in axes else n for d, n in enumerate(shape)) if keepdim else drop_axes(shape, axes)

        def body(i: Index, r: Index) -> Expr:
            outer = iter(i)
            red = iter(r)
            full = []
            for d in range(len(shape)):
                if d in axes:
                    full.append(next(red))
                    if keepdim:
                        next(outer)
                else:
                    full.append(next(outer))
            return value(tuple(full))

        return self.reduce(kept, dtype, combiner, [shape[a] for a in axes], body, suffix)


# ===================================================================== rules and graphs
def defcompute(*names: str) -> Callable[[ComputeRule], ComputeRule]:
    """Decorator attaching the decorated compute rule to the already declared ops ``names``."""

    def wrap(rule: ComputeRule) -> ComputeRule:
        for name in names:
            opdef = registry._REGISTRY.get(name)
            if opdef is None:
                raise KilnError(f"defcompute: op '{name}' is not declared (declare it before its rule)")
            if opdef.compute is not None:
                raise KilnError(f"defcompute: op '{name}' already has a compute rule")
            opdef.compute = rule
        return rule

    return wrap


def apply_rule(builder: KernelBuilder, op: registry.OpDef, inputs: Sequence[Tensor], attrs: dict[str, Any],
               types: Sequence[TensorType], hint: str) -> tuple[Tensor, ...]:
    """Run ``op``'s compute rule; the results are checked against the inferred ``types``."""
    if op.compute is None:
        raise LoweringError(f"op '{op.name}' has no compute definition, so it cannot be lowered to "
                            "loops; implement it in the backend (e.g. with its reference)")
    ctx = ComputeContext(builder, tuple(types), sanitize(hint))
    result = op.compute(ctx, *inputs, **attrs)
    results = result if isinstance(result, tuple) else (result,)
    if len(results) != len(types):
        raise LoweringError(f"compute rule of '{op.name}' gives {len(results)} results, expected {len(types)}")
    for k, (t, want) in enumerate(zip(results, types)):
        if t.shape != tuple(want.shape) or t.dtype != want.dtype:
            raise LoweringError(f"kiln bug: compute rule of '{op.name}' gives result {k} as "
                                f"{t.dtype.short}{list(t.shape)} but its type is {want}")
    return results


def compute_graph(builder: KernelBuilder, graph: Graph, inputs: Sequence[Tensor]) -> list[Tensor]:
    """The outputs of ``graph`` (a fused body) as tensors over ``inputs``.

    Producers are inlined into consumers, except values stored in local buffers: stages of
    the rules themselves, values that are both an output and used inside (consumers then
    read the stored value), and values used more than once whose expression exceeds
    :data:`INLINE_COST`.
    """
    if graph.params:
        raise LoweringError(f"body @{graph.name} has params; pass them as operands")
    env: dict[Any, Tensor] = dict(zip(graph.inputs, inputs))
    for c in graph.constants:
        env[c] = builder.constant(c.data, c.type, c.name)
    uses = Counter(v for n in graph.nodes for v in n.inputs)
    outputs = set(graph.outputs)
    for node in graph.nodes:
        results = apply_rule(builder, node.op, [env[v] for v in node.inputs], node.attrs,
                             [v.type for v in node.outputs], node.outputs[0].name)
        for value, t in zip(node.outputs, results):
            shared = uses[value] > 1 and element_cost(t) > INLINE_COST
            if t.buffer is None and ((value in outputs and uses[value]) or shared):
                t = builder.materialize(t, value.name)
            env[value] = t
    return [env[v] for v in graph.outputs]


__all__ = [
    "INLINE_COST", "OPERAND_COST", "Cast", "ComputeContext", "ComputeRule", "Const", "Index", "KernelBuilder",
    "LoweringError", "Select", "Tensor", "Unary", "all_of", "apply_rule", "as_expr", "broadcast_index",
    "call", "cmp", "compute_dtype", "compute_graph", "const", "convert", "defcompute", "drop_axes",
    "element_cost", "expression_size", "float_compute_dtype", "floordiv", "floormod", "identity",
    "index_space", "kernel_shape", "linear_index", "maximum", "minimum", "reshape_index", "sanitize", "select",
    "simplify_index", "size_value", "static_shape", "wrap_loops",
]
