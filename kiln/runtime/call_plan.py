"""A call plan: a compiled graph as one flat list of prebuilt call records.

Every value of the graph has a numbered *slot*.  Slots ``0 .. num_args-1`` receive the
executable's arguments (user inputs, then parameters); the others are filled by steps:

* :class:`KernelStep` -- a native function ``void f(void *const *ptrs)`` called (through
  ctypes) with the raw data pointers of its slots' tensors, inputs then outputs;
  :class:`NativeRunStep` runs several consecutive ones in a single foreign call;
* :class:`TorchStep` -- a Python callable on tensors (a library call such as
  ``torch.matmul(a, b, out=c)``), either writing into preallocated outputs or returning
  new tensors;
* :class:`ViewStep` -- a zero-copy re-indexing (``reshape``, ``permute``...); a view of a
  slot whose storage is fixed (the arena, a constant) is made once per workspace, not per
  call;
* :class:`ContiguousStep` -- makes an argument contiguous for a native kernel (a no-op for
  contiguous tensors);
* :class:`PackStep` -- keeps a persistent contiguous copy of a weight view up to date;
* :class:`ReleaseStep` -- drops tensors after their last use.

A *workspace* holds what one thread needs to run the plan: the arena tensor (one
allocation holding every planned intermediate at its planned offset), tensor views of it
for each planned slot, the pointer arrays of the native calls (arena pointers filled in
once) and the bound call records.  Workspaces are per thread (``threading.local``), so
**concurrent calls from several threads are safe**: they never share intermediate
buffers.  Each thread pays for its own arena once.

Per call, the plan copies the slot template, stores the arguments, allocates the graph
outputs that steps write into (fresh tensors: outputs escape to the caller), and runs one
loop over the bound records.  Nothing else is proportional to the graph size.

With ``poison=True`` (a testing aid) the arena and every fresh output are filled with
``0xFF`` bytes (NaN for floats) before each call, so reading memory before writing it
cannot go unnoticed.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Slots = list[Any]
BoundCall = Callable[[Slots], None]


@dataclass(frozen=True)
class SlotSpec:
    """A planned slot: an arena view (``offset`` in bytes) of ``shape``/``dtype``, a fresh
    output tensor allocated per call (``offset=None``), or, with ``persistent``, a tensor
    each workspace allocates once and keeps across calls (packed weights)."""

    slot: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None = None
    persistent: bool = False


@dataclass(frozen=True)
class KernelStep:
    """Call ``function(ptrs)`` with the data pointers of ``slots`` (inputs, then outputs), each
    advanced by its entry of ``offsets`` (bytes; a kernel reads a view as its root's pointer
    plus the view's offset)."""

    function: Any  # a ctypes function taking one ``void **``
    slots: tuple[int, ...]
    offsets: tuple[int, ...] = ()
    label: str = ""

    def bind(self, static: set[int], template: Slots) -> BoundCall:
        offsets = self.offsets or (0,) * len(self.slots)
        ptrs = (ctypes.c_void_p * max(len(self.slots), 1))()
        dynamic = []
        for pos, (slot, offset) in enumerate(zip(self.slots, offsets)):
            if slot in static:
                ptrs[pos] = template[slot].data_ptr() + offset
            else:
                dynamic.append((pos, slot, offset))
        fn = self.function
        if not dynamic:
            return lambda slots: fn(ptrs)
        if len(dynamic) == 1:
            (pos0, slot0, off0), = dynamic

            def call_one(slots: Slots) -> None:
                ptrs[pos0] = slots[slot0].data_ptr() + off0
                fn(ptrs)
            return call_one
        if not any(off for _, _, off in dynamic):
            pairs = [(pos, slot) for pos, slot, _ in dynamic]

            def call(slots: Slots) -> None:
                for pos, slot in pairs:
                    ptrs[pos] = slots[slot].data_ptr()
                fn(ptrs)
            return call

        def call_offsets(slots: Slots) -> None:
            for pos, slot, off in dynamic:
                ptrs[pos] = slots[slot].data_ptr() + off
            fn(ptrs)
        return call_offsets


@dataclass(frozen=True)
class TorchStep:
    """``function(*inputs, *outputs)`` when ``writes_into`` (outputs are preallocated slots),
    else ``outputs = function(*inputs)`` (one tensor, or a tuple for several outputs)."""

    function: Callable[..., Any]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    writes_into: bool = True
    label: str = ""

    def bind(self, static: set[int], template: Slots) -> BoundCall:
        fn, ins, outs = self.function, self.inputs, self.outputs
        if self.writes_into:
            args = ins + outs
            return lambda slots: fn(*[slots[i] for i in args])
        if len(outs) == 1:
            out0 = outs[0]

            def call_one(slots: Slots) -> None:
                slots[out0] = fn(*[slots[i] for i in ins])
            return call_one

        def call(slots: Slots) -> None:
            results = fn(*[slots[i] for i in ins])
            for slot, value in zip(outs, results):
                slots[slot] = value
        return call


@dataclass(frozen=True)
class ViewStep:
    """``output = function(input)`` for a zero-copy view function."""

    function: Callable[[torch.Tensor], torch.Tensor]
    input: int
    output: int
    label: str = ""

    def bind(self, static: set[int], template: Slots) -> BoundCall | None:
        if self.input in static:
            source = template[self.input]
            view = self.function(source)
            if _shares_storage(view, source):
                template[self.output] = view
                static.add(self.output)
                return None
        fn, i, o = self.function, self.input, self.output

        def call(slots: Slots) -> None:
            slots[o] = fn(slots[i])
        return call


@dataclass(frozen=True)
class ContiguousStep:
    """Replace the tensors in ``slots`` by contiguous ones (themselves when they already are)."""

    slots: tuple[int, ...]

    def bind(self, static: set[int], template: Slots) -> BoundCall | None:
        dynamic = tuple(s for s in self.slots if s not in static or not template[s].is_contiguous())
        if not dynamic:
            return None
        if len(dynamic) == 1:
            s0 = dynamic[0]

            def call_one(slots: Slots) -> None:
                slots[s0] = slots[s0].contiguous()
            return call_one

        def call(slots: Slots) -> None:
            for s in dynamic:
                slots[s] = slots[s].contiguous()
        return call


@dataclass(frozen=True)
class NativeRunStep:
    """Consecutive native kernels in one call: ``runner(calls, n, ptrs)`` runs kernel
    ``table[calls[2i]]`` on ``ptrs + calls[2i+1]`` for ``i < n``; ``ptrs`` concatenates every
    kernel's pointers (see :class:`KernelStep`), so a run of kernels costs one foreign call."""

    runner: Any  # a ctypes function (const long *, long, void *const *)
    kernels: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]  # (table index, slots, offsets)
    label: str = ""

    def bind(self, static: set[int], template: Slots) -> BoundCall:
        total = sum(len(slots) for _, slots, _ in self.kernels)
        ptrs = (ctypes.c_void_p * max(total, 1))()
        calls = (ctypes.c_long * (2 * len(self.kernels)))()
        dynamic = []
        pos = 0
        for i, (index, slots, offsets) in enumerate(self.kernels):
            calls[2 * i], calls[2 * i + 1] = index, pos
            for slot, offset in zip(slots, offsets or (0,) * len(slots)):
                if slot in static:
                    ptrs[pos] = template[slot].data_ptr() + offset
                else:
                    dynamic.append((pos, slot, offset))
                pos += 1
        # Plain addresses: ctypes converts ints faster than array objects.
        runner = _RUNNER_PROTOTYPE(ctypes.cast(self.runner, ctypes.c_void_p).value)
        n, calls_at, ptrs_at = len(self.kernels), ctypes.addressof(calls), ctypes.addressof(ptrs)
        keep = (calls, ptrs)  # the arrays live as long as the bound call

        if not dynamic:
            return lambda slots, _keep=keep: runner(calls_at, n, ptrs_at)

        def call(slots: Slots, _keep=keep) -> None:
            for p, slot, off in dynamic:
                ptrs[p] = slots[slot].data_ptr() + off
            runner(calls_at, n, ptrs_at)
        return call


_RUNNER_PROTOTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p)


@dataclass(frozen=True)
class PackStep:
    """Keep ``target`` (a persistent tensor of the workspace) equal to a contiguous copy of
    the view ``view = (shape, strides, offset)`` of the tensor in ``source``: the copy is
    made again only when that tensor's storage or version counter changed since the last
    call, so a weight prepacked for a GEMM follows in-place updates of the parameter."""

    source: int
    view: tuple[tuple[int, ...], tuple[int, ...], int]
    target: int
    label: str = ""
    panels: bool = False
    """Write the ``K x N`` view as 16-column panels (``(ceil(N/16), K, 16)``, zero-padded),
    the layout of kiln's own GEMM, instead of a plain contiguous copy."""

    def bind(self, static: set[int], template: Slots) -> BoundCall:
        target = template[self.target]
        shape, strides, offset = self.view
        source = self.source
        panels = self.panels
        last: list[object] = [None]

        def call(slots: Slots) -> None:
            w = slots[source]
            try:
                key: object = (w.data_ptr(), w._version)
            except RuntimeError:  # inference tensors have no version counter: always copy
                key = None
            if key is None or key != last[0]:
                view = torch.as_strided(w, shape, strides, w.storage_offset() + offset)
                if panels:
                    write_panels(view, target)
                else:
                    target.copy_(view)
                last[0] = key
        return call


def write_panels(b: torch.Tensor, out: torch.Tensor) -> None:
    """``b`` (``K x N``) into ``out`` (``(P, K, W)``) as ``W``-column panels, zero-padded."""
    k, n = b.shape
    width = out.shape[2]
    full = n // width
    if full:
        out[:full].copy_(b[:, : full * width].reshape(k, full, width).permute(1, 0, 2))
    rest = n - full * width
    if rest:
        out[full, :, :rest].copy_(b[:, full * width:])
        out[full, :, rest:].zero_()


@dataclass(frozen=True)
class ReleaseStep:
    """Drop the tensors in ``slots`` (library results after their last use), so their memory
    is freed during the call rather than at its end."""

    slots: tuple[int, ...]

    def bind(self, static: set[int], template: Slots) -> BoundCall | None:
        dynamic = tuple(s for s in self.slots if s not in static)
        if not dynamic:
            return None

        def call(slots: Slots) -> None:
            for s in dynamic:
                slots[s] = None
        return call


Step = KernelStep | NativeRunStep | TorchStep | ViewStep | ContiguousStep | PackStep | ReleaseStep


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@dataclass
class Workspace:
    """One thread's arena, slot template and bound calls."""

    arena: torch.Tensor
    template: Slots
    calls: list[BoundCall] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    """What each bound call runs (for :meth:`CallPlan.profile`)."""


class CallPlan:
    """Runs a graph as a flat list of steps (see the module docstring).

    Args:
        num_slots: number of slots; ``0 .. num_args-1`` are the arguments.
        num_args: how many tensors a call passes (user inputs, then parameters).
        constants: slot -> tensor fixed at build time (graph constants, folded values).
        planned: slots living in the arena (``offset`` set) or allocated fresh per call.
        arena_bytes: size of the arena.
        steps: the steps, in execution order.
        outputs: slots returned, in graph-output order.
    """

    def __init__(self, *, num_slots: int, num_args: int, constants: dict[int, torch.Tensor],
                 planned: Sequence[SlotSpec], arena_bytes: int, steps: Sequence[Step],
                 outputs: Sequence[int], name: str = "graph", poison: bool = False):
        self.poison = poison
        self.num_slots = num_slots
        self.num_args = num_args
        self.constants = dict(constants)
        self.arena_specs = [s for s in planned if s.offset is not None]
        self.persistent_specs = [s for s in planned if s.persistent]
        self.fresh_specs = [(s.slot, s.shape, s.dtype) for s in planned if s.offset is None and not s.persistent]
        self.arena_bytes = arena_bytes
        self.steps = list(steps)
        self.outputs = list(outputs)
        self.name = name
        self._local = threading.local()
        self._workspaces = 0
        self._lock = threading.Lock()

    @property
    def workspaces(self) -> int:
        """How many workspaces (threads that called the plan) exist so far."""
        return self._workspaces

    def workspace(self) -> Workspace:
        """This thread's workspace, made on its first call."""
        ws = getattr(self._local, "ws", None)
        if ws is None:
            ws = self._make_workspace()
            self._local.ws = ws
            with self._lock:
                self._workspaces += 1
        return ws

    def _make_workspace(self) -> Workspace:
        arena = torch.empty(max(self.arena_bytes, 1), dtype=torch.uint8)
        template: Slots = [None] * self.num_slots
        static: set[int] = set()
        for slot, tensor in self.constants.items():
            template[slot] = tensor
            static.add(slot)
        for spec in self.persistent_specs:
            template[spec.slot] = torch.empty(spec.shape, dtype=spec.dtype)
            static.add(spec.slot)
        for spec in self.arena_specs:
            nbytes = _numel(spec.shape) * _itemsize(spec.dtype)
            raw = arena[spec.offset: spec.offset + nbytes]
            template[spec.slot] = raw.view(spec.dtype).view(spec.shape) if nbytes else \
                torch.empty(spec.shape, dtype=spec.dtype)
            static.add(spec.slot)
        calls, labels = [], []
        for step in self.steps:
            call = step.bind(static, template)
            if call is not None:
                calls.append(call)
                labels.append(f"{type(step).__name__}: {getattr(step, 'label', '')}")
        return Workspace(arena, template, calls, labels)

    def __call__(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ws = self.workspace()
        slots = ws.template.copy()
        slots[: self.num_args] = args
        for slot, shape, dtype in self.fresh_specs:
            slots[slot] = torch.empty(shape, dtype=dtype)
        if self.poison:
            self._poison(ws, slots)
        for call in ws.calls:
            call(slots)
        return [slots[i] for i in self.outputs]


    def profile(self, args: Sequence[torch.Tensor], repeat: int = 3) -> list[tuple[str, float]]:
        """Seconds each bound call takes (best of ``repeat`` runs), with what it runs."""
        ws = self.workspace()
        best = [float("inf")] * len(ws.calls)
        for _ in range(repeat):
            slots = ws.template.copy()
            slots[: self.num_args] = args
            for slot, shape, dtype in self.fresh_specs:
                slots[slot] = torch.empty(shape, dtype=dtype)
            for i, call in enumerate(ws.calls):
                start = time.perf_counter()
                call(slots)
                best[i] = min(best[i], time.perf_counter() - start)
        return list(zip(ws.labels, best))

    def _poison(self, ws: Workspace, slots: Slots) -> None:
        """Fill the arena and the fresh outputs with garbage (NaN bytes), so a kernel that reads
        memory before writing it fails its test instead of passing on lucky zeros."""
        ws.arena.fill_(0xFF)
        for slot, _, _ in self.fresh_specs:
            if slots[slot].numel():
                slots[slot].reshape(-1).view(torch.uint8).fill_(0xFF)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


__all__ = ["CallPlan", "ContiguousStep", "KernelStep", "NativeRunStep", "PackStep", "ReleaseStep", "SlotSpec", "Step",
           "TorchStep", "ViewStep", "Workspace", "write_panels"]
