"""CUDA C for kernels in kernel form: :class:`CudaPrinter` and :func:`cuda_kernel`.

A kernel (``docs/gpu.md``) is a loop program without parameters whose body is perfectly
nested *block loops* ``@mapped("blockIdx.*")`` around perfectly nested *thread loops*
``@mapped("threadIdx.*")`` around the per-thread code.  :func:`cuda_kernel` lowers its task
loops (:func:`kiln.ir.loops.lower_mappings`), renames everything (buffers ``b0, b1, ...``,
iterators ``v0, v1, ...``: no user text reaches the source) and prints::

    extern "C" __global__ void __launch_bounds__(256) name(float *__restrict__ b0,
                                                           const float *__restrict__ b1) {
      __shared__ __align__(16) float b2[2][64][33];
      const int v0 = blockIdx.x;
      const int v1 = threadIdx.x;
      float b3[4][4] = {};
      ...per-thread code...
    }

What :class:`CudaPrinter` adds to :class:`kiln.ir.loops.cgen.CStylePrinter`:

* global buffers are flat ``T *__restrict__`` parameters (``const`` when the kernel never
  writes them) in ``program.buffers`` order, indexed by row-major offsets; ``shared`` buffers
  are ``__shared__`` arrays, ``register`` buffers per-thread local arrays (zero-initialized);
* block and thread loops become ``blockIdx``/``threadIdx`` reads (the launch is exactly the
  loops' extents, so no bounds check is needed); other loops are ``for`` loops
  (``unrolled(f)`` -> ``#pragma unroll f``);
* ``barrier`` -> ``__syncthreads()``, ``barrier warp`` -> ``__syncwarp()``;
  a shuffle -> ``__shfl_<mode>_sync(0xffffffffu, value, offset, width)``;
* a vector copy (at most 16 bytes, as the verifier demands) -> one reinterpreted load and
  store of ``float4``/``float2``/``float`` (float32) or
  ``uint4``/``uint2``/``unsigned``/``unsigned short``/``unsigned char``; an asynchronous
  one (4, 8 or 16 bytes) -> ``cp.async.ca`` (``cp.async.cg`` for 16 bytes) inline PTX on
  the shared address from ``__cvta_generic_to_shared``;
  ``commit_copies`` -> ``cp.async.commit_group``, ``wait_copies n`` -> ``cp.async.wait_group n``;
* float math as ``expf``, ``logf``, ...; infinities and NaN as bit patterns (no host header
  needed);
* float16/bfloat16 values live in ``float`` registers (:class:`HalfAsFloat`): memory holds
  ``__half``/``__nv_bfloat16``, a load converts to float, a store rounds to nearest even, a
  cast to a half type rounds in place;
* index arithmetic is ``int`` when every integer subexpression C would evaluate in 32 bits
  provably fits there given the loops' ranges (:func:`.ranges.fits_int`), else ``long``; ``floordiv``/``floormod`` by a positive constant of an
  expression that is provably non-negative (built from loop iterators with non-negative
  ranges) print as C's ``/`` and ``%``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kiln.ir.loops import lower_mappings
from kiln.ir.loops.gpu import block_loops, kernel_body, kernel_launch, thread_loops, verify_kernel
from kiln.ir.loops.cgen import C_TYPES, HALF_TYPES, CStylePrinter, HalfAsFloat
from kiln.ir.loops.expr import INDEX, Binary, Const, Expr, Var

from kiln.ir.loops.rename import generated_names
from kiln.ir.loops.program import (
    Barrier, Buffer, CopyCommit, CopyWait, If, Loop, Node, Program, Reduce, Shuffle, Store, TaskLoop, VectorCopy,
)
from kiln.ir.types import DType

from .ranges import fits_int, flat_offset

_COMMENT_SAFE = re.compile(r"[^A-Za-z0-9_.%@ ,:\-]")

CUDA_TYPES: Mapping[DType, str] = {
    **C_TYPES, DType.float16: "__half", DType.bfloat16: "__nv_bfloat16", DType.bool: "bool",
}
"""The CUDA C++ spelling of every dtype (memory types: half values compute as ``float``)."""

CUDA_PRELUDE = """#define KILN_MIN(a, b) ((a) < (b) ? (a) : (b))
#define KILN_MAX(a, b) ((a) > (b) ? (a) : (b))
__device__ __forceinline__ long kiln_floordiv(long a, long b) {
  long q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long kiln_floormod(long a, long b) {
  long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
"""
"""Device helpers every printed kernel relies on."""

CUDA_HALF_PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ float kiln_round_f16(float x) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float kiln_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
"""
"""What kernels with float16/bfloat16 buffers need besides (the headers are large: units
include them only when some kernel uses a half type)."""


def cuda_prelude(half: bool) -> str:
    """The prelude of a unit: with the half-type headers and helpers when ``half``."""
    return (CUDA_HALF_PRELUDE if half else "") + CUDA_PRELUDE


class UnsupportedKernel(ValueError):
    """A program the CUDA printer cannot print: not in kernel form, or a construct it lacks."""


def c_comment(text: str) -> str:
    """``text`` made safe inside a C comment: only ``[A-Za-z0-9_.%@ ,:-]``, at most 120 chars."""
    return _COMMENT_SAFE.sub("_", text)[:120]


# ----------------------------------------------------------------------------- renaming
def rename_kernel(program: Program) -> tuple[Program, dict[str, str]]:
    """``program`` (no task loops) with buffers renamed ``b0, b1, ...`` in declaration order
    and iterators ``v0, v1, ...`` (:func:`kiln.ir.loops.rename.generated_names`, loop labels
    dropped); returns it and the buffer renaming (old -> new)."""
    if any(isinstance(n, TaskLoop) for n, _ in program.walk()):
        raise UnsupportedKernel("rename_kernel: lower task loops first (kiln.ir.loops.lower_mappings)")
    return generated_names(program, keep_loop_names=False)


def written_buffers(nodes: Iterable[Node]) -> set[str]:
    """Buffers some node of ``nodes`` (recursively) writes."""
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, Loop):
            out |= written_buffers(n.body)
        elif isinstance(n, If):
            out |= written_buffers(n.then) | written_buffers(n.orelse)
        elif isinstance(n, TaskLoop):
            out |= written_buffers(n.body)
        elif isinstance(n, (Store, Reduce, Shuffle)):
            out.add(n.buffer)
        elif isinstance(n, VectorCopy):
            out.add(n.dst)
    return out


def static_shape(b: Buffer) -> tuple[int, ...]:
    if not all(isinstance(d, Const) for d in b.shape):
        raise UnsupportedKernel(f"buffer {b.name} has a symbolic shape; kernels have static shapes")
    return tuple(int(d.value) for d in b.shape)


# ----------------------------------------------------------------------------- shared printer hooks
class NonNegativeIndices:
    """Printer hooks (a mixin before a :class:`CStylePrinter`): ``floordiv``/``floormod`` by a
    positive integer constant of a provably non-negative integer expression print as C's
    ``/`` and ``%`` (equal there, and much cheaper on a GPU).  Non-negative: literals >= 0,
    iterators of loops whose lower bound is non-negative (and those :attr:`nonneg` names),
    and ``+``, ``*``, ``min``, ``max``, ``/``, ``%``, ``floordiv``, ``floormod`` of
    non-negative operands."""

    def nonneg_vars(self) -> set[str]:
        if not hasattr(self, "_nonneg"):
            self._nonneg: set[str] = set()
        return self._nonneg

    def for_loop(self, n: Loop, ind: str) -> None:
        if self.nonnegative(n.lower):
            self.nonneg_vars().add(n.iterator)
        super().for_loop(n, ind)  # type: ignore[misc]

    def nonnegative(self, e: Expr) -> bool:
        if isinstance(e, Const):
            return e.dtype.is_integer and e.value >= 0
        if isinstance(e, Var):
            return e.name in self.nonneg_vars()
        if isinstance(e, Binary) and e.op in ("+", "*", "min", "max", "/", "%", "floordiv", "floormod"):
            return self.nonnegative(e.lhs) and self.nonnegative(e.rhs)
        return False

    def binary(self, e: Binary) -> tuple[str, int]:
        if e.op in ("floordiv", "floormod") and isinstance(e.rhs, Const) and e.rhs.dtype.is_integer \
                and e.rhs.value > 0 and self.dtype(e.lhs).is_integer and self.nonnegative(e.lhs):  # type: ignore
            return super().binary(Binary("/" if e.op == "floordiv" else "%", e.lhs, e.rhs))  # type: ignore[misc]
        return super().binary(e)  # type: ignore[misc]


# ----------------------------------------------------------------------------- the CUDA printer
_VECTOR_WORDS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned", 8: "uint2", 16: "uint4"}
_FLOAT_WORDS = {4: "float", 8: "float2", 16: "float4"}
_SHUFFLE = {"xor": "__shfl_xor_sync", "down": "__shfl_down_sync", "up": "__shfl_up_sync", "idx": "__shfl_sync"}


class CudaPrinter(HalfAsFloat, NonNegativeIndices, CStylePrinter):
    """Prints one kernel (renamed, no task loops) as a ``__global__`` function; see the module
    docstring.  ``CudaPrinter(program).function(name)`` is its text."""

    types = CUDA_TYPES
    prelude = CUDA_PRELUDE
    half_load = {DType.float16: "__half2float", DType.bfloat16: "__bfloat162float"}
    half_store = {DType.float16: "__float2half_rn", DType.bfloat16: "__float2bfloat16_rn"}
    half_round = {DType.float16: "kiln_round_f16", DType.bfloat16: "kiln_round_bf16"}

    def __init__(self, program: Program):
        super().__init__(program)
        self.blocks, self.threads = block_loops(program), thread_loops(program)
        self.body, self.launch = kernel_body(program), kernel_launch(program)
        self.buffers = {b.name: b for b in program.buffers}
        self.shapes = {b.name: static_shape(b) for b in program.buffers}
        for b in program.buffers:
            if b.scope == "local":
                raise UnsupportedKernel(f"kernel {program.name}: buffer {b.name} is local; kernels hold "
                                        f"global, shared and register buffers")
        self.written = written_buffers(program.body)
        globals_ = {b.name for b in program.buffers if b.scope == "global"}
        self.index_type = "int" if fits_int(program, self.shapes, globals_) else "long"

    @classmethod
    def type_error(cls, dtype: DType) -> Exception:
        return UnsupportedKernel(f"dtype {dtype.short} has no CUDA type")

    # ---------------------------------------------------------------- the function
    def function(self, name: str) -> str:
        params = ", ".join(self.buffer_param(b) for b in self.program.buffers if b.scope == "global")
        self.lines.append(f'extern "C" __global__ void __launch_bounds__({self.launch.threads}) '
                          f"{name}({params or 'void'}) {{")
        for b in self.program.buffers:
            if b.scope == "shared":
                self.lines.append(f"  __shared__ __align__(16) {self.type_name(b.dtype)} {b.name}{self._dims(b)};")
        for lp in (*self.blocks, *self.threads):
            self.var_dtypes[lp.iterator] = INDEX
            self.nonneg_vars().add(lp.iterator)
            self.lines.append(f"  const {self.index_type} {lp.iterator} = {lp.annotation.axis};")
        for b in self.program.buffers:
            if b.scope == "register":
                self.lines.append(f"  __align__(16) {self.type_name(b.dtype)} {b.name}{self._dims(b)} = {{}};")
        for n in self.body:
            self.node(n, "  ")
        self.lines.append("}")
        return "\n".join(self.lines)

    def _dims(self, b: Buffer) -> str:
        return "".join(f"[{d}]" for d in self.shapes[b.name]) or "[1]"

    def buffer_param(self, b: Buffer) -> str:
        const = "" if b.name in self.written else "const "
        return f"{const}{self.type_name(b.dtype)} *__restrict__ {b.name}"

    def ref(self, buffer: str, indices: tuple[Expr, ...]) -> str:
        if self.buffers[buffer].scope != "global":
            return super().ref(buffer, indices)
        offset = flat_offset(indices, self.shapes[buffer])
        return f"{buffer}[{self.expr(offset) if offset is not None else '0'}]"

    # ---------------------------------------------------------------- loops
    def loop_pragmas(self, n: Loop) -> list[str]:
        if n.annotation.mode == "mapped":
            raise UnsupportedKernel(f"loop {n.name} is mapped to {n.annotation.axis} inside the per-thread code")
        if n.annotation.mode == "unrolled":
            return [f"#pragma unroll {n.annotation.factor}"]
        return []

    def loop_header(self, n: Loop) -> str:
        it = n.iterator
        step = f"{it}++" if n.step == 1 else f"{it} += {n.step}"
        return f"for ({self.index_type} {it} = {self.expr(n.lower)}; {it} < {self.expr(n.upper)}; {step}) {{"

    # ---------------------------------------------------------------- nodes
    def node(self, n: Node, ind: str) -> None:
        if isinstance(n, Barrier):
            self.lines.append(ind + ("__syncthreads();" if n.scope == "block" else "__syncwarp();"))
        elif isinstance(n, CopyCommit):
            self.lines.append(ind + 'asm volatile("cp.async.commit_group;\\n" ::);')
        elif isinstance(n, CopyWait):
            self.lines.append(ind + f'asm volatile("cp.async.wait_group {n.pending};\\n" ::);')
        elif isinstance(n, Shuffle):
            self.shuffle(n, ind)
        elif isinstance(n, VectorCopy):
            self.vector_copy(n, ind)
        elif isinstance(n, TaskLoop):
            raise UnsupportedKernel("task loops must be lowered before printing (kiln.ir.loops.lower_mappings)")
        else:
            super().node(n, ind)

    def shuffle(self, n: Shuffle, ind: str) -> None:
        dtype = self.dtype(n.value)
        value = self.expr(n.value)
        if dtype == DType.bool or dtype in (DType.int8, DType.uint8):
            value = f"(int)({value})"
        call = f"{_SHUFFLE[n.mode]}(0xffffffffu, {value}, (int)({self.expr(n.offset)}), {n.width})"
        self.lines.append(ind + self.store_line(self.ref(n.buffer, n.indices), n.buffer, call))

    def vector_copy(self, n: VectorCopy, ind: str) -> None:
        total = self.buf_dtypes[n.dst].itemsize * n.width
        dst = f"&{self.ref(n.dst, n.dst_indices)}"
        src = f"&{self.ref(n.src, n.src_indices)}"
        if n.asynchronous:
            if total not in (4, 8, 16):
                raise UnsupportedKernel(f"asynchronous vector copy {n.name} moves {total} bytes; cp.async "
                                        f"copies 4, 8 or 16")
            kind = "cg" if total == 16 else "ca"
            self.lines.append(f'{ind}asm volatile("cp.async.{kind}.shared.global [%0], [%1], {total};\\n" :: '
                              f'"r"((unsigned)__cvta_generic_to_shared({dst})), "l"({src}));')
            return
        floats = self.buf_dtypes[n.dst] == DType.float32 and total in _FLOAT_WORDS
        word = (_FLOAT_WORDS if floats else _VECTOR_WORDS).get(total)
        if word is None:
            raise UnsupportedKernel(f"vector copy {n.name} moves {total} bytes; one access moves 1, 2, 4, 8 or 16")
        self.lines.append(f"{ind}*reinterpret_cast<{word} *>({dst}) = *reinterpret_cast<const {word} *>({src});")

    # ---------------------------------------------------------------- literals
    def const(self, c: Const) -> tuple[str, int]:
        if c.dtype.is_floating and not math.isfinite(float(c.value)):
            bits = _special_bits(float(c.value), c.dtype)
            return bits, 8
        return super().const(c)


def _special_bits(value: float, dtype: DType) -> str:
    """An infinity or NaN as a bit pattern (no header needed in device code)."""
    if dtype == DType.float64:
        pattern = 0x7FF8000000000000 if math.isnan(value) else 0x7FF0000000000000
        text = f"__longlong_as_double(0x{pattern:X}LL)"
    else:
        pattern = 0x7FC00000 if math.isnan(value) else 0x7F800000
        text = f"__int_as_float(0x{pattern:X})"
    return f"(-{text})" if value < 0 else text


# ----------------------------------------------------------------------------- one kernel
@dataclass(frozen=True)
class CudaKernel:
    """One printed kernel: its function ``name``, ``text`` (the ``__global__`` function), the
    launch (``grid``, ``block``), the C types of its global parameters in order
    (``param_types``) and the renamed program it was printed from."""

    name: str
    text: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    param_types: tuple[str, ...]
    program: Program

    @property
    def uses_half(self) -> bool:
        """Whether a buffer of the kernel has a half type (its unit needs the half headers)."""
        return any(b.dtype in HALF_TYPES for b in self.program.buffers)


def cuda_kernel(name: str, program: Program, comment: str = "") -> CudaKernel:
    """Print kernel-form ``program`` as the CUDA function ``name`` (module docstring).

    Raises :class:`~kiln.ir.errors.VerificationError` when ``program`` fails
    :func:`kiln.ir.loops.gpu.verify_kernel` and :class:`UnsupportedKernel` when it holds what
    the printer cannot express; the messages name the construct.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"kernel name {name!r} is not a C identifier")
    verify_kernel(program)
    lowered = lower_mappings(program)
    renamed, _ = rename_kernel(lowered)
    printer = CudaPrinter(renamed)
    text = printer.function(name)
    if comment:
        text = f"/* {c_comment(comment)} */\n{text}"
    types = tuple(("" if b.name in printer.written else "const ") + CUDA_TYPES[b.dtype] + " *"
                  for b in renamed.buffers if b.scope == "global")
    return CudaKernel(name, text, printer.launch.grid, printer.launch.block, types, renamed)


# ----------------------------------------------------------------------------- constants
def c_literal(value: float | int | bool, dtype: DType) -> str:
    """``value`` exactly as a C literal of ``dtype`` (hex floats; half types as the float
    holding them, for arrays of ``float``)."""
    if dtype == DType.bool:
        return "1" if value else "0"
    if dtype.is_integer:
        return f"{int(value)}L" if dtype == DType.int64 else str(int(value))
    f = float(value)
    suffix = "" if dtype == DType.float64 else "f"
    if math.isnan(f):
        return f'__builtin_nan{suffix}("")'
    if math.isinf(f):
        return f"{'-' if f < 0 else ''}__builtin_inf{suffix}()"
    return f.hex() + ("" if dtype == DType.float64 else "f")


def constant_array(qualifiers: str, ctype: str, name: str, dtype: DType, data: np.ndarray) -> str:
    """``<qualifiers> ctype name[n] = {...};`` holding ``data`` exactly.  Half types are
    written as their bit patterns (``ctype`` must then be a 16-bit integer type or a type
    constructible from one)."""
    values = np.asarray(data, dtype=dtype.numpy).reshape(-1)
    if dtype in HALF_TYPES:
        bits = values.view(np.uint16).tolist()
        text = ", ".join(f"0x{b:04x}" for b in bits)
    else:
        text = ", ".join(c_literal(v, dtype) for v in values.tolist())
    return f"{qualifiers}{ctype} {name}[{max(values.size, 1)}] = {{{text or '0'}}};\n"


__all__ = ["CUDA_HALF_PRELUDE", "CUDA_PRELUDE", "CUDA_TYPES", "cuda_prelude", "CudaKernel", "CudaPrinter", "HalfAsFloat",
           "NonNegativeIndices", "UnsupportedKernel", "c_comment", "c_literal", "constant_array", "cuda_kernel",
           "rename_kernel", "static_shape", "written_buffers"]
