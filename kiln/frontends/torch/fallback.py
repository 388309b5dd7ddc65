"""Per-op fallback: run what kiln supports in kiln and the rest of an ATen graph in PyTorch.

:func:`compile_fx` takes an ATen-level FX ``GraphModule`` whose placeholders are tensors
(user inputs and, at ``param_indices``, parameters/buffers) and returns a
:class:`CompiledFx`, called exactly like the graph module and returning the same output
structure.

Guarantees:

* When every node is supported, the whole graph is captured into one kiln graph.
* Otherwise the supported nodes are grouped into partitions by torch's
  ``CapabilityBasedPartitioner``, which never merges two partitions when that would create
  a cycle; each partition is captured and built by the backend, every other node runs in
  PyTorch.  Partitions made only of view ops stay in PyTorch (nothing to compute).
* A partition that capture still refuses (an argument combination, or a lowering bug
  reported as :class:`~kiln.frontends.errors.CaptureError`) runs in PyTorch as a whole.
* Exactly one :class:`KilnFallbackWarning` is issued per compiled graph that does not run
  entirely in kiln, naming each unsupported ATen op with its count and source lines.
  ``strict=True`` raises the first unsupported node's
  :class:`~kiln.frontends.errors.UnsupportedOpError` (or the ``CaptureError``) instead.
* Kiln graphs take part in autograd: in grad mode, with an input requiring grad, they run
  kiln's forward graph and, on ``.backward()``, kiln's backward graph
  (:class:`kiln.frontends.torch.autograd.DifferentiableGraph`); PyTorch nodes differentiate as usual.
* The given graph module is never modified.
"""

from __future__ import annotations

import operator
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from kiln.backends import DEFAULT_BACKEND, Backend, get_backend
from kiln.backends.base import BackendError
from kiln.frontends.errors import CaptureError, UnsupportedOpError
from kiln.ir import Graph, KilnError
from kiln.ir.sizes import SizeError, bind_sizes, format_sizes, is_dynamic, specialize
from kiln.passes.inline_custom_vjp import inline_custom_vjp
from kiln.passes.pipeline import GraphTransform
from kiln.runtime.module import RNG_SEED_PARAM, draw_seed

from . import aten_support
from . import capture as capture_mod
from .aten_support import describe_inputs, source_location, unsupported_reason
from .autograd import DifferentiableGraph
from .lowering import is_mutating

# Ops that only re-describe memory: a partition made of nothing else stays in PyTorch.
_VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.permute", "aten.t", "aten.transpose",
    "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.slice", "aten.select", "aten.alias",
    "aten.detach", "aten.view_copy", "aten.alias_copy", "aten.unflatten", "aten.flatten",
})


class KilnFallbackWarning(UserWarning):
    """Some ATen ops of a graph are not supported by kiln and run in PyTorch."""


@dataclass
class FallbackReport:
    """What ran where: unsupported op counts and source lines, other reasons (``notes``),
    partition and PyTorch node counts."""

    unsupported: Counter[str] = field(default_factory=Counter)
    sources: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    kiln_partitions: int = 0
    torch_nodes: int = 0

    def add(self, node: fx.Node) -> None:
        op = op_name(node)
        self.unsupported[op] += 1
        src = source_of(node)
        lines = self.sources.setdefault(op, [])
        if src and src not in lines:
            lines.append(src)

    def message(self, graph_name: str) -> str:
        total = sum(self.unsupported.values())
        what = f"{total} ATen node(s) of graph '{graph_name}' are not supported by kiln and" if total \
            else f"parts of graph '{graph_name}'"
        lines = [f"kiln: {what} run in PyTorch; {self.kiln_partitions} partition(s) run in kiln:"]
        for op, count in self.unsupported.most_common():
            where = self.sources.get(op) or ["<unknown source line>"]
            shown = "; ".join(where[:3]) + (f"; and {len(where) - 3} more" if len(where) > 3 else "")
            lines.append(f"  {op} x{count} at {shown}")
        lines.extend(f"  {note}" for note in self.notes)
        lines.append("  Pass strict=True to raise UnsupportedOpError instead.")
        return "\n".join(lines)


class CompiledFx:
    """An ATen graph module with its supported parts compiled by kiln (see module docstring).

    Attributes: ``graphs`` (the kiln graphs), ``report`` (:class:`FallbackReport`, ``None``
    when the whole graph runs in kiln), ``module`` (the graph module that runs, partitioned).
    """

    def __init__(self, run: Callable[..., Any], graphs: Sequence[Graph], report: FallbackReport | None,
                 module: fx.GraphModule | None = None):
        self._run = run
        self.graphs = list(graphs)
        self.report = report
        self.module = module

    def __call__(self, *args: Any) -> Any:
        return self._run(*args)

    @property
    def info(self) -> dict[str, Any]:
        """Counters for :attr:`kiln.runtime.CompiledModule.stats`."""
        if self.report is None:
            return {"fallback_ops": {}, "torch_nodes": 0}
        return {"fallback_ops": dict(self.report.unsupported), "torch_nodes": self.report.torch_nodes}


def op_name(node: fx.Node) -> str:
    """``aten.add.Tensor`` for an op overload, the qualified name for other callables."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return getattr(target, "__qualname__", None) or str(target)


_GETITEM = operator.getitem


def source_of(node: fx.Node) -> str | None:
    """``file.py:LINE in fn: code`` of the user's line that produced ``node``, if recorded."""
    return source_location(node)


def is_supported(node: fx.Node) -> bool:
    """Whether ``node`` is a call kiln lowers (a ``getitem`` when its producer is)."""
    return node.op == "call_function" and aten_support.is_supported(node)


def unsupported_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The call_function nodes of ``gm`` that kiln cannot lower, in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and not is_supported(n)]


class _KilnSupport(OperatorSupportBase):
    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: fx.Node) -> bool:
        return is_supported(node)


def compile_fx(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], *,
               param_indices: frozenset[int] = frozenset(), backend: str | Backend = DEFAULT_BACKEND,
               options: Mapping[str, Any] | None = None, strict: bool = False,
               transform: GraphTransform | None = None, name: str = "main") -> CompiledFx:
    """Compile ``gm`` with kiln where supported, PyTorch elsewhere (see module docstring)."""
    backend = get_backend(backend)
    gm = _copy(gm)
    writes, user_spec = _lift_input_writes(gm)
    if writes:
        inner = compile_fx(gm, example_inputs, param_indices=param_indices, backend=backend,
                           options=options, strict=strict, transform=transform, name=name)
        return CompiledFx(_InputWrites(inner, writes, user_spec), inner.graphs, inner.report,
                          inner.module)
    unsupported = unsupported_nodes(gm)
    _refuse_unsupported_writes(unsupported)
    if strict:
        # Capture is strict: it raises the first unsupported node's UnsupportedOpError.
        return _compile_whole(gm, example_inputs, param_indices, backend, options, transform, name)
    report = FallbackReport()
    for node in unsupported:
        if node.target is not _GETITEM:  # a getitem of an unsupported op is not news
            report.add(node)
    if not unsupported:
        try:
            return _compile_whole(gm, example_inputs, param_indices, backend, options, transform, name)
        except (UnsupportedOpError, CaptureError) as e:  # e.g. a non-tensor output: split instead
            report.notes.append(str(e).splitlines()[0])
    return _compile_partitioned(gm, example_inputs, param_indices, backend, options, transform, name,
                                report)


def _refuse_unsupported_writes(unsupported: Sequence[fx.Node]) -> None:
    """An in-place write kiln cannot lower cannot run in PyTorch either: the partitions around
    it hold copies, so the write would be lost.  Refuse it, also without ``strict``."""
    for node in unsupported:
        if is_mutating(node):
            raise UnsupportedOpError(
                op_name(node), describe_inputs(node), source_of(node),
                unsupported_reason(node) or "the op writes in place",
                hint="kiln compiles functional graphs (torch.compile functionalizes them for "
                "kiln); rewrite the in-place update functionally (torch.where, torch.cat, "
                "index_put, slice_scatter) or pass a functionalized graph.")


_COPY_ = torch.ops.aten.copy_.default


def _lift_input_writes(gm: fx.GraphModule) -> tuple[list[int], pytree.TreeSpec | None]:
    """Turn the final ``copy_(placeholder, value)`` nodes of a functionalized graph (buffer
    updates: batch norm's running statistics) into extra trailing outputs; returns the
    placeholder index each extra output is written into and the spec of the original
    outputs.  ``gm`` is edited (a copy)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {node: i for i, node in enumerate(placeholders)}
    copies = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _COPY_
              and n.args[0] in index and not n.users]
    if not copies:
        return [], None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves, spec = pytree.tree_flatten(output.args[0])
    written = [index[n.args[0]] for n in copies]
    values = [n.args[1] for n in copies]
    for node in copies:
        gm.graph.erase_node(node)
    gm.graph.erase_node(output)
    gm.graph.output(tuple(leaves) + tuple(values))
    gm.recompile()
    return written, spec


class _InputWrites:
    """Runs a compiled graph whose trailing outputs are new values of some inputs (buffers),
    copies them into those inputs in place (outside autograd) and returns the rest."""

    def __init__(self, inner: CompiledFx, writes: Sequence[int], spec: pytree.TreeSpec):
        self.inner = inner
        self.writes = list(writes)
        self.spec = spec

    def __call__(self, *args: Any) -> Any:
        flat = list(self.inner(*args))
        values = flat[len(flat) - len(self.writes):]
        with torch.no_grad():
            for i, value in zip(self.writes, values):
                args[i].copy_(value)
        return pytree.tree_unflatten(flat[: len(flat) - len(self.writes)], self.spec)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    copy.graph.eliminate_dead_code()
    copy.recompile()
    return copy


def _build(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor], param_indices: frozenset[int],
           backend: Backend, options: Mapping[str, Any] | None, transform: GraphTransform | None,
           name: str) -> tuple[Graph, Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]]:
    """Capture ``gm`` and build it; returns the graph and a runner over placeholder order."""
    captured = capture_mod.capture_fx(gm, list(example_inputs), param_indices=param_indices, name=name)
    # torch.autograd.Function nodes: the inference graph needs only their forward
    graph = inline_custom_vjp(captured.graph)
    graph = transform(graph) if transform is not None else graph
    # Differentiable: in grad mode with inputs requiring grad it runs kiln's forward/backward.
    executable = DifferentiableGraph(captured.graph, build_for_sizes(backend, graph, options),
                                     backend, dict(options or {}), transform)
    n = len(example_inputs)
    sizes = captured.size_inputs
    order = [i for i in range(n) if i not in param_indices and i not in sizes] \
        + sorted(i for i in param_indices if i < n)
    # params the lowering added (the random ops' seed) follow the placeholders' params
    extra = [captured.params[v.name] for v in captured.graph.params[len(order) - len(graph.inputs):]]
    seeds = [t for v, t in zip(captured.graph.params[len(order) - len(graph.inputs):], extra)
             if v.name == RNG_SEED_PARAM]
    if len(order) + len(extra) != len(graph.inputs) + len(graph.params):
        raise KilnError(
            f"kiln internal error: graph @{graph.name} has {len(graph.inputs)} inputs and "
            f"{len(graph.params)} params but the FX graph has {n} placeholders"
        )
    guard = SizeGuard(captured.graph, order, sizes) if is_dynamic(captured.graph) else None

    def run(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if guard is not None:
            guard.check(args)
        for seed in seeds:
            seed.fill_(draw_seed())
        return executable([*(args[i] for i in order), *extra])

    return graph, run


def build_for_sizes(backend: Backend, graph: Graph, options: Mapping[str, Any] | None) -> Any:
    """``backend.build(graph, options)``; for a symbolic graph the backend cannot build
    (:class:`~kiln.backends.BackendError`: it runs static shapes only), a
    :class:`SpecializingExecutable` that builds the static graph of each set of sizes it is
    called with, once (the graph is still captured and optimized once)."""
    try:
        return backend.build(graph, dict(options or {}))
    except BackendError:
        if not is_dynamic(graph):
            raise
        return SpecializingExecutable(graph, lambda g: backend.build(g, dict(options or {})))


class SpecializingExecutable:
    """Runs a symbolic graph on a backend that builds static graphs only: each call binds the
    sizes from its tensors' shapes (checked against the graph's ranges), and runs the static
    graph ``specialize(graph, sizes)``, built on first use and kept (``builds``)."""

    def __init__(self, graph: Graph, build: Callable[[Graph], Any]):
        self.graph = graph
        self._build = build
        self.builds: dict[tuple[tuple[str, int], ...], Any] = {}
        self._values = [*graph.inputs, *graph.params]

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        symbolic = [k for k, v in enumerate(self._values) if not v.type.is_static]
        sizes = bind_sizes([self._values[k].type for k in symbolic], [tuple(args[k].shape) for k in symbolic],
                           [f"graph @{self.graph.name} {self._values[k].origin} '{self._values[k].name}'"
                            for k in symbolic], self.graph.sizes)
        key = tuple(sorted(sizes.items()))
        executable = self.builds.get(key)
        if executable is None:
            executable = self.builds[key] = self._build(specialize(self.graph, sizes))
        return executable(args)


class SizeGuard:
    """Checks a symbolic graph's call before it runs: the named sizes bound from the tensor
    arguments' shapes lie in the graph's ranges, and every size argument (a ``SymInt``
    placeholder, passed as an int) equals the size it stands for.  A call that fails raises
    :class:`~kiln.ir.sizes.SizeError` and nothing runs (under ``torch.compile``, Dynamo's
    own guards send such sizes to a recompile before they reach kiln)."""

    def __init__(self, graph: Graph, order: Sequence[int], sizes: Mapping[int, Any]):
        self.types = [v.type for v in (*graph.inputs, *graph.params)]
        self.order = list(order)
        self.names = [f"graph @{graph.name} {v.origin} '{v.name}'" for v in (*graph.inputs, *graph.params)]
        self.sizes = dict(sizes)
        self.ranges = dict(graph.sizes)
        self.symbolic = [k for k, t in enumerate(self.types) if not t.is_static]

    def check(self, args: Sequence[Any]) -> dict[str, int]:
        tensors = [args[self.order[k]] for k in self.symbolic]
        bound = bind_sizes([self.types[k] for k in self.symbolic], [tuple(t.shape) for t in tensors],
                           [self.names[k] for k in self.symbolic], self.ranges)
        for index, dim in self.sizes.items():
            want = dim if isinstance(dim, int) else dim.evaluate(bound)
            if int(args[index]) != want:
                raise SizeError(f"size argument {index} is {int(args[index])}, but the tensor shapes "
                                f"give {dim} = {want} ({format_sizes(bound)})")
        return bound


def _output_structure(gm: fx.GraphModule) -> tuple[list[Any], pytree.TreeSpec]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return pytree.tree_flatten(output.args[0])


def _compile_whole(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                   param_indices: frozenset[int], backend: Backend, options: Mapping[str, Any] | None,
                   transform: GraphTransform | None, name: str) -> CompiledFx:
    graph, run = _build(gm, example_inputs, param_indices, backend, options, transform, name)
    leaves, spec = _output_structure(gm)
    node_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Node)]
    if len(node_slots) != len(graph.outputs):
        raise KilnError(f"kiln internal error: graph @{graph.name} has {len(graph.outputs)} outputs, "
                        f"the FX graph {len(node_slots)}")

    def call(*args: torch.Tensor) -> Any:
        values = list(leaves)
        for slot, value in zip(node_slots, run(args)):
            values[slot] = value
        return pytree.tree_unflatten(values, spec)

    return CompiledFx(call, [graph], None)


def _is_view_only(partition: Partition) -> bool:
    for node in partition.nodes:
        if node.target is _GETITEM:
            continue
        if op_name(node).rsplit(".", 1)[0] not in _VIEW_OPS:
            return False
    return True


def _compile_partitioned(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                         param_indices: frozenset[int], backend: Backend,
                         options: Mapping[str, Any] | None, transform: GraphTransform | None,
                         name: str, report: FallbackReport) -> CompiledFx:
    partitioner = CapabilityBasedPartitioner(gm, _KilnSupport(), allows_single_node_partition=True)
    partitions = [p for p in partitioner.propose_partitions() if not _is_view_only(p)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_nodes = {placeholders[i] for i in param_indices if i < len(placeholders)}
    fused = partitioner.fuse_partitions(partitions, prefix="kiln_part_") if partitions else gm
    sub_inputs = _record_submodule_inputs(fused, example_inputs)
    graphs: list[Graph] = []
    for node in list(fused.graph.nodes):
        if node.op != "call_module" or node.target not in sub_inputs:
            continue
        sub_params = frozenset(i for i, a in enumerate(node.args) if a in param_nodes)
        sub = getattr(fused, node.target)
        try:
            graph, run = _build(sub, sub_inputs[node.target], sub_params, backend, options, transform,
                                f"{name}_{node.target}")
        except (UnsupportedOpError, CaptureError) as e:  # capture refused it: keep it in PyTorch
            report.notes.append(f"partition {node.target} runs in PyTorch: {str(e).splitlines()[0]}")
            continue
        _, spec = _output_structure(sub)
        setattr(fused, node.target, _KilnPartition(run, spec.num_leaves, spec.type in (tuple, list)))
        graphs.append(graph)
    fused.recompile()
    report.kiln_partitions = len(graphs)
    report.torch_nodes = sum(1 for n in fused.graph.nodes
                             if n.op == "call_function" and n.target is not _GETITEM)
    warnings.warn(report.message(name), KilnFallbackWarning, stacklevel=3)
    return CompiledFx(fused, graphs, report, fused)


class _KilnPartition(torch.nn.Module):
    """Stands in for a fused partition submodule: same arguments, same output structure."""

    def __init__(self, run: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]], num_outputs: int,
                 returns_tuple: bool):
        super().__init__()
        self._kiln_run = run
        self.num_outputs = num_outputs
        self.returns_tuple = returns_tuple

    def forward(self, *args: torch.Tensor) -> Any:
        outputs = self._kiln_run(args)
        return tuple(outputs) if self.returns_tuple else outputs[0]


class _InputRecorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.recorded: dict[str, list[torch.Tensor]] = {}

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.recorded[target] = list(args)
        return super().call_module(target, args, kwargs)


def _record_submodule_inputs(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]
                             ) -> dict[str, list[torch.Tensor]]:
    """Run ``gm`` once eagerly to get real example inputs of each fused partition."""
    recorder = _InputRecorder(gm)
    concrete = [int(x.node.hint) if isinstance(x, torch.SymInt) and x.node.hint is not None else x
                for x in example_inputs]
    with torch.no_grad():
        recorder.run(*concrete)
    return recorder.recorded
