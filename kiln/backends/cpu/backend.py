"""The ``cpu`` backend: generated C with OpenMP plus ATen library calls, one shared object per
graph, run as a flat call plan on the host.

The build pipeline is the device-neutral one of :mod:`kiln.backends.common.build`; this
module fills its hooks (:class:`CpuBuild`):

* implementations: this backend's library table, generated kernels, and the numpy
  reference on the host for the rest (:data:`.library.SELECTION`);
* the partition: native GEMMs with packed weights and channels-last convolution chains
  (:class:`.partition.CpuPartitioner`), GEMM providers chosen by :class:`.gemm.GemmTuner`;
* sources: every generated kernel lowered (:mod:`kiln.passes.lower`), scheduled
  (:mod:`.schedules`, OpenMP) and printed (:mod:`.codegen`) into one C translation unit,
  compiled once by the C toolchain (:mod:`.toolchain`) and kept in the compile cache;
* loading: ``ctypes`` (the BLAS and kiln GEMM function pointers set once), kernels launched
  by :class:`kiln.runtime.call_plan.HostLauncher`; a kernel that cannot be generated runs
  its node's reference (and ``torch.matmul`` for its GEMM) on the host.

Options (defaults in ``CpuBackend.option_defaults``):

* ``cache`` (True): use the compile cache; ``cache_dir`` (None): its folder (default
  ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``);
* ``select`` (``"rule"``): ``"rule"``, ``"time"`` (time library vs generated once per
  node signature) or ``"generated"`` (no library calls); see :mod:`kiln.backends.common.select`;
* ``threads`` (None): threads the schedules plan for (default ``torch.get_num_threads()``);
  ``1`` marks nothing parallel;
* ``schedule`` (True): apply the default schedules (False: plain serial loops);
* ``poison`` (False): fill intermediate and output memory with NaN bytes before every call
  (a testing aid that exposes reads of unwritten memory);
* ``updated_params`` (()): names of params the caller changes before every call (a
  training step's weights, which ``kiln.compile_train`` passes): their GEMMs read them as
  they are instead of from a packed copy that would be made again at every call;
* ``nchw_convs`` (()): names of the results of convolution nodes (plain ``conv`` nodes, or
  ``fused`` nodes whose anchor is a convolution) whose results stay NCHW: their library
  call's result is made contiguous NCHW instead of kept channels-last, so no layout
  conversion is planned around them (the per-site layout choice of
  :mod:`kiln.tuning.rl.site_kinds`).

Thread safety: the executable may be called from several threads at once; each thread gets
its own workspace (arena and pointer arrays), so calls never share intermediate buffers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from kiln.backends.base import BackendError
from kiln.backends.common.build import PROFILE_ENV_VAR, BuildPipeline, CompiledBackend, CompiledExecutable
from kiln.backends.common.partition import GraphPlan, PlanOp
from kiln.backends.common.select import Choice
from kiln.ir import Graph, Node
from kiln.ir.sizes import graph_sizes
from kiln.ir.types import DType, SizeRange
from kiln.runtime.cache import CompileCache
from kiln.runtime.call_plan import HostLauncher, Step, TorchStep

from . import microgemm, toolchain
from .codegen import FOREIGN_ROWS, KernelSource, kernel_function, sanitize_program, translation_unit
from .gemm import KILN_PROVIDER, PROVIDERS, GemmTuner, blas_providers, set_blas_threads
from .library import SELECTION, reference_call
from .packing import pack_step
from .partition import CpuPartitioner
from .standalone import runner_library


GEMM_BUCKETS = (8, 32, 128, 512)
"""Values of a graph's one named size at which its GEMM providers are tuned (see
:meth:`CpuBuild.size_buckets`)."""


class CpuExecutable(CompiledExecutable):
    """A graph built by the cpu backend (see :class:`kiln.backends.common.build.CompiledExecutable`;
    ``info["fallbacks"]`` lists the nodes run with the numpy reference, and why)."""


class CpuBackend(CompiledBackend):
    """Native CPU code: see the module docstring."""

    name: ClassVar[str] = "cpu"
    option_defaults: ClassVar[Mapping[str, Any]] = {
        "cache": True, "cache_dir": None, "select": "rule", "threads": None, "schedule": True, "poison": False,
        "updated_params": (), "nchw_convs": (),
    }
    selection = SELECTION
    device: ClassVar[str] = "cpu"
    dynamic_shapes: ClassVar[bool] = True

    def pipeline(self, opts: Mapping[str, Any]) -> CpuBuild:
        threads = int(opts["threads"] or torch.get_num_threads())
        cache = CompileCache(opts["cache_dir"], enabled=bool(opts["cache"]))
        cc = toolchain.find_compiler()
        return CpuBuild(self, cache, cc, threads=threads, schedule=bool(opts["schedule"]), poison=bool(opts["poison"]),
                        tuner=_tuner(cache, cc, threads, persist=True), updated=opts["updated_params"],
                        nchw=opts["nchw_convs"])


def _tuner(cache: CompileCache, cc: str, threads: int, *, persist: bool) -> GemmTuner:
    """The GEMM tuner of a build; its choices persist in ``gemm.json`` of the cache folder."""
    path = cache.directory / "gemm.json" if persist and cache.enabled else None
    return GemmTuner(path, toolchain.compiler_identity(cc), threads, microgemm.library(cache, cc))


class CpuBuild(BuildPipeline):
    """One cpu build configuration: cache, compiler ``cc``, threads, schedules, GEMM tuner."""

    executable_type = CpuExecutable

    def __init__(self, backend: CpuBackend, cache: CompileCache, cc: str, *, threads: int, schedule: bool,
                 poison: bool = False, tuner: GemmTuner | None = None, updated: Sequence[str] = (),
                 nchw: Sequence[str] = ()):
        super().__init__(backend, cache, toolchain.cpu_compiler(cc), poison=poison)
        self.updated = frozenset(updated)
        """Params the caller changes at every call (a training step's weights): never packed."""
        self.nchw = frozenset(nchw)
        """Results of convolution nodes kept NCHW (option ``nchw_convs``)."""
        self.cc = cc
        self.threads = threads
        self.schedule = schedule
        self.tuner = tuner or _tuner(cache, cc, threads, persist=False)

    def partition(self, graph: Graph, choose: Callable[[Node], Choice]) -> GraphPlan:
        tuner = self.tuner
        gemm = tuner.choose if blas_providers() or tuner.micro is not None else None
        return CpuPartitioner(graph, self.backend, gemm, tune_sizes=getattr(self, "tune_sizes", None),
                              updated=self.updated, nchw=self.nchw, threads=self.threads).run(choose)

    def size_buckets(self, graph: Graph) -> list[dict[str, int]]:
        """GEMM provider buckets of a graph with one named size: the size at
        :data:`GEMM_BUCKETS` (inside its range).  The tuner times each GEMM at each bucket;
        a variant is compiled only for buckets whose fastest providers differ (kiln's GEMM
        at a few rows, a BLAS at many, for instance)."""
        names = sorted(graph_sizes(graph))
        if len(names) != 1 or not any(n.op.has("matmul") or n.op_name in ("matmul", "fused") for n in graph.nodes):
            return []
        r = graph.sizes.get(names[0], SizeRange())
        values = sorted({max(r.lo, v if r.hi is None else min(v, r.hi)) for v in GEMM_BUCKETS})
        return [{names[0]: v} for v in values]

    def code_options(self, plan: GraphPlan) -> dict[str, Any]:
        options = {"threads": self.threads, "schedule": self.schedule, "choices": plan.choices,
                   "gemm": _providers(plan), "schedule_records": _records_digest(self)}
        if self.updated:
            options["updated_params"] = sorted(self.updated)
        if self.nchw:
            options["nchw_convs"] = sorted(self.nchw)
        return options

    def build_identity(self) -> str:
        return toolchain.build_identity()

    def kernel_source(self, symbol: str, op: PlanOp) -> tuple[KernelSource, list]:
        """The kernel of ``op`` (its GEMM and/or its lowered, sanitized, scheduled loop program)
        and the schedule's trace."""
        from kiln.ir.loops.expr import SIZE_PREFIX  # noqa: PLC0415
        from kiln.passes.lower import lower_node  # noqa: PLC0415 (the loop IR loads on a cache miss only)

        from .schedules import default_schedule  # noqa: PLC0415

        head = ("gemm_a", "gemm_b") if op.gemm is not None else ()
        if op.node is None:
            return KernelSource(symbol, None, (*head, "gemm_c"), comment=op.label, gemm=op.gemm), []
        lowered = lower_node(op.node)
        program, renamed = sanitize_program(lowered.program)
        order = getattr(self, "size_order", {})
        size_table = {new.name: order[old.name[len(SIZE_PREFIX):]]
                      for old, new in zip(lowered.program.params, program.params)}
        trace: list = []
        if self.schedule:
            hints = getattr(self, "size_hint", {})
            hint = {name: hints[index] for name, index in size_table.items()} if size_table else None
            ranges = getattr(self, "size_ranges", [])
            in_range = {name: ranges[index] for name, index in size_table.items()} if size_table else None
            scheduled = default_schedule(program, op.template, threads=self.threads, records=self.cache.directory,
                                         size_hint=hint, ranges=in_range)
            program, trace = scheduled.program, scheduled.trace
        names = (*head, *dict.fromkeys(renamed[n] for n in lowered.inputs), *(renamed[n] for n in lowered.outputs))
        if len(names) != len(op.args):
            raise BackendError(f"kiln bug: kernel {op.label} has {len(op.args)} arguments but its program "
                               f"{len(names)} buffers")
        constants = {renamed[name]: data for name, data in lowered.constants.items()}
        return KernelSource(symbol, program, names, constants, comment=op.label, gemm=op.gemm,
                            size_table=size_table), trace

    def source_identity(self, source: KernelSource) -> str:
        return kernel_function(replace(source, symbol="kiln_same", comment=""))

    def translation_unit(self, sources: list[KernelSource]) -> str:
        return translation_unit(sources, toolchain.vector_math_declarations(toolchain.vector_math(self.cc)))

    def load(self, path: Path | None, symbols: list[str], plan: GraphPlan) -> tuple[Any, HostLauncher | None]:
        """The loaded shared object (GEMM function pointers set) and its launcher."""
        providers = _providers(plan)
        if any(p.startswith("openblas") for p in providers):
            set_blas_threads(self.threads)
        foreign = {op.foreign.address: op.foreign for op in plan.ops if op.step == "foreign"}
        if path is None and not foreign:
            return None, None
        lib = ctypes.CDLL(str(path)) if path is not None else runner_library()
        if lib is None:
            raise BackendError("kiln's convolution kernels need the kernel-table runner, which did not build")
        if providers:
            for index, name in enumerate(PROVIDERS):
                provider = blas_providers().get(name)
                if provider is not None:
                    lib.kiln_set_blas(ctypes.c_long(index), ctypes.c_void_p(provider.sgemm),
                                      ctypes.c_void_p(provider.dgemm))
            if self.tuner.micro is not None:
                lib.kiln_set_mgemm(ctypes.c_void_p(self.tuner.micro.address))
                if any(op.gemm.dtype == DType.bfloat16 for op in plan.kernels if op.gemm is not None):
                    bf16 = self.tuner.micro.bf16
                    lib.kiln_set_mgemm_bf16(ctypes.c_void_p(bf16.address if bf16 is not None else None))
        lib.kiln_run.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_long, ctypes.POINTER(ctypes.c_void_p)]
        lib.kiln_run.restype = None
        lib.kiln_add_kernel.argtypes, lib.kiln_add_kernel.restype = [ctypes.c_void_p], ctypes.c_long
        rows = {address: lib.kiln_add_kernel(ctypes.c_void_p(address)) for address in foreign}
        if any(row < 0 for row in rows.values()):
            raise BackendError(f"kiln bug: more than {FOREIGN_ROWS} distinct foreign kernels in one plan")
        return lib, HostLauncher(lib.kiln_run, rows)

    def kernel_fallback(self, op: PlanOp) -> Step:
        return kernel_fallback(op)

    def pack_step(self, op: PlanOp) -> Step:
        return pack_step(op)


def _records_digest(build: CpuBuild) -> str:
    """The tuning records of this machine (:mod:`kiln.backends.common.records`): part of the
    cache key, so a new record rebuilds the graphs it may change."""
    if not build.schedule:
        return "off"
    from kiln.backends.common.records import machine_key, store_for  # noqa: PLC0415

    return store_for(build.cache.directory).digest(machine_key(build.threads))


def _providers(plan: GraphPlan) -> list[str]:
    """The GEMM provider of each GEMM kernel (``+packed`` when it reads a packed weight)."""
    return [op.gemm.provider + ("+packed" if op.gemm.packed_b else "") for op in plan.kernels if op.gemm is not None]


def build_executable(graph: Graph, choose: Callable[[Node], Choice], cache: CompileCache, cc: str, *,
                     threads: int, schedule: bool, poison: bool = False,
                     tuner: GemmTuner | None = None) -> CpuExecutable:
    """Build ``graph`` with the cpu pipeline, choosing implementations by ``choose`` (the
    module docstring); ``tuner`` picks GEMM providers (default: one that remembers nothing)."""
    build = CpuBuild(CpuBackend(), cache, cc, threads=threads, schedule=schedule, poison=poison, tuner=tuner)
    return build.run(graph, choose)


# ------------------------------------------------------------------------------ fallbacks
def kernel_fallback(op: PlanOp) -> TorchStep:
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


__all__ = ["GEMM_BUCKETS", "PROFILE_ENV_VAR", "CpuBackend", "CpuBuild", "CpuExecutable", "build_executable", "kernel_fallback"]
