"""The host side of the cuda backend: graph kernels, their wrappers and the translation unit.

One node of the graph plan (a fused group) becomes a :class:`GraphKernel`: the GPU kernels
of its :class:`~kiln.backends.cuda.kernels.GpuPlan`, printed (:mod:`.codegen`), with what
each kernel parameter is bound to -- an argument of the node's call (``args[i]``), a tensor
constant of the fused body (a ``__device__`` array) or a scratch buffer of the plan.  The
translation unit of a graph (:func:`cuda_unit`) holds

* every kernel (``extern "C" __global__``), between ``// kernel <name>`` and
  ``// end kernel`` lines (:func:`kernel_sources` reads them back);
* per graph kernel a host wrapper ``void kiln_kN(void *const *args)`` that allocates its
  scratch buffers (``cudaMallocAsync`` + ``cudaMemsetAsync`` to zero), launches its kernels
  in order with ``<<<grid, block, 0, kiln_stream>>>`` and frees the scratch
  (``cudaFreeAsync``), all on the stream;
* ``kiln_set_stream(void *)`` (the stream of the calling thread: ``thread_local``),
  ``kiln_error()`` (the first CUDA error since the last call, naming the kernel or
  allocation, or ``NULL``; it clears it) and the table runner ``kiln_run(calls, n, ptrs)``
  of the cpu backend's units (the same text).

Texts are printed once with the placeholder :data:`SYMBOL` for the graph kernel's symbol and
specialized by :meth:`GraphKernel.render`, so identical graph kernels (the layers of a
transformer) print identically and share one wrapper.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kiln.backends.cpu.codegen import table_runner
from kiln.ir.loops.program import Buffer
from kiln.ir.types import DType

from .codegen import CUDA_TYPES, HALF_TYPES, CudaKernel, c_comment, constant_array, cuda_kernel, cuda_prelude

SYMBOL = "kiln_ksym"
"""Placeholder of a graph kernel's symbol in printed texts (no generated name contains it)."""
_MARK = re.compile(r"^// kernel ([A-Za-z_][A-Za-z0-9_]*)\n(.*?)\n// end kernel$", re.M | re.S)

CUDA_RUNTIME = """#include <cuda_runtime.h>
#include <stdio.h>

static thread_local cudaStream_t kiln_stream = 0;
static thread_local int kiln_failed = 0;
static thread_local char kiln_error_text[512];
static void kiln_check(cudaError_t status, const char *what) {
  if (status != cudaSuccess && !kiln_failed) {
    kiln_failed = 1;
    snprintf(kiln_error_text, sizeof kiln_error_text, "%s: %s (%s)", what, cudaGetErrorString(status),
             cudaGetErrorName(status));
  }
}
extern "C" void kiln_set_stream(void *stream) { kiln_stream = (cudaStream_t)stream; }
extern "C" const char *kiln_error(void) {
  if (!kiln_failed) return 0;
  kiln_failed = 0;
  return kiln_error_text;
}
"""
"""The unit's stream and error state, and their exported accessors."""


@dataclass(frozen=True)
class Binding:
    """What one global parameter of a kernel receives: ``("arg", i)`` the graph kernel's
    argument ``i``, ``("const", i)`` its constant ``i``, ``("scratch", i)`` its scratch ``i``."""

    kind: str
    index: int

    def c_text(self, constants: str = "c") -> str:
        """The C expression passing it in a wrapper (constant ``i`` is ``<constants>i``)."""
        if self.kind == "arg":
            return f"args[{self.index}]"
        if self.kind == "const":
            return f"{constants}{self.index}"
        return f"s{self.index}"


@dataclass(frozen=True)
class PlannedKernel:
    """One GPU kernel of a graph kernel: printed (``cuda``), its ``kind``, the bindings of its
    global parameters in order and, for the host emulation, the text of its emulated function
    (``emulated``; ``None`` when not built)."""

    cuda: CudaKernel
    kind: str
    bindings: tuple[Binding, ...]
    emulated: str | None = None


@dataclass(frozen=True)
class GraphKernel:
    """One node of the graph plan: its GPU kernels in launch order, its tensor constants
    ``(dtype, data)``, its scratch buffers (bytes) and a free-text ``comment``; texts hold
    :data:`SYMBOL` until :meth:`render`."""

    symbol: str
    kernels: tuple[PlannedKernel, ...]
    constants: tuple[tuple[DType, np.ndarray], ...] = ()
    scratch: tuple[int, ...] = ()
    comment: str = ""

    def render(self, text: str, symbol: str | None = None) -> str:
        return text.replace(SYMBOL, symbol or self.symbol)

    def kernel_names(self, symbol: str | None = None) -> list[str]:
        return [self.render(k.cuda.name, symbol) for k in self.kernels]


def kernel_name(index: int) -> str:
    """The placeholder name of kernel ``index`` of a graph kernel."""
    return f"{SYMBOL}_{index}"


def graph_kernel(symbol: str, plan, lowered_buffers: Sequence[Buffer], arguments: Mapping[str, int],
                 constants: Mapping[str, np.ndarray], *, comment: str = "",
                 emulated: Sequence[str | None] | None = None) -> GraphKernel:
    """The graph kernel ``symbol`` of a :class:`~kiln.backends.cuda.kernels.GpuPlan` ``plan``:
    every kernel printed; each global parameter bound by name to the argument of the call
    at ``arguments[name]``, to a constant (``constants``) or to a scratch buffer of the plan.
    ``lowered_buffers`` are the lowered program's buffers (the types the bindings must have).
    ``emulated[i]`` is the emulated text of kernel ``i``, when built.

    Raises ``ValueError`` naming the kernel and buffer when a kernel's global buffer is none
    of these or differs from it in shape or dtype.
    """
    declared = {b.name: b for b in lowered_buffers if b.scope == "global"}
    const_names = list(constants)
    scratch = list(plan.scratch)
    scratch_of = {b.name: i for i, b in enumerate(scratch)}
    planned = []
    for i, gk in enumerate(plan.kernels):
        bindings = []
        for b in gk.program.buffers:
            if b.scope != "global":
                continue
            if b.name in scratch_of:
                expected, binding = scratch[scratch_of[b.name]], Binding("scratch", scratch_of[b.name])
            elif b.name in declared and b.name in constants:
                expected, binding = declared[b.name], Binding("const", const_names.index(b.name))
            elif b.name in declared and b.name in arguments:
                expected, binding = declared[b.name], Binding("arg", arguments[b.name])
            else:
                raise ValueError(f"kernel {gk.name} of {comment or symbol}: global buffer '{b.name}' is neither an "
                                 f"argument, a constant nor a scratch buffer of its plan")
            if tuple(b.shape) != tuple(expected.shape) or b.dtype != expected.dtype:
                raise ValueError(f"kernel {gk.name} of {comment or symbol}: global buffer '{b.name}' is "
                                 f"{b.dtype.short}{list(b.shape)} but the plan has {expected.dtype.short}"
                                 f"{list(expected.shape)}")
            bindings.append(binding)
        printed = cuda_kernel(kernel_name(i), gk.program, comment=f"{gk.kind} kernel")
        planned.append(PlannedKernel(printed, gk.kind, tuple(bindings), None if emulated is None else emulated[i]))
    consts = tuple((declared[name].dtype, np.asarray(data)) for name, data in constants.items())
    sizes = tuple(max(_nbytes(b), 1) for b in scratch)
    return GraphKernel(symbol, tuple(planned), consts, sizes, comment)


def _nbytes(b: Buffer) -> int:
    n = b.dtype.itemsize
    for d in b.shape:
        n *= int(d.value)
    return n


# ----------------------------------------------------------------------------- the CUDA unit
def cuda_device_part(kernel: GraphKernel, symbol: str | None = None) -> str:
    """The device side of ``kernel``: its constant arrays and its kernels (marked)."""
    parts = [f"/* {c_comment(kernel.comment)} */"] if kernel.comment else []
    for i, (dtype, data) in enumerate(kernel.constants):
        ctype = "unsigned short" if dtype in HALF_TYPES else CUDA_TYPES[dtype]
        parts.append(constant_array("static __device__ ", ctype, f"{SYMBOL}_c{i}", dtype, data).rstrip())
    for k in kernel.kernels:
        parts.append(f"// kernel {k.cuda.name}\n{k.cuda.text}\n// end kernel")
    return kernel.render("\n".join(parts), symbol) + "\n"


def cuda_wrapper(kernel: GraphKernel, symbol: str | None = None) -> str:
    """``void kiln_kN(void *const *args)``: scratch, launches in order, frees (module docstring)."""
    lines = [f"void {SYMBOL}(void *const *args) {{"]
    for i in range(len(kernel.constants)):
        lines += [f"  static void *c{i} = 0;",
                  f'  if (!c{i}) kiln_check(cudaGetSymbolAddress(&c{i}, {SYMBOL}_c{i}), "constant {i} of {SYMBOL}");']
    for i, nbytes in enumerate(kernel.scratch):
        lines += [f"  void *s{i} = 0;",
                  f'  kiln_check(cudaMallocAsync(&s{i}, {nbytes}, kiln_stream), "scratch {i} of {SYMBOL}");',
                  f'  kiln_check(cudaMemsetAsync(s{i}, 0, {nbytes}, kiln_stream), "scratch {i} of {SYMBOL}");']
    for k in kernel.kernels:
        grid, block = ", ".join(map(str, k.cuda.grid)), ", ".join(map(str, k.cuda.block))
        args = ", ".join(f"({t}){b.c_text()}" for t, b in zip(k.cuda.param_types, k.bindings))
        lines += [f"  {k.cuda.name}<<<dim3({grid}), dim3({block}), 0, kiln_stream>>>({args});",
                  f'  kiln_check(cudaGetLastError(), "{k.cuda.name}");']
    for i in range(len(kernel.scratch)):
        lines.append(f'  kiln_check(cudaFreeAsync(s{i}, kiln_stream), "scratch {i} of {SYMBOL}");')
    lines.append("}")
    return kernel.render("\n".join(lines), symbol) + "\n"


def cuda_unit(kernels: Sequence[GraphKernel]) -> str:
    """The CUDA translation unit of a graph (module docstring); kernel table row ``i`` is
    ``kernels[i]``."""
    half = any(k.cuda.uses_half for g in kernels for k in g.kernels)
    parts = ["/* generated by kiln's cuda backend */", CUDA_RUNTIME, cuda_prelude(half)]
    parts += [cuda_device_part(k) for k in kernels]
    parts.append('extern "C" {')
    parts += [cuda_wrapper(k) for k in kernels]
    parts.append(table_runner([k.symbol for k in kernels]))
    parts.append('}  /* extern "C" */')
    return "\n".join(parts)


def kernel_sources(text: str) -> dict[str, str]:
    """Kernel name -> CUDA C source of every kernel in a unit's text (its marked functions)."""
    return {m.group(1): m.group(2) for m in _MARK.finditer(text)}


def program_kinds(kernels: Sequence[GraphKernel]) -> dict[str, int]:
    """How many GPU kernels of each kind ``kernels`` hold."""
    out: dict[str, int] = {}
    for g in kernels:
        for k in g.kernels:
            out[k.kind] = out.get(k.kind, 0) + 1
    return out


__all__ = ["CUDA_RUNTIME", "SYMBOL", "Binding", "GraphKernel", "PlannedKernel", "cuda_device_part", "cuda_unit",
           "cuda_wrapper", "graph_kernel", "kernel_name", "kernel_sources", "program_kinds", "table_runner"]
