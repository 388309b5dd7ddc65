"""The ``tvm`` backend: kiln's kernels as TVM TensorIR, built by ``tvm.compile``, run as one
call plan on the host.

The build pipeline is the device-neutral one of :mod:`kiln.backends.common.build`; this
module fills its hooks (:class:`TvmBuild`):

* implementations and the partition are the cpu backend's (:data:`kiln.backends.cpu.library.SELECTION`,
  :class:`kiln.backends.cpu.partition.CpuPartitioner` without native GEMMs or foreign
  convolutions): library calls
  (MKL GEMMs, oneDNN convolutions, attention) with their epilogues as generated kernels
  by rule, generated kernels for everything else, ``select="generated"`` or ``"time"``
  as for every compiled backend;
* sources: every kernel is lowered (:mod:`kiln.passes.lower`) and translated to a PrimFunc
  (:mod:`.tir`): with ``schedules="kiln"`` after kiln's isl-checked default schedule
  (:mod:`kiln.backends.cpu.schedules`), loop for loop; with ``"tvm"`` or ``"tuned"`` the
  unscheduled program in block form, scheduled by dlight or MetaSchedule records
  (:mod:`.schedules`).  All PrimFuncs of a graph form one IRModule, built by one
  ``tvm.compile`` into one library (:mod:`.toolchain`) kept in the compile cache;
* loading: the library from the cache, kernels launched by :class:`.launcher.TvmLauncher`
  with data pointers; a kernel that cannot be translated runs its node's reference on the
  host (``info["fallbacks"]``).

Options (``TvmBackend.option_defaults``):

* ``target`` (None: LLVM for the host CPU, ``{"kind": "llvm", "mcpu": <host>}``): a dict
  of target attributes or a ``tvm.target.Target`` (host CPU targets only: the plan's
  tensors live on the host);
* ``schedules`` (``"kiln"``): ``"kiln"``, ``"tvm"`` or ``"tuned"`` (above);
* ``tune_trials`` (0): with ``schedules="tuned"``, tune the kernels without a record first,
  this many MetaSchedule trials in all (``kiln tune --backend tvm`` does it for a model);
* ``threads`` (None: ``torch.get_num_threads()``): what kiln's schedules plan for and the
  size of TVM's thread pool;
* ``cache``, ``cache_dir``, ``select``, ``poison``: as for every compiled backend.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from kiln.backends.base import BackendError
from kiln.backends.common.build import BuildPipeline, CompiledBackend, CompiledExecutable
from kiln.backends.common.partition import GraphPlan, PlanOp
from kiln.backends.common.select import Choice
from kiln.backends.common.toolchain import sources_digest
from kiln.backends.cpu.backend import kernel_fallback
from kiln.backends.cpu.library import SELECTION
from kiln.backends.cpu.partition import CpuPartitioner
from kiln.backends.cpu.toolchain import build_identity as kiln_build_identity
from kiln.ir import Graph, Node
from kiln.runtime.cache import CompileCache, digest
from kiln.runtime.call_plan import Step

_PACKAGE = Path(__file__).resolve().parent
SCHEDULES = ("kiln", "tvm", "tuned")


@dataclass
class TvmKernel:
    """One translated kernel: its symbol, PrimFunc, form (``"kiln"``: scheduled loops,
    ``"blocks"``: for TVM's schedules), the program text it came from, its constants (in
    argument order after the plan's buffers) and why it is not in the requested form."""

    symbol: str
    func: Any
    form: str
    program: str
    args: tuple[str, ...]
    constants: list[np.ndarray] = field(default_factory=list)
    note: str = ""
    scratch: list = field(default_factory=list)
    """``(shape, dtype)`` of its scratch buffers, passed after the constants."""


class TvmExecutable(CompiledExecutable):
    """A graph built by the tvm backend (see :class:`~kiln.backends.common.build.CompiledExecutable`);
    ``source`` is the module document (JSON), :attr:`tir` the module as TVMScript."""

    @property
    def tir(self) -> str:
        return json.loads(self._source_text)["module"] if self._source_text else ""


class TvmBackend(CompiledBackend):
    """TensorIR kernels built by TVM: see the module docstring."""

    name: ClassVar[str] = "tvm"
    option_defaults: ClassVar[Mapping[str, Any]] = {
        "cache": True, "cache_dir": None, "select": "rule", "poison": False, "threads": None, "target": None,
        "schedules": "kiln", "tune_trials": 0,
    }
    selection = SELECTION
    selection_file: ClassVar[str] = "tvm_selection.json"

    def check_options(self, graph: Graph, opts: Mapping[str, Any]) -> None:
        super().check_options(graph, opts)
        if opts["schedules"] not in SCHEDULES:
            raise BackendError(f"kiln backend 'tvm': option schedules={opts['schedules']!r} is not one of "
                               f"{', '.join(SCHEDULES)}")
        trials = opts["tune_trials"]
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 0:
            raise BackendError(f"kiln backend 'tvm': option tune_trials must be an int >= 0, got {trials!r}")
        if trials and opts["schedules"] != "tuned":
            raise BackendError("kiln backend 'tvm': tune_trials needs schedules='tuned' (the tuned records are "
                               "what a build with schedules='tuned' uses)")
        target = opts["target"]
        if target is not None and not isinstance(target, Mapping) and type(target).__name__ != "Target":
            raise BackendError(f"kiln backend 'tvm': option target must be a dict of TVM target attributes "
                               f"(e.g. {{'kind': 'llvm', 'mcpu': 'znver2'}}) or a tvm.target.Target, got {target!r}")
        if isinstance(target, Mapping) and target.get("kind", "llvm") != "llvm":
            raise BackendError(f"kiln backend 'tvm' runs on the host: target kind {target['kind']!r} is not "
                               f"supported; use kind 'llvm'")

    def pipeline(self, opts: Mapping[str, Any]) -> TvmBuild:
        from .toolchain import TvmToolchain, host_target  # noqa: PLC0415 (TVM loads on first build)

        try:
            target = host_target(opts["target"])
        except Exception as e:  # noqa: BLE001 - TVM's own error types
            raise BackendError(f"kiln backend 'tvm': TVM refused target {opts['target']!r}: {e}") from e
        cache = CompileCache(opts["cache_dir"], enabled=bool(opts["cache"]))
        return TvmBuild(self, cache, TvmToolchain(target), threads=int(opts["threads"] or torch.get_num_threads()),
                        schedules=opts["schedules"], tune_trials=int(opts["tune_trials"]),
                        poison=bool(opts["poison"]))


class TvmBuild(BuildPipeline):
    """One tvm build configuration: cache, target, threads, schedules (module docstring)."""

    executable_type = TvmExecutable

    def __init__(self, backend: TvmBackend, cache: CompileCache, toolchain, *, threads: int, schedules: str,
                 tune_trials: int = 0, poison: bool = False):
        super().__init__(backend, cache, toolchain, poison=poison)
        self.threads = threads
        self.schedules = schedules
        self.tune_trials = tune_trials
        self.progress: Callable[[str], None] | None = None
        self._modules: dict[str, Any] = {}  # document digest -> its IRModule (built without parsing)

    @property
    def target(self):
        return self.toolchain.target

    def partition(self, graph: Graph, choose: Callable[[Node], Choice]) -> GraphPlan:
        return CpuPartitioner(graph, self.backend, None, foreign=False).run(choose)

    def code_options(self, plan: GraphPlan) -> dict[str, Any]:
        options = {"choices": plan.choices, "threads": self.threads, "schedules": self.schedules}
        if self.schedules == "tuned":
            options["records"] = self._records_digest()
            options["tune_trials"] = self.tune_trials
        return options

    def _records_digest(self) -> str:
        """The tuning database's records (a new record changes the tuned build)."""
        from .schedules import tuning_dir  # noqa: PLC0415

        folder = tuning_dir(self.cache.directory)
        return sources_digest(folder.glob("*.json"), folder)

    def build_identity(self) -> str:
        return f"tvm-backend {sources_digest(_PACKAGE.glob('*.py'), _PACKAGE, kiln_build_identity())}"

    def kernel_source(self, symbol: str, op: PlanOp) -> tuple[TvmKernel, list]:
        from kiln.backends.cpu.codegen import sanitize_program  # noqa: PLC0415 (lowering loads on a miss only)
        from kiln.backends.cpu.schedules import default_schedule  # noqa: PLC0415
        from kiln.passes.lower import lower_node  # noqa: PLC0415

        from .tir import UnsupportedProgramError, block_func, scheduled_func  # noqa: PLC0415

        if op.node is None or op.gemm is not None:
            raise BackendError(f"kiln bug: the tvm backend planned a kernel without a loop program ({op.label})")
        lowered = lower_node(op.node)
        program, renamed = sanitize_program(lowered.program)
        names = (*dict.fromkeys(renamed[n] for n in lowered.inputs), *(renamed[n] for n in lowered.outputs))
        if len(names) != len(op.args):
            raise BackendError(f"kiln bug: kernel {op.label} has {len(op.args)} arguments but its program "
                               f"{len(names)} buffers")
        constants = {renamed[name]: data for name, data in lowered.constants.items()}
        args = (*names, *constants)
        arrays = [np.asarray(data, dtype=program.buffer(n).dtype.numpy) for n, data in constants.items()]
        note = ""
        if self.schedules != "kiln":
            try:
                func = block_func(program, args, symbol)
                return TvmKernel(symbol, func, "blocks", str(program), args, arrays), []
            except UnsupportedProgramError as e:
                note = f"kiln's schedule (no block form: {e})"
        scheduled = default_schedule(program, op.template, threads=self.threads)
        func, scratch = scheduled_func(scheduled.program, args, symbol)
        return TvmKernel(symbol, func, "kiln", str(scheduled.program), args, arrays, note, scratch), scheduled.trace

    def source_identity(self, source: TvmKernel) -> str:
        h = hashlib.sha256()
        for a in source.constants:
            h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
        return f"{source.form}|{source.args}|{h.hexdigest()}|{source.program}"

    def translation_unit(self, sources: list[TvmKernel]) -> str:
        from .schedules import database, default_schedules, tune, tuned, tuning_dir  # noqa: PLC0415
        from .tir import pointer_params  # noqa: PLC0415
        from .toolchain import module_document  # noqa: PLC0415

        blocks = {k.symbol: k.func for k in sources if k.form == "blocks"}
        notes = {k.symbol: k.note for k in sources if k.note}
        scheduled: dict[str, Any] = {}
        if blocks and self.schedules == "tuned":
            work_dir = tuning_dir(self.cache.directory)
            if self.tune_trials:
                tune(blocks, self.target, work_dir, self.tune_trials, self.progress)
            db = database(work_dir)
            for symbol, func in blocks.items():
                found = tuned(func, db, self.target)
                if found is not None:
                    scheduled[symbol] = found.with_attr("global_symbol", symbol)
                    notes[symbol] = "MetaSchedule record"
                else:
                    notes[symbol] = "dlight (no MetaSchedule record)"
        rest = {s: f for s, f in blocks.items() if s not in scheduled}
        scheduled.update(default_schedules(rest, self.target, notes))
        funcs = {}
        for k in sources:
            if k.form == "blocks":
                funcs[k.symbol], k.scratch = pointer_params(scheduled[k.symbol], k.symbol)
            else:
                funcs[k.symbol] = k.func
        from .compat import tvm  # noqa: PLC0415

        module = tvm.IRModule(funcs)
        kernels = {k.symbol: (k.constants, k.scratch) for k in sources if k.constants or k.scratch}
        text = module_document(module, self.target, kernels, notes)
        self._modules[digest(text)] = module
        return text

    def compile(self, text: str, folder: Path) -> Path:
        return self.toolchain.build_module(self._modules.pop(digest(text), None), text, folder)

    def load(self, path: Path | None, symbols: list[str], plan: GraphPlan):
        if path is None:
            return None, None
        from .launcher import LoadedKernel, TvmLauncher  # noqa: PLC0415
        from .toolchain import load_artifact, set_threads  # noqa: PLC0415

        library, kernels = load_artifact(path)
        set_threads(self.threads)
        table = []
        for symbol in symbols:
            try:
                function = library[symbol]
            except Exception as e:  # noqa: BLE001
                raise BackendError(f"kiln bug: the cached TVM library has no kernel {symbol}; delete the cache "
                                   f"entry") from e
            constants, scratch = kernels.get(symbol, ([], []))
            tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in constants]
            table.append(LoadedKernel(symbol, function, tensors, scratch))
        return library, TvmLauncher(table)

    def run(self, graph: Graph, choose: Callable[[Node], Choice]) -> CompiledExecutable:
        """The common pipeline; ``info`` also gets ``schedules`` notes per kernel (``tvm_notes``)."""
        exe = super().run(graph, choose)
        notes: dict[str, str] = {}
        if exe.source:
            notes = json.loads(exe.source).get("notes", {})
        exe.info["tvm_notes"] = notes
        return exe

    def kernel_fallback(self, op: PlanOp) -> Step:
        return kernel_fallback(op)


__all__ = ["SCHEDULES", "TvmBackend", "TvmBuild", "TvmExecutable", "TvmKernel"]
