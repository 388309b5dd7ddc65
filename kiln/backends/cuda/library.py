"""Library calls and implementation choices of the cuda backend.

:data:`LIBRARY` (keyed by op name) holds the ops this backend can run as torch calls on the
device -- cuBLAS GEMMs (``matmul``), cuDNN convolutions (``conv``, ``conv_transpose``),
``scaled_dot_product_attention``, ``embedding``, ``index_put``, ``scatter_add``: the cpu
backend's device-neutral calls, with convolutions through ``torch.nn.functional`` (the cpu
backend's oneDNN weight packing is host-only).

:data:`SELECTION` is the rule over it (:class:`CudaSelection`): a generated kernel wherever
one can be generated, the library for convolutions (``conv`` nodes and fused groups of
template ``conv``: cuDNN plus a generated epilogue), the library for ops without a compute
definition, and the op's numpy reference on the host for the rest.  ``select="time"``
times the library and the generated kernel of a node on the device
(:class:`kiln.backends.common.select.TimedSelector`).

:func:`host_reference_call` runs a node's reference on the host for tensors of any device
(copied to the host and back), and :func:`kernel_fallback` is the step of a graph kernel
whose GPU kernels could not be generated: that reference, written into the planned outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kiln.backends.common.library import LibraryCall
from kiln.backends.common.partition import Partitioner, PlanOp
from kiln.backends.common.select import Choice, Selection
from kiln.backends.cpu import library as cpu_library
from kiln.backends.base import Backend
from kiln.ir import Graph, Node
from kiln.runtime.call_plan import TorchStep

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _conv(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    a = node.attrs
    conv = _CONV.get(len(a["stride"]))
    if conv is None:
        raise KeyError(f"no library convolution for {len(a['stride'])} spatial dims")
    stride, padding, dilation, groups = tuple(a["stride"]), tuple(a["padding"]), tuple(a["dilation"]), a["groups"]

    def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return conv(x, w, b, stride, padding, dilation, groups)
    return LibraryCall(convolution, False, f"torch.nn.functional.conv{len(stride)}d")


LIBRARY: dict[str, Callable[[Node, Sequence[bool]], LibraryCall]] = {
    **{name: cpu_library.LIBRARY[name] for name in ("matmul", "conv_transpose", "scaled_dot_product_attention",
                                                     "embedding", "index_put", "scatter_add")},
    "conv": _conv,
}
"""Op name -> builder of its library call (module docstring)."""


def has_library(node: Node) -> bool:
    """Whether :data:`LIBRARY` has a call for ``node`` (the cpu table's conditions)."""
    return cpu_library.library_name(node) is not None and node.op_name in LIBRARY


def library_call(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    if not has_library(node):
        raise KeyError(f"op '{node.op_name}' has no library implementation in the cuda backend")
    return LIBRARY[node.op_name](node, persistent)


def is_convolution(node: Node) -> bool:
    """A convolution node, or a fused group anchored on one."""
    if node.op_name == "fused":
        return node.attrs.get("template") == "conv"
    return node.op.has("conv")


class CudaSelection(Selection):
    """The cuda backend's rule (module docstring): generated first, except convolutions."""

    def rule(self, node: Node) -> Choice:
        impls = self.available(node)
        if "generated" in impls and not is_convolution(node):
            return Choice("generated", "generated GPU kernel")
        return super().rule(node)


SELECTION = CudaSelection(has_library, host_reference=True)
"""The cuda backend's implementations: generated kernels, its library table, and the numpy
reference on the host for nodes with neither."""


# ------------------------------------------------------------------------------ the host
def host_reference_call(node: Node, device: torch.device | str = "cpu") -> LibraryCall:
    """``node``'s numpy reference for tensors on ``device``: operands are copied to the host,
    results back to ``device``."""
    run = cpu_library.reference_call(node).function
    device = torch.device(device)

    def on_host(*tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        results = run(*(t.cpu() for t in tensors))
        if device.type == "cpu":
            return results
        if isinstance(results, tuple):
            return tuple(r.to(device) for r in results)
        return results.to(device)
    return LibraryCall(on_host, False, f"reference on the host:{node.op_name}")


class CudaPartitioner(Partitioner):
    """The common partition with this backend's library table and host references whose
    results go to ``device`` (where the plan's tensors live)."""

    def __init__(self, graph: Graph, backend: Backend, device: torch.device | str = "cpu"):
        super().__init__(graph, backend)
        self.device = torch.device(device)

    def library_call(self, node: Node, persistent: list[bool]) -> LibraryCall:
        return library_call(node, persistent)

    def host_call(self, node: Node) -> LibraryCall:
        return host_reference_call(node, self.device)


def kernel_fallback(op: PlanOp) -> TorchStep:
    """The step of graph kernel ``op`` whose GPU kernels could not be generated: its node's
    reference on the host, written into the planned outputs.  Inputs that are views (kernels
    read them through their root) are rebuilt from their roots with ``as_strided``."""
    assert op.node is not None and op.gemm is None
    ins = [pv.root().slot for pv in op.inputs]
    views = [(tuple(pv.meta.shape), pv.meta.stride(), pv.meta.storage_offset()) if pv.base is not None else None
             for pv in op.inputs]
    outs = [pv.slot for pv in op.outputs]
    run = cpu_library.reference_call(op.node).function  # results are copied into the outputs
    n_in = len(ins)

    def fallback(*tensors: torch.Tensor) -> None:
        args = [t if v is None else torch.as_strided(t, v[0], v[1], t.storage_offset() + v[2])
                for t, v in zip(tensors[:n_in], views)]
        results = run(*(a.cpu() for a in args))
        results = results if isinstance(results, tuple) else (results,)
        for out, r in zip(tensors[n_in:], results):
            out.copy_(r)
    return TorchStep(fallback, tuple(ins), tuple(outs), True, op.label)


__all__ = ["LIBRARY", "SELECTION", "CudaPartitioner", "CudaSelection", "has_library", "host_reference_call",
           "is_convolution", "kernel_fallback", "library_call"]
