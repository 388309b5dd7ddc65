"""Compile a loop program's C (``to_c``) with the system C compiler and call it with ctypes.

Used to check generated programs against the interpreter and to time schedules.  Shared
objects are cached by the hash of their source and flags in a per-user temp directory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .cgen import to_c
from .interp import buffer_shape
from .program import Program

DEFAULT_FLAGS = ("-O2", "-std=c99", "-ffp-contract=off")
_CTYPES = {"i64": ctypes.c_long, "f64": ctypes.c_double, "f32": ctypes.c_float, "bool": ctypes.c_bool}


def compiler() -> str | None:
    """The C compiler to use (``$CC``, else ``cc``/``gcc``/``clang``), or ``None``."""
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _cache_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"kiln-loops-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    d.mkdir(parents=True, exist_ok=True)
    return d


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
        self._fn.argtypes = ([ctypes.c_long] * (len(program.params) - len(scalars))
                             + [_CTYPES.get(q.dtype.short, ctypes.c_double) for q in scalars]
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
                args.append(_CTYPES.get(q.dtype.short, ctypes.c_double)(float(params[q.name])))
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
        """Best wall time of ``repeat`` runs, in seconds (arrays are updated each run)."""
        args = self._args(params, arrays)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            self._fn(*args)
            best = min(best, time.perf_counter() - t0)
        return best


def compile_c(program: Program, flags: tuple[str, ...] = DEFAULT_FLAGS, openmp: bool = False) -> NativeKernel:
    """Compile ``to_c(program)`` into a shared object and load it."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found: set $CC or install cc/gcc/clang")
    symbol = "kiln_" + program.name
    source = to_c(program, name=symbol)
    all_flags = tuple(flags) + (("-fopenmp",) if openmp else ()) + ("-shared", "-fPIC")
    key = hashlib.sha256((source + "\0" + " ".join(all_flags) + cc).encode()).hexdigest()[:24]
    out = _cache_dir() / f"{key}.so"
    if not out.exists():
        src = _cache_dir() / f"{key}.c"
        src.write_text(source)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([cc, *all_flags, str(src), "-o", str(tmp), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {program.name} failed:\n{proc.stderr}\n--- source ---\n{source}")
        os.replace(tmp, out)
    return NativeKernel(program, source, out, symbol)
