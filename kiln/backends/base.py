"""The backend protocol and registry.

A backend turns a graph into an *executable*::

    exe = get_backend("reference").build(graph, {"float64": False})
    outputs = exe([*user_inputs, *params])      # torch tensors in, torch tensors out

The executable receives the graph's user inputs then its parameters, in graph order, as
torch tensors, and returns one torch tensor per graph output, with the graph's declared
shapes and dtypes.  It does not check its inputs: :class:`kiln.runtime.CompiledModule` does
that before calling it.

Backends register a zero-argument factory under a name, so a backend's heavy imports
(a C compiler driver, Triton) happen only when it is first asked for::

    register_backend("cpu", lambda: CpuBackend())

Each backend declares its options with their defaults in ``option_defaults``; unknown
options are rejected with the list of known ones.

:meth:`Backend.supports` says whether a backend can run a node; a graph holding a node it
cannot run is refused at build time with :func:`unsupported_node`'s error, which names the
op, its operand types and how to go on.  Backends that generate code build on the
device-neutral core in :mod:`kiln.backends.common` (``docs/backends.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from kiln.ir import Graph, KilnError, Node
from kiln.runtime.tensors import from_numpy, to_numpy

DEFAULT_BACKEND = "cpu"
"""The backend :func:`kiln.compile` and ``torch.compile(backend="kiln")`` use by default: the
native cpu backend (:mod:`kiln.backends.cpu`); ``"reference"`` stays available."""


class BackendError(KilnError):
    """An unknown backend or option, or a graph a backend cannot build."""


class Executable(Protocol):
    """What :meth:`Backend.build` returns.  An executable may also take ``out`` (output
    position -> tensor) and write those outputs into the caller's tensors
    (:class:`kiln.backends.common.build.CompiledExecutable`); callers check the signature."""

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


class Backend:
    """Base class of backends: a ``name``, declared options, :meth:`supports` and :meth:`build`."""

    name: ClassVar[str] = ""
    option_defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, **defaults: Any):
        """``defaults`` replace option defaults for this instance: ``CudaBackend(emulate=True)``
        is a backend object that emulates unless told otherwise, for APIs that take a backend
        rather than options (``kiln.zoo.run.run_entry``, the benchmark harness)."""
        if defaults:
            self.option_defaults = self.resolve_options(defaults)

    def build(self, graph: Graph, options: Mapping[str, Any] | None = None) -> Executable:
        """Compile ``graph``; the result runs it on torch tensors (see the module docstring)."""
        raise NotImplementedError

    def supports(self, node: Node) -> bool:
        """Whether this backend can run ``node`` (on its device, or on the host when the
        backend runs such nodes there itself)."""
        raise NotImplementedError

    def resolve_options(self, options: Mapping[str, Any] | None) -> dict[str, Any]:
        """``option_defaults`` updated with ``options``; unknown names raise BackendError."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.option_defaults))
        if unknown:
            known = ", ".join(f"{k}={v!r}" for k, v in self.option_defaults.items()) or "none"
            raise BackendError(
                f"kiln backend '{self.name}' has no option(s) {', '.join(unknown)}; its options "
                f"(with defaults) are: {known}"
            )
        return {**self.option_defaults, **options}

    def __repr__(self) -> str:
        return f"<kiln backend '{self.name}'>"


def unsupported_node(backend: str, node: Node) -> BackendError:
    """The error for a node that backend ``backend`` cannot run: the node, its op and operand
    types, and how to go on."""
    outputs = ", ".join(f"%{v.name}" for v in node.outputs)
    types = ", ".join(str(v.type) for v in node.inputs)
    others = ", ".join(name for name in available_backends() if name != backend) or "none"
    return BackendError(
        f"kiln backend '{backend}' cannot run {outputs} = {node.op_name}({types}): it has no "
        f"implementation of op '{node.op_name}'; build with a backend that runs it (others: {others}), "
        f"give the op a compute definition or a reference implementation, or add it to the "
        f"backend's library table")


BackendFactory = Callable[[], Backend]
_FACTORIES: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register ``factory`` (called with no arguments) as the backend ``name``."""
    if not name or not callable(factory):
        raise ValueError("register_backend needs a non-empty name and a callable factory")
    if name in _FACTORIES and _FACTORIES[name] is not factory:
        raise BackendError(f"kiln backend '{name}' is already registered")
    _FACTORIES[name] = factory


def get_backend(name: str | Backend) -> Backend:
    """The backend registered as ``name`` (a :class:`Backend` instance passes through)."""
    if isinstance(name, Backend):
        return name
    try:
        factory = _FACTORIES[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(_FACTORIES)) or "none"
        raise BackendError(f"unknown kiln backend {name!r}; known backends: {known}") from None
    return factory()


def available_backends() -> list[str]:
    """Names of the registered backends, sorted."""
    return sorted(_FACTORIES)


# --------------------------------------------------------------------------- reference


class ReferenceBackend(Backend):
    """Runs the graph op by op with each op's numpy reference implementation (CPU only).

    Option ``float64``: compute every floating-point op in float64 and round each output
    to its declared dtype once at the end (a high-precision oracle for tests).
    """

    name: ClassVar[str] = "reference"
    option_defaults: ClassVar[Mapping[str, Any]] = {"float64": False}

    def supports(self, node: Node) -> bool:
        """Every op with a reference implementation."""
        return node.op.reference is not None

    def build(self, graph: Graph, options: Mapping[str, Any] | None = None) -> Executable:
        opts = self.resolve_options(options)
        for node in graph.nodes:
            if not self.supports(node):
                raise unsupported_node(self.name, node)
        return ReferenceExecutable(graph, float64=bool(opts["float64"]))


class ReferenceExecutable:
    """A graph bound to :func:`kiln.backends.reference.run_graph`.  A graph with symbolic
    shapes binds its sizes from the arguments at every call (checked against
    ``graph.sizes``: a size out of range raises :class:`kiln.ir.sizes.SizeError`)."""

    def __init__(self, graph: Graph, *, float64: bool = False):
        from kiln.backends.reference import run_graph  # noqa: PLC0415 (kept out of import time)

        self.graph = graph
        self.float64 = float64
        self._run_graph = run_graph
        self._num_inputs = len(graph.inputs)
        self._num_args = len(graph.inputs) + len(graph.params)
        self._output_dtypes = [v.dtype.numpy for v in graph.outputs]

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(args) != self._num_args:
            raise BackendError(
                f"graph @{self.graph.name} takes {self._num_inputs} inputs and "
                f"{self._num_args - self._num_inputs} params, got {len(args)} tensors"
            )
        arrays = [to_numpy(t) for t in args]
        results = self._run_graph(self.graph, arrays[: self._num_inputs], arrays[self._num_inputs:],
                                  float64=self.float64)
        return [from_numpy(_as_dtype(r, dt)) for r, dt in zip(results, self._output_dtypes)]


def _as_dtype(result: Any, dtype: np.dtype) -> np.ndarray:
    arr = np.asarray(result)
    return arr if arr.dtype == dtype else arr.astype(dtype)


register_backend(ReferenceBackend.name, ReferenceBackend)
