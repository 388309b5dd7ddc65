"""What the triton backend can run a node with: candidates, their rule, their timing.

Per node the *candidates* (:data:`CANDIDATES`, in rule order) are

* ``"triton"`` -- a generated Triton kernel (every fused group and every op with a compute
  definition);
* ``"library"`` -- a PyTorch call on device tensors (:data:`TORCH_LIBRARY`: GEMMs through
  cuBLAS, convolutions through cuDNN, attention, gathers and scatters); for a fused
  ``matmul``/``conv`` group, the library anchor followed by a generated Triton kernel for
  the epilogue;
* ``"cuda"`` -- task-mapped CUDA C from :mod:`kiln.backends.cuda`, offered only when that
  package is importable: through its ``supports(node)`` and ``library_call(node,
  persistent)`` when it has them, else through its registered ``"cuda"`` backend, which
  compiles the node alone (``select="generated"``; emulated on the host without a GPU) into
  an executable the plan calls like a library function (:func:`backend_candidate`).

Adding an implementation is one :class:`Candidate` in :data:`CANDIDATES`: its name, a test
of whether it runs a node, and how the partition plans it.

:class:`TritonSelection` is the backend's :class:`kiln.backends.common.select.Selection`:
views are zero-copy views, operand-free creations fold at build time, and every other node
gets the first available candidate in rule order -- except ops whose PyTorch kernel a
generated loop nest does not approach (:data:`LIBRARY_FIRST`: convolutions, whose direct
loops lose to cuDNN, and scatters, whose loops would run serially), which prefer
``"library"``.  A node none of them runs and whose op has a numpy reference runs it on the
host (``"reference"``: operands copied to the host and results back).  ``select="time"``
builds each available candidate of a node once on random inputs, keeps the fastest and
remembers it per node signature and device in ``triton_selection.json`` of the cache
folder (:class:`kiln.backends.common.select.TimedSelector`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.backends.base import available_backends, get_backend
from kiln.backends.common.build import probe_graph
from kiln.backends.common.library import LibraryCall
from kiln.backends.common.select import Choice, Selection, anchor_of
from kiln.backends.cpu.library import LIBRARY as CPU_LIBRARY
from kiln.backends.cpu.library import library_name as cpu_library_name
from kiln.backends.cpu.library import reference_call
from kiln.ir import Node

LIBRARY_FIRST = frozenset({"conv", "conv_transpose", "index_put", "scatter_add"})
"""Ops whose library call the rule prefers to a generated kernel (module docstring)."""

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _conv(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    a = node.attrs
    conv = _CONV[len(a["stride"])]
    stride, padding, dilation, groups = tuple(a["stride"]), tuple(a["padding"]), tuple(a["dilation"]), a["groups"]

    def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return conv(x, w, b, stride, padding, dilation, groups)
    return LibraryCall(convolution, False, f"torch.nn.functional.conv{len(stride)}d")


TORCH_LIBRARY: dict[str, Callable[[Node, Sequence[bool]], LibraryCall]] = {
    **{name: build for name, build in CPU_LIBRARY.items() if name != "conv"},
    "conv": _conv,
}
"""Op name -> builder of its PyTorch call, on any device: the cpu backend's ATen calls, with
convolutions through ``torch.nn.functional`` (no host-only prepacked weights)."""


def has_torch_call(node: Node) -> bool:
    return cpu_library_name(node) is not None


def torch_call(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
    """The PyTorch call of ``node`` (:data:`TORCH_LIBRARY`)."""
    name = cpu_library_name(node)
    if name is None:
        raise KeyError(f"op '{node.op_name}' has no PyTorch call in the triton backend's table")
    return TORCH_LIBRARY[name](node, persistent)


def host_reference_call(node: Node) -> LibraryCall:
    """``node``'s numpy reference on the host: operands copied there, results copied back
    to the operands' device (the first operand's; the host for nodes without operands)."""
    run = reference_call(node).function

    def on_host(*tensors: torch.Tensor):
        device = tensors[0].device if tensors else torch.device("cpu")
        results = run(*(t.cpu() for t in tensors))
        if isinstance(results, tuple):
            return tuple(r.to(device) for r in results)
        return results.to(device)
    return LibraryCall(on_host, False, f"reference:{node.op_name} (host)")


# ------------------------------------------------------------------------------ candidates
@dataclass(frozen=True)
class Candidate:
    """One implementation of nodes: ``runs(node)`` says whether it can, ``call(node,
    persistent)`` makes its library call (``None`` for ``"triton"`` and ``"library"``,
    which the partition plans as Triton kernels and PyTorch calls itself)."""

    name: str
    runs: Callable[[Node], bool]
    call: Callable[[Node, Sequence[bool]], LibraryCall] | None = None


def _triton_runs(node: Node) -> bool:
    return node.op_name == "fused" or node.op.compute is not None


def _library_runs(node: Node) -> bool:
    if node.op_name == "fused":
        anchor = anchor_of(node.attrs["body"]) if node.attrs["template"] in ("matmul", "conv") else None
        return anchor is not None and has_torch_call(anchor)
    return has_torch_call(node)


def backend_candidate(name: str) -> Candidate:
    """The registered backend ``name`` as a candidate: it runs the nodes with a generated
    kernel that it supports, each compiled alone (a probe graph of the node, built with
    ``select="generated"``, emulated on the host when the backend can and no GPU exists)
    into an executable that the plan calls as a library function."""
    def runs(node: Node) -> bool:
        if node.op_name != "fused" and node.op.compute is None:
            return False
        try:
            return bool(get_backend(name).supports(node))
        except Exception:  # noqa: BLE001 - a backend that cannot say runs nothing
            return False

    def call(node: Node, persistent: Sequence[bool] = ()) -> LibraryCall:
        backend = get_backend(name)
        probe, _ = probe_graph(node)
        options: dict = {"select": "generated"}
        if "emulate" in backend.option_defaults and not torch.cuda.is_available():
            options["emulate"] = True
        exe = backend.build(probe, options)
        single = len(node.outputs) == 1

        def run(*tensors: torch.Tensor):
            outs = exe(list(tensors))
            return outs[0] if single else tuple(outs)
        return LibraryCall(run, False, f"kiln backend '{name}', node compiled alone")
    return Candidate(name, runs, call)


def _cuda_candidate() -> Candidate | None:
    """The ``"cuda"`` candidate when :mod:`kiln.backends.cuda` is importable (module docstring)."""
    if importlib.util.find_spec("kiln.backends.cuda") is None:
        return None
    try:
        cuda = importlib.import_module("kiln.backends.cuda")
    except ImportError:
        return None
    supports, call = getattr(cuda, "supports", None), getattr(cuda, "library_call", None)
    if callable(supports) and callable(call):
        return Candidate("cuda", supports, call)
    if "cuda" in available_backends():
        return backend_candidate("cuda")
    return None


CANDIDATES: list[Candidate] = [c for c in (Candidate("triton", _triton_runs),
                                           Candidate("library", _library_runs, torch_call),
                                           _cuda_candidate()) if c is not None]
"""The implementations of the triton backend, in rule order (module docstring)."""

IMPLEMENTATIONS = ("view", "fold", *(c.name for c in CANDIDATES), "reference")
_REASONS = {"view": "zero-copy view", "fold": "constant at build time", "triton": "generated Triton kernel",
            "library": "PyTorch library call", "cuda": "task-mapped CUDA kernel",
            "reference": "no device implementation: numpy reference on the host"}


class TritonSelection(Selection):
    """The triton backend's implementations of a node (module docstring)."""

    def __init__(self, candidates: Sequence[Candidate] = ()):
        super().__init__(has_torch_call, host_reference=True)
        self.candidates = list(candidates or CANDIDATES)

    def candidate(self, name: str) -> Candidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(f"the triton backend has no implementation {name!r}; it has "
                       f"{', '.join(c.name for c in self.candidates)}")

    def available(self, node: Node) -> tuple[str, ...]:
        if node.op.has("view") and node.op_name in self.views:
            return ("view",)
        if node.op.has("creation") and not node.inputs:
            return ("fold",)
        names = [c.name for c in self.candidates if c.runs(node)]
        op = node.op_name if node.op_name != "fused" else (getattr(anchor_of(node.attrs["body"]), "op_name", ""))
        if op in LIBRARY_FIRST and "library" in names:
            names.remove("library")
            names.insert(0, "library")
        if node.op.reference is not None:
            names.append("reference")
        return tuple(names)

    def rule(self, node: Node) -> Choice:
        impls = self.available(node)
        if not impls:
            raise ValueError(f"no implementation of op '{node.op_name}' in the triton backend")
        return Choice(impls[0], _REASONS.get(impls[0], impls[0]))

    def generated(self, node: Node) -> Choice:
        if "triton" in self.available(node):
            return Choice("triton", "generated kernels requested")
        return self.rule(node)

    def timed_candidates(self, node: Node) -> list[str]:
        names = {c.name for c in self.candidates}
        return [i for i in self.available(node) if i in names]


__all__ = ["CANDIDATES", "IMPLEMENTATIONS", "LIBRARY_FIRST", "TORCH_LIBRARY", "Candidate",
           "TritonSelection", "backend_candidate", "has_torch_call", "host_reference_call", "torch_call"]
