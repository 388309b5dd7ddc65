"""The build pipeline of code-generating backends: cache lookup, lower, compile, bind.

A :class:`CompiledBackend` builds a graph in these steps (:meth:`BuildPipeline.run`):

1. chooses each node's implementation (:mod:`.select`, by the backend's
   :class:`~kiln.backends.common.select.Selection`) and partitions the graph into plan
   operations with predicted layouts (:mod:`.partition`);
2. plans the memory of intermediate buffers by liveness (:mod:`.memory_plan`);
3. looks the graph up in the compile cache (:class:`kiln.runtime.cache.CompileCache`; key:
   IR text, the options that shape code, the choices, the toolchain and build identities);
   on a miss generates every kernel's source, prints them into one translation unit,
   compiles it once and stores it with a manifest (kernel symbols, fallbacks, schedules);
4. loads the artifact and binds a :class:`kiln.runtime.call_plan.CallPlan` on the backend's
   device (its :class:`~kiln.runtime.call_plan.Allocator` and
   :class:`~kiln.runtime.call_plan.KernelLauncher`).

What differs between backends are the hooks of :class:`BuildPipeline` (one build
configuration: the cache, the :class:`~kiln.backends.common.toolchain.Toolchain`, tuned
choices): :meth:`~BuildPipeline.partition` (the backend's
:class:`~kiln.backends.common.partition.Partitioner`), :meth:`~BuildPipeline.code_options`,
:meth:`~BuildPipeline.kernel_source`, :meth:`~BuildPipeline.source_identity`,
:meth:`~BuildPipeline.translation_unit`, :meth:`~BuildPipeline.load` (returns the launcher), :meth:`~BuildPipeline.kernel_fallback`
and :meth:`~BuildPipeline.pack_step` (compiling is the toolchain's ``build``, its
``identity()`` keys the cache, and artifacts are stored under its artifact type); and of :class:`CompiledBackend`: ``selection``,
``device`` and :meth:`~CompiledBackend.pipeline`.  The cpu backend
(:mod:`kiln.backends.cpu.backend`) fills them with generated C, the C toolchain, ctypes,
its GEMMs and OpenMP; a CUDA or Triton backend fills the same hooks.

Options every compiled backend has: ``select`` (``"rule"``, ``"time"`` or
``"generated"``, see :mod:`.select`) and ``poison`` (fill intermediate and output memory
with NaN bytes before every call, a testing aid).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from kiln.backends.base import Backend, BackendError
from kiln.ir import Graph, Node
from kiln.ir.printer import format_graph_name
from kiln.ir.sizes import is_dynamic, specialize
from kiln.runtime.cache import CompileCache, cache_key
from kiln.runtime.call_plan import (
    HOST,
    Allocator,
    CallPlan,
    ContiguousStep,
    DynamicCallPlan,
    KernelCall,
    KernelLauncher,
    NativeRunStep,
    PrepareStep,
    ReleaseStep,
    SlotSpec,
    Step,
    TorchStep,
    ViewStep,
)
from kiln.runtime.tensors import torch_dtype
from kiln.runtime.timing import best_time

from .dynamic import DynamicPlanner, legality_ranges, sample_sizes, size_binder, size_function, typical_sizes
from .memory_plan import MemoryPlan, plan_memory, plan_symbolic
from .partition import GraphPlan, Partitioner, PlanOp, lifetimes
from .select import SELECT_MODES, Choice, Selection, TimedSelector
from .toolchain import Toolchain

PROFILE_ENV_VAR = "KILN_PROFILE_KERNELS"
"""Set to ``1`` at build time: one native call per kernel, so ``plan.profile`` times each."""


class CompiledExecutable:
    """A graph built by a compiled backend; call it with the graph's inputs then params.

    ``info`` holds: ``kernels`` (generated kernels), ``library_calls``, ``foreign_kernels``
    (native functions outside the unit, launched with its kernels), ``fallbacks`` (nodes
    whose kernel could not be generated, and why), ``choices`` (node -> implementation),
    ``memory`` (the plan's report line), ``arena_bytes``, ``intermediate_bytes``,
    ``cache_hit``, ``cache_key``, ``source`` (path of the source file), ``build_s``,
    ``schedules`` (each generated kernel's replayable ``Schedule.trace``).
    """

    def __init__(self, graph: Graph, plan: CallPlan, info: dict[str, Any], source_text: str | None,
                 library: Any = None):
        self.graph = graph
        self.plan = plan
        self.library = library  # the loaded artifact: kept alive with the executable
        self.info = info
        self._source_text = source_text
        self._num_args = len(graph.inputs) + len(graph.params)

    @property
    def source(self) -> str:
        """The translation unit of this graph ("" when it has no generated kernel)."""
        return self._source_text or ""

    def __call__(self, args: Sequence[torch.Tensor], out: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The graph's outputs.  ``out`` (output position -> tensor, not sharing memory with
        ``args``): outputs to write into the caller's tensors where the plan allocates them
        fresh (:class:`~kiln.runtime.call_plan.CallPlan`); which did comes back as identity."""
        if len(args) != self._num_args:
            raise BackendError(f"graph @{format_graph_name(self.graph.name)} takes {len(self.graph.inputs)} inputs "
                               f"and {len(self.graph.params)} params, got {len(args)} tensors")
        if not torch.is_grad_enabled():
            return self.plan(args, out)
        with torch.no_grad():
            return self.plan(args, out)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.info['kernels']} kernels, {self.info['library_calls']} library "
                f"calls, {len(self.info['fallbacks'])} fallbacks, cache {'hit' if self.info['cache_hit'] else 'miss'}>")


class BuildPipeline:
    """One build configuration of ``backend`` (its cache, toolchain and tuned choices) and
    the hooks the pipeline calls; :meth:`run` builds a graph (module docstring)."""

    executable_type: ClassVar[type[CompiledExecutable]] = CompiledExecutable

    def __init__(self, backend: CompiledBackend, cache: CompileCache, toolchain: Toolchain, *,
                 poison: bool = False):
        self.backend = backend
        self.cache = cache
        self.toolchain = toolchain
        self.poison = poison

    # ----------------------------------------------------------------- hooks
    @property
    def allocator(self) -> Allocator:
        """Where the call plan's tensors live (default: the host)."""
        return HOST

    def partition(self, graph: Graph, choose: Callable[[Node], Choice]) -> GraphPlan:
        """The backend's partition of ``graph`` (default: :class:`~.partition.Partitioner`,
        for a backend without library calls or native GEMMs)."""
        return Partitioner(graph, self.backend).run(choose)

    def code_options(self, plan: GraphPlan) -> dict[str, Any]:
        """Everything besides the IR text that shapes the generated code (part of the cache key)."""
        return {"choices": plan.choices}

    def toolchain_identity(self) -> str:
        """The compiler (version, flags, target machine): part of every cache key."""
        return self.toolchain.identity()

    def build_identity(self) -> str:
        """kiln's own identity (its code-generating sources): part of every cache key."""
        raise NotImplementedError

    def kernel_source(self, symbol: str, op: PlanOp) -> tuple[Any, list]:
        """The source of kernel ``op`` named ``symbol`` and its schedule trace; raising makes
        the kernel fall back (:meth:`kernel_fallback`)."""
        raise NotImplementedError

    def source_identity(self, source: Any) -> str:
        """The text of a kernel source without its symbol and comments: kernels with equal
        identities share one function."""
        raise NotImplementedError

    def translation_unit(self, sources: list[Any]) -> str:
        """The one source text holding ``sources``."""
        raise NotImplementedError

    def compile(self, text: str, folder: Path) -> Path:
        """Compile ``text`` into an artifact in ``folder``; its path."""
        return self.toolchain.build(text, folder)

    def load(self, path: Path | None, symbols: list[str], plan: GraphPlan) -> tuple[Any, KernelLauncher | None]:
        """Load the artifact at ``path`` (``None``: the graph has no compiled kernel) whose
        kernel table holds ``symbols``; the loaded object and its launcher."""
        raise NotImplementedError

    def kernel_fallback(self, op: PlanOp) -> Step:
        """The step running kernel ``op`` whose source could not be generated."""
        raise BackendError(f"kiln backend '{self.backend.name}' could not generate the kernel {op.label}")

    def pack_step(self, op: PlanOp) -> Step:
        """The step of a ``pack`` operation (a prepared weight copy) of the backend's partition."""
        raise BackendError(f"kiln bug: backend '{self.backend.name}' planned a pack operation it cannot bind")

    # ----------------------------------------------------------------- the pipeline
    def size_buckets(self, graph: Graph) -> list[dict[str, int]]:
        """Sizes at which a symbolic graph may deserve a variant of its own (default: none);
        see :meth:`run`."""
        return []

    def run(self, graph: Graph, choose: Callable[[Node], Choice]) -> CompiledExecutable:
        """Build ``graph`` (module docstring, steps 1-4).  A symbolic graph with
        :meth:`size_buckets` is partitioned once per bucket (``self.tune_sizes`` set to it:
        the backend tunes its choices there, e.g. GEMM providers); buckets whose code options
        agree share one build, and only where measurement chose differently is another
        variant compiled.  Each call's sizes pick the nearest bucket's variant when their
        plan is first made, so a call costs the same look-up as with one variant."""
        buckets = self.size_buckets(graph) if is_dynamic(graph) else []
        if len(buckets) < 2:
            return self._run(graph, choose)
        start = time.perf_counter()
        variants: dict[str, CompiledExecutable] = {}
        chosen: list[CompiledExecutable] = []
        for bucket in buckets:
            self.tune_sizes = bucket
            plan = self.partition(graph, choose)
            options = repr(self.code_options(plan))
            if options not in variants:
                variants[options] = self._run(graph, choose, plan)
            chosen.append(variants[options])
        self.tune_sizes = None
        first = chosen[-1]
        if len(variants) == 1:
            return first
        names = tuple(sorted(buckets[0]))
        points = [tuple(b[n] for n in names) for b in buckets]
        plans = [exe.plan for exe in chosen]

        def instance(key: tuple[int, ...]) -> CallPlan:
            nearest = min(range(len(points)), key=lambda i: sum(abs(math.log(k) - math.log(p))
                                                                for k, p in zip(key, points[i])))
            return plans[nearest].instance(key)

        combined = DynamicCallPlan(num_args=len(graph.inputs) + len(graph.params), bind=first.plan.bind,
                                   instance=instance, name=graph.name, poison=self.poison, allocator=self.allocator)
        info = dict(first.info)
        info["variants"] = [{"sizes": b, "gemm": exe.info["gemm_providers"], "cache_key": exe.info["cache_key"]}
                            for b, exe in zip(buckets, chosen)]
        info["build_s"] = time.perf_counter() - start
        return self.executable_type(graph, combined, info, first.source, [e.library for e in variants.values()])

    def _run(self, graph: Graph, choose: Callable[[Node], Choice], plan: GraphPlan | None = None) -> CompiledExecutable:
        start = time.perf_counter()
        plan = plan if plan is not None else self.partition(graph, choose)
        self.size_order = {name: i for i, name in enumerate(plan.sizes)}
        self.size_hint = typical_sizes(graph, plan.sizes)
        self.size_ranges = legality_ranges(graph, plan.sizes)
        symbolic = None
        if plan.sizes:  # symbolic shapes: the memory plan's order at the sample sizes
            requests = lifetimes(plan, plan.sample)
            memory = plan_memory(requests)
            symbolic = plan_symbolic(requests, size_function(plan.sizes, [
                plan.values[r.key].type.size * plan.values[r.key].type.dtype.itemsize for r in requests]))
        else:
            memory = plan_memory(lifetimes(plan))
        kernels = plan.kernels
        key = cache_key(key_text(graph), self.code_options(plan), self.toolchain_identity(), self.build_identity())
        entry = self.cache.lookup(key, self.toolchain.artifact) if kernels else None
        fallbacks: dict[str, str] = {}
        source_text: str | None = None
        traces: dict[str, list] = {}
        path = None
        if kernels and entry is not None and len(entry.manifest.get("kernels", ())) == len(kernels):
            symbols = [k["symbol"] for k in entry.manifest["kernels"]]
            fallbacks = {k["label"]: k["reason"] for k in entry.manifest["kernels"] if k["symbol"] is None}
            traces = {k["label"]: k.get("schedule", []) for k in entry.manifest["kernels"] if k["symbol"]}
            path, source_text, hit = entry.library, entry.source.read_text(), True
        else:
            hit, entry = False, None
            sources, symbols, fallbacks, traces = self._kernel_sources(kernels)
            if sources:
                source_text = self.translation_unit(sources)
                built = self.compile(source_text, self.cache.scratch_dir())
                manifest = {"kernels": [{"symbol": s, "label": k.label, "reason": fallbacks.get(k.label, ""),
                                         "schedule": traces.get(k.label, [])} for s, k in zip(symbols, kernels)]}
                entry = self.cache.store(key, source_text, built, manifest, artifact=self.toolchain.artifact,
                                         source_suffix=self.toolchain.source_suffix)
                path = entry.library
        # symbol -> its row of the kernel table (shared kernels repeat a symbol)
        table = {s: i for i, s in enumerate(dict.fromkeys(s for s in symbols if s is not None))}
        library, launcher = self.load(path, list(table), plan)
        indexes = [None if s is None or path is None else table[s] for s in symbols]
        info = _info(plan, memory, symbols, fallbacks, hit, key, entry, time.perf_counter() - start)
        info["schedules"] = traces
        info["gemm_providers"] = list(self.code_options(plan).get("gemm", []))
        if symbolic is not None:
            info["sizes"] = {n: str(graph.sizes.get(n, "[2, inf)")) for n in plan.sizes}
            info["sample_sizes"] = dict(plan.sample or {})
            planner = DynamicPlanner(plan, symbolic, indexes,
                                     lambda concrete, mem, sizes: self._sized_plan(concrete, mem, sizes, launcher, indexes))
            operands = [*graph.inputs, *graph.params]
            names = [f"{'input' if i < len(graph.inputs) else 'param'} %{v.name}" for i, v in enumerate(operands)]
            dynamic_plan = DynamicCallPlan(num_args=len(plan.args), name=graph.name, poison=self.poison,
                                           allocator=self.allocator, instance=planner,
                                           bind=size_binder([v.type for v in operands], names, plan.sizes, graph.sizes))
            return self.executable_type(graph, dynamic_plan, info, source_text, library)
        call_plan = CallPlan(num_slots=len(plan.values), num_args=len(plan.args), constants=_constants(plan),
                             planned=_planned(plan, memory), arena_bytes=memory.arena_bytes,
                             steps=self.bind_steps(plan, launcher, indexes), outputs=[pv.slot for pv in plan.outputs],
                             name=graph.name, poison=self.poison, allocator=self.allocator)
        return self.executable_type(graph, call_plan, info, source_text, library)

    def _sized_plan(self, plan: GraphPlan, memory: MemoryPlan, sizes: tuple[int, ...],
                    launcher: KernelLauncher | None, indexes: list[int | None]) -> CallPlan:
        """The static call plan of a symbolic graph's partition at concrete ``sizes`` (made by
        :class:`~.dynamic.DynamicPlanner`): every kernel call also gets the size table, a
        constant slot after the plan's values."""
        size_slot = len(plan.values)
        constants = _constants(plan)
        constants[size_slot] = torch.tensor(sizes or (0,), dtype=torch.int64)
        return CallPlan(num_slots=size_slot + 1, num_args=len(plan.args), constants=constants,
                        planned=_planned(plan, memory), arena_bytes=memory.arena_bytes,
                        steps=self.bind_steps(plan, launcher, indexes, extra=(size_slot,)),
                        outputs=[pv.slot for pv in plan.outputs], name=plan.graph.name, poison=False,
                        allocator=self.allocator)

    def _kernel_sources(self, kernels: list[PlanOp]) -> tuple[list[Any], list[str | None], dict[str, str],
                                                              dict[str, list]]:
        """Every kernel's source; a kernel that fails falls back (symbol ``None``).  Kernels
        with one :meth:`source_identity` (the layers of a transformer) share one function:
        each later one gets the first one's symbol, so the compiler sees every distinct
        kernel once.  Also returns each kernel's schedule trace, by label."""
        sources: list[Any] = []
        symbols: list[str | None] = []
        fallbacks: dict[str, str] = {}
        traces: dict[str, list] = {}
        seen: dict[str, str] = {}
        for index, op in enumerate(kernels):
            symbol = f"kiln_k{index}"
            try:
                source, trace = self.kernel_source(symbol, op)
                text = self.source_identity(source)
            except Exception as e:  # noqa: BLE001 - any failure falls back
                symbols.append(None)
                fallbacks[op.label] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                continue
            traces[op.label] = trace
            if text in seen:
                symbols.append(seen[text])
                continue
            seen[text] = symbol
            sources.append(source)
            symbols.append(symbol)
        return sources, symbols, fallbacks, traces

    def bind_steps(self, plan: GraphPlan, launcher: KernelLauncher | None, indexes: list[int | None],
                   extra: tuple[int, ...] = ()) -> list[Step]:
        """The runtime steps of the plan's operations; consecutive kernels share one launch
        (:class:`~kiln.runtime.call_plan.NativeRunStep`) and consecutive argument checks one
        step.  ``extra`` slots are passed to every kernel after its arguments (the size table)."""
        steps: list[Step] = []
        run: list[KernelCall] = []
        labels: list[str] = []
        separate = os.environ.get(PROFILE_ENV_VAR) == "1"

        def flush() -> None:
            if run:
                assert launcher is not None
                steps.append(NativeRunStep(launcher, tuple(run), "; ".join(labels)))
                run.clear()
                labels.clear()

        kernel_index = 0
        for op in plan.ops:
            if op.step == "kernel":
                index = indexes[kernel_index]
                kernel_index += 1
                if index is not None:
                    args = op.args
                    run.append((index, tuple(pv.root().slot for pv in args) + extra,
                                tuple(pv.byte_offset for pv in args) + (0,) * len(extra)))
                    labels.append(op.label)
                    if separate:
                        flush()
                    continue
                flush()
                steps.append(self.kernel_fallback(op))
                continue
            if op.step == "foreign":
                args = [*op.inputs, *op.outputs]
                run.append((op.foreign, tuple(pv.root().slot for pv in args) + extra,
                            tuple(pv.byte_offset for pv in args) + (0,) * len(extra)))
                labels.append(op.label)
                if separate:
                    flush()
                continue
            flush()
            ins = tuple(pv.slot for pv in op.inputs)
            outs = tuple(pv.slot for pv in op.outputs)
            if op.step == "library":
                assert op.call is not None
                steps.append(TorchStep(op.call.function, ins, outs, op.call.writes_into, op.label))
            elif op.step == "view":
                assert op.view is not None
                steps.append(ViewStep(op.view, ins[0], outs[0], op.label))
            elif op.step == "copy":
                steps.append(TorchStep(_copy_into, ins, outs, True, op.label))
            elif op.step == "contiguous":
                if steps and isinstance(steps[-1], ContiguousStep):
                    steps[-1] = ContiguousStep(steps[-1].slots + ins)
                else:
                    steps.append(ContiguousStep(ins))
            elif op.step == "pack":
                step = self.pack_step(op)
                if isinstance(step, PrepareStep) and steps and isinstance(steps[-1], PrepareStep):
                    step = PrepareStep(steps.pop().parts + step.parts)
                steps.append(step)
            elif op.step == "clone":
                steps.append(TorchStep(torch.clone, ins, outs, False, op.label))
            elif op.step == "release":
                steps.append(ReleaseStep(ins))
            else:
                raise BackendError(f"kiln bug: unknown plan operation {op.step!r}")
        flush()
        return steps


class CompiledBackend(Backend):
    """A backend built on :class:`BuildPipeline` (module docstring).

    Subclasses set ``name``, ``option_defaults`` (with ``select`` and ``poison``),
    ``selection`` (what the backend can run, :class:`~.select.Selection`) and ``device``, and
    implement :meth:`pipeline`.
    """

    selection: ClassVar[Selection]
    device: ClassVar[str] = "cpu"
    dynamic_shapes: ClassVar[bool] = False
    """Whether the backend's kernels take symbolic sizes as arguments (its ``kernel_source``
    fills a kernel's size table, see :mod:`.dynamic`): then a graph with symbolic shapes is
    built once and runs at every size in range."""
    selection_file: ClassVar[str] = "selection.json"
    """Where ``select="time"`` keeps its choices, in the compile cache folder."""

    def supports(self, node: Node) -> bool:
        return self.selection.supports(node)

    def pipeline(self, opts: Mapping[str, Any]) -> BuildPipeline:
        """A build configuration for the resolved options ``opts``."""
        raise NotImplementedError

    def check_options(self, graph: Graph, opts: Mapping[str, Any]) -> None:
        """Refuse bad options and graphs before anything slow happens."""
        if opts["select"] not in SELECT_MODES:
            raise BackendError(f"kiln backend '{self.name}': option select={opts['select']!r} is not one of "
                               f"{', '.join(SELECT_MODES)}")
        dynamic = [v for v in (*graph.inputs, *graph.params) if not v.type.is_static]
        if dynamic and not self.dynamic_shapes:
            raise BackendError(f"kiln backend '{self.name}' runs static shapes only; %{dynamic[0].name} has type "
                               f"{dynamic[0].type}; capture with concrete example inputs")

    def build(self, graph: Graph, options: Mapping[str, Any] | None = None) -> CompiledExecutable:
        opts = self.resolve_options(options)
        self.check_options(graph, opts)
        pipeline = self.pipeline(opts)
        return pipeline.run(graph, self.chooser(opts, pipeline))

    def chooser(self, opts: Mapping[str, Any], pipeline: BuildPipeline) -> Callable[[Node], Choice]:
        """How nodes get their implementation under option ``select``."""
        if opts["select"] == "generated":
            return self.selection.generated
        if opts["select"] != "time":
            return self.selection.rule
        cache = pipeline.cache
        path = cache.directory / self.selection_file if cache.enabled else None
        return TimedSelector(self.selection, path, pipeline.toolchain_identity(), self.measurer(opts)).choose

    def run_device(self, opts: Mapping[str, Any]) -> str:
        """The device a build with options ``opts`` runs on (default: ``device``)."""
        return self.device

    def measurer(self, opts: Mapping[str, Any]) -> Callable[[Node, str], float]:
        """``measure(node, impl)``: seconds per call of ``node`` alone built with ``impl``
        (on random inputs of its types on :meth:`run_device`, synchronized on a GPU,
        :func:`kiln.runtime.timing.best_time`)."""
        device = self.run_device(opts)
        gpu = torch.device(device).type == "cuda"

        def measure(node: Node, impl: str) -> float:
            probe, target = probe_graph(node)
            if is_dynamic(probe):  # a symbolic node is timed at its graph's sample sizes
                probe = specialize(probe, sample_sizes(probe))
                target = probe.nodes[0]
            rule = self.selection.rule
            exe = self.pipeline({**opts, "poison": False}).run(
                probe, lambda n: Choice(impl, "probe") if n is target else rule(n))
            args = [random_tensor(v.type, device) for v in probe.inputs]

            def run() -> None:
                exe(args)
                if gpu:
                    torch.cuda.synchronize()
            return best_time(run)
        return measure


# ------------------------------------------------------------------------------ helpers
def key_text(graph: Graph) -> str:
    """The IR text that keys the cache: the graph's text without its name, which does not
    change the code (``kiln.compile`` and ``torch.compile`` of one model share an entry)."""
    text = str(graph)
    head = f"graph @{format_graph_name(graph.name)}"
    return "graph @_" + text[len(head):] if text.startswith(head) else text


def _copy_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def _constants(plan: GraphPlan) -> dict[int, torch.Tensor]:
    return {pv.slot: pv.const for pv in plan.values if pv.const is not None}


def _planned(plan: GraphPlan, memory: MemoryPlan) -> list[SlotSpec]:
    """Arena slots and fresh outputs (buffers), then persistent prepared copies (packed)."""
    planned = [SlotSpec(pv.slot, tuple(pv.type.shape), torch_dtype(pv.type.dtype), memory.offsets.get(pv.slot))
               for pv in plan.values if pv.origin == "buffer" and (pv.fresh or pv.slot in memory.offsets)]
    planned += [SlotSpec(pv.slot, tuple(pv.type.shape), torch_dtype(pv.type.dtype), persistent=True)
                for pv in plan.values if pv.origin == "packed"]
    return planned


def _info(plan: GraphPlan, memory: MemoryPlan, symbols: list[str | None], fallbacks: dict[str, str],
          hit: bool, key: str, entry: Any, build_s: float) -> dict[str, Any]:
    return {
        "kernels": sum(s is not None for s in symbols),
        "library_calls": sum(op.step == "library" for op in plan.ops),
        "foreign_kernels": sum(op.step == "foreign" for op in plan.ops),
        "fallbacks": dict(fallbacks),
        "choices": dict(plan.choices),
        "memory": memory.report(),
        "arena_bytes": memory.arena_bytes,
        "intermediate_bytes": memory.total_bytes,
        "cache_hit": hit,
        "cache_key": key,
        "source": str(entry.source) if entry is not None else None,
        "build_s": build_s,
    }


def probe_graph(node: Node) -> tuple[Graph, Node]:
    """A graph holding only a copy of ``node``, its operands as inputs."""
    probe = Graph("probe")
    inputs = [probe.add_input(f"x{i}", v.type) for i, v in enumerate(node.inputs)]
    copy = probe.add_node(node.op, inputs, node.attrs)
    probe.set_outputs(copy.outputs)
    return probe, copy


def random_tensor(type: Any, device: str = "cpu") -> torch.Tensor:
    """Timing operands: random floats, zeros for integers (valid indices for gathers)."""
    shape = tuple(type.shape)
    if type.dtype.is_floating:
        return torch.randn(shape, dtype=torch_dtype(type.dtype), device=device)
    return torch.zeros(shape, dtype=torch_dtype(type.dtype), device=device)


__all__ = ["PROFILE_ENV_VAR", "BuildPipeline", "CompiledBackend", "CompiledExecutable", "key_text", "probe_graph",
           "random_tensor"]
