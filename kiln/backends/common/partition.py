"""The partition of a graph into what a backend runs: operations on planned values.

:class:`Partitioner` turns each node, by its chosen implementation (:mod:`.select`), into
operations (:class:`PlanOp`):

* ``kernel``  -- one native function: a generated loop kernel of a node, a GEMM (a
  backend's native GEMM, :meth:`Partitioner.gemm`), or a GEMM followed by the generated
  kernel of its fused epilogue; lowered and compiled only on a compile-cache miss;
* ``library`` -- a library call of the backend's table, or a reference call on the host,
  on torch tensors;
* ``view``    -- a zero-copy torch view, run only where a torch call, a copy or a graph
  output needs the view tensor: kernels read views as their root's pointer plus an offset;
* ``copy``    -- a strided value copied into a contiguous buffer before a loop kernel reads it;
* ``contiguous`` -- an argument or a library result made contiguous (a no-op when it is)
  before kernels read it or views of it;
* ``foreign`` -- a native function outside the generated unit (``PlanOp.foreign``: the cpu
  backend's convolution entry) on the raw pointers of ``inputs`` then ``outputs``, launched
  with the kernels around it in one native call;
* ``pack``    -- a prepared copy of a weight that a GEMM or a foreign kernel reads (made by a
  backend's hook), kept per workspace and refreshed only when the weight changes; packs
  read parameters only, so they run first, before every kernel;
* ``clone``   -- a graph output that would alias a build-time constant is copied;
* ``release`` -- tensors returned by library calls are dropped after their last use.

Before anything is planned, the partition asks the backend whether it can run each node
(:meth:`kiln.backends.base.Backend.supports`); a node it cannot run raises
:class:`~kiln.backends.base.BackendError` naming the op, its operand types and how to go on.

Every value (:class:`PlanValue`) has a slot, an origin and a ``meta`` tensor with its
predicted strides and storage offset within its root.  Layouts of views come from applying
the same torch view functions to ``meta`` tensors, so they are exactly what the runtime
sees once roots are contiguous; arguments and library results that kernels read are made
contiguous at run time, which makes every prediction a kernel relies on hold.

Backends specialize the partition by overriding its hooks: :meth:`Partitioner.library_call`
(the backend's library table; required), :meth:`~Partitioner.host_call` (a node run on the
host), :meth:`~Partitioner.gemm` / :meth:`~Partitioner.anchor_gemm` (native GEMM kernels),
:meth:`~Partitioner.library` (the layout of library results) and
:meth:`~Partitioner.layouts` (layout decisions once every node is planned).  The cpu
backend's :class:`kiln.backends.cpu.partition.CpuPartitioner` fills them with its GEMMs,
weight packing and channels-last convolutions.

:func:`lifetimes` gives each buffer written in place its lifetime in operations (reads of
its views included) for the memory plan (:mod:`.memory_plan`); buffers reachable from a
graph output are not planned (they are allocated per call: outputs escape).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kiln.backends.base import Backend, unsupported_node
from kiln.ir import Graph, Node, Value
from kiln.ir.sizes import concrete_type, has_sizes, is_dynamic
from kiln.ir.types import TensorType
from kiln.runtime.tensors import from_numpy, torch_dtype

from .absorb import absorb_views
from .dynamic import sample_sizes, size_names
from .library import VIEWS, LibraryCall
from .memory_plan import BufferRequest
from .select import Choice, anchor_of


@dataclass(eq=False)
class PlanValue:
    """A tensor of the plan. ``origin``: ``arg``, ``const``, ``buffer`` (written in place by an
    operation), ``returned`` (a new tensor from a library call), ``view`` or ``packed`` (a
    persistent prepared copy of a weight)."""

    slot: int
    type: TensorType
    name: str
    origin: str
    base: PlanValue | None = None
    meta: torch.Tensor | None = None
    const: torch.Tensor | None = None
    fresh: bool = False
    """A buffer allocated per call instead of in the arena (it escapes as a graph output)."""
    view_node: Node | None = None
    """For a view: the view op that makes it from ``base`` (kernels absorb it, see absorb.py)."""

    def root(self) -> PlanValue:
        v = self
        while v.base is not None:
            v = v.base
        return v

    @property
    def byte_offset(self) -> int:
        """Offset of this value's first element from its root's, in bytes."""
        assert self.meta is not None
        return self.meta.storage_offset() * self.meta.element_size()


@dataclass(eq=False)
class PlanOp:
    """One operation (see the module docstring).  For kernels, ``args`` are the values whose
    pointers the native function receives, in order; ``temps`` are buffers it uses only
    inside (a GEMM result read by the epilogue).  ``gemm`` is the backend's description of
    the GEMM a kernel starts with (operands ``inputs[0]`` and ``inputs[1]``; the cpu
    backend's :class:`~kiln.backends.cpu.gemm.GemmSpec`); the partition only needs to know
    that there is one."""

    step: str
    inputs: list[PlanValue]
    outputs: list[PlanValue]
    label: str
    node: Node | None = None
    template: str = ""
    call: LibraryCall | None = None
    view: Callable[[torch.Tensor], torch.Tensor] | None = None
    gemm: Any = None
    temps: list[PlanValue] = field(default_factory=list)
    source: Node | None = None
    """The node a library call or view was made from (remade at each set of sizes of a
    symbolic graph, :mod:`.dynamic`)."""
    remake: Callable[[Node], LibraryCall] | None = None
    """How the library call is made from a node (its node at concrete sizes)."""
    foreign: Any = None
    """For a ``foreign`` operation: the native function it launches
    (:class:`kiln.runtime.call_plan.ForeignKernel`)."""

    @property
    def args(self) -> list[PlanValue]:
        """Kernel arguments: GEMM operands (A, B, C), then the loop kernel's distinct inputs
        and its outputs."""
        if self.gemm is None:
            return [*dict.fromkeys(self.inputs), *self.outputs]
        a, b, *rest = self.inputs
        if self.node is None:
            return [a, b, self.outputs[0]]
        result = (self.temps or self.outputs)[0]
        loop_outputs = [v for v in self.outputs if v is not result]
        return [a, b, *dict.fromkeys([result, *rest]), *loop_outputs]


@dataclass
class GraphPlan:
    """What :meth:`Partitioner.run` returns."""

    graph: Graph
    values: list[PlanValue]
    args: list[PlanValue]
    ops: list[PlanOp]
    outputs: list[PlanValue]
    choices: dict[str, str] = field(default_factory=dict)
    sizes: tuple[str, ...] = ()
    """The named sizes of a symbolic graph (size-table order); empty for static shapes."""
    sample: dict[str, int] | None = None
    """The sizes the ``meta`` layouts of a symbolic graph were predicted at."""

    @property
    def kernels(self) -> list[PlanOp]:
        return [op for op in self.ops if op.step == "kernel"]


class Partitioner:
    """Plans one graph for ``backend`` (see the module docstring); :meth:`run` does it all."""

    def __init__(self, graph: Graph, backend: Backend):
        self.graph = graph
        self.backend = backend
        self.values: list[PlanValue] = []
        self.ops: list[PlanOp] = []
        self.of: dict[Value, PlanValue] = {}
        self.sample: dict[str, int] | None = sample_sizes(graph) if is_dynamic(graph) else None
        """Sizes at which a symbolic graph's layouts are predicted (``None``: static shapes)."""
        self.param_slots: set[int] = set()
        """Slots of the graph's parameters: the only operands a GEMM may read from a packed
        copy kept across calls (an input's tensor can be new at each call at the address and
        version counter of the last one, so a packed copy of it would go stale)."""

    # ----------------------------------------------------------------- hooks
    def library_call(self, node: Node, persistent: list[bool]) -> LibraryCall:
        """The backend's library call of ``node`` (``persistent[i]``: operand ``i`` is a
        parameter, the same tensor at every call)."""
        raise NotImplementedError(f"{type(self).__name__} has no library table")

    def host_call(self, node: Node) -> LibraryCall:
        """``node`` run on the host (implementation ``reference``), for backends that do."""
        raise unsupported_node(self.backend.name, node)

    def gemm(self, node: Node, ins: list[PlanValue], label: str) -> bool:
        """Plan a plain ``matmul`` as a native GEMM kernel when the backend has one; whether it did."""
        return False

    def anchor_gemm(self, anchor: Node, ins: list[PlanValue]) -> tuple[Any, list[PlanValue]] | None:
        """For a fused ``library+epilogue`` node: the native GEMM of its ``anchor`` (the
        backend's description and the operands it reads), run in one kernel with the
        epilogue, or ``None`` (the anchor is a library call)."""
        return None

    def anchor_library(self, anchor: Node, body: Graph,
                       operand: dict[Value, PlanValue]) -> tuple[LibraryCall, list[Node], list[Value]] | None:
        """For a fused ``library+epilogue`` node whose anchor is a library call: a call that
        also computes the first nodes of the epilogue, or ``None``.  Returns the call, the
        nodes it computes (the anchor first; the result is the last one's) and the body
        inputs it reads, in its argument order (``operand`` maps body inputs to plan values)."""
        return None

    def layouts(self) -> None:
        """Layout decisions once every node is planned (before views are absorbed)."""

    # ----------------------------------------------------------------- values
    def persistent(self, values: list[PlanValue]) -> list[bool]:
        """Which of ``values`` are the graph's parameters (the same tensors at every call)."""
        return [pv.slot in self.param_slots for pv in values]

    def new(self, type: TensorType, name: str, origin: str, **kw) -> PlanValue:
        pv = PlanValue(len(self.values), type, name, origin, **kw)
        if pv.meta is None:
            shape = type.shape if type.is_static or self.sample is None else concrete_type(type, self.sample).shape
            pv.meta = torch.empty(tuple(shape), dtype=torch_dtype(type.dtype), device="meta")
        self.values.append(pv)
        return pv

    # ----------------------------------------------------------------- nodes
    def node(self, node: Node, choice: Choice) -> None:
        label = f"%{', %'.join(v.name for v in node.outputs)} = {node.op_name}"
        ins = [self.of[v] for v in node.inputs]
        impl = choice.impl
        if impl == "fold" and self.sample is not None and (
                any(has_sizes(a) for a in node.attrs.values()) or not node.outputs[0].type.is_static):
            impl = "reference"  # a symbolic creation: made at each call's sizes
        if impl == "view":
            self.view(node, ins[0], label)
        elif impl == "fold":
            result = node.op.reference(**node.attrs)
            tensor = from_numpy(_as_array(result, node.outputs[0].type))
            self.of[node.outputs[0]] = self.new(node.outputs[0].type, node.outputs[0].name, "const", const=tensor)
        elif impl == "library" and node.op_name == "matmul" and self.gemm(node, ins, label):
            pass
        elif impl == "library":
            persistent = self.persistent(ins)
            self.library(self.library_call(node, persistent), ins, list(node.outputs), label,
                         remake=lambda n, p=persistent: self.library_call(n, p), source=node)
        elif impl == "reference":
            self.library(self.host_call(node), ins, list(node.outputs), label, remake=self.host_call, source=node)
        elif impl == "library+epilogue":
            self.library_epilogue(node, ins, label)
        elif impl == "generated":
            outs = [self.new(v.type, v.name, "buffer") for v in node.outputs]
            self.of.update(zip(node.outputs, outs))
            template = node.attrs["template"] if node.op_name == "fused" else kernel_template(node)
            self.ops.append(PlanOp("kernel", ins, outs, label, node=node, template=template))
        else:
            raise ValueError(f"unknown implementation {impl!r} for node {label}")

    def view(self, node: Node, source: PlanValue, label: str) -> None:
        fn = VIEWS[node.op_name](node, self.sample)
        meta = fn(source.meta)
        out = node.outputs[0]
        if meta._is_view():
            pv = self.new(out.type, out.name, "view", base=source, meta=meta, view_node=node)
        else:  # torch's reshape copies here: a new contiguous tensor
            pv = self.new(out.type, out.name, "returned")
        self.of[out] = pv
        self.ops.append(PlanOp("view", [source], [pv], label, view=fn, source=node))

    def library(self, call: LibraryCall, ins: list[PlanValue], outs: list[Value], label: str,
                remake: Callable[[Node], LibraryCall] | None = None, source: Node | None = None) -> list[PlanValue]:
        """A library call's operation; its result values (buffers it writes into, or new tensors).
        ``remake(node)`` makes the call again from ``source`` at concrete sizes (symbolic graphs)."""
        origin = "buffer" if call.writes_into else "returned"
        pvs = [self.new(v.type, v.name, origin) for v in outs]
        self.of.update(zip(outs, pvs))
        self.ops.append(PlanOp("library", ins, pvs, f"{label} [{call.label}]", call=call, source=source,
                               remake=remake))
        return pvs

    def library_epilogue(self, node: Node, ins: list[PlanValue], label: str) -> None:
        body: Graph = node.attrs["body"]
        anchor = anchor_of(body)
        assert anchor is not None
        operand = dict(zip(body.inputs, ins))
        result = anchor.outputs[0]
        anchor_ins = [operand[v] for v in anchor.inputs]
        found = self.anchor_gemm(anchor, anchor_ins)
        spec = None
        if found is not None:
            spec, anchor_ins = found
        absorbed = self.anchor_library(anchor, body, operand) if spec is None else None
        computed = absorbed[1] if absorbed is not None else [anchor]
        result = computed[-1].outputs[0]
        epilogue, used = split_epilogue(body, anchor, computed[1:])
        escapes = result in body.outputs
        if spec is not None:
            anchor_pv = self.new(result.type, result.name, "buffer")
        elif absorbed is not None:
            call, _, reads = absorbed
            names = "+".join(n.op_name for n in computed)
            anchor_pv = self.library(call, [operand[v] for v in reads], [result], f"%{result.name} = {names}",
                                     source=anchor)[0]
        else:
            persistent = self.persistent(anchor_ins)
            anchor_pv = self.library(self.library_call(anchor, persistent), anchor_ins, [result],
                                     f"%{result.name} = {anchor.op_name}",
                                     remake=lambda n, p=persistent: self.library_call(n, p), source=anchor)[0]
        outs: list[PlanValue] = []
        for graph_out, body_out in zip(node.outputs, body.outputs):
            if body_out is result:
                self.of[graph_out] = anchor_pv
            else:
                pv = self.new(graph_out.type, graph_out.name, "buffer")
                self.of[graph_out] = pv
                outs.append(pv)
        synthetic = None
        if epilogue is not None:
            scratch = Graph("epilogue")
            operands = [scratch.add_input(v.name, v.type) for v in epilogue.inputs]
            synthetic = scratch.add_node("fused", operands, {"template": "elementwise", "body": epilogue})
        if spec is not None:
            op_outs = ([anchor_pv] if escapes else []) + outs
            temps = [] if escapes else [anchor_pv]
            epi_ins = [operand[v] for v in used]
            self.ops.append(PlanOp("kernel", [*anchor_ins[:2], *epi_ins], op_outs, f"{label} [gemm+epilogue]",
                                   node=synthetic, template="elementwise", gemm=spec, temps=temps))
        elif synthetic is not None:
            self.ops.append(PlanOp("kernel", [anchor_pv] + [operand[v] for v in used], outs, f"{label} epilogue",
                                   node=synthetic, template="elementwise"))

    # ----------------------------------------------------------------- whole-plan rewrites
    def contiguous_inputs(self) -> None:
        """Make every kernel's reads valid: strided views a loop kernel reads are absorbed into
        it (:mod:`.absorb`) or, failing that, copied into contiguous buffers; arguments and
        library results that kernels read (or read views of) become contiguous at run time."""
        ops: list[PlanOp] = []
        copies: dict[int, PlanValue] = {}
        roots_read: set[int] = set()
        for op in self.ops:
            if op.step == "foreign" or (op.step == "pack" and op.call is None):
                # read through the roots' predicted layouts (a pack with a call reads its
                # sources as torch tensors, whatever their layout)
                roots_read.update(pv.root().slot for pv in op.inputs)
            if op.step == "kernel":
                absorb_views(op)
                fixed = []
                for i, pv in enumerate(op.inputs):
                    if op.gemm is not None and i < 2:  # GEMM operands: any unit-stride layout
                        roots_read.add(pv.root().slot)
                        fixed.append(pv)
                        continue
                    if pv.slot in copies:
                        fixed.append(copies[pv.slot])
                        continue
                    roots_read.add(pv.root().slot)
                    if pv.meta.is_contiguous():
                        fixed.append(pv)
                        continue
                    copy = self.new(pv.type, pv.name + ".contiguous", "buffer")
                    ops.append(PlanOp("copy", [pv], [copy], f"contiguous copy of %{pv.name}"))
                    copies[pv.slot] = copy
                    fixed.append(copy)
                op.inputs = fixed
            ops.append(op)
        self.ops = []
        for pv in self.values:
            if pv.origin == "arg" and pv.slot in roots_read:
                self.ops.append(PlanOp("contiguous", [pv], [pv], f"contiguous argument %{pv.name}"))
        for op in ops:
            self.ops.append(op)
            if op.step in ("library", "view"):
                for pv in op.outputs:
                    if pv.origin == "returned" and pv.slot in roots_read:
                        self.ops.append(PlanOp("contiguous", [pv], [pv], f"contiguous %{pv.name}"))

    def hoist_packs(self) -> None:
        """Move every ``pack`` to the front, after the arguments are made contiguous: packs
        read only parameters, which no operation writes, and kernels between two packs then
        share one native call."""
        packs = [op for op in self.ops if op.step == "pack"]
        if not packs:
            return
        rest = [op for op in self.ops if op.step != "pack"]
        lead = 0
        while lead < len(rest) and rest[lead].step == "contiguous" and rest[lead].inputs[0].origin == "arg":
            lead += 1
        self.ops = rest[:lead] + packs + rest[lead:]

    def outputs(self) -> list[PlanValue]:
        outs: list[PlanValue] = []
        for v in self.graph.outputs:
            pv = self.of[v]
            root = pv.root()
            if root.origin == "buffer":
                root.fresh = True
            elif root.origin == "const":
                clone = self.new(pv.type, pv.name + ".clone", "returned")
                self.ops.append(PlanOp("clone", [pv], [clone], f"copy of constant output %{v.name}"))
                pv = clone
            outs.append(pv)
        return outs

    def prune_views(self, outputs: list[PlanValue]) -> None:
        """Keep only the view operations whose tensors something other than a kernel (or a
        weight packing, which reads through the root) needs."""
        needed = {pv.slot for pv in outputs}
        for op in self.ops:
            if op.step not in ("kernel", "view", "pack", "foreign"):
                needed.update(pv.slot for pv in op.inputs)
        for op in reversed(self.ops):
            if op.step == "view" and (op.outputs[0].slot in needed or op.outputs[0].origin == "returned"):
                needed.add(op.inputs[0].slot)
        self.ops = [op for op in self.ops if op.step != "view" or op.outputs[0].slot in needed
                    or op.outputs[0].origin == "returned"]

    def releases(self, outputs: list[PlanValue]) -> None:
        """Drop tensors returned by library calls (and views of them) after their last use."""
        keep = {pv.root().slot for pv in outputs}
        last: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            for pv in (*op.inputs, *op.outputs):
                root = pv.root()
                if root.origin == "returned" and root.slot not in keep:
                    last[root.slot] = max(last.get(root.slot, i), i)
                    if pv.origin == "view":
                        last[pv.slot] = i
        by_op: dict[int, list[PlanValue]] = {}
        for slot, i in last.items():
            by_op.setdefault(max(i, last[self.values[slot].root().slot]), []).append(self.values[slot])
        ops: list[PlanOp] = []
        for i, op in enumerate(self.ops):
            ops.append(op)
            if i in by_op:
                ops.append(PlanOp("release", by_op[i], [], "release"))
        self.ops = ops

    def run(self, choose: Callable[[Node], Choice]) -> GraphPlan:
        """The operations that run the graph; ``choose`` picks each node's implementation.

        It plans outside inference mode even when called inside it: there torch records no
        view relations, so every view of a ``meta`` tensor would look like a copy, and a
        buffer read through a view could be freed and reused too early."""
        with torch.inference_mode(False):
            return self._run(choose)

    def _run(self, choose: Callable[[Node], Choice]) -> GraphPlan:
        graph = self.graph
        for node in graph.nodes:
            if not self.backend.supports(node):
                raise unsupported_node(self.backend.name, node)
        args = []
        for v in (*graph.inputs, *graph.params):
            pv = self.new(v.type, v.name, "arg")
            self.of[v] = pv
            args.append(pv)
        self.param_slots = {self.of[v].slot for v in graph.params}
        for c in graph.constants:
            self.of[c] = self.new(c.type, c.name, "const", const=from_numpy(c.data))
        choices = {}
        for node in graph.nodes:
            choice = choose(node)
            choices[", ".join(f"%{v.name}" for v in node.outputs) + f" = {node.op_name}"] = choice.impl
            self.node(node, choice)
        self.layouts()
        self.contiguous_inputs()
        self.hoist_packs()
        outputs = self.outputs()
        self.prune_views(outputs)
        self.releases(outputs)
        return GraphPlan(graph, self.values, args, self.ops, outputs, choices,
                         size_names(graph) if self.sample is not None else (), self.sample)


def kernel_template(node: Node) -> str:
    """The schedule template of a generated kernel of ``node`` (by its op's traits)."""
    for trait, template in (("matmul", "matmul"), ("conv", "conv"), ("reduction", "reduction"),
                            ("normalization", "reduction"), ("elementwise", "elementwise"),
                            ("pointwise", "elementwise")):
        if node.op.has(trait):
            return template
    return "opaque"


def _as_array(result: object, type: TensorType) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(result).astype(type.dtype.numpy, copy=False).reshape(type.shape))


def split_epilogue(body: Graph, anchor: Node, absorbed: Sequence[Node] = ()) -> tuple[Graph | None, list[Value]]:
    """The epilogue of ``anchor`` in ``body`` as a graph whose first input is the anchor's
    result and whose other inputs are the body inputs it reads (also returned); ``None``
    when every body output is the anchor's result.  ``absorbed``: the epilogue's first nodes,
    computed with the anchor (by :meth:`Partitioner.anchor_library`); the last one's result
    then stands for the anchor's."""
    skipped = {anchor, *absorbed}
    result = (absorbed[-1] if absorbed else anchor).outputs[0]
    outputs = [v for v in body.outputs if v is not result]
    if not outputs:
        return None, []
    read = {v for n in body.nodes if n not in skipped for v in n.inputs}
    used = [v for v in body.inputs if v in read]
    epi = Graph(f"{body.name}_epilogue")
    vmap: dict[Value, Value] = {result: epi.add_input(result.name, result.type)}
    for v in used:
        vmap[v] = epi.add_input(v.name, v.type)
    for c in body.constants:
        vmap[c] = epi.add_constant(c.data, c.dtype, name=c.name, dedup=False)
    for n in body.nodes:
        if n in skipped:
            continue
        new = epi.add_node(n.op, [vmap[v] for v in n.inputs], n.attrs, names=[v.name for v in n.outputs])
        vmap.update(zip(n.outputs, new.outputs))
    epi.set_outputs([vmap[v] for v in outputs])
    return epi, used


def lifetimes(plan: GraphPlan, sizes: dict[str, int] | None = None) -> list[BufferRequest]:
    """Lifetimes of the arena buffers: values written in place, not escaping, from the
    operation that writes them to the last one reading them or a view of them (byte sizes
    of symbolic types at ``sizes``)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(plan.ops):
        for pv in (*op.outputs, *op.temps):
            root = pv.root()
            if root.origin == "buffer" and not root.fresh:
                first.setdefault(root.slot, i)
                last[root.slot] = max(last.get(root.slot, i), i)
        for pv in op.inputs:
            root = pv.root()
            if root.origin == "buffer" and not root.fresh:
                last[root.slot] = max(last.get(root.slot, i), i)
    def nbytes(t: TensorType) -> int:
        return t.nbytes if sizes is None or t.is_static else concrete_type(t, sizes).nbytes
    return [BufferRequest(slot, nbytes(plan.values[slot].type), first[slot], last[slot]) for slot in first]


__all__ = ["GraphPlan", "Partitioner", "PlanOp", "PlanValue", "kernel_template", "lifetimes", "split_epilogue"]
