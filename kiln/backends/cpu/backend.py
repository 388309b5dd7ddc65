"""The ``cpu`` backend: generated C with OpenMP plus ATen library calls, one shared object per
graph, run as a flat call plan.

``build(graph, options)``:

1. chooses each node's implementation (:mod:`.select`) and turns the graph into plan
   operations with predicted layouts (:mod:`.graphplan`);
2. plans the memory of intermediate buffers by liveness (:mod:`.plan`);
3. looks the graph up in the compile cache (:mod:`kiln.runtime.cache`; key: IR text,
   options, choices, compiler and kiln identity); on a miss lowers every generated kernel
   (:mod:`kiln.passes.lower`), schedules it (:mod:`.schedules`), prints all kernels into one
   translation unit (:mod:`.codegen`), compiles it once and stores it;
4. loads the shared object with ctypes and binds a :class:`kiln.runtime.call_plan.CallPlan`.

Options (defaults in ``CpuBackend.option_defaults``):

* ``cache`` (True): use the compile cache; ``cache_dir`` (None): its folder (default
  ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``);
* ``select`` (``"rule"``): ``"rule"``, ``"time"`` (time library vs generated once per
  node signature) or ``"generated"`` (no library calls); see :mod:`.select`;
* ``threads`` (None): threads the schedules plan for (default ``torch.get_num_threads()``);
  ``1`` marks nothing parallel;
* ``schedule`` (True): apply the default schedules (False: plain serial loops);
* ``poison`` (False): fill intermediate and output memory with NaN bytes before every call
  (a testing aid that exposes reads of unwritten memory).

Thread safety: the executable may be called from several threads at once; each thread gets
its own workspace (arena and pointer arrays), so calls never share intermediate buffers.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch

from kiln.backends.base import Backend, BackendError
from kiln.ir import Graph, Node
from kiln.ir.printer import format_graph_name
from kiln.runtime.cache import CompileCache, cache_key
from kiln.runtime.call_plan import (
    CallPlan,
    ContiguousStep,
    NativeRunStep,
    PackStep,
    ReleaseStep,
    SlotSpec,
    Step,
    TorchStep,
    ViewStep,
)
from kiln.runtime.tensors import torch_dtype

from . import toolchain
from .codegen import KernelSource, c_comment, kernel_function, sanitize_program, translation_unit
from . import microgemm
from .gemm import KILN_PROVIDER, PROVIDERS, GemmTuner, blas_providers, set_blas_threads
from .graphplan import GraphPlan, PlanOp, build_graph_plan, lifetimes
from .library import reference_call
from kiln.backends.common.memory_plan import MemoryPlan, plan_memory
from .select import SELECT_MODES, Choice, TimedSelector, generated_choice, rule_choice


class CpuBackend(Backend):
    """Native CPU code: see the module docstring."""

    name: ClassVar[str] = "cpu"
    option_defaults: ClassVar[Mapping[str, Any]] = {
        "cache": True, "cache_dir": None, "select": "rule", "threads": None, "schedule": True, "poison": False,
    }

    def build(self, graph: Graph, options: Mapping[str, Any] | None = None) -> CpuExecutable:
        opts = self.resolve_options(options)
        if opts["select"] not in SELECT_MODES:
            raise BackendError(f"kiln backend 'cpu': option select={opts['select']!r} is not one of "
                               f"{', '.join(SELECT_MODES)}")
        dynamic = [v for v in (*graph.inputs, *graph.params) if not v.type.is_static]
        if dynamic:
            raise BackendError(f"kiln backend 'cpu' runs static shapes only; %{dynamic[0].name} has type "
                               f"{dynamic[0].type}; capture with concrete example inputs")
        threads = int(opts["threads"] or torch.get_num_threads())
        cache = CompileCache(opts["cache_dir"], enabled=bool(opts["cache"]))
        cc = toolchain.find_compiler()
        if opts["select"] == "time":
            selector = TimedSelector(cache.directory / "selection.json" if cache.enabled else None,
                                     toolchain.compiler_identity(cc), self._measurer(opts))
            choose: Callable[[Node], Choice] = selector.choose
        elif opts["select"] == "generated":
            choose = generated_choice
        else:
            choose = rule_choice
        tuner = GemmTuner(cache.directory / "gemm.json" if cache.enabled else None,
                          toolchain.compiler_identity(cc), threads, microgemm.library(cache, cc))
        return build_executable(graph, choose, cache, cc, threads=threads, schedule=bool(opts["schedule"]),
                                poison=bool(opts["poison"]), tuner=tuner)

    def _measurer(self, opts: Mapping[str, Any]) -> Callable[[Node, str], float]:
        def measure(node: Node, impl: str) -> float:
            probe, target = _probe_graph(node)
            cache = CompileCache(opts["cache_dir"], enabled=bool(opts["cache"]))
            threads = int(opts["threads"] or torch.get_num_threads())
            cc = toolchain.find_compiler()
            tuner = GemmTuner(cache.directory / "gemm.json" if cache.enabled else None,
                              toolchain.compiler_identity(cc), threads, microgemm.library(cache, cc))
            exe = build_executable(
                probe, lambda n: Choice(impl, "probe") if n is target else rule_choice(n), cache, cc,
                threads=threads, schedule=bool(opts["schedule"]), tuner=tuner)
            args = [_random_tensor(v.type) for v in probe.inputs]
            return _best_time(lambda: exe(args))
        return measure


class CpuExecutable:
    """A graph built by the cpu backend; call it with the graph's inputs then params.

    ``info`` holds: ``kernels`` (generated kernels), ``library_calls``, ``fallbacks`` (nodes
    run with the numpy reference, and why), ``choices`` (node -> implementation),
    ``memory`` (the plan's report line), ``arena_bytes``, ``intermediate_bytes``,
    ``cache_hit``, ``cache_key``, ``source`` (path of the C file), ``build_s``, ``schedules``
    (each generated kernel's replayable ``Schedule.trace``).
    """

    def __init__(self, graph: Graph, plan: CallPlan, info: dict[str, Any], source_text: str | None,
                 library: Any = None):
        self.graph = graph
        self.plan = plan
        self.library = library  # the loaded shared object: kept alive with the executable
        self.info = info
        self._source_text = source_text
        self._num_args = len(graph.inputs) + len(graph.params)

    @property
    def source(self) -> str:
        """The C translation unit of this graph ("" when it has no generated kernel)."""
        return self._source_text or ""

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(args) != self._num_args:
            raise BackendError(f"graph @{c_comment(self.graph.name)} takes {len(self.graph.inputs)} inputs and "
                               f"{len(self.graph.params)} params, got {len(args)} tensors")
        if not torch.is_grad_enabled():
            return self.plan(args)
        with torch.no_grad():
            return self.plan(args)

    def __repr__(self) -> str:
        return (f"<CpuExecutable {self.info['kernels']} kernels, {self.info['library_calls']} library calls, "
                f"{len(self.info['fallbacks'])} fallbacks, cache {'hit' if self.info['cache_hit'] else 'miss'}>")


# ------------------------------------------------------------------------------ building
def build_executable(graph: Graph, choose: Callable[[Node], Choice], cache: CompileCache, cc: str, *,
                     threads: int, schedule: bool, poison: bool = False,
                     tuner: GemmTuner | None = None) -> CpuExecutable:
    """Build ``graph`` (module docstring, steps 1-4)."""
    start = time.perf_counter()
    tuner = tuner or GemmTuner(None, toolchain.compiler_identity(cc), threads, microgemm.library(cache, cc))
    gemm = tuner.choose if blas_providers() or tuner.micro is not None else None
    gplan = build_graph_plan(graph, choose, gemm=gemm)
    requests = lifetimes(gplan)
    memory = plan_memory(requests)
    kernels = gplan.kernels
    providers = [op.gemm.provider + ("+packed" if op.gemm.packed_b else "") for op in kernels if op.gemm is not None]
    key = cache_key(_key_text(graph), {"threads": threads, "schedule": schedule, "choices": gplan.choices,
                                       "gemm": providers},
                    toolchain.compiler_identity(cc), toolchain.build_identity())
    entry = cache.lookup(key) if kernels else None
    fallbacks: dict[str, str] = {}
    source_text: str | None = None
    traces: dict[str, list] = {}
    if kernels and entry is not None and len(entry.manifest.get("kernels", ())) == len(kernels):
        symbols = [k["symbol"] for k in entry.manifest["kernels"]]
        fallbacks = {k["label"]: k["reason"] for k in entry.manifest["kernels"] if k["symbol"] is None}
        traces = {k["label"]: k.get("schedule", []) for k in entry.manifest["kernels"] if k["symbol"]}
        library_path, source_text, hit = entry.library, entry.source.read_text(), True
    elif kernels:
        sources, symbols, fallbacks, traces = _kernel_sources(kernels, threads=threads, schedule=schedule)
        hit = False
        library_path = None
        if sources:
            declarations = toolchain.vector_math_declarations(toolchain.vector_math(cc))
            source_text = translation_unit(sources, declarations)
            built = toolchain.compile_shared_object(source_text, cache.scratch_dir(), cc)
            manifest = {"kernels": [{"symbol": s, "label": k.label, "reason": fallbacks.get(k.label, ""),
                                     "schedule": traces.get(k.label, [])} for s, k in zip(symbols, kernels)]}
            entry = cache.store(key, source_text, built, manifest)
            library_path = entry.library
    else:
        symbols, hit, library_path = [], False, None
    lib, indexes = _load(library_path, symbols, bool(providers), tuner.micro)
    if any(p.startswith("openblas") for p in providers):
        set_blas_threads(threads)
    steps = _bind_steps(gplan, lib, indexes)
    planned = [SlotSpec(pv.slot, tuple(pv.type.shape), torch_dtype(pv.type.dtype), memory.offsets.get(pv.slot))
               for pv in gplan.values if pv.origin == "buffer" and (pv.fresh or pv.slot in memory.offsets)]
    planned += [SlotSpec(pv.slot, tuple(pv.type.shape), torch_dtype(pv.type.dtype), persistent=True)
                for pv in gplan.values if pv.origin == "packed"]
    constants = {pv.slot: pv.const for pv in gplan.values if pv.const is not None}
    call_plan = CallPlan(num_slots=len(gplan.values), num_args=len(gplan.args), constants=constants,
                         planned=planned, arena_bytes=memory.arena_bytes, steps=steps,
                         outputs=[pv.slot for pv in gplan.outputs], name=graph.name, poison=poison)
    info = _info(gplan, memory, symbols, fallbacks, hit, key, entry, time.perf_counter() - start)
    info["schedules"] = traces
    return CpuExecutable(graph, call_plan, info, source_text, lib)


def _key_text(graph: Graph) -> str:
    """The IR text that keys the cache: the graph's text without its name, which does not
    change the code (``kiln.compile`` and ``torch.compile`` of one model share an entry)."""
    text = str(graph)
    head = f"graph @{format_graph_name(graph.name)}"
    return "graph @_" + text[len(head):] if text.startswith(head) else text


def _kernel_sources(kernels: list[PlanOp], *, threads: int, schedule: bool
                    ) -> tuple[list[KernelSource], list[str | None], dict[str, str], dict[str, list]]:
    """Lower, schedule and describe every kernel; a kernel that fails falls back (None).
    Kernels whose C is the same but for their symbol and comment (the layers of a
    transformer) share one function: each later one gets the first one's symbol, so the C
    compiler sees every distinct kernel once.  Also returns each kernel's schedule trace
    (``Schedule.trace``), by label."""
    sources: list[KernelSource] = []
    symbols: list[str | None] = []
    fallbacks: dict[str, str] = {}
    traces: dict[str, list] = {}
    seen: dict[str, str] = {}
    for index, op in enumerate(kernels):
        symbol = f"kiln_k{index}"
        try:
            source, trace = _kernel_source(symbol, op, threads=threads, schedule=schedule)
            text = kernel_function(replace(source, symbol="kiln_same", comment=""))  # printable, and its identity
        except Exception as e:  # noqa: BLE001 - any failure falls back to the reference
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


def _kernel_source(symbol: str, op: PlanOp, *, threads: int, schedule: bool) -> tuple[KernelSource, list]:
    """The kernel of ``op`` (its GEMM and/or its lowered, sanitized, scheduled loop program)
    and the schedule's trace."""
    from kiln.passes.lower import lower_node  # noqa: PLC0415 (the loop IR loads on a cache miss only)

    from .schedules import default_schedule  # noqa: PLC0415

    head = ("gemm_a", "gemm_b") if op.gemm is not None else ()
    if op.node is None:
        return KernelSource(symbol, None, (*head, "gemm_c"), comment=op.label, gemm=op.gemm), []
    lowered = lower_node(op.node)
    program, renamed = sanitize_program(lowered.program)
    trace: list = []
    if schedule:
        scheduled = default_schedule(program, op.template, threads=threads)
        program, trace = scheduled.program, scheduled.trace
    names = (*head, *dict.fromkeys(renamed[n] for n in lowered.inputs), *(renamed[n] for n in lowered.outputs))
    if len(names) != len(op.args):
        raise BackendError(f"kiln bug: kernel {op.label} has {len(op.args)} arguments but its program "
                           f"{len(names)} buffers")
    constants = {renamed[name]: data for name, data in lowered.constants.items()}
    return KernelSource(symbol, program, names, constants, comment=op.label, gemm=op.gemm), trace


def _load(path: Any, symbols: list[str | None], gemm: bool, micro: microgemm.MicroGemm | None
          ) -> tuple[Any, list[int | None]]:
    """The loaded library (or None) and each kernel's index in its ``kiln_run`` table."""
    table: dict[str, int] = {}  # symbol -> its row of kiln_run's table (shared kernels repeat a symbol)
    for s in symbols:
        if s is not None and s not in table:
            table[s] = len(table)
    indexes = [None if s is None else table[s] for s in symbols]
    if path is None:
        return None, [None] * len(symbols)
    lib = ctypes.CDLL(str(path))
    if gemm:
        for index, name in enumerate(PROVIDERS):
            provider = blas_providers().get(name)
            if provider is not None:
                lib.kiln_set_blas(ctypes.c_long(index), ctypes.c_void_p(provider.sgemm),
                                  ctypes.c_void_p(provider.dgemm))
        if micro is not None:
            lib.kiln_set_mgemm(ctypes.c_void_p(micro.address))
    lib.kiln_run.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_long, ctypes.POINTER(ctypes.c_void_p)]
    lib.kiln_run.restype = None
    return lib, indexes


PROFILE_ENV_VAR = "KILN_PROFILE_KERNELS"
"""Set to ``1`` at build time: one native call per kernel, so ``plan.profile`` times each."""


def _bind_steps(gplan: GraphPlan, lib: Any, indexes: list[int | None]) -> list[Step]:
    """The runtime steps of the plan's operations; consecutive kernels share one foreign
    call (:class:`NativeRunStep`) and consecutive argument checks one step."""
    steps: list[Step] = []
    run: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    labels: list[str] = []
    separate = os.environ.get(PROFILE_ENV_VAR) == "1"

    def flush() -> None:
        if run:
            steps.append(NativeRunStep(lib.kiln_run, tuple(run), "; ".join(labels)))
            run.clear()
            labels.clear()

    kernel_index = 0
    for op in gplan.ops:
        if op.step == "kernel":
            index = indexes[kernel_index]
            kernel_index += 1
            if index is not None:
                args = op.args
                run.append((index, tuple(pv.root().slot for pv in args), tuple(pv.byte_offset for pv in args)))
                labels.append(op.label)
                if separate:
                    flush()
                continue
            flush()
            steps.append(_kernel_fallback(op))
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
            source = op.inputs[0]
            view = (tuple(source.meta.shape), tuple(source.meta.stride()), source.meta.storage_offset())
            steps.append(PackStep(source.root().slot, view, outs[0], op.label,
                                  panels=op.outputs[0].type.shape != source.type.shape))
        elif op.step == "clone":
            steps.append(TorchStep(torch.clone, ins, outs, False, op.label))
        elif op.step == "release":
            steps.append(ReleaseStep(ins))
        else:
            raise BackendError(f"kiln bug: unknown plan operation {op.step!r}")
    flush()
    return steps


def _copy_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def _kernel_fallback(op: PlanOp) -> TorchStep:
    """A kernel that could not be generated: ``torch.matmul`` for its GEMM, the reference of
    its node for its loops, written into its outputs.  Inputs that are views (kernels read
    them through their root) are rebuilt from their roots with ``as_strided``."""
    ins = [pv.root().slot for pv in op.inputs]
    views = [(tuple(pv.meta.shape), pv.meta.stride(), pv.meta.storage_offset()) if pv.base is not None else None
             for pv in op.inputs]
    outs = [pv.slot for pv in (*op.outputs, *op.temps)]
    n_in, n_out = len(ins), len(op.outputs)
    loops = _reference_into(op.node) if op.node is not None else None
    gemm = op.gemm is not None
    result_index = (len(op.outputs) if op.temps else 0)  # where the GEMM result sits among outs

    def fallback(*tensors: torch.Tensor) -> None:
        # as_strided's offset is absolute in the storage: add the root's own offset (arena)
        args = [t if v is None else torch.as_strided(t, v[0], v[1], t.storage_offset() + v[2])
                for t, v in zip(tensors[:n_in], views)]
        targets = list(tensors[n_in:])
        if gemm:
            result = targets[result_index]
            b = args[1]
            if b.dim() == 3 and op.gemm.packed_b and op.gemm.provider == KILN_PROVIDER:  # panels -> K x N
                b = b.permute(1, 0, 2).reshape(b.shape[1], -1)[:, :op.gemm.n]
            torch.matmul(args[0], b, out=result)
            if loops is not None:
                loop_outs = [o for i, o in enumerate(targets[:n_out]) if not (i == 0 and not op.temps)]
                loops(result, *args[2:], *loop_outs)
            return
        assert loops is not None
        loops(*args, *targets[:n_out])
    return TorchStep(fallback, tuple(ins), tuple(outs), True, op.label)


def _reference_into(node: Node) -> Callable[..., None]:
    """A generated kernel's fallback: the node's reference, written into the planned outputs."""
    run = reference_call(node).function
    n_out = len(node.outputs)

    def reference_into(*tensors: torch.Tensor) -> None:
        ins, outs = tensors[: len(tensors) - n_out], tensors[len(tensors) - n_out:]
        results = run(*ins)
        results = results if isinstance(results, tuple) else (results,)
        for out, r in zip(outs, results):
            out.copy_(r)
    return reference_into


def _info(gplan: GraphPlan, memory: MemoryPlan, symbols: list[str | None], fallbacks: dict[str, str],
          hit: bool, key: str, entry: Any, build_s: float) -> dict[str, Any]:
    return {
        "kernels": sum(s is not None for s in symbols),
        "library_calls": sum(op.step == "library" for op in gplan.ops),
        "fallbacks": dict(fallbacks),
        "choices": dict(gplan.choices),
        "memory": memory.report(),
        "arena_bytes": memory.arena_bytes,
        "intermediate_bytes": memory.total_bytes,
        "cache_hit": hit,
        "cache_key": key,
        "source": str(entry.source) if entry is not None else None,
        "build_s": build_s,
    }


# ------------------------------------------------------------------------------ timing probes
def _probe_graph(node: Node) -> tuple[Graph, Node]:
    """A graph holding only a copy of ``node``, its operands as inputs."""
    probe = Graph("probe")
    inputs = [probe.add_input(f"x{i}", v.type) for i, v in enumerate(node.inputs)]
    copy = probe.add_node(node.op, inputs, node.attrs)
    probe.set_outputs(copy.outputs)
    return probe, copy


def _random_tensor(type: Any) -> torch.Tensor:
    shape = tuple(type.shape)
    if type.dtype.is_floating:
        return torch.randn(shape, dtype=torch_dtype(type.dtype))
    return torch.zeros(shape, dtype=torch_dtype(type.dtype))  # valid indices for gathers


def _best_time(run: Callable[[], Any], repeat: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best

