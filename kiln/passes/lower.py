"""Lowering graph kernels to loop programs (:mod:`kiln.ir.loops`).

Public API (stable)::

    from kiln.passes.lower import LoweredKernel, LoweringError, lower_node, lower_graph_kernels

    kernel = lower_node(node)            # any node whose op has a compute definition, incl. ``fused``
    kernels = lower_graph_kernels(graph) # one entry per ``graph.nodes``; None: left to the backend

    kernel.program    # kiln.ir.loops.Program: plain serial loops; one i64 parameter ``size_<n>`` per
                      # named size of a symbolic shape (none for static shapes)
    kernel.inputs     # buffer names, one per node operand, in operand order
    kernel.outputs    # buffer names, one per node result, in result order
    kernel.template   # the fused node's template, else the node's fusion class
    kernel.constants  # {buffer name: ndarray}: global buffers holding tensor constants

Running a kernel: every global buffer gets an array of exactly its dtype and shape (the
graph value's type); inputs and ``constants`` are read, outputs are written::

    arrays = {name: a for name, a in zip(kernel.inputs, operands)} | kernel.constants
    arrays |= {name: np.empty(v.shape, v.dtype.numpy) for name, v in zip(kernel.outputs, node.outputs)}
    kiln.loops.run(kernel.program, {}, arrays)      # or kiln.loops.compile_c(kernel.program)

Guarantees:

* Buffers are named after graph values, sanitized to C identifiers (``%0`` -> ``v0``,
  ``%fc1.bias`` -> ``fc1_bias``, names that would clash with C keywords, math functions or
  loop iterators get a ``_`` appended; duplicates get ``_1``, ``_2``); their dtypes and
  shapes are the graph values' exactly.  An operand used twice appears twice in ``inputs``
  with one buffer.  Scalar constants are inlined as literals, ramps (a folded ``arange``,
  :mod:`kiln.ir.ops.ramp`) are index arithmetic, in a fused body or as a graph constant
  operand (its buffer stays an input, unread); other tensor constants of a fused body
  become global buffers (named after the constant) listed in ``constants``.
  Intermediate values that must be stored (reduction results, values reused by several
  consumers when recomputing them would be costly) are ``local`` buffers named
  ``<value>_<stage>`` (``v3_max``, ``v7_acc``).
* The program is one function of the node: producers are inlined into consumers (views and
  elementwise chains completely; an elementwise prologue into a reduction's body); a
  consumer over the same index space as a reduction runs in the reduction's loop nest (the
  epilogue of a matmul or conv, the normalization after a softmax's row sums), by merging
  consecutive loop nests whose shared loops provably hand each iteration the cells it reads.
  Nothing else is reordered: loops are serial and unannotated, reductions run their
  reduced axes innermost in increasing order.  Schedules are the backend's business
  (``kiln.loops.Schedule`` checks each of them).
* Layouts follow the readers: a result that is an axis permutation of a reduction stage
  (``permute(max_pool2d(x))``, a pooling written channels-last) is written by that stage in
  place, axes permuted, with no local buffer and no copy; a local stage that every load
  reads by loop iterators in one permuted order is laid out in that order (its writes are
  permuted instead).  Buffer contents never change, only where a cell lives.
* Loop bounds are affine (or quasi-affine: ``floordiv`` by constants), so every program is
  accepted by ``kiln.loops.Schedule``; data-dependent indices (gather, embedding) are loads
  in index position, which the polyhedral model treats as may-accesses.
* ``str(kiln.loops.parse(str(p))) == str(p)`` for every lowered program ``p``.
* float16/bfloat16 kernels compute in float32 and round each op's result, as the
  references do (the cpu backend's C printer does the same: ``HalfAsFloat`` in
  ``kiln/ir/loops/cgen.py``).

Symbolic shapes lower to loop extents and buffer shapes over size parameters; a compute
rule that needs a concrete size (a mean's ``1/n`` over a symbolic axis, say) raises
:class:`LoweringError`, as do ops whose result shape depends on data (``index`` with a bool mask).
:func:`lower_graph_kernels` maps those, and every node ``skip`` selects (by default the
``view`` ops: reshape, permute, expand, slice, select), to ``None``: the backend implements
them itself (as views, library calls or the reference implementation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kiln.ir import Graph, Node
from kiln.ir.loops import (
    Expr, If, Load, Loop, Param, Program, Var, loads_of, map_expr, substitute,
)
from kiln.ir.loops.expr import size_param
from kiln.ir.loops import Node as LoopNode
from kiln.ir.ops.compute import (
    KernelBuilder,
    LoweringError,
    apply_rule,
    kernel_shape,
    sanitize,
)
from kiln.ir.ops.ramp import ramp_of
from kiln.ir.types import sizes_of
from kiln.passes.fusion import node_class

__all__ = ["LoweredKernel", "LoweringError", "can_lower", "default_skip", "fuse_nests", "lower_graph_kernels",
           "lower_node"]


@dataclass(frozen=True)
class LoweredKernel:
    """A node as one loop program; see the module docstring for what each field holds."""

    program: Program
    inputs: list[str]
    outputs: list[str]
    template: str
    constants: dict[str, np.ndarray] = field(default_factory=dict)


# ============================================================================= lowering
def can_lower(node: Node) -> bool:
    """Whether :func:`lower_node` accepts ``node``: its op has a compute definition.  Symbolic
    shapes lower to programs with size parameters (a rule that needs a concrete size
    raises :class:`LoweringError` from :func:`lower_node`), unless a result has a size no
    operand shape gives (a data-dependent size such as a bool mask's count)."""
    return node.op.compute is not None and _free_result_size(node) is None


def _free_result_size(node: Node):
    """A result of ``node`` whose shape names a size its operands' shapes do not, or ``None``."""
    known: set[str] = set()
    for v in node.inputs:
        known |= sizes_of(v.type.shape)
    return next((v for v in node.outputs if not sizes_of(v.type.shape) <= known), None)


def default_skip(node: Node) -> bool:
    """Nodes :func:`lower_graph_kernels` leaves to the backend by default: views, and nodes
    that cannot be lowered (:func:`can_lower`)."""
    return node.op.has("view") or not can_lower(node)


def lower_graph_kernels(graph: Graph, skip: Callable[[Node], bool] | None = None) -> list[LoweredKernel | None]:
    """One entry per node of ``graph.nodes``: its kernel, or ``None`` where ``skip(node)``
    (default :func:`default_skip`) leaves it to the backend."""
    skip = default_skip if skip is None else skip
    return [None if skip(node) else lower_node(node) for node in graph.nodes]


def lower_node(node: Node) -> LoweredKernel:
    """``node`` (any op with a compute definition, ``fused`` included) as one loop program."""
    free = _free_result_size(node)
    if free is not None:
        raise LoweringError(f"result %{free.name} of {node.op_name} has symbolic shape {free.type} with a size no "
                            "operand gives; lowering needs it (specialize the graph to concrete shapes first)")
    builder = KernelBuilder()
    buffer_of: dict = {}
    for v in node.inputs:
        if v not in buffer_of:
            buffer_of[v] = builder.declare(v.name, kernel_shape(v.type), v.dtype, "global")
    inputs = [buffer_of[v] for v in node.inputs]
    outputs = [builder.declare(v.name, kernel_shape(v.type), v.dtype, "global") for v in node.outputs]
    try:
        operands = [builder.constant(v.data, v.type, v.name) if _ramp_constant(v) else builder.tensor_of(n)
                    for v, n in zip(node.inputs, inputs)]
        results = apply_rule(builder, node.op, operands, node.attrs,
                             [v.type for v in node.outputs], node.outputs[0].name)
        aliases: dict[str, str] = {}
        permuted: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, t in zip(outputs, results):
            local = builder.buffers.get(t.buffer) if t.buffer else None
            if local is not None and local.scope == "local" and t.buffer not in aliases and local.dtype == t.dtype:
                aliases[t.buffer] = name  # the stage writes the result buffer directly
            elif (view := _permuted_stage(builder, t)) is not None and view[0] not in aliases \
                    and view[0] not in permuted:
                permuted[view[0]] = (name, view[1])  # the stage writes the result buffer, axes permuted
            else:
                builder.store(name, t)  # element functions run here: errors of lazy rules too
    except (TypeError, ValueError) as e:  # a rule doing arithmetic a symbolic size does not allow
        if not node_sizes(node):
            raise
        raise LoweringError(f"{node.op_name}: its compute rule needs concrete sizes here ({e})") from e
    body = permute_buffers(rename_buffers(fuse_nests(builder.nests), aliases), permuted)
    kept = [b for b in builder.buffers.values() if b.name not in aliases and b.name not in permuted]
    body, kept = _read_order_layouts(body, kept)
    order = {name: k for k, name in enumerate([*inputs, *builder.constants, *outputs])}
    kept.sort(key=lambda b: (b.scope != "global", order.get(b.name, len(order))))
    name = node.attrs["body"].name if node.op_name == "fused" else f"{node.op_name}_{node.outputs[0].name}"
    params = tuple(Param(size_param(n)) for n in sorted(node_sizes(node)))
    program = Program(sanitize(name), params, tuple(kept), tuple(body))
    template = node.attrs["template"] if node.op_name == "fused" else node_class(node)
    return LoweredKernel(program, inputs, outputs, template, dict(builder.constants))


def _ramp_constant(v) -> bool:
    """A graph constant operand that is a ramp: read as index arithmetic, not its buffer
    (:mod:`kiln.ir.ops.ramp`; the buffer stays a kernel argument, unread)."""
    return v.origin == "const" and v.type.is_static and ramp_of(v.data, v.dtype) is not None


_PROBE = "_axis"


def _permuted_stage(builder: KernelBuilder, t) -> tuple[str, tuple[int, ...]] | None:
    """``(stage, perm)`` when result ``t`` is an axis permutation of a local stage buffer of
    its dtype: ``t[p] == stage[p[perm[0]], ..., p[perm[-1]]]`` (a ``permute`` of a reduction
    result, as a channels-last pooling writes it).  The stage then writes the result buffer
    with its axes permuted, and no copy of it is made."""
    if t.buffer is not None or t.rank < 2:
        return None
    probe = tuple(Var(f"{_PROBE}{i}") for i in range(t.rank))
    e = t[probe]
    local = builder.buffers.get(e.buffer) if isinstance(e, Load) else None
    if local is None or local.scope != "local" or local.dtype != t.dtype or len(e.indices) != t.rank:
        return None
    perm = []
    for i in e.indices:
        if not (isinstance(i, Var) and i.name.startswith(_PROBE) and i.name[len(_PROBE):].isdigit()):
            return None
        perm.append(int(i.name[len(_PROBE):]))
    if sorted(perm) != list(range(t.rank)) or perm == sorted(perm):
        return None
    dims = builder.dims.get(e.buffer)
    if dims is None or any(dims[j] != t.shape[perm[j]] for j in range(t.rank)):
        return None
    return e.buffer, tuple(perm)


def permute_buffers(nodes: Iterable[LoopNode], mapping: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[LoopNode]:
    """``nodes`` with every access ``a[i_0, ..., i_n]`` of a buffer ``a`` in ``mapping``
    (``a -> (b, perm)``) going to ``b[j]`` with ``j[perm[k]] = i_k``: ``a`` stored in ``b``'s
    memory with its axes permuted."""
    if not mapping:
        return list(nodes)

    def moved(buffer: str, indices: tuple[Expr, ...]) -> tuple[str, tuple[Expr, ...]]:
        target, perm = mapping[buffer]
        out: list[Expr] = [Var("_")] * len(perm)
        for k, j in enumerate(perm):
            out[j] = indices[k]
        return target, tuple(out)

    def fn(e: Expr) -> Expr:
        return map_expr(e, lambda s: Load(*moved(s.buffer, s.indices))
                        if isinstance(s, Load) and s.buffer in mapping else None)

    return [_move_writes(n, mapping, moved) for n in _map_nodes(nodes, fn, {})]


def _move_writes(n: LoopNode, mapping: Mapping, moved: Callable) -> LoopNode:
    """``n`` with its stores and reductions into a buffer of ``mapping`` moved (``permute_buffers``)."""
    if isinstance(n, Loop):
        return replace(n, body=tuple(_move_writes(c, mapping, moved) for c in n.body))
    if isinstance(n, If):
        return replace(n, then=tuple(_move_writes(c, mapping, moved) for c in n.then),
                       orelse=tuple(_move_writes(c, mapping, moved) for c in n.orelse))
    if n.buffer in mapping:
        buffer, indices = moved(n.buffer, n.indices)
        return replace(n, buffer=buffer, indices=indices)
    return n


def _read_order_layouts(body: list[LoopNode], buffers: list) -> tuple[list[LoopNode], list]:
    """Lay out each local stage buffer in the order its readers walk it: when every load of
    it indexes it by distinct loop iterators, in one and the same permutation of the loop
    nesting order (an epilogue writing a channels-last result from an NCHW reduction
    stage), its axes are permuted so that those loads read it in nesting order; its writes
    follow (:func:`permute_buffers`)."""
    orders: dict[str, set[tuple[int, ...] | None]] = {}

    def visit(nodes: Iterable[LoopNode], depth: dict[str, int]) -> None:
        for n in nodes:
            if isinstance(n, Loop):
                visit(n.body, {**depth, n.iterator: len(depth)})
            elif isinstance(n, If):
                visit(n.then, depth)
                visit(n.orelse, depth)
            else:
                for e in (n.value, *n.indices):
                    for ld in loads_of(e):
                        orders.setdefault(ld.buffer, set()).add(_nesting_order(ld.indices, depth))

    visit(body, {})
    mapping: dict[str, tuple[str, tuple[int, ...]]] = {}
    out = []
    for b in buffers:
        seen = orders.get(b.name, set())
        if b.scope == "local" and len(seen) == 1 and (perm := next(iter(seen))) is not None \
                and list(perm) != sorted(perm):
            shape: list = [None] * len(perm)
            for k, j in enumerate(perm):
                shape[j] = b.shape[k]
            mapping[b.name] = (b.name, perm)
            b = replace(b, shape=tuple(shape))
        out.append(b)
    return permute_buffers(body, mapping), out


def _nesting_order(indices: tuple[Expr, ...], depth: Mapping[str, int]) -> tuple[int, ...] | None:
    """For indices that are distinct loop iterators, each one's rank in nesting order; else None."""
    if len(indices) < 2 or not all(isinstance(i, Var) and i.name in depth for i in indices):
        return None
    names = [i.name for i in indices]
    if len(set(names)) != len(names):
        return None
    ranked = sorted(names, key=depth.__getitem__)
    return tuple(ranked.index(n) for n in names)


def node_sizes(node: Node) -> frozenset[str]:
    """The named sizes of ``node``'s operand and result shapes and, for a fused node, of its
    body's values: the size parameters of its program (``size_<name>``)."""
    out: set[str] = set()
    for v in (*node.inputs, *node.outputs):
        out |= sizes_of(v.type.shape)
    body = node.attrs.get("body") if node.op_name == "fused" else None
    if body is not None:
        for n in body.nodes:
            for v in n.outputs:
                out |= sizes_of(v.type.shape)
    return frozenset(out)


# ========================================================================= nest fusion
def fuse_nests(nodes: Sequence[LoopNode]) -> list[LoopNode]:
    """Merge each loop with the loop right before it when both have the same bounds and the
    merge cannot change a result: the second writes nothing the first reads or writes, and
    for every buffer the first writes and the second reads, one axis is indexed by exactly
    the loop's iterator in all those writes and reads (so iteration ``v`` of the second
    reads only cells iteration ``v`` of the first wrote).  Bodies are merged recursively."""
    out: list[LoopNode] = []
    for node in nodes:
        prev = out[-1] if out else None
        if isinstance(prev, Loop) and isinstance(node, Loop) and _fusable(prev, node):
            renamed = _substitute_nodes(node.body, {node.iterator: Var(prev.iterator)})
            out[-1] = replace(prev, body=tuple(fuse_nests([*prev.body, *renamed])))
        else:
            out.append(node)
    return out


def _fusable(first: Loop, second: Loop) -> bool:
    if (first.lower, first.upper, first.step) != (second.lower, second.upper, second.step):
        return False
    writes_a, reads_a, _ = _accesses(first.body)
    writes_b, reads_b, bound_b = _accesses(second.body)
    if first.iterator != second.iterator and first.iterator in bound_b:
        return False
    if set(writes_b) & (set(writes_a) | set(reads_a)):
        return False
    mine, theirs = Var(first.iterator), Var(second.iterator)
    for buf in set(writes_a) & set(reads_b):
        rank = len(writes_a[buf][0])
        if not any(all(w[q] == mine for w in writes_a[buf]) and all(r[q] == theirs for r in reads_b[buf])
                   for q in range(rank)):
            return False
    return True


def _accesses(nodes: Iterable[LoopNode]):
    """Write and read index tuples per buffer, and the iterators bound, under ``nodes``."""
    writes: dict[str, list[tuple[Expr, ...]]] = {}
    reads: dict[str, list[tuple[Expr, ...]]] = {}
    bound: set[str] = set()

    def read(e: Expr) -> None:
        for ld in loads_of(e):
            reads.setdefault(ld.buffer, []).append(ld.indices)

    def visit(ns: Iterable[LoopNode]) -> None:
        for n in ns:
            if isinstance(n, Loop):
                bound.add(n.iterator)
                read(n.lower)
                read(n.upper)
                visit(n.body)
            elif isinstance(n, If):
                read(n.cond)
                visit(n.then)
                visit(n.orelse)
            else:
                writes.setdefault(n.buffer, []).append(n.indices)
                for e in (n.value, *n.indices):
                    read(e)

    visit(nodes)
    return writes, reads, bound


def _map_nodes(nodes: Iterable[LoopNode], fn: Callable[[Expr], Expr], rename: Mapping[str, str]) -> tuple:
    out = []
    for n in nodes:
        if isinstance(n, Loop):
            out.append(replace(n, lower=fn(n.lower), upper=fn(n.upper), body=_map_nodes(n.body, fn, rename)))
        elif isinstance(n, If):
            out.append(replace(n, cond=fn(n.cond), then=_map_nodes(n.then, fn, rename),
                               orelse=_map_nodes(n.orelse, fn, rename)))
        else:
            out.append(replace(n, buffer=rename.get(n.buffer, n.buffer), indices=tuple(fn(i) for i in n.indices),
                               value=fn(n.value)))
    return tuple(out)


def _substitute_nodes(nodes: Iterable[LoopNode], mapping: Mapping[str, Expr]) -> tuple:
    return _map_nodes(nodes, lambda e: substitute(e, mapping), {})


def rename_buffers(nodes: Iterable[LoopNode], mapping: Mapping[str, str]) -> list[LoopNode]:
    """``nodes`` with every store to and load from buffer ``a`` going to ``mapping[a]``."""
    if not mapping:
        return list(nodes)

    def fn(e: Expr) -> Expr:
        return map_expr(e, lambda s: Load(mapping[s.buffer], s.indices)
                        if isinstance(s, Load) and s.buffer in mapping else None)

    return list(_map_nodes(nodes, fn, mapping))
