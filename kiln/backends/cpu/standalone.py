"""Standalone native kernels of the cpu backend that library calls run: building, loading,
and choosing them per shape by measurement.

Some library calls of the cpu backend (:mod:`.attention`, :mod:`.conv`) run kiln's own C
kernels instead of an ATen kernel when that measures faster.  Each such kernel family is one
C source compiled into a shared object by the backend's C toolchain and kept in the compile
cache (:func:`load_library`: built once per source, compiler and machine, then loaded from
the cache), called through ``ctypes`` on the data pointers of torch tensors.

:class:`KernelChooser` decides, per kernel family and shape signature, between kiln's kernel
and the existing implementation: both are called in turn on random inputs of the node's
shapes for a few rounds, each one's best time counts (a disturbance by other processes then
hits both alike; a side 4x slower after the first round has lost), and the choice is kept
in ``kernels.json`` of the compile cache folder, keyed by machine (a digest of the compiler's
and the CPU's identity), threads and signature, so each shape is timed once per machine.
``KILN_NATIVE_KERNELS`` overrides the measurement: ``0`` never uses kiln's kernels, ``1``
always does where they apply (tests use both).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kiln.backends.common.choices import ChoiceStore
from kiln.backends.common.toolchain import build_cached
from kiln.ir import Node
from kiln.runtime.cache import CompileCache, default_cache_dir
from kiln.runtime.tensors import torch_dtype
from kiln.runtime.timing import best_time

from . import toolchain

ENV_VAR = "KILN_NATIVE_KERNELS"
"""``0``: never use kiln's standalone kernels; ``1``: always (where they apply); unset: measure."""
CHOICES = ("kiln", "library")


@functools.lru_cache(maxsize=16)
def load_library(source: str) -> ctypes.CDLL | None:
    """The shared object built from ``source`` by the cpu toolchain (from the compile cache,
    built on a miss); ``None`` when there is no C compiler or the build fails, so callers
    fall back to the library implementation."""
    cc = toolchain.c_compiler()
    if cc is None:
        return None
    try:
        cache = CompileCache()
        entry = build_cached(toolchain.cpu_compiler(cc), source, cache, manifest={"kernels": []})
        return ctypes.CDLL(str(Path(entry.library)))
    except (OSError, toolchain.CompileError):
        return None


@functools.lru_cache(maxsize=1)
def runner_library() -> ctypes.CDLL | None:
    """A shared object holding only a kernel-table runner (``kiln_run``, ``kiln_add_kernel``
    of :func:`~.codegen.table_runner`, no kernels of its own): it launches the foreign
    kernels of a plan that has no generated kernel."""
    from .codegen import table_runner  # noqa: PLC0415

    return load_library(table_runner([]))


def threads() -> int:
    """Threads a kernel call uses: torch's (the OpenMP pool kiln's kernels share)."""
    return max(1, torch.get_num_threads())


@functools.lru_cache(maxsize=4)
def _store(directory: str) -> ChoiceStore:
    return ChoiceStore(Path(directory) / "kernels.json", lambda v: v in CHOICES, ".kernels.")


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    cc = toolchain.c_compiler()
    identity = toolchain.compiler_identity(cc) if cc else "no-cc"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


DECISIVE = 4.0
"""A first-round ratio of best times that ends :meth:`KernelChooser.measure` early."""


class KernelChooser:
    """Chooses between kiln's kernel and the library implementation of one kernel family
    (``family``) by timing both (see the module docstring)."""

    def __init__(self, family: str, rounds: int = 5, source: str = ""):
        self.family = family
        self.rounds = rounds
        self.version = hashlib.sha256(source.encode()).hexdigest()[:12] if source else ""
        """A digest of kiln's kernel source, part of every stored choice's key: a changed
        kernel is timed again."""

    def choose(self, signature: str, kiln: Callable[[], object], library: Callable[[], object]) -> str:
        """``"kiln"`` or ``"library"`` for ``signature``: remembered, forced by
        ``KILN_NATIVE_KERNELS``, or measured now with the two zero-argument callables."""
        forced = os.environ.get(ENV_VAR)
        if forced in ("0", "1"):
            return "kiln" if forced == "1" else "library"
        store = _store(str(default_cache_dir()))
        key = f"{_machine()}|threads={threads()}|{self.family}{'@' + self.version if self.version else ''}|{signature}"
        known = store.get(key)
        if known is not None:
            return known
        choice = self.measure(kiln, library)
        store.put(key, choice)
        return choice

    def measure(self, kiln: Callable[[], object], library: Callable[[], object]) -> str:
        """Time both in turn for ``rounds`` rounds; the one with the lower best time wins.
        After the first round a side :data:`DECISIVE` times slower has lost (an emulated
        half-precision library call can take 20x kiln's time: no need to run it five times)."""
        best = {"kiln": float("inf"), "library": float("inf")}
        for fn in (kiln, library):  # warm-up (first-call costs, packing)
            fn()
        for _ in range(self.rounds):
            for name, fn in (("kiln", kiln), ("library", library)):
                best[name] = min(best[name], best_time(fn, repeat=1, warmup=0))
            if max(best.values()) > DECISIVE * min(best.values()):
                break
        return min(best, key=best.__getitem__)


def random_operands(node: Node, strides: Sequence[tuple[int, ...] | None]) -> list[torch.Tensor]:
    """Random operands of ``node``'s shapes, each with ``strides[i]`` where given (the layout
    the compiled graph passes: a view of a wider projection leaves gaps in its storage)."""
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for value, stride in zip(node.inputs, strides):
        shape = tuple(value.shape)
        layout = stride is not None and len(stride) == len(shape) and all(s >= 0 for s in stride)
        # random storage seen through the strides (which may repeat elements: a broadcast mask)
        size = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if layout and all(shape) else None
        if value.dtype.name == "bool":
            data = torch.rand(size or shape, generator=gen) < 0.8
        else:
            data = torch.randn(size or shape, generator=gen).to(torch_dtype(value.dtype))
        tensors.append(data.as_strided(shape, stride) if size else data)
    return tensors


def pointer(t: torch.Tensor | None) -> ctypes.c_void_p:
    """The data pointer of ``t`` (NULL for ``None``)."""
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)


__all__ = ["CHOICES", "ENV_VAR", "KernelChooser", "load_library", "pointer", "random_operands", "runner_library",
           "threads"]
