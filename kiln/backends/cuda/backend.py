"""The ``cuda`` backend: task-mapped CUDA C kernels, cuBLAS/cuDNN library calls, one shared
object per graph, run as a call plan on the GPU -- or, with ``emulate=True``, the same
kernels emulated on the host.

The build pipeline is the device-neutral one of :mod:`kiln.backends.common.build`; this
module fills its hooks:

* implementations (:data:`.library.SELECTION`): a generated kernel wherever one can be
  generated, torch library calls for convolutions and ops without a compute definition,
  the numpy reference on the host for the rest; the partition is the common one
  (:class:`.library.CudaPartitioner`: views, copies, the memory plan);
* sources: every graph kernel is lowered (:func:`kiln.passes.lower.lower_node`) and planned
  into GPU kernels (:func:`kiln.backends.cuda.kernels.plan_kernels`), printed as CUDA C
  (:mod:`.codegen`) with a host wrapper per graph kernel (:mod:`.host`), all in one
  translation unit built by nvcc (:mod:`.toolchain`) and kept in the compile cache;
* running: ``ctypes`` loads the object; :class:`CudaLauncher` sets the unit's stream to
  torch's current stream before each run and raises the first CUDA error it reports; the
  plan allocates through torch's caching allocator (``TorchDeviceAllocator("cuda")``).

With ``emulate=True`` (:mod:`.emulation`) each GPU kernel is run through
:func:`kiln.ir.loops.emulate.emulate` and printed as host C, built by the cpu backend's C
toolchain and run by :class:`kiln.runtime.call_plan.HostLauncher` on CPU tensors; the CUDA
unit is still produced.  Either way the executable's ``sources`` maps every GPU kernel's
name to its CUDA C function and ``cuda_source`` is the whole CUDA unit.

Options (``CudaBackend.option_defaults``): ``cache``/``cache_dir`` (the compile cache),
``select`` (``"rule"``, ``"time"``: library vs generated timed on the device,
``"generated"``), ``poison`` (NaN-fill planned memory before each call), ``emulate``
(False: run on the GPU), ``arch`` (``sm_XY``; default: the current GPU's, else ``sm_90``).

With ``KILN_LOGS`` containing ``kernels``, each generated GPU kernel is reported through
``kiln.runtime.logs.kernel_log``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from kiln.backends.base import BackendError
from kiln.backends.common.build import BuildPipeline, CompiledBackend, CompiledExecutable
from kiln.backends.common.partition import GraphPlan, PlanOp
from kiln.backends.common.select import Choice
from kiln.backends.common.toolchain import sources_digest
from kiln.ir import Graph, Node
from kiln.runtime.cache import CompileCache
from kiln.runtime.call_plan import HOST, Allocator, BoundCall, HostLauncher, KernelCall, Slots, Step, \
    TorchDeviceAllocator

from .host import SYMBOL, GraphKernel, cuda_device_part, cuda_unit, cuda_wrapper, graph_kernel, kernel_name, \
    kernel_sources
from .library import SELECTION, CudaPartitioner, kernel_fallback

_PACKAGE = Path(__file__).resolve().parent


class CudaExecutable(CompiledExecutable):
    """A graph built by the cuda backend (:class:`kiln.backends.common.build.CompiledExecutable`).

    ``sources``: GPU kernel name -> its CUDA C function; ``cuda_source``: the whole CUDA
    unit; ``info`` adds ``gpu_kernels`` (distinct GPU kernels), ``kinds`` (kernels per kind)
    and ``emulated``.  Without emulation, every argument must be a CUDA tensor."""

    emulated: ClassVar[bool] = False

    @property
    def cuda_source(self) -> str:
        from .emulation import embedded_cuda_unit  # noqa: PLC0415

        return embedded_cuda_unit(self.source) if self.emulated else self.source

    @functools.cached_property
    def sources(self) -> dict[str, str]:
        return kernel_sources(self.cuda_source)

    def __call__(self, args: Sequence[torch.Tensor], out: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        if not self.emulated:
            # parameters are the same tensors at every call: all arguments are checked once,
            # then the inputs only
            checked = args if not getattr(self, "_checked", False) else args[:len(self.graph.inputs)]
            for i, t in enumerate(checked):
                if not t.is_cuda:
                    kind = "input" if i < len(self.graph.inputs) else "parameter"
                    raise BackendError(f"kiln backend 'cuda' runs graph @{self.graph.name} on the GPU but its {kind} "
                                       f"{i} is on {t.device}; move the model and inputs to CUDA (.cuda()) or "
                                       f"build with emulate=True to run on the host")
            self._checked = True
        return super().__call__(args, out)


class EmulatedExecutable(CudaExecutable):
    """A graph built by the cuda backend with ``emulate=True``: runs on CPU tensors."""

    emulated: ClassVar[bool] = True


class CudaLauncher(HostLauncher):
    """:class:`~kiln.runtime.call_plan.HostLauncher` over a CUDA unit: before each run the
    unit's stream is set to torch's current stream (``kiln_set_stream``), after it the
    unit's error state is read (``kiln_error``) and a failure raises :class:`BackendError`
    naming the kernel or allocation and the CUDA error."""

    def __init__(self, library: Any):
        super().__init__(library.kiln_run)
        self.set_stream = library.kiln_set_stream
        self.error = library.kiln_error

    def bind(self, kernels: Sequence[KernelCall], static: set[int], template: Slots) -> BoundCall:
        run = super().bind(kernels, static, template)
        set_stream, error, current = self.set_stream, self.error, torch.cuda.current_stream

        def launch(slots: Slots) -> None:
            set_stream(current().cuda_stream)
            run(slots)
            message = error()
            if message:
                raise BackendError(f"kiln backend 'cuda': {message.decode(errors='replace')}")
        return launch


class CudaBackend(CompiledBackend):
    """CUDA kernels on the GPU, or emulated on the host: see the module docstring."""

    name: ClassVar[str] = "cuda"
    option_defaults: ClassVar[Mapping[str, Any]] = {
        "cache": True, "cache_dir": None, "select": "rule", "poison": False, "emulate": False, "arch": None,
    }
    selection = SELECTION
    device: ClassVar[str] = "cuda"

    def check_options(self, graph: Graph, opts: Mapping[str, Any]) -> None:
        super().check_options(graph, opts)
        if not opts["emulate"] and not torch.cuda.is_available():
            raise BackendError("kiln backend 'cuda' found no CUDA device (torch.cuda.is_available() is False); "
                               "pass emulate=True to run its kernels on the host, or use backend='cpu'")

    def pipeline(self, opts: Mapping[str, Any]) -> CudaBuild:
        cache = CompileCache(opts["cache_dir"], enabled=bool(opts["cache"]))
        if opts["emulate"]:
            from kiln.backends.cpu import toolchain as cpu_toolchain  # noqa: PLC0415

            return EmulatedBuild(self, cache, cpu_toolchain.cpu_compiler(), poison=bool(opts["poison"]),
                                 arch=opts["arch"])
        from .toolchain import nvcc_compiler  # noqa: PLC0415

        compiler = nvcc_compiler(opts["arch"])
        return CudaBuild(self, cache, compiler, poison=bool(opts["poison"]), arch=compiler.arch)

    def run_device(self, opts: Mapping[str, Any]) -> str:
        return "cpu" if opts["emulate"] else "cuda"


class CudaBuild(BuildPipeline):
    """One build configuration of the GPU path: cache, nvcc, architecture (module docstring)."""

    executable_type = CudaExecutable
    emulate: ClassVar[bool] = False

    def __init__(self, backend: CudaBackend, cache: CompileCache, toolchain: Any, *, poison: bool = False,
                 arch: str | None = None):
        super().__init__(backend, cache, toolchain, poison=poison)
        self.arch = arch

    @property
    def allocator(self) -> Allocator:
        return TorchDeviceAllocator("cuda")

    def partition(self, graph: Graph, choose: Callable[[Node], Choice]) -> GraphPlan:
        return CudaPartitioner(graph, self.backend, self.allocator.device).run(choose)

    def code_options(self, plan: GraphPlan) -> dict[str, Any]:
        return {"choices": plan.choices, "emulate": self.emulate, "arch": self.arch}

    def build_identity(self) -> str:
        return build_identity()

    def kernel_source(self, symbol: str, op: PlanOp) -> tuple[GraphKernel, list]:
        """The graph kernel of ``op``: lowered, planned into GPU kernels, printed (and emulated)."""
        from kiln.passes.lower import lower_node  # noqa: PLC0415 (loaded on a cache miss only)

        from .kernels import plan_kernels  # noqa: PLC0415

        if op.node is None or op.gemm is not None:
            raise BackendError(f"kiln backend 'cuda' got kernel {op.label} without a node to lower")
        lowered = lower_node(op.node)
        names = (*dict.fromkeys(lowered.inputs), *lowered.outputs)
        if len(names) != len(op.args):
            raise BackendError(f"kiln bug: kernel {op.label} has {len(op.args)} arguments but its program "
                               f"{len(names)} buffers")
        plan = plan_kernels(lowered, template=op.template, node=op.node, options=kernel_options(op, names))
        emulated = None
        if self.emulate:
            from kiln.ir.loops.emulate import emulate  # noqa: PLC0415

            from .emulation import emulated_function  # noqa: PLC0415

            emulated = [emulated_function(kernel_name(i), emulate(k.program)) for i, k in enumerate(plan.kernels)]
        kernel = graph_kernel(symbol, plan, lowered.program.buffers, {n: i for i, n in enumerate(names)},
                              plan.constants, comment=op.label, emulated=emulated)
        log_kernels(kernel, self.backend.name)
        return kernel, []

    def source_identity(self, source: GraphKernel) -> str:
        plain = replace(source, comment="")
        return cuda_device_part(plain, SYMBOL) + cuda_wrapper(plain, SYMBOL)

    def translation_unit(self, sources: list[GraphKernel]) -> str:
        return cuda_unit(sources)

    def load(self, path: Path | None, symbols: list[str], plan: GraphPlan) -> tuple[Any, HostLauncher | None]:
        if path is None:
            return None, None
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        lib.kiln_set_stream.argtypes = [ctypes.c_void_p]
        lib.kiln_set_stream.restype = None
        lib.kiln_error.argtypes = []
        lib.kiln_error.restype = ctypes.c_char_p
        return lib, CudaLauncher(lib)

    def kernel_fallback(self, op: PlanOp) -> Step:
        return kernel_fallback(op)

    def run(self, graph: Graph, choose: Callable[[Node], Choice]) -> CompiledExecutable:
        exe = super().run(graph, choose)
        sources = exe.sources if isinstance(exe, CudaExecutable) else {}
        kinds: dict[str, int] = {}
        for text in sources.values():
            kind = text.split(" kernel */", 1)[0].removeprefix("/* ") if text.startswith("/* ") else "unknown"
            kinds[kind] = kinds.get(kind, 0) + 1
        exe.info.update(gpu_kernels=len(sources), kinds=kinds, emulated=self.emulate)
        return exe


class EmulatedBuild(CudaBuild):
    """The emulation build (``emulate=True``): host C of the emulated kernels, the cpu C
    toolchain, :class:`~kiln.runtime.call_plan.HostLauncher`, host tensors."""

    executable_type = EmulatedExecutable
    emulate: ClassVar[bool] = True

    @property
    def allocator(self) -> Allocator:
        return HOST

    def toolchain_identity(self) -> str:
        """The C compiler's identity, marked as the emulation's (timed choices of the cpu
        backend, made with the same compiler, are not this backend's)."""
        return "cuda emulation\n" + super().toolchain_identity()

    def source_identity(self, source: GraphKernel) -> str:
        from .emulation import emulation_part  # noqa: PLC0415

        return super().source_identity(source) + emulation_part(replace(source, comment=""), SYMBOL)

    def translation_unit(self, sources: list[GraphKernel]) -> str:
        from .emulation import emulation_unit  # noqa: PLC0415

        return emulation_unit(sources)

    def load(self, path: Path | None, symbols: list[str], plan: GraphPlan) -> tuple[Any, HostLauncher | None]:
        if path is None:
            return None, None
        lib = ctypes.CDLL(str(path))
        _declare(lib)
        return lib, HostLauncher(lib.kiln_run)


def _declare(lib: Any) -> None:
    lib.kiln_run.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_long, ctypes.POINTER(ctypes.c_void_p)]
    lib.kiln_run.restype = None


def kernel_options(op: PlanOp, names: Sequence[str]) -> Any:
    """The :class:`~kiln.backends.cuda.kernels.KernelOptions` of graph kernel ``op``: the
    alignment of each argument (16 bytes for a whole tensor, less for a view at an odd
    offset), by buffer name."""
    from .kernels import KernelOptions  # noqa: PLC0415

    alignment = {name: _alignment(pv.byte_offset) for name, pv in zip(names, op.args)}
    return KernelOptions(alignment=alignment)


def _alignment(byte_offset: int, most: int = 16) -> int:
    align = most
    while byte_offset % align:
        align //= 2
    return align


def log_kernels(kernel: GraphKernel, backend: str) -> None:
    """Report every GPU kernel of ``kernel`` through ``kiln.runtime.logs.kernel_log`` when
    ``KILN_LOGS`` names ``kernels``."""
    try:
        from kiln.runtime.logs import enabled, kernel_log  # noqa: PLC0415
    except ImportError:  # a runtime without kernel logs
        return
    if not enabled("kernels"):
        return
    for k, name in zip(kernel.kernels, kernel.kernel_names()):
        kernel_log(backend=backend, name=name, source=kernel.render(k.cuda.text), choice=f"generated ({k.kind})",
                   time_s=None)


@functools.lru_cache(maxsize=1)
def build_identity() -> str:
    """The cpu backend's build identity (the lowering, loop IR and C printers) plus a hash of
    this package (printers, kernel generators, host code)."""
    from kiln.backends.cpu.toolchain import build_identity as cpu_identity  # noqa: PLC0415

    return f"{cpu_identity()} cuda {sources_digest(_PACKAGE.rglob('*.py'), _PACKAGE)}"


__all__ = ["CudaBackend", "CudaBuild", "CudaExecutable", "CudaLauncher", "EmulatedBuild", "EmulatedExecutable",
           "build_identity", "kernel_options", "log_kernels"]
