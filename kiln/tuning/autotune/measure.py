"""Measuring schedules with the cpu backend's real code.

A candidate's program is printed by the cpu backend's kernel printer
(:func:`kiln.backends.cpu.codegen.translation_unit`: OpenMP pragmas, register reductions,
``restrict`` buffers, the backend's flags), compiled by its toolchain into the artifact
cache -- several at once, in a background process pool -- loaded with ctypes and timed with
:func:`kiln.runtime.timing.best_time`.  Before it is timed, every candidate runs once on the
tuning inputs and its outputs are compared with the unscheduled program's: a candidate whose
results differ is rejected (and counted), never recorded.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kiln.backends.common.toolchain import build_cached
from kiln.backends.cpu import toolchain
from kiln.backends.cpu.codegen import KernelSource, translation_unit
from kiln.ir.loops.expr import Const, Expr, substitute
from kiln.ir.loops.interp import buffer_shape
from kiln.ir.loops.program import If, Loop, Program, Reduce, Store
from kiln.runtime.cache import CompileCache
from kiln.runtime.timing import best_time

SYMBOL = "kiln_k0"
MIN_ROUND_S = 1e-3
"""A timed round lasts at least this long (tiny kernels run several calls per round)."""


def specialize(program: Program, sizes: Mapping[str, int]) -> Program:
    """``program`` with its integer size parameters replaced by ``sizes`` (a static kernel,
    as the cpu backend builds them); scalar parameters stay."""
    missing = [p for p in program.size_params if p not in sizes]
    if missing:
        raise ValueError(f"autotune: program '{program.name}' has size parameter(s) {missing} with no value in "
                         f"params {dict(sizes)}; pass params={{{', '.join(repr(m) + ': 64' for m in missing)}, ...}}")
    mapping: dict[str, Expr] = {p: Const(int(sizes[p])) for p in program.size_params}
    if not mapping:
        return program

    def sub(e: Expr) -> Expr:
        return substitute(e, mapping)

    def node(n: Any) -> Any:
        if isinstance(n, Loop):
            return replace(n, lower=sub(n.lower), upper=sub(n.upper), body=tuple(node(c) for c in n.body))
        if isinstance(n, If):
            return replace(n, cond=sub(n.cond), then=tuple(node(c) for c in n.then),
                           orelse=tuple(node(c) for c in n.orelse))
        if isinstance(n, (Store, Reduce)):
            return replace(n, indices=tuple(sub(i) for i in n.indices), value=sub(n.value))
        raise ValueError(f"autotune: program '{program.name}' holds a {type(n).__name__}, which the cpu "
                         "backend's kernels never do; tune plain loop programs (loops, ifs, stores, reductions)")

    buffers = tuple(replace(b, shape=tuple(sub(d) for d in b.shape)) for b in program.buffers)
    params = tuple(p for p in program.params if p.name not in mapping)
    return Program(program.name, params, buffers, tuple(node(n) for n in program.body))


def kernel_text(program: Program, scalars: Mapping[str, float]) -> str:
    """The C translation unit of ``program`` as the cpu backend prints a kernel."""
    cc = toolchain.find_compiler()
    args = tuple(b.name for b in program.buffers if b.scope == "global")
    source = KernelSource(SYMBOL, program, args, params=dict(scalars))
    return translation_unit([source], toolchain.vector_math_declarations(toolchain.vector_math(cc)))


def compile_text(text: str, cache_dir: str | None = None) -> str:
    """Compile one translation unit with the cpu backend's toolchain (into the artifact
    cache); the path of the shared object."""
    cache = CompileCache(cache_dir)
    entry = build_cached(toolchain.cpu_compiler(), text, cache, manifest={"symbol": SYMBOL})
    return str(entry.library)


def try_compile(text: str, cache_dir: str | None = None) -> tuple[str | None, str]:
    """:func:`compile_text`, or ``(None, the compiler's first error line)`` when the C compiler
    rejects the text.  What the process pool runs."""
    try:
        return compile_text(text, cache_dir), ""
    except toolchain.CompileError as e:
        lines = [ln for ln in (e.stderr or str(e)).splitlines() if "error" in ln]
        return None, (lines[0] if lines else str(e).splitlines()[0])[:300]


def compile_pool(workers: int) -> Executor | None:
    """A process pool of ``workers`` compilers (``None`` for ``workers <= 1``: compile inline)."""
    if workers <= 1:
        return None
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(method))


@dataclass
class Inputs:
    """Seeded random arrays for every global buffer, and the outputs of the reference run."""

    arrays: dict[str, np.ndarray]
    expected: dict[str, np.ndarray]


def random_inputs(program: Program, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for b in program.buffers:
        if b.scope != "global":
            continue
        shape = buffer_shape(program, b.name, {})
        if b.dtype.is_floating:
            out[b.name] = rng.random(shape).astype(b.dtype.numpy) + 0.5
        elif b.dtype.short == "bool":
            out[b.name] = rng.random(shape) < 0.5
        else:
            out[b.name] = rng.integers(0, 4, shape).astype(b.dtype.numpy)
    return out


class LoadedKernel:
    """A compiled kernel entry ``void kiln_k0(void *const *args)`` called on numpy arrays."""

    def __init__(self, path: str, program: Program):
        self._lib = ctypes.CDLL(path)
        self._fn = getattr(self._lib, SYMBOL)
        self._fn.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._fn.restype = None
        self.names = [b.name for b in program.buffers if b.scope == "global"]

    def bind(self, arrays: Mapping[str, np.ndarray]) -> Any:
        ptrs = (ctypes.c_void_p * len(self.names))(*[arrays[n].ctypes.data for n in self.names])
        fn = self._fn
        return lambda: fn(ptrs)


def tolerance(dtype: np.dtype) -> float:
    return 1e-3 if np.dtype(dtype).itemsize <= 4 else 1e-8


def same_results(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> str | None:
    """``None`` when every buffer matches within rounding (reductions may be reassociated by
    the printer), else which buffer differs and by how much."""
    for name, w in want.items():
        g = got[name]
        if w.dtype.kind != "f":
            if not np.array_equal(g, w):
                return f"buffer {name} differs"
            continue
        scale = max(1.0, float(np.max(np.abs(w))) if w.size else 1.0)
        err = float(np.max(np.abs(g.astype(np.float64) - w))) / scale if w.size else 0.0
        if not np.isfinite(err) or err > tolerance(w.dtype) * 10:
            return f"buffer {name} differs by {err:.3g} (relative to its largest value)"
    return None


class Measurer:
    """Compiles and times candidate programs of one kernel (see the module docstring)."""

    def __init__(self, original: Program, scalars: Mapping[str, float], *, seed: int = 0, repeat: int = 5,
                 pool: Executor | None = None, cache_dir: str | None = None):
        self.original = original
        self.scalars = dict(scalars)
        self.repeat = repeat
        self.pool = pool
        self.cache_dir = cache_dir
        self.inputs = random_inputs(original, seed)
        self.compiled = 0
        self.wrong: list[str] = []
        self.failed: list[str] = []
        """Candidates the C compiler rejected (their first error line): a printer limit, not a schedule's fault."""
        self._times: dict[str, float | None] = {}
        reference = self._run_once(self._load(kernel_text(original, self.scalars)), original)
        self.expected = reference

    def _load(self, text: str) -> LoadedKernel:
        path = compile_text(text, self.cache_dir)
        self.compiled += 1
        return LoadedKernel(path, self.original)

    def _run_once(self, kernel: LoadedKernel, program: Program) -> dict[str, np.ndarray]:
        arrays = {k: v.copy() for k, v in self.inputs.items()}
        kernel.bind(arrays)()
        return arrays

    def measure(self, programs: Sequence[Program]) -> list[float | None]:
        """Seconds per call of each program (``None``: its results were wrong -- see
        :attr:`wrong` -- or the C compiler rejected it -- :attr:`failed`); programs with equal C
        text are built and timed once."""
        texts = [kernel_text(p, self.scalars) for p in programs]
        todo = [t for t in dict.fromkeys(texts) if t not in self._times]
        if self.pool is not None and len(todo) > 1:
            built = list(self.pool.map(try_compile, todo, [self.cache_dir] * len(todo)))
        else:
            built = [try_compile(t, self.cache_dir) for t in todo]
        self.compiled += len(todo)
        for text, (path, error) in zip(todo, built):
            if path is None:
                self.failed.append(error)
                self._times[text] = None
            else:
                self._times[text] = self._time(path)
        return [self._times[t] for t in texts]

    def time_of(self, program: Program) -> float | None:
        return self.measure([program])[0]

    def _time(self, path: str) -> float | None:
        kernel = LoadedKernel(path, self.original)
        got = self._run_once(kernel, self.original)
        problem = same_results(got, self.expected)
        if problem is not None:
            self.wrong.append(problem)
            return None
        return self._best(kernel, self.repeat)

    def _best(self, kernel: LoadedKernel, repeat: int) -> float:
        arrays = {k: v.copy() for k, v in self.inputs.items()}
        run = kernel.bind(arrays)
        once = best_time(run, repeat=1, warmup=1)
        number = max(1, min(1000, int(MIN_ROUND_S / max(once, 1e-9))))  # rounds of >= 1 ms: tiny kernels
        return best_time(run, repeat=repeat, warmup=0, number=number)

    def remeasure(self, programs: Sequence[Program], repeat: int) -> list[float]:
        """Time ``programs`` again (already built ones from the cache), ``repeat`` rounds each,
        alternating between them round by round, and keep each one's best: the final
        comparison of the tuned and the default schedule, free of the search's selection bias."""
        kernels = [LoadedKernel(compile_text(kernel_text(p, self.scalars), self.cache_dir), self.original)
                   for p in programs]
        best = [float("inf")] * len(kernels)
        for _ in range(repeat):
            for i, k in enumerate(kernels):
                best[i] = min(best[i], self._best(k, 1))
        return best


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


__all__ = ["Measurer", "compile_pool", "compile_text", "try_compile", "default_workers", "kernel_text", "random_inputs",
           "same_results", "specialize"]
