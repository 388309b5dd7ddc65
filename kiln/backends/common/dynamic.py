"""Symbolic graphs built once and run at any size in range.

A graph with symbolic shapes (:class:`kiln.ir.types.SymDim`) is partitioned and compiled
once: its generated kernels take the sizes as arguments (a size table, ``const long *``,
passed after their buffers), and the partition predicts layouts with ``meta`` tensors at
*sample sizes* (:func:`sample_sizes`).  What depends on the actual sizes is made per set of
sizes, on the first call that has it, in time linear in the plan (:class:`DynamicPlanner`):

* the memory plan: buffer byte sizes are expressions of the sizes; the placement order
  found once at the sample sizes (:func:`kiln.backends.common.memory_plan.plan_symbolic`)
  gives each buffer's offset from the actual sizes;
* layouts: the view functions replayed on ``meta`` tensors of the actual shapes, so kernels
  get their views' byte offsets at those sizes (and a layout that would differ from the
  build's prediction is refused, never run);
* library calls, views and reference fallbacks built from the nodes at those sizes
  (:func:`concrete_node`); the outputs allocated at the call's shapes.

The result for one set of sizes is a static :class:`kiln.runtime.call_plan.CallPlan`, kept
by :class:`kiln.runtime.call_plan.DynamicCallPlan`, which binds and checks the sizes of each
call (:func:`size_binder`) and looks the plan up by them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import sympy
import torch

from kiln.backends.base import BackendError
from kiln.ir import Graph, KilnError, Node
from kiln.ir.sizes import SizeError, bind_sizes, concrete_type, format_sizes, graph_sizes
from kiln.ir.types import SizeRange, SymDim, TensorType, size_symbol
from kiln.runtime.tensors import torch_dtype

from .library import VIEWS
from .memory_plan import MemoryPlan, SymbolicMemoryPlan

SAMPLES = (37, 41, 43, 47, 53, 59, 61, 67, 71, 73)
"""Sample sizes (distinct primes, clamped into each size's range) at which the partition
predicts layouts; distinct values keep two sizes from looking interchangeable."""


def size_names(graph: Graph) -> tuple[str, ...]:
    """The named sizes of ``graph``'s inputs and params, sorted: the order of every size
    table and size key."""
    return tuple(sorted(graph_sizes(graph)))


def sample_sizes(graph: Graph) -> dict[str, int]:
    """A value of every named size, inside its range (see :data:`SAMPLES`)."""
    out: dict[str, int] = {}
    for i, name in enumerate(size_names(graph)):
        r = graph.sizes.get(name, SizeRange())
        value = max(SAMPLES[i % len(SAMPLES)] + 2 * (i // len(SAMPLES)), r.lo)
        out[name] = value if r.hi is None else min(value, r.hi)
    return out


TYPICAL_CAP = 1024
"""A size without a finite range maximum is taken as this large when scheduling."""


def typical_sizes(graph: Graph, names: Sequence[str]) -> list[int]:
    """Per size (in ``names`` order), the value kernels are scheduled for: the range's
    maximum, capped at :data:`TYPICAL_CAP` (a nest is parallel when its work at those
    sizes calls for it; small calls then pay one OpenMP region)."""
    out = []
    for name in names:
        r = graph.sizes.get(name, SizeRange())
        out.append(max(r.lo, min(r.hi if r.hi is not None else TYPICAL_CAP, TYPICAL_CAP)))
    return out


UNBOUNDED = 2**62
"""The top a size without a finite range maximum is given in the legality checks."""


def legality_ranges(graph: Graph, names: Sequence[str]) -> list[tuple[int, int]]:
    """Per size (in ``names`` order), the ``(low, high)`` range the isl checks of the graph's
    kernels assume: the recorded range (a step legal only for sizes outside it is accepted,
    one illegal inside it refused)."""
    out = []
    for name in names:
        r = graph.sizes.get(name, SizeRange())
        out.append((r.lo, r.hi if r.hi is not None else UNBOUNDED))
    return out


def size_function(names: Sequence[str], dims: Sequence[Any]) -> Callable[[Sequence[int]], list[int]]:
    """A fast function of the size values (in ``names`` order) giving each of ``dims`` (ints
    or symbolic sizes) as an int."""
    exprs = [d.expr if isinstance(d, SymDim) else sympy.Integer(int(d)) for d in dims]
    if not exprs:
        return lambda values: []
    fn = sympy.lambdify([size_symbol(n) for n in names], exprs, modules="math")
    return lambda values: [int(v) for v in fn(*values)]


# ------------------------------------------------------------------------------ binding
def size_binder(types: Sequence[TensorType], names: Sequence[str], sizes: Sequence[str],
                ranges: Mapping[str, SizeRange]) -> Callable[[Sequence[torch.Tensor]], tuple[int, ...]]:
    """``bind(args) -> key``: the sizes (in ``sizes`` order) of one call's arguments, each
    argument's whole shape checked against its symbolic type and every size against its
    range; a mismatch raises :class:`~kiln.ir.sizes.SizeError` (from
    :func:`kiln.ir.sizes.bind_sizes`, which words it).  The fast path is generated Python:
    one shape read per size, one tuple comparison per argument."""
    where: dict[str, tuple[int, int]] = {}
    for i, t in enumerate(types):
        for axis, d in enumerate(t.shape):
            if isinstance(d, SymDim) and d.is_symbol and d.name not in where:
                where[d.name] = (i, axis)

    def slow(args: Sequence[torch.Tensor]) -> tuple[int, ...]:
        bound = bind_sizes(types, [tuple(a.shape) for a in args], names, ranges)
        return tuple(bound[n] for n in sizes)

    if any(n not in where for n in sizes):  # a size known only through an expression
        return slow
    env: dict[str, Any] = {"slow": slow}
    lines = ["def bind(args):", "    try:"]
    for k, n in enumerate(sizes):
        i, axis = where[n]
        lines.append(f"        s{k} = args[{i}].shape[{axis}]")
    index = {n: k for k, n in enumerate(sizes)}
    checks = []
    for k, n in enumerate(sizes):
        r = ranges.get(n, SizeRange())
        checks.append(f"s{k} < {r.lo}" + (f" or s{k} > {r.hi}" if r.hi is not None else ""))
    for i, t in enumerate(types):
        if all(isinstance(d, int) or (isinstance(d, SymDim) and d.is_symbol) for d in t.shape):
            dims = [str(d) if isinstance(d, int) else f"s{index[d.name]}" for d in t.shape]
            checks.append(f"args[{i}].shape != ({', '.join(dims)}{',' if len(dims) == 1 else ''})")
        else:
            env[f"shape{i}"] = size_function(sizes, t.shape)
            checks.append(f"list(args[{i}].shape) != shape{i}(({', '.join(f's{k}' for k in range(len(sizes)))},))")
    lines += ["    except (IndexError, AttributeError):", "        return slow(args)"]
    if checks:
        lines.append(f"    if {' or '.join(f'({c})' for c in checks)}:")
        lines.append("        return slow(args)")
    lines.append(f"    return ({', '.join(f's{k}' for k in range(len(sizes)))},)")
    exec("\n".join(lines), env)  # noqa: S102 - generated from the graph's own types
    return env["bind"]


# ------------------------------------------------------------------------------ nodes
def concrete_node(node: Node, sizes: Mapping[str, int]) -> Node:
    """A copy of ``node`` at concrete ``sizes``: operands and results of static types,
    attributes (fused bodies included) evaluated; inference re-checks it."""
    from kiln.backends.reference import node_attrs  # noqa: PLC0415 (the reference module is light)

    scratch = Graph("concrete")
    inputs = [scratch.add_input(f"x{i}", concrete_type(v.type, sizes)) for i, v in enumerate(node.inputs)]
    copy = scratch.add_node(node.op, inputs, node_attrs(node, sizes), names=[v.name for v in node.outputs])
    for v, want in zip(copy.outputs, node.outputs):
        if tuple(v.type.shape) != tuple(concrete_type(want.type, sizes).shape):
            raise KilnError(f"kiln bug: %{want.name} = {node.op_name} is {v.type} at {format_sizes(sizes)}, "
                            f"but its symbolic type {want.type} says {concrete_type(want.type, sizes)}")
    return copy


# ------------------------------------------------------------------------------ the planner
class DynamicPlanner:
    """Makes the static plan of one set of sizes from the symbolic partition ``plan`` (a
    :class:`~.partition.GraphPlan` with ``sizes`` set); ``make(plan, memory, size_table)``
    turns a concrete partition into a :class:`kiln.runtime.call_plan.CallPlan` (the build
    pipeline's binding, with the size table ``key`` in a slot appended to every kernel call)."""

    def __init__(self, plan: Any, memory: SymbolicMemoryPlan, kernel_indexes: Sequence[int | None],
                 make: Callable[[Any, MemoryPlan, tuple[int, ...]], Any]):
        self.plan = plan
        self.names = plan.sizes
        self.memory = memory
        self.make = make
        kernels = [op for op in plan.ops if op.step == "kernel"]
        self.fallback_kernels = {id(op) for op, index in zip(kernels, kernel_indexes) if index is None}
        self.shapes = size_function(self.names, [d for pv in plan.values for d in pv.type.shape])
        self.ranks = [pv.type.rank for pv in plan.values]

    def __call__(self, key: tuple[int, ...]) -> Any:
        sizes = dict(zip(self.names, key))
        try:
            return self._instance(key, sizes)
        except SizeError:
            raise
        except (KilnError, RuntimeError, ValueError, TypeError) as e:
            raise BackendError(f"kiln: the graph built for symbolic sizes cannot run at {format_sizes(sizes)}: "
                               f"{e}") from e

    def _instance(self, key: tuple[int, ...], sizes: dict[str, int]) -> Any:
        plan = self.plan
        flat = self.shapes(key)
        shapes, at = [], 0
        for rank in self.ranks:
            shapes.append(tuple(flat[at:at + rank]))
            at += rank
        values: list[Any] = []
        for pv, shape in zip(plan.values, shapes):
            base = values[pv.base.slot] if pv.base is not None else None
            if pv.origin == "view" and base is not None:
                if pv.view_node is None:
                    raise KilnError(f"value %{pv.name} is a view the symbolic plan cannot replay")
                meta = VIEWS[pv.view_node.op_name](pv.view_node, sizes)(base.meta)
            elif pv.meta is not None and pv.type.is_static:
                meta = pv.meta
            else:
                meta = torch.empty(shape, dtype=torch_dtype(pv.type.dtype), device="meta")
            values.append(replace(pv, type=pv.type.with_shape(shape) if not pv.type.is_static else pv.type,
                                  base=base, meta=meta))
        ops = [self._op(op, values, sizes) for op in plan.ops]
        concrete = replace(plan, values=values, args=[values[pv.slot] for pv in plan.args], ops=ops,
                           outputs=[values[pv.slot] for pv in plan.outputs], sizes=(), sample=None)
        offsets, arena = self.memory.evaluate(key)
        memory = MemoryPlan(offsets, {}, arena, arena)
        plan = self.make(concrete, memory, key)
        plan.persistent_group = id(self)  # one build's plans share their packed weights
        return plan

    def _op(self, op: Any, values: list[Any], sizes: dict[str, int]) -> Any:
        ins = [values[pv.slot] for pv in op.inputs]
        outs = [values[pv.slot] for pv in op.outputs]
        temps = [values[pv.slot] for pv in op.temps]
        changes: dict[str, Any] = {"inputs": ins, "outputs": outs, "temps": temps}
        if op.step == "library" and op.remake is not None and op.source is not None:
            changes["call"] = op.remake(concrete_node(op.source, sizes))
        elif op.step == "view" and op.source is not None:
            changes["view"] = VIEWS[op.source.op_name](op.source, sizes)
        elif op.step == "kernel":
            for sym, pv in zip(op.inputs, ins):
                if sym.meta.is_contiguous() and not pv.meta.is_contiguous():
                    raise KilnError(f"kernel {op.label} reads %{pv.name}, contiguous at the build's sample "
                                    f"sizes but not at these")
                if op.gemm is not None and sym.type.is_static and sym.meta.stride() != pv.meta.stride():
                    raise KilnError(f"GEMM kernel {op.label} has the leading dimensions of %{pv.name} at the "
                                    f"build's sample sizes ({sym.meta.stride()}), not at these ({pv.meta.stride()})")
            if id(op) in self.fallback_kernels and op.node is not None:
                changes["node"] = concrete_node(op.node, sizes)
        return replace(op, **changes)


__all__ = ["SAMPLES", "TYPICAL_CAP", "UNBOUNDED", "DynamicPlanner", "concrete_node", "legality_ranges", "sample_sizes",
           "size_binder", "size_function", "size_names", "typical_sizes"]
