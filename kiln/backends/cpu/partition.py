"""The cpu backend's partition hooks: native GEMMs with packed weights, and channels-last
convolution chains.

:class:`CpuPartitioner` fills the hooks of :class:`kiln.backends.common.partition.Partitioner`:

* library calls come from this backend's table (:mod:`.library`), and nodes with nothing
  better run with their numpy reference on the host;
* a ``matmul`` (alone, or as the anchor of a fused epilogue) whose operands allow it
  becomes a native GEMM kernel (:mod:`.gemm`); when the GEMM tuner reads a weight from a
  prepared copy, a ``pack`` operation keeps that copy (16-column panels for kiln's own GEMM,
  :mod:`.microgemm`, else a contiguous copy of the transposed weight);
* a convolution result that oneDNN returns channels-last keeps that layout: the slot holds
  the NHWC (3-d: NDHWC) tensor and the NCHW value is a ``permute`` view of it; a 4-d or 5-d
  kernel result whose every reader is such a convolution or another kernel is written
  channels-last too (:func:`kiln.backends.common.absorb.permute_result`), so convolution
  chains never convert layouts between layers.  Convolution nodes named in ``nchw``
  (the backend option ``nchw_convs``) return contiguous NCHW results instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from kiln.backends.base import Backend, get_backend
from kiln.backends.common.absorb import permute_result
from kiln.backends.common.library import VIEWS, LibraryCall
from kiln.backends.common.partition import GraphPlan, Partitioner, PlanOp, PlanValue
from kiln.backends.common.dynamic import size_names, typical_sizes
from kiln.backends.common.select import Choice
from kiln.ir.loops.expr import size_expr
from kiln.ir import Graph, Node, Value
from kiln.ir.types import DType

from .gemm import KILN_PROVIDER, GemmSpec, gemm_spec, size_c_expr
from .library import conv_call, library_call, reference_call
from .conv_plan import KilnConvCall, conv_epilogue, finish, plan_foreign, with_activation
from .packed_conv import POST_OPS, BatchNormFolded, PackedConv
from .microgemm import packed_shape
from .microgemm_bf16 import packed_shape_bf16

GemmChooser = Callable[[GemmSpec, bool], "GemmSpec | None"]
"""``choose(spec, packable)``: ``spec`` with its provider (and weight packing) set."""


class CpuPartitioner(Partitioner):
    """The partition of the cpu backend (see the module docstring).  ``gemm_provider``
    (the GEMM tuner's ``choose``) allows native GEMM kernels."""

    def __init__(self, graph: Graph, backend: Backend, gemm: GemmChooser | None = None,
                 tune_sizes: dict[str, int] | None = None, updated: frozenset[str] = frozenset(),
                 nchw: frozenset[str] = frozenset(), threads: int = 1, foreign: bool = True):
        super().__init__(graph, backend)
        self.threads = threads
        """Threads kiln's convolution kernels split their work between."""
        self.foreign = foreign
        """Whether kiln's convolutions may be planned as foreign kernels of native runs
        (:mod:`.conv_plan`); a backend whose launcher has no kernel table of its own passes
        ``False`` and runs them as library calls."""
        self.nchw = nchw
        """Result names of convolution nodes whose results stay NCHW (option ``nchw_convs``)."""
        self.updated = updated
        """Params that change at every call (a training step's weights): a packed copy of one
        would be made again at every call, so their GEMMs read them as they are."""
        self.gemm_provider = gemm
        self.tune_sizes = tune_sizes
        """Sizes at which GEMMs with a symbolic M are tuned (default: the scheduling sizes)."""
        self.cast_of: dict[int, PlanValue] = {}
        """The parameter (view) each persistent converted copy of a parameter is made from."""
        self._planning: Node | None = None
        """The graph node being planned (see :meth:`_reduced`)."""
        self._reduction_inputs: set[Value] | None = None

    def library_call(self, node: Node, persistent: list[bool]) -> LibraryCall:
        planned = [self.of.get(v) for v in node.inputs]
        strides = [None if pv is None or pv.meta is None else tuple(pv.meta.stride()) for pv in planned]
        return library_call(node, persistent, strides)

    def host_call(self, node: Node) -> LibraryCall:
        return reference_call(node)

    # ----------------------------------------------------------------- GEMMs
    def _gemm_spec(self, anchor: Node, a: PlanValue, b: PlanValue) -> tuple[GemmSpec, PlanValue] | None:
        """The GEMM of ``anchor`` and the value its kernel reads as B (a packed copy of a
        transposed weight when the tuner chose one), or ``None``."""
        if self.gemm_provider is None or anchor.op_name != "matmul":
            return None
        # a static view of a symbolic tensor (``x[:, 0]`` of ``[b, seq, d]``) has strides that
        # depend on the sizes: its GEMM is symbolic too
        symbolic = not all(t.is_static for t in (a.type, b.type, a.root().type, b.root().type,
                                                  anchor.outputs[0].type))
        if symbolic and not self._symbolic_m(a, b):
            return None  # other symbolic GEMMs: a library GEMM (torch.matmul) at each call's sizes
        spec = gemm_spec(a.meta, b.meta, anchor.outputs[0].dtype)
        if spec is None:
            return None
        if symbolic:
            if spec.batch or spec.a.trans != "N" or spec.a.ld != a.type.shape[-1]:
                return None
            m = a.type.size // a.type.shape[-1]
            names = size_names(self.graph)
            typical = self.tune_sizes or dict(zip(names, typical_sizes(self.graph, names)))
            # M is read at run time; the provider is timed at the typical M (the scheduling sizes)
            order = {name: i for i, name in enumerate(names)}
            spec = replace(spec, m=m.evaluate(typical), m_expr=size_c_expr(size_expr(m.expr), order))
        root = b.root()  # a weight that stays the same from call to call, or a prepared copy of one
        if root.slot in self.cast_of:  # a bf16/f16 copy of a weight (parameter casts, below)
            root = self.cast_of[root.slot].root()
        weight = root.slot in self.param_slots and root.name not in self.updated
        packable = weight and b.type.rank == 2 and not spec.batch
        chosen = self.gemm_provider(spec, packable)
        if chosen is None:
            return None  # no GEMM of this dtype here: a library call
        spec = chosen
        if not spec.packed_b:
            return spec, b
        if spec.provider == KILN_PROVIDER and spec.dtype == DType.bfloat16:  # pair panels (.microgemm)
            packed_type = b.type.with_shape(packed_shape_bf16(spec.k, spec.n))
            label = f"pair panels of %{b.name}"
        elif spec.provider == KILN_PROVIDER:  # 16-column panels (kiln.backends.cpu.microgemm)
            packed_type = b.type.with_shape(packed_shape(spec.k, spec.n))
            label = f"panels of %{b.name}"
        else:
            packed_type, label = b.type, f"packed copy of %{b.name}"
        packed = self.new(packed_type, b.name + ".packed", "packed")
        self.ops.append(PlanOp("pack", [b], [packed], label))
        return spec, packed

    @staticmethod
    def _symbolic_m(a: PlanValue, b: PlanValue) -> bool:
        """A GEMM whose only symbolic size is M: a contiguous ``[..., M, K]`` left operand
        (its leading axes merge into M) with a static K, and a static right matrix (a weight).
        M is then read from the size table at run time; nothing else depends on the sizes."""
        return (b.type.is_static and b.type.rank == 2 and a.type.rank >= 2 and isinstance(a.type.shape[-1], int)
                and a.meta.is_contiguous() and not a.type.is_static)

    def gemm(self, node: Node, ins: list[PlanValue], label: str) -> bool:
        """A plain matmul as a native GEMM kernel, when its operands allow one."""
        found = self._gemm_spec(node, ins[0], ins[1])
        if found is None:
            return False
        spec, b = found
        out = self.new(node.outputs[0].type, node.outputs[0].name, "buffer")
        self.of[node.outputs[0]] = out
        self.ops.append(PlanOp("kernel", [ins[0], b], [out], f"{label} [gemm]", template="matmul", gemm=spec))
        return True

    def anchor_gemm(self, anchor: Node, ins: list[PlanValue]) -> tuple[GemmSpec, list[PlanValue]] | None:
        found = self._gemm_spec(anchor, *ins[:2]) if anchor.op_name == "matmul" else None
        if found is None:
            return None
        spec, b = found
        return spec, [ins[0], b, *ins[2:]]

    # ----------------------------------------------------------------- parameter casts
    def node(self, node: Node, choice: Choice) -> None:
        """A ``cast`` of a parameter (mixed precision's float32 weights read as bf16/f16) is a
        ``pack``: a persistent converted copy, made again only when the parameter's storage
        or version changes, instead of a conversion kernel at every call."""
        self._planning = node
        if (node.op_name == "cast" and choice.impl == "generated" and node.outputs[0] not in self.graph.outputs
                and node.outputs[0].type.is_static):
            source = self.of[node.inputs[0]]
            if source.root().slot in self.param_slots and source.type.is_static:
                out = node.outputs[0]
                packed = self.new(out.type, out.name + ".packed", "packed")
                self.of[out] = packed
                self.cast_of[packed.slot] = source
                self.ops.append(PlanOp("pack", [source], [packed], f"%{out.name} = {out.dtype.short} copy of "
                                                                    f"%{source.name}"))
                return
        super().node(node, choice)

    # ----------------------------------------------------------------- convolutions
    def anchor_library(self, anchor: Node, body: Graph,
                       operand: dict[Value, PlanValue]) -> tuple[LibraryCall, list[Node], list[Value]] | None:
        """A convolution with a parameter weight computes the inference batch norm after it
        (folded into its weight, :class:`~.packed_conv.BatchNormFolded`) when the norm's
        statistics and affine parameters are parameters too.  On kiln's kernels in a graph of
        static shapes (a foreign kernel, :mod:`.conv_plan`) it also applies a residual add
        and an activation in its tile store; oneDNN adds a residual and applies a ReLU in its
        call."""
        if anchor.op_name != "conv" or not all(v.type.is_static for v in (*anchor.inputs, *anchor.outputs)):
            return None
        persistent = self.persistent([operand[v] for v in anchor.inputs])
        if len(persistent) < 2 or not persistent[1] or not all(persistent[2:]):
            return None
        x = operand[anchor.inputs[0]]
        strides = [None if x.meta is None else tuple(x.meta.stride())]
        call = conv_call(anchor, persistent, strides=strides)  # kiln's own kernel or oneDNN, by measurement
        native = call.native is not None and self.foreign and self.sample is None
        chain = _epilogue_chain(body, anchor)
        computed, reads, eps = [anchor], list(anchor.inputs), None
        if (chain and chain[0].op_name == "batch_norm"
                and (native or anchor.outputs[0].type.size >= FOLD_MIN_ELEMENTS)
                and all(v in operand for v in chain[0].inputs[1:])
                and all(self.persistent([operand[v] for v in chain[0].inputs[1:]]))):
            computed.append(chain.pop(0))
            reads += computed[-1].inputs[1:]
            eps = computed[-1].attrs["eps"]
        if native:
            nodes, act, residual = conv_epilogue(body, computed[-1])
            if len(computed) == 1 and not nodes:
                return None
            kcall = call.native
            kcall = KilnConvCall(with_activation(kcall.conv, act), kcall.w_shape, kcall.has_bias, eps,
                                 residual is not None)
            computed += nodes
            reads += [residual] if residual is not None else []
            label = call.label + ("" if eps is None else ", batch norm folded") + ("" if act == "none" else f", {act}") \
                + ("" if residual is None else ", residual")
            return LibraryCall(kcall, False, label, channels_last=True, native=kcall), computed, reads
        residual = None
        if isinstance(call.function, PackedConv):
            nodes, act, found = conv_epilogue(body, computed[-1])
            if found is not None and act in POST_OPS and found.type.rank == 4 and found in operand:
                residual = found
                call = conv_call(anchor, persistent, act, strides)  # the sum (and ReLU) in oneDNN's call
                computed += nodes
                reads.append(residual)
            elif chain and chain[0].op_name == "relu":
                call = conv_call(anchor, persistent, "relu", strides)
                computed.append(chain.pop(0))
        if len(computed) == 1:
            return None
        fn = call.function
        if eps is not None:
            fn = BatchNormFolded(fn, len(anchor.inputs) > 2, eps, residual is not None)
        elif residual is not None and len(anchor.inputs) == 2:  # (x, w, residual): no bias between
            fn = _without_bias(fn)
        label = (call.label + ("" if eps is None else ", batch norm folded into the weight")
                 + ("" if residual is None else ", residual add"))
        return replace(call, function=fn, label=label), computed, reads

    # ----------------------------------------------------------------- layouts
    def library(self, call: LibraryCall, ins: list[PlanValue], outs: list[Value], label: str,
                remake: Callable[[Node], LibraryCall] | None = None, source: Node | None = None) -> list[PlanValue]:
        if call.channels_last and not call.writes_into and self._planning is not None and self.nchw \
                and self._planning.outputs and self._planning.outputs[0].name in self.nchw:
            call, again = _nchw(call), None if remake is None else (lambda n: _nchw(remake(n)))
            return super().library(call, ins, outs, label, again, source)
        if call.native is not None and self.foreign and self.sample is None and len(outs) == 1:
            value = plan_foreign(self, call, ins, outs[0], label)
            if value is not None:
                return [value]
        if (call.channels_last and not call.writes_into and len(outs) == 1 and outs[0].type.rank in CHANNELS_LAST_RANKS
                and not (outs[0].type.rank == 5 and self._reduced())):
            return [self.channels_last(call, ins, outs[0], label, remake, source)]
        return super().library(call, ins, outs, label, remake, source)

    def _reduced(self) -> bool:
        """Whether a reduction kernel reads a result of the graph node being planned (a
        training-mode batch norm's statistics, or its backward): it reduces over the spatial
        axes, which a channels-last 3-d layout makes strided (measured: a 3-d CNN's training
        step 48.5 ms with NCDHW there, 60.9 ms with NDHWC)."""
        if self._planning is None:
            return False
        if self._reduction_inputs is None:  # once per graph
            self._reduction_inputs = {v for n in self.graph.nodes if n.op_name == "fused"
                                      and n.attrs.get("template") == "reduction" for v in n.inputs}
        return any(v in self._reduction_inputs for v in self._planning.outputs)

    def channels_last(self, call: LibraryCall, ins: list[PlanValue], out: Value, label: str,
                      remake: Callable[[Node], LibraryCall] | None = None, source: Node | None = None) -> PlanValue:
        """A library call whose NCHW (or NCDHW) result is laid out channels-last: the slot
        holds the contiguous NHWC (NDHWC) tensor, and the NCHW value is a ``permute`` view of
        it (which kernels absorb and torch calls read as it is)."""
        physical = self.new(out.type.with_shape(_channels_last_shape(out.type.shape)), out.name + ".nhwc", "returned")
        to_last = _to_channels_last(out.type.rank)

        def nhwc(call: LibraryCall) -> LibraryCall:
            fn = call.function
            return LibraryCall(lambda *tensors: fn(*tensors).permute(*to_last), False, call.label, True)
        again = None if remake is None else (lambda n: nhwc(remake(n)))
        self.ops.append(PlanOp("library", ins, [physical], f"{label} [{call.label}]", call=nhwc(call),
                               source=source, remake=again))
        logical = self.new(out.type, out.name, "view", base=physical)
        self.ops.append(self._nchw_view(physical, logical))
        self.of[out] = logical
        return logical

    def _nchw_view(self, physical: PlanValue, logical: PlanValue) -> PlanOp:
        """Make ``logical`` the NCHW ``permute`` view of the NHWC value ``physical``."""
        scratch = Graph("layout")
        rank = physical.type.rank
        to_nchw = scratch.add_node("permute", [scratch.add_input("nhwc", physical.type)],
                                   {"dims": [0, rank - 1, *range(1, rank - 1)]})
        view_fn = VIEWS["permute"](to_nchw)
        logical.origin, logical.base, logical.view_node = "view", physical, to_nchw
        logical.meta = view_fn(physical.meta)
        return PlanOp("view", [physical], [logical], f"%{logical.name} = NCHW view", view=view_fn, source=to_nchw)

    def layouts(self) -> None:
        """Convolution chains stay channels-last (:meth:`channels_last_chains`); then the
        foreign convolutions read their inputs as they are laid out (:func:`.conv_plan.finish`)."""
        self.channels_last_chains()
        finish(self, self.threads)

    def channels_last_chains(self) -> None:
        """Keep convolution chains channels-last: a 4-d or 5-d kernel result (not a graph output) whose
        every reader is a channels-last convolution or another kernel is written NHWC
        (:func:`~kiln.backends.common.absorb.permute_result`); readers see the NCHW value as
        a view, which kernels absorb and convolutions take as it is.  No layout round trips
        between layers."""
        if not any(op.step in ("library", "foreign") and op.call.channels_last for op in self.ops):
            return
        escaping = {self.of[v].root().slot for v in self.graph.outputs}
        readers: dict[int, list[PlanOp]] = {}
        for op in self.ops:
            for pv in op.inputs:
                readers.setdefault(pv.root().slot, []).append(op)
        for index in range(len(self.ops) - 1, -1, -1):
            op = self.ops[index]
            if op.step != "kernel" or op.node is None or op.gemm is not None or len(op.outputs) != 1:
                continue
            out = op.outputs[0]
            if out.type.rank not in CHANNELS_LAST_RANKS or out.slot in escaping or not readers.get(out.slot):
                continue
            # A GEMM kernel's operand layout is fixed in its spec when it is planned, so its
            # operands must keep the layout they had then.
            if not all((r.step == "kernel" and r.gemm is None) or (r.step in ("library", "foreign") and r.call.channels_last)
                       for r in readers[out.slot]):
                continue
            if out.type.rank == 5 and any(r.step == "kernel" and r.template == "reduction" for r in readers[out.slot]):
                continue  # a reduction over the spatial axes would read it strided (see _reduced)
            physical = self.new(out.type.with_shape(_channels_last_shape(out.type.shape)), out.name + ".nhwc",
                                "buffer")
            permute_result(op, list(_to_channels_last(out.type.rank)))
            op.outputs = [physical]
            self.ops[index + 1:index + 1] = [self._nchw_view(physical, out)]


FOLD_MIN_ELEMENTS = 32768
"""Convolution results from this many elements up fold a following batch norm into the
weight: below it the check that the folded weight is current (a few microseconds of Python)
costs more than the separate normalization pass it saves."""

CHANNELS_LAST_RANKS = (4, 5)
"""Ranks of the convolution results kept channels-last (2-d and 3-d convolutions)."""


def _nchw(call: LibraryCall) -> LibraryCall:
    """``call`` returning its result contiguous NCHW (option ``nchw_convs``)."""
    fn = call.function
    return LibraryCall(lambda *tensors: fn(*tensors).contiguous(), False, call.label + ", NCHW", False)


def _to_channels_last(rank: int) -> tuple[int, ...]:
    """The ``permute`` dims from NC<spatial> to N<spatial>C."""
    return (0, *range(2, rank), 1)


def _channels_last_shape(shape: tuple) -> tuple:
    return (shape[0], *shape[2:], shape[1])


def _without_bias(conv: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``conv`` (called as ``(x, w, b, residual)``) called as ``(x, w, residual)``."""
    def call(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return conv(x, w, None, residual)
    return call


def _epilogue_chain(body: Graph, anchor: Node) -> list[Node]:
    """The nodes after ``anchor`` in ``body`` that each read the previous one's result as
    their first operand, as its only reader, while that result is no body output."""
    readers: dict[Value, list[Node]] = {}
    for n in body.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    chain: list[Node] = []
    current = anchor
    while True:
        out = current.outputs[0]
        users = readers.get(out, [])
        if out in body.outputs or len(users) != 1 or users[0].inputs[0] is not out or out in users[0].inputs[1:]:
            return chain
        current = users[0]
        chain.append(current)


def build_graph_plan(graph: Graph, choose: Callable[[Node], Choice], *, gemm: GemmChooser | None = None,
                     backend: Backend | None = None) -> GraphPlan:
    """The cpu backend's partition of ``graph`` (:meth:`Partitioner.run`); ``choose`` picks
    each node's implementation; ``gemm(spec, packable)`` (which sets a GEMM's BLAS provider
    and weight packing) allows native GEMM kernels."""
    return CpuPartitioner(graph, backend or get_backend("cpu"), gemm).run(choose)


__all__ = ["CpuPartitioner", "GemmChooser", "build_graph_plan"]
