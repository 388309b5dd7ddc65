"""kiln's convolutions as foreign kernels of the cpu backend's native runs, their epilogues
applied in the kernels' tile stores.

A 2-d float32 convolution that runs on one of kiln's kernels (:mod:`.conv`) of a graph with
static shapes is not a torch call: the partition plans it as a ``foreign`` operation, the
C entry ``kiln_conv_k`` launched by the same native call as the generated kernels around it
(:class:`kiln.runtime.call_plan.ForeignKernel`), on

* its sizes and strides, a constant ``int64`` array computed once the layouts are settled
  (:func:`finish`);
* the input, read in place through its predicted strides (a depthwise kernel needs it
  channels-last: any other layout is copied into a channels-last buffer first);
* the packed weight and the bias, persistent tensors of the workspace written by a ``pack``
  (:class:`kiln.runtime.call_plan.PrepareStep`) only when a parameter changed -- with the
  inference batch norm that follows folded into both (:func:`~.packed_conv.fold_batch_norm`);
* the residual, when a residual add follows (a channels-last tensor of the result's shape);
* the result, an arena buffer written channels-last (NHWC), whose NCHW value is a view.

:func:`conv_epilogue` finds what the kernels apply to each output element before storing
it, ``act(acc + bias + residual)``: a residual ``add`` of a tensor of the result's type, then
``relu``, ``relu6`` (``clamp(0, 6)``) or ``hardswish`` (as it is decomposed:
``y * clamp(y + 3, 0, 6) / 6``).  The rest of a fused group's epilogue stays a generated
kernel.  :class:`KilnConvCall` computes the same thing with torch tensors: it is the call
where a convolution stays a library call (symbolic shapes, ``nchw_convs``).
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.backends.common.library import LibraryCall
from kiln.backends.common.partition import PlanOp, PlanValue
from kiln.ir import Graph, Node, Value
from kiln.ir.types import DType, TensorType
from kiln.runtime.call_plan import ForeignKernel

from . import conv as kernels
from .conv import KilnConv2d
from .packed_conv import fold_batch_norm, version_key


class KilnConvCall:
    """A kiln convolution with what it absorbed, called as
    ``(x, w, [b], [gamma, beta, mean, var], [residual])``: ``has_bias``, ``eps`` (a folded
    inference batch norm; ``None`` for none) and ``residual`` say which operands are there;
    the activation is ``conv``'s."""

    def __init__(self, conv: KilnConv2d, w_shape: tuple[int, ...], has_bias: bool, eps: float | None = None,
                 residual: bool = False):
        self.conv = conv
        self.w_shape = tuple(w_shape)
        self.has_bias = has_bias
        self.eps = None if eps is None else float(eps)
        self.residual = residual
        self._folded: tuple | None = None
        """``(key, sources, weight, bias)`` of the last fold (:meth:`weights`)."""

    def operands(self, ins: list) -> tuple:
        """``(x, w, b, stats, residual)`` of the call's operands (``None``/``[]`` where absent)."""
        x, w, rest = ins[0], ins[1], list(ins[2:])
        b = rest.pop(0) if self.has_bias else None
        stats = [rest.pop(0) for _ in range(4)] if self.eps is not None else []
        r = rest.pop(0) if self.residual else None
        return x, w, b, stats, r

    def weights(self, w: torch.Tensor, b: torch.Tensor | None, stats: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias the kernel computes with: ``w`` and ``b``, or with the batch
        norm of ``stats`` folded in -- folded again only when one of them changed, so that the
        kernel's packed copy of the folded weight is kept too."""
        if self.eps is None:
            return w, b
        sources = [w, b, *stats]
        key = version_key(sources)
        folded = self._folded
        if folded is not None and key is not None and folded[0] == key:
            return folded[2], folded[3]
        weight, bias = self._fold(w, b, stats)
        self._folded = (key, sources, weight, bias)  # the sources kept: see version_key
        return weight, bias

    def _fold(self, w: torch.Tensor, b: torch.Tensor | None, stats: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float32 weight and bias with the batch norm (when there is one) folded in, now."""
        with torch.no_grad():
            w, b = w.detach().float(), None if b is None else b.detach().float()
            if self.eps is None:
                return w, b
            return fold_batch_norm(w, b, *[t.detach() for t in stats], self.eps)

    def __call__(self, *ins: torch.Tensor) -> torch.Tensor:
        x, w, b, stats, r = self.operands(list(ins))
        weight, bias = self.weights(w, b, stats)
        return self.conv(x, weight, bias, residual=r)

    def prepare(self, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Write the packed weight (``targets[0]``) and the bias (``targets[1]``, when there
        is one) of the weight operands ``sources`` (``w, [b], [gamma, beta, mean, var]``)."""
        _, w, b, stats, _ = self.operands([None, *sources, *([None] if self.residual else [])])
        weight, bias = self._fold(w, b, stats)
        with torch.no_grad():
            self.conv.pack_weight_into(weight, targets[0])
            if bias is not None:
                targets[1].copy_(bias)

    @property
    def bias(self) -> bool:
        """Whether the kernel adds a bias (the convolution's, or a folded batch norm's)."""
        return self.has_bias or self.eps is not None


# ------------------------------------------------------------------------------ epilogues
def _readers(body: Graph) -> dict[Value, list[Node]]:
    readers: dict[Value, list[Node]] = {}
    for n in body.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    return readers


def _constant(body: Graph, v: Value, value: float) -> bool:
    """Whether ``v`` is a constant of ``body`` holding ``value`` everywhere."""
    for c in body.constants:
        if c is v:
            return bool(np.all(np.asarray(c.data) == value))
    return False


def _clamps(node: Node) -> tuple[float | None, float | None]:
    a = node.attrs
    return a.get("min"), a.get("max")


def conv_epilogue(body: Graph, start: Node) -> tuple[list[Node], str, Value | None]:
    """The nodes after ``start`` (the convolution, or the batch norm folded into it) that
    kiln's kernels apply in their tile store (module docstring), the activation's name and
    the residual operand (a body input), in the order they are computed.  Each absorbed
    intermediate result is read only by absorbed nodes and is no body output."""
    readers = _readers(body)
    taken: list[Node] = []
    current = start.outputs[0]
    residual: Value | None = None
    users = readers.get(current, [])
    if len(users) == 1 and users[0].op_name == "add" and current not in body.outputs:
        add = users[0]
        other = add.inputs[1] if add.inputs[0] is current else add.inputs[0]
        if other is not current and other in body.inputs and other.type == current.type:
            residual, current = other, add.outputs[0]
            taken.append(add)
    act, nodes = _activation(body, readers, current)
    if act != "none" and current not in body.outputs:
        taken += nodes
    else:
        act = "none"
    return taken, act, residual


def _activation(body: Graph, readers: dict[Value, list[Node]], y: Value) -> tuple[str, list[Node]]:
    """The activation applied to ``y`` by the nodes that read it, or ``("none", [])``."""
    users = readers.get(y, [])
    if len(users) == 1:
        n = users[0]
        if n.op_name == "relu":
            return "relu", [n]
        if n.op_name == "clamp" and _clamps(n) == (0.0, 6.0):
            return "relu6", [n]
    # hardswish: t = y + 3; t = clamp(t, 0, 6) (one clamp or two); t = y * t; t / 6
    if len(users) != 2:
        return "none", []
    add = next((n for n in users if n.op_name == "add"), None)
    mul = next((n for n in users if n.op_name == "mul"), None)
    if add is None or mul is None or add.inputs[0] is not y or not _constant(body, add.inputs[1], 3.0):
        return "none", []
    chain, t = [add], add.outputs[0]
    bounds = [None, None]
    while len(readers.get(t, [])) == 1 and readers[t][0].op_name == "clamp" and t not in body.outputs:
        clamp = readers[t][0]
        low, high = _clamps(clamp)
        bounds = [low if low is not None else bounds[0], high if high is not None else bounds[1]]
        chain.append(clamp)
        t = clamp.outputs[0]
    if bounds != [0.0, 6.0] or t in body.outputs or readers.get(t) != [mul] or set(mul.inputs) != {y, t}:
        return "none", []
    chain.append(mul)
    divs = readers.get(mul.outputs[0], [])
    if (len(divs) != 1 or divs[0].op_name != "div" or divs[0].inputs[0] is not mul.outputs[0]
            or not _constant(body, divs[0].inputs[1], 6.0) or mul.outputs[0] in body.outputs):
        return "none", []
    return "hardswish", [*chain, divs[0]]


def with_activation(conv: KilnConv2d, act: str) -> KilnConv2d:
    """``conv`` with activation ``act`` applied in its tile store."""
    return KilnConv2d(conv.kind, conv.stride, conv.padding, conv.dilation, conv.groups, act=act)


# ------------------------------------------------------------------------------ the plan
def plan_foreign(part, call: LibraryCall, ins: list[PlanValue], out: Value, label: str) -> PlanValue | None:
    """Plan ``call`` (a library call with a :class:`KilnConvCall` as ``native``) on the
    operands ``ins`` as a ``foreign`` operation of the cpu partition ``part`` (module
    docstring); the NCHW result value, or ``None`` where it cannot be (its weights are not
    parameters, no compiler)."""
    kcall: KilnConvCall = call.native
    address = kernels.conv_entry()
    x, w, b, stats, r = kcall.operands(ins)
    weights = [w, *([b] if b is not None else []), *stats]
    if address is None or any(pv.origin != "arg" or pv.slot not in part.param_slots for pv in weights):
        return None
    shape = tuple(out.type.shape)
    nhwc = (shape[0], *shape[2:], shape[1])
    f32 = DType.float32
    packed = part.new(TensorType(kcall.conv.packed_weight_shape(tuple(w.type.shape)), f32), w.name + ".conv_packed",
                      "packed")
    targets = [packed]
    if kcall.bias:
        targets.append(part.new(TensorType((shape[1],), f32), out.name + ".bias", "packed"))
    part.ops.append(PlanOp("pack", weights, targets, f"kiln convolution weights of %{out.name}",
                           call=LibraryCall(kcall.prepare, True, "pack")))
    n, c, h, wd = x.type.shape
    size = len(_geometry(kcall, x.type.shape, (h * wd * c, 1, wd * c, c), r is not None, 1))  # before layouts settle
    geometry = part.new(TensorType((size,), DType.int64), out.name + ".geometry", "const",
                        const=torch.zeros(size, dtype=torch.int64))
    physical = part.new(out.type.with_shape(nhwc), out.name + ".nhwc", "buffer")
    inputs = [geometry, x, packed, targets[-1] if kcall.bias else x, x if r is None else r]
    part.ops.append(PlanOp("foreign", inputs, [physical], f"{label} [{call.label}, native]", call=call,
                           foreign=ForeignKernel(address, "kiln_conv_k")))
    logical = part.new(out.type, out.name, "view", base=physical)
    part.ops.append(part._nchw_view(physical, logical))
    part.of[out] = logical
    return logical


def _geometry(kcall: KilnConvCall, shape: tuple, strides: tuple, residual: bool, threads: int) -> list[int]:
    """The size array of ``kiln_conv_k`` for an input of ``shape`` and element ``strides``."""
    return kcall.conv.native_geometry(tuple(shape), tuple(strides), kcall.w_shape, kcall.bias, residual, threads)


def _channels_last(meta: torch.Tensor) -> bool:
    return meta.permute(0, 2, 3, 1).is_contiguous()


def finish(part, threads: int) -> None:
    """Once layouts are settled: each foreign convolution's size array from its input's
    predicted strides; an input a depthwise kernel cannot read, or a residual that is not
    channels-last, is copied into a channels-last buffer first."""
    ops: list[PlanOp] = []
    for op in part.ops:
        if op.step == "foreign" and isinstance(op.call.native, KilnConvCall):
            kcall: KilnConvCall = op.call.native
            geometry, x, _, _, r = op.inputs
            if kcall.conv.kind == "depthwise" and x.type.shape[1] > 1 and x.meta.stride(1) != 1:
                op.inputs[1] = x = _relayout(part, ops, x)
            if kcall.residual and not _channels_last(r.meta):
                op.inputs[4] = r = _relayout(part, ops, r)
            sizes = _geometry(kcall, x.type.shape, x.meta.stride(), kcall.residual, threads)
            geometry.const = torch.tensor(sizes, dtype=torch.int64)
        ops.append(op)
    part.ops = ops


def _relayout(part, ops: list[PlanOp], value: PlanValue) -> PlanValue:
    """A channels-last copy of the 4-d ``value`` (the NCHW view of a new buffer, written by a
    library call before the current operation)."""
    shape = tuple(value.type.shape)
    physical = part.new(value.type.with_shape((shape[0], *shape[2:], shape[1])), value.name + ".nhwc_copy", "buffer")
    ops.append(PlanOp("library", [value], [physical], f"channels-last copy of %{value.name}",
                      call=LibraryCall(_to_channels_last, True, "channels-last copy")))
    logical = part.new(value.type, value.name + ".cl", "view", base=physical)
    ops.append(part._nchw_view(physical, logical))
    return logical


def _to_channels_last(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src.permute(0, 2, 3, 1))


__all__ = ["KilnConvCall", "conv_epilogue", "finish", "plan_foreign", "with_activation"]
