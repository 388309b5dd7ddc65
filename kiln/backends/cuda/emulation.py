"""The host emulation of the cuda backend's kernels (option ``emulate=True``).

Every GPU kernel is run through :func:`kiln.ir.loops.emulate.emulate` (the MCUDA
transformation: block and thread loops become serial loops, barriers and shuffles split the
thread loops into phases, shared and register buffers become host buffers) and printed as a
host C function by :class:`EmulationPrinter` -- the cpu backend's printer
(:class:`kiln.backends.cpu.codegen.KernelPrinter`) with half types: float16 and bfloat16
memory is ``unsigned short`` holding the IEEE bits, converted to ``float`` on load and
rounded to nearest even on store by the helpers of :data:`HALF_HELPERS` (exact software
conversions, so no compiler support for half types is needed).

:func:`emulation_unit` is the C translation unit of a graph: the emulated kernels, per graph
kernel a wrapper ``void kiln_kN(void *const *args)`` that ``calloc``-s its scratch buffers,
calls its emulated kernels in launch order and frees the scratch, and the cpu backend's
``kiln_run`` table runner.  The CUDA unit of the same kernels (:func:`.host.cuda_unit`)
follows inside ``#if 0`` (never compiled here): the executable's ``sources`` and
``cuda_source`` come from it, on a compile-cache hit too.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.backends.cpu.codegen import KernelPrinter, sanitize_program
from kiln.ir.loops.cgen import CStylePrinter
from kiln.ir.loops.program import If, Loop, Node, Program, Reduce
from kiln.ir.types import DType

from .codegen import HALF_TYPES, HalfAsFloat, NonNegativeIndices, c_comment, constant_array
from .host import SYMBOL, GraphKernel, cuda_unit, table_runner

HALF_HELPERS = """typedef union { unsigned u; float f; } kiln_bits;
static inline float kiln_bf16_load(unsigned short h) { kiln_bits v; v.u = (unsigned)h << 16; return v.f; }
static inline unsigned short kiln_bf16_store(float x) {
  kiln_bits v; v.f = x;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((v.u >> 16) | 0x40u);
  return (unsigned short)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}
static inline float kiln_f16_load(unsigned short h) {
  kiln_bits o, magic; magic.u = 113u << 23;
  const unsigned shifted_exp = 0x7c00u << 13;
  o.u = (unsigned)(h & 0x7fffu) << 13;
  unsigned exp = shifted_exp & o.u;
  o.u += (127u - 15u) << 23;
  if (exp == shifted_exp) o.u += (128u - 16u) << 23;
  else if (exp == 0) { o.u += 1u << 23; o.f -= magic.f; }
  o.u |= (unsigned)(h & 0x8000u) << 16;
  return o.f;
}
static inline unsigned short kiln_f16_store(float x) {
  kiln_bits f, infty, max16, denorm;
  infty.u = 255u << 23; max16.u = (127u + 16u) << 23; denorm.u = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  unsigned short o;
  f.f = x;
  unsigned sign = f.u & 0x80000000u;
  f.u ^= sign;
  if (f.u >= max16.u) o = (f.u > infty.u) ? 0x7e00 : 0x7c00;
  else if (f.u < (113u << 23)) { f.f += denorm.f; o = (unsigned short)(f.u - denorm.u); }
  else {
    unsigned odd = (f.u >> 13) & 1u;
    f.u += ((unsigned)(15 - 127) << 23) + 0xfffu;
    f.u += odd;
    o = (unsigned short)(f.u >> 13);
  }
  return (unsigned short)(o | (sign >> 16));
}
static inline float kiln_round_f16(float x) { return kiln_f16_load(kiln_f16_store(x)); }
static inline float kiln_round_bf16(float x) { return kiln_bf16_load(kiln_bf16_store(x)); }
"""
"""Exact float <-> float16/bfloat16 conversions (round to nearest even, NaN kept NaN)."""


class EmulationPrinter(HalfAsFloat, NonNegativeIndices, KernelPrinter):
    """The cpu backend's printer for emulated kernels, with half types (module docstring).
    Reductions into half buffers are not accumulated in registers (they round at every step,
    as the kernel does)."""

    types = {**KernelPrinter.types, DType.float16: "unsigned short", DType.bfloat16: "unsigned short"}
    half_load = {DType.float16: "kiln_f16_load", DType.bfloat16: "kiln_bf16_load"}
    half_store = {DType.float16: "kiln_f16_store", DType.bfloat16: "kiln_bf16_store"}
    half_round = {DType.float16: "kiln_round_f16", DType.bfloat16: "kiln_round_bf16"}

    def loop(self, n: Loop, ind: str) -> None:
        if any(self.buf_dtypes[r.buffer] in HALF_TYPES for r in _reductions((n,))):
            CStylePrinter.loop(self, n, ind)
            return
        super().loop(n, ind)


def _reductions(nodes: tuple[Node, ...]) -> list[Reduce]:
    out: list[Reduce] = []
    for n in nodes:
        if isinstance(n, Loop):
            out += _reductions(n.body)
        elif isinstance(n, If):
            out += _reductions(n.then) + _reductions(n.orelse)
        elif isinstance(n, Reduce):
            out.append(n)
    return out


def emulated_function(name: str, program: Program) -> str:
    """The host C function ``name`` of an emulated kernel (``static``; renamed first)."""
    renamed, _ = sanitize_program(program)
    return EmulationPrinter(renamed).function(name) + "\n"


def emulation_wrapper(kernel: GraphKernel, symbol: str | None = None) -> str:
    """``void kiln_kN(void *const *args)``: calloc the scratch, call the emulated kernels in
    launch order, free the scratch."""
    lines = [f"void {SYMBOL}(void *const *args) {{"]
    for i, nbytes in enumerate(kernel.scratch):
        lines.append(f"  void *s{i} = calloc({nbytes}, 1);")
    for k in kernel.kernels:
        args = ", ".join(f"(void *){b.c_text(f'{SYMBOL}_c')}" for b in k.bindings)
        lines.append(f"  {k.cuda.name}({args});")
    for i in range(len(kernel.scratch)):
        lines.append(f"  free(s{i});")
    lines.append("}")
    return kernel.render("\n".join(lines), symbol) + "\n"


def emulation_part(kernel: GraphKernel, symbol: str | None = None) -> str:
    """The constants, emulated kernels and wrapper of one graph kernel."""
    parts = [f"/* {c_comment(kernel.comment)} */"] if kernel.comment else []
    for i, (dtype, data) in enumerate(kernel.constants):
        ctype = "unsigned short" if dtype in HALF_TYPES else EmulationPrinter.type_name(dtype)
        parts.append(constant_array("static const ", ctype, f"{SYMBOL}_c{i}", dtype, data).rstrip())
    for k in kernel.kernels:
        if k.emulated is None:
            raise ValueError(f"kernel {k.cuda.name} of {kernel.comment or kernel.symbol} has no emulation")
        parts.append(k.emulated.rstrip())
    parts.append(emulation_wrapper(kernel, SYMBOL))
    return kernel.render("\n".join(parts), symbol)


def emulation_unit(kernels: Sequence[GraphKernel]) -> str:
    """The host C unit of a graph, with its CUDA unit inside ``#if 0`` (module docstring)."""
    parts = ["/* generated by kiln's cuda backend: host emulation of its kernels */", "#include <string.h>",
             KernelPrinter.prelude, HALF_HELPERS]
    parts += [emulation_part(k) for k in kernels]
    parts.append(table_runner([k.symbol for k in kernels]))
    parts += [CUDA_BEGIN, cuda_unit(kernels), CUDA_END]
    return "\n".join(parts)


CUDA_BEGIN = "#if 0  /* the CUDA unit of these kernels (not compiled here) */"
CUDA_END = "#endif  /* the CUDA unit */"


def embedded_cuda_unit(text: str) -> str:
    """The CUDA unit inside an emulation unit's text ("" when it holds none)."""
    start, end = text.find(CUDA_BEGIN), text.rfind(CUDA_END)
    if start < 0 or end < start:
        return ""
    return text[start + len(CUDA_BEGIN):end].strip("\n") + "\n"


__all__ = ["CUDA_BEGIN", "CUDA_END", "HALF_HELPERS", "EmulationPrinter", "embedded_cuda_unit", "emulated_function",
           "emulation_part", "emulation_unit", "emulation_wrapper"]
