"""The ``triton`` backend: Triton kernels generated from kiln's fused groups, PyTorch library
calls, and (when present) task-mapped CUDA kernels, run as one call plan on a device.

The build pipeline is the device-neutral one of :mod:`kiln.backends.common.build`; this
module fills its hooks (:class:`TritonBuild`):

* implementations: :class:`.library.TritonSelection` (``"triton"``, ``"library"``,
  ``"cuda"``, host ``"reference"``; by rule, or timed with ``select="time"``);
* the partition: the common one, with the backend's PyTorch table for library calls and
  the host reference for nodes nothing else runs (:class:`TritonPartitioner`);
* sources: every kernel of the plan becomes part of one Python module of ``@triton.jit``
  kernels (:mod:`.generate`, :mod:`.source`), checked and kept in the compile cache as an
  artifact of type ``"triton"`` (:mod:`.toolchain`);
* loading: the module is imported from the cache, each kernel gets its launch
  configuration (interpreter: fixed; GPU: timed once and remembered, :mod:`.configs`), and
  :class:`.launcher.TritonLauncher` launches them; tensors live on the backend's device
  (``TorchDeviceAllocator``).  A kernel that cannot be generated runs its node's reference
  on the host.

Options (``TritonBackend.option_defaults``):

* ``interpret`` (None: ``True`` when CUDA is unavailable): run kernels in Triton's
  interpreter on CPU tensors (the backend sets ``TRITON_INTERPRET=1`` while it defines
  them); ``False`` compiles them for the GPU;
* ``device`` (None: ``"cpu"`` when interpreting, else ``"cuda"``): where the plan's tensors
  live; the executable refuses tensors on another device;
* ``select`` (``"rule"``), ``"time"`` or ``"generated"`` (Triton wherever it can);
* ``tune`` (True): time each kernel's configurations on the GPU once (ignored when
  interpreting); ``config`` (None): a dict of launch parameters overriding every kernel's
  configuration (``{"XBLOCK": 128, "BLOCK_K": 32}``: tests and experiments);
* ``tf32`` (False): let float32 ``tl.dot`` use TF32 tensor cores (faster, ~1e-3 relative);
* ``cache``, ``cache_dir``, ``poison``: as for every compiled backend.

``KILN_LOGS=kernels`` logs every kernel (name, choice, configuration, time, source).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from kiln.backends.base import BackendError
from kiln.backends.common.build import (
    BuildPipeline,
    CompiledBackend,
    CompiledExecutable,
)
from kiln.backends.common.partition import GraphPlan, Partitioner, PlanOp
from kiln.backends.common.select import Choice
from kiln.backends.common.toolchain import sources_digest
from kiln.backends.cpu.backend import kernel_fallback as host_kernel_fallback
from kiln.backends.cpu.toolchain import build_identity as kiln_build_identity
from kiln.ir import Graph, Node
from kiln.runtime.cache import CompileCache
from kiln.runtime.call_plan import Step, TorchDeviceAllocator, TorchStep
from kiln.runtime.logs import enabled, kernel_log
from kiln.runtime.timing import best_time

from . import configs
from .launcher import LoadedKernel, TritonLauncher, load_entry, random_operands
from .library import TritonSelection, host_reference_call, torch_call
from .source import KernelSource, module_text
from .toolchain import TritonToolchain, import_kernels, interpreted_library, triton_version

_PACKAGE = Path(__file__).resolve().parent


class TritonExecutable(CompiledExecutable):
    """A graph built by the triton backend (see :class:`~kiln.backends.common.build.CompiledExecutable`);
    it checks that its first argument lives on the plan's device."""

    def __call__(self, args: Sequence[torch.Tensor], out: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        if args and args[0].device.type != self.plan.device.type:
            raise BackendError(f"graph @{self.graph.name} was built by the triton backend for device "
                               f"'{self.plan.device}' but received tensors on '{args[0].device}'; move the model "
                               f"and inputs there, or build with interpret={self.plan.device.type != 'cpu'}")
        return super().__call__(args, out)


class TritonBackend(CompiledBackend):
    """Triton kernels and library calls on a device: see the module docstring."""

    name: ClassVar[str] = "triton"
    option_defaults: ClassVar[Mapping[str, Any]] = {
        "cache": True, "cache_dir": None, "select": "rule", "poison": False, "interpret": None, "device": None,
        "tune": True, "config": None, "tf32": False,
    }
    selection = TritonSelection()
    selection_file: ClassVar[str] = "triton_selection.json"

    def check_options(self, graph: Graph, opts: Mapping[str, Any]) -> None:
        super().check_options(graph, opts)
        if opts["config"] is not None and not isinstance(opts["config"], Mapping):
            raise BackendError(f"kiln backend 'triton': option config must be a dict of launch parameters, got "
                               f"{opts['config']!r}")
        interpret, device = _placement(opts)
        if not interpret and not torch.cuda.is_available():
            raise BackendError("kiln backend 'triton': interpret=False needs a CUDA device and none is available; "
                               "leave interpret unset (or True) to run the kernels in Triton's interpreter on the CPU")
        if interpret and torch.device(device).type != "cpu":
            raise BackendError(f"kiln backend 'triton': the interpreter runs on CPU tensors, not device={device!r}")

    def pipeline(self, opts: Mapping[str, Any]) -> TritonBuild:
        interpret, device = _placement(opts)
        cache = CompileCache(opts["cache_dir"], enabled=bool(opts["cache"]))
        toolchain = TritonToolchain(interpret, device)
        tuner = configs.ConfigTuner(cache.directory / "triton_configs.json" if cache.enabled else None,
                                    toolchain.identity(), tune=bool(opts["tune"]) and not interpret)
        return TritonBuild(self, cache, toolchain, interpret=interpret, device=device, tuner=tuner,
                           overrides=dict(opts["config"] or {}), tf32=bool(opts["tf32"]), poison=bool(opts["poison"]))

    def run_device(self, opts: Mapping[str, Any]) -> str:
        return _placement(opts)[1]


def _placement(opts: Mapping[str, Any]) -> tuple[bool, str]:
    interpret = opts["interpret"]
    if interpret is None:
        interpret = not torch.cuda.is_available()
    device = opts["device"] or ("cpu" if interpret else "cuda")
    return bool(interpret), str(device)


class TritonPartitioner(Partitioner):
    """The common partition with the backend's implementations (module docstring)."""

    def library_call(self, node: Node, persistent: list[bool]):
        return torch_call(node, persistent)

    def host_call(self, node: Node):
        return host_reference_call(node)

    def node(self, node: Node, choice: Choice) -> None:
        impl = choice.impl
        if impl == "triton":
            return super().node(node, Choice("generated", choice.reason))
        if impl == "library":
            return super().node(node, Choice("library+epilogue" if node.op_name == "fused" else "library",
                                             choice.reason))
        if impl in ("view", "fold", "reference"):
            return super().node(node, choice)
        candidate = self.backend.selection.candidate(impl)
        if candidate.call is None:
            raise BackendError(f"kiln bug: implementation {impl!r} of node %{node.outputs[0].name} has no call")
        ins = [self.of[v] for v in node.inputs]
        label = f"%{', %'.join(v.name for v in node.outputs)} = {node.op_name}"
        self.library(candidate.call(node, self.persistent(ins)), ins, list(node.outputs), label)
        return None


class TritonBuild(BuildPipeline):
    """One triton build configuration (module docstring)."""

    executable_type = TritonExecutable

    def __init__(self, backend: TritonBackend, cache: CompileCache, toolchain: TritonToolchain, *, interpret: bool,
                 device: str, tuner: configs.ConfigTuner, overrides: dict, tf32: bool, poison: bool = False):
        super().__init__(backend, cache, toolchain, poison=poison)
        self.interpret = interpret
        self.device = torch.device(device)
        self.tuner = tuner
        self.overrides = overrides
        self.tf32 = tf32
        self._allocator = TorchDeviceAllocator(self.device)

    @property
    def allocator(self) -> TorchDeviceAllocator:
        return self._allocator

    def partition(self, graph: Graph, choose: Callable[[Node], Choice]) -> GraphPlan:
        return TritonPartitioner(graph, self.backend).run(choose)

    def run(self, graph: Graph, choose: Callable[[Node], Choice]) -> CompiledExecutable:
        """The common pipeline; ``info`` also gets ``kinds`` (kernel kind -> how many distinct
        kernels of the module have it) and, on a GPU, ``gpu_kernels``."""
        exe = super().run(graph, choose)
        kernels = getattr(exe.library, "KERNELS", {}) if exe.library is not None else {}
        kinds: dict[str, int] = {}
        for entry in kernels.values():
            kinds[entry["kind"]] = kinds.get(entry["kind"], 0) + 1
        exe.info["kinds"] = kinds
        if not self.interpret:
            exe.info["gpu_kernels"] = exe.info["kernels"]
        return exe

    def code_options(self, plan: GraphPlan) -> dict[str, Any]:
        return {"choices": plan.choices, "interpret": self.interpret, "tf32": self.tf32}

    def build_identity(self) -> str:
        return f"triton-backend {sources_digest(_PACKAGE.glob('*.py'), _PACKAGE, kiln_build_identity())}"

    def kernel_source(self, symbol: str, op: PlanOp) -> tuple[KernelSource, list]:
        from .generate import kernel_source  # noqa: PLC0415 (lowering loads on a cache miss only)

        if op.node is None or op.gemm is not None:
            raise BackendError(f"kiln bug: the triton backend planned a kernel without a node ({op.label})")
        source = kernel_source(op.node, interpret=self.interpret, tf32=self.tf32, comment=_comment(op.label),
                               symbol=symbol)
        if len(source.args) != len(op.args):
            raise BackendError(f"kiln bug: kernel {op.label} has {len(op.args)} arguments but its source "
                               f"{len(source.args)}")
        return source, []

    def source_identity(self, source: KernelSource) -> str:
        return source.identity()

    def translation_unit(self, sources: list[KernelSource]) -> str:
        return module_text(sources, interpret=self.interpret)

    def load(self, path: Path | None, symbols: list[str], plan: GraphPlan) -> tuple[Any, TritonLauncher | None]:
        if enabled("kernels"):
            for op in plan.ops:
                if op.step == "library" and op.call is not None:
                    impl = plan.choices.get(op.label.split(" [")[0], "library")
                    kernel_log(backend="triton", name=op.label, source="", choice=f"{impl} ({op.call.label})")
        if path is None:
            return None, None
        module = import_kernels(path, self.interpret)
        table = [self._loaded(symbol, module, plan) for symbol in symbols]
        return module, TritonLauncher(table, self.allocator, interpret=self.interpret)

    def _loaded(self, symbol: str, module: Any, plan: GraphPlan) -> LoadedKernel:
        entry = module.KERNELS.get(symbol)
        if entry is None:
            raise BackendError(f"kiln bug: the cached Triton module has no kernel {symbol}; delete the cache entry")
        probe = load_entry(symbol, entry, {}, self.device)
        time_s, how = None, "interpreter"
        if self.interpret:
            config = dict(entry["interpret"])
        else:
            text = _kernel_text(module, symbol).replace(symbol, "kiln_same")
            config, time_s, how = self.tuner.choose(text, entry["configs"], lambda cfg: self._time(probe, cfg))
        config = {**config, **self.overrides}
        probe.config = config
        if enabled("kernels"):
            text = _kernel_text(module, symbol)
            label = _header_label(text, symbol)
            epilogue = label.endswith(" epilogue")
            impl = plan.choices.get(label[: -len(" epilogue")] if epilogue else label, "triton")
            impl = f"{impl} anchor + triton epilogue" if epilogue else impl
            kernel_log(backend="triton", name=f"{symbol} ({entry['kind']}: {label})", source=text,
                       choice=f"{impl}, config {configs.describe(config)} ({how})", time_s=time_s)
        return probe

    def _time(self, kernel: LoadedKernel, config: dict) -> float:
        ptrs = random_operands(kernel, self.device)

        def run() -> None:
            kernel.launch(ptrs, config)
            torch.cuda.synchronize(self.device)
        return best_time(run, repeat=5, warmup=2)

    def kernel_fallback(self, op: PlanOp) -> Step:
        step = host_kernel_fallback(op)
        if self.device.type == "cpu":
            return step
        run = step.function
        n_in = len(step.inputs)

        def on_host(*tensors: torch.Tensor) -> None:
            host = [t.cpu() for t in tensors]
            run(*host)
            for device_tensor, host_tensor in zip(tensors[n_in:], host[n_in:]):
                device_tensor.copy_(host_tensor)
        return TorchStep(on_host, step.inputs, step.outputs, True, step.label)


def _comment(label: str) -> str:
    """A plan label safe for a Python comment line."""
    return "".join(ch if ch.isprintable() and ch not in "\r\n" else " " for ch in label)[:160]


def _header_label(text: str, symbol: str) -> str:
    """The plan label in a kernel's header line ``# ---- <symbol>: <label> (<kind>)``."""
    first = text.splitlines()[0] if text else ""
    head = f"# ---- {symbol}: "
    if not first.startswith(head):
        return symbol
    return first[len(head):].rsplit(" (", 1)[0]


def _kernel_text(module: Any, symbol: str) -> str:
    """The source of one kernel symbol in the module (its part of the file)."""
    try:
        lines = inspect.getsource(module).splitlines()
    except (OSError, TypeError):
        return ""
    head = f"# ---- {symbol}:"
    start = next((i for i, line in enumerate(lines) if line.startswith(head)), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("# ---- ")), len(lines))
    return "\n".join(lines[start:end]).rstrip()


__all__ = ["TritonBackend", "TritonBuild", "TritonExecutable", "TritonPartitioner", "interpreted_library",
           "triton_version"]
