"""Run a loop program natively: its plain C (:func:`kiln.ir.loops.cgen.to_c`) built by the C
toolchain and called through ctypes.

Used to check generated programs against the interpreter and to time schedules.  The
program is compiled by :class:`~kiln.backends.cpu.toolchain.CCompiler` with
:data:`DEFAULT_FLAGS` (``-O2 -std=c99 -ffp-contract=off``: no fused multiply-adds, so results
match the interpreter's rounding; ``-fopenmp`` with ``openmp=True``), and the shared object
is kept in the artifact cache (:class:`kiln.runtime.cache.CompileCache`), addressed by its
source and the compiler's identity (:func:`kiln.backends.common.toolchain.build_cached`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from kiln.backends.common.toolchain import build_cached
from kiln.ir.loops.cgen import to_c
from kiln.ir.loops.interp import buffer_shape
from kiln.ir.loops.program import Program
from kiln.runtime.cache import CompileCache
from kiln.runtime.timing import best_time

from .toolchain import CCompiler, CompileError, c_compiler

DEFAULT_FLAGS = ("-O2", "-std=c99", "-ffp-contract=off")
_CTYPES = {"i64": ctypes.c_long, "f64": ctypes.c_double, "f32": ctypes.c_float, "bool": ctypes.c_bool}


class NativeKernel:
    """A compiled loop program: call it like :func:`kiln.ir.loops.interp.run`."""

    def __init__(self, program: Program, source: str, path: Path, symbol: str):
        self.program = program
        self.source = source
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._fn = getattr(self._lib, symbol)
        self._fn.restype = None
        scalars = [q for q in program.params if not q.dtype.is_integer]
        unpassable = [q.name for q in scalars if q.dtype.short not in _CTYPES]
        if unpassable:
            raise ValueError(f"{program.name}: ctypes cannot pass scalar parameter(s) {unpassable} "
                             f"({', '.join(q.dtype.short for q in scalars if q.name in unpassable)})")
        self._fn.argtypes = ([ctypes.c_long] * (len(program.params) - len(scalars))
                             + [_CTYPES[q.dtype.short] for q in scalars]
                             + [ctypes.c_void_p] * sum(b.scope == "global" for b in program.buffers))

    def _args(self, params: Mapping[str, int | float], arrays: Mapping[str, np.ndarray]) -> list:
        p = self.program
        missing = [q.name for q in p.params if q.name not in params]
        if missing:
            raise ValueError(f"{p.name}: missing parameter(s) {missing}")
        sizes = {q.name: int(params[q.name]) for q in p.params if q.dtype.is_integer}
        args: list = [ctypes.c_long(int(params[q.name])) for q in p.params if q.dtype.is_integer]
        for q in p.params:
            if not q.dtype.is_integer:
                args.append(_CTYPES[q.dtype.short](float(params[q.name])))
        for b in p.buffers:
            if b.scope != "global":
                continue
            arr = arrays.get(b.name)
            shape = buffer_shape(p, b.name, sizes)
            if arr is None or arr.shape != shape or arr.dtype != b.dtype.numpy or not arr.flags.c_contiguous:
                raise ValueError(f"{p.name}: buffer '{b.name}' needs a C-contiguous {b.dtype.short}{list(shape)} "
                                 f"array, got {None if arr is None else (arr.dtype, arr.shape)}")
            args.append(arr.ctypes.data_as(ctypes.c_void_p))
        return args

    def __call__(self, params: Mapping[str, int | float], arrays: Mapping[str, np.ndarray]) -> None:
        self._fn(*self._args(params, arrays))

    def time(self, params: Mapping[str, int | float], arrays: Mapping[str, np.ndarray], repeat: int = 3) -> float:
        """Best wall time of ``repeat`` runs, in seconds (arrays are updated each run; no
        untimed warm-up run), measured by :func:`kiln.runtime.timing.best_time`."""
        args = self._args(params, arrays)
        return best_time(lambda: self._fn(*args), repeat=repeat, warmup=0)


def loop_compiler(cc: str, flags: tuple[str, ...] = DEFAULT_FLAGS, openmp: bool = False) -> CCompiler:
    """The toolchain :func:`compile_c` builds with: ``cc`` with ``flags`` (plus ``-fopenmp``
    when ``openmp``) into a shared object linked with libm."""
    return CCompiler(cc, tuple(flags) + (("-fopenmp",) if openmp else ()) + ("-shared", "-fPIC"))


def compile_c(program: Program, flags: tuple[str, ...] = DEFAULT_FLAGS, openmp: bool = False,
              cache: CompileCache | None = None) -> NativeKernel:
    """Compile ``to_c(program)`` into a shared object (from ``cache``, default the artifact
    cache folder, when built before) and load it.

    Raises ``RuntimeError`` without a C compiler or when the compiler rejects the source.
    """
    cc = c_compiler()
    if cc is None:
        raise RuntimeError("no C compiler found: set $CC or install cc/gcc/clang")
    symbol = "kiln_" + program.name
    source = to_c(program, name=symbol)
    try:
        entry = build_cached(loop_compiler(cc, flags, openmp), source, cache or CompileCache(),
                             manifest={"symbol": symbol})
    except CompileError as e:
        raise RuntimeError(f"compiling {program.name} failed:\n{e.stderr}\n--- source ---\n{source}") from e
    return NativeKernel(program, source, entry.library, symbol)


__all__ = ["DEFAULT_FLAGS", "NativeKernel", "compile_c", "loop_compiler"]
