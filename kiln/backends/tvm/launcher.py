"""Launching a graph's TVM kernels from a call plan.

:class:`TvmLauncher` is the :class:`kiln.runtime.call_plan.KernelLauncher` of one loaded
TVM library.  Every kernel is a packed function taking one data pointer per buffer (see
:mod:`.tir`): the buffers of its plan operation (a root's address plus the view's byte
offset), its constant buffers, which the launcher holds as tensors made once when the
library is loaded, and its scratch buffers (the program's local buffers), allocated once per
workspace so threads never share them.  :meth:`TvmLauncher.bind` resolves the pointers of
static slots (arena, constants, scratch) once per workspace; a call writes the dynamic ones (arguments, fresh
outputs) and calls each function (about 2 us per kernel).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.runtime.call_plan import BoundCall, KernelCall, Slots, split_arguments


@dataclass
class LoadedKernel:
    """One kernel symbol of a loaded library."""

    symbol: str
    function: Any
    constants: list[torch.Tensor] = field(default_factory=list)
    scratch: list[tuple[tuple[int, ...], str]] = field(default_factory=list)


class TvmLauncher:
    """Launches the kernels of one library (module docstring)."""

    def __init__(self, table: Sequence[LoadedKernel]):
        self.table = list(table)

    def bind(self, kernels: Sequence[KernelCall], static: set[int], template: Slots) -> BoundCall:
        runs: list[tuple[Any, list[Any], list[tuple[int, int, int]]]] = []
        keep: list = [k.constants for k in self.table]  # tensors whose pointers the calls hold
        for index, slots, offsets in kernels:
            kernel = self.table[index]
            fixed, dynamic = split_arguments(slots, offsets, static, template,
                                             lambda t, offset: ctypes.c_void_p(t.data_ptr() + offset))
            scratch = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in kernel.scratch]
            fixed += [ctypes.c_void_p(t.data_ptr()) for t in (*kernel.constants, *scratch)]
            runs.append((kernel.function, fixed, dynamic))
            keep.append(scratch)

        def call(slots: Slots, _keep=keep) -> None:
            for function, fixed, dynamic in runs:
                if dynamic:
                    args = list(fixed)
                    for position, slot, offset in dynamic:
                        args[position] = ctypes.c_void_p(slots[slot].data_ptr() + offset)
                    function(*args)
                else:
                    function(*fixed)
        return call


__all__ = ["LoadedKernel", "TvmLauncher"]
