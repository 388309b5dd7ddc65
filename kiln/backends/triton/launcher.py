"""Launching a graph's Triton kernels from a call plan.

:class:`TritonLauncher` is the :class:`kiln.runtime.call_plan.KernelLauncher` of one loaded
kernel module.  Its table holds one :class:`LoadedKernel` per kernel symbol: the module's
launch function, the configuration chosen for it, and its constant buffers as device
tensors (made once, when the module is loaded).

:meth:`TritonLauncher.bind` prepares a run of kernels for one workspace: scratch buffers
are allocated there (one set per workspace, so threads never share them), pointer
arguments of static slots (the arena, constants) are resolved once, and a kernel argument
that is a view at a byte offset of its root is passed as a flat view starting at that
element.  A call then collects the dynamic slots' tensors and calls each launch function.
In the interpreter, launches run with Triton's library functions in interpreted form
(:func:`.toolchain.interpreted_library`).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.runtime.call_plan import Allocator, BoundCall, KernelCall, Slots, split_arguments

from .toolchain import interpreted_library


@dataclass
class LoadedKernel:
    """One kernel symbol of a loaded module, ready to launch."""

    symbol: str
    launch: Callable[[list, dict], None]
    config: dict
    kind: str
    scratch: list[tuple[tuple[int, ...], torch.dtype]]
    constants: list[torch.Tensor] = field(default_factory=list)
    args: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)


def torch_dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"kernel module names an unknown dtype {name!r}")
    return dtype


def load_entry(symbol: str, entry: dict, config: dict, device: torch.device) -> LoadedKernel:
    """A :class:`LoadedKernel` of the module entry ``entry`` with configuration ``config``."""
    constants = []
    for shape, dtype, data in entry["constants"]:
        raw = bytearray(base64.b64decode(data))
        tensor = torch.frombuffer(raw, dtype=torch_dtype_named(dtype)) if raw else torch.empty(0, dtype=torch_dtype_named(dtype))
        constants.append(tensor.reshape(shape).clone().to(device))
    scratch = [(tuple(shape), torch_dtype_named(dtype)) for shape, dtype in entry["scratch"]]
    args = [(tuple(shape), torch_dtype_named(dtype)) for shape, dtype in entry["args"]]
    return LoadedKernel(symbol, entry["launch"], dict(config), entry["kind"], scratch, constants, args)


def at_offset(tensor: torch.Tensor, byte_offset: int) -> torch.Tensor:
    """``tensor``'s memory from ``byte_offset`` on, as a flat view (kernels address it
    row-major from there)."""
    if not byte_offset:
        return tensor
    return tensor.reshape(-1)[byte_offset // tensor.element_size():]


class TritonLauncher:
    """Launches the kernels of one module (module docstring)."""

    def __init__(self, table: Sequence[LoadedKernel], allocator: Allocator, *, interpret: bool):
        self.table = list(table)
        self.allocator = allocator
        self.interpret = interpret

    def bind(self, kernels: Sequence[KernelCall], static: set[int], template: Slots) -> BoundCall:
        runs: list[tuple[LoadedKernel, list[Any], list[tuple[int, int, int]]]] = []
        for index, slots, offsets in kernels:
            kernel = self.table[index]
            fixed, dynamic = split_arguments(slots, offsets, static, template, at_offset)
            fixed += kernel.constants
            fixed += [self.allocator.empty(shape, dtype) for shape, dtype in kernel.scratch]
            runs.append((kernel, fixed, dynamic))
        context = interpreted_library if self.interpret else contextlib.nullcontext

        def call(slots: Slots) -> None:
            with context():
                for kernel, fixed, dynamic in runs:
                    ptrs = list(fixed)
                    for position, slot, offset in dynamic:
                        ptrs[position] = at_offset(slots[slot], offset)
                    kernel.launch(ptrs, kernel.config)
        return call


def random_operands(kernel: LoadedKernel, device: torch.device) -> list[torch.Tensor]:
    """Operands for timing ``kernel``: random floats, zeros for integers (valid indices),
    its constants and fresh scratch."""
    ptrs: list[torch.Tensor] = []
    for shape, dtype in kernel.args:
        if dtype.is_floating_point:
            ptrs.append(torch.randn(shape, dtype=dtype, device=device))
        else:
            ptrs.append(torch.zeros(shape, dtype=dtype, device=device))
    ptrs += kernel.constants
    ptrs += [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in kernel.scratch]
    return ptrs


__all__ = ["LoadedKernel", "TritonLauncher", "at_offset", "load_entry", "random_operands", "torch_dtype_named"]
