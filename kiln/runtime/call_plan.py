"""A call plan: a compiled graph as one flat list of prebuilt call records, on one device.

Backends build call plans; the runtime runs them.  Every value of the graph has a numbered
*slot*.  Slots ``0 .. num_args-1`` receive the executable's arguments (user inputs, then
parameters); the others are filled by steps:

* :class:`NativeRunStep` -- consecutive native kernels of one loaded artifact, launched by
  its :class:`KernelLauncher` (on the host, :class:`HostLauncher`: one ctypes call that runs
  a table of ``void f(void *const *ptrs)`` functions on the raw data pointers of their
  slots' tensors; a :class:`ForeignKernel`, a function of another shared object, joins the
  table when the artifact is loaded);
* :class:`TorchStep` -- a Python callable on tensors (a library call such as
  ``torch.matmul(a, b, out=c)``), either writing into preallocated outputs or returning
  new tensors;
* :class:`ViewStep` -- a zero-copy re-indexing (``reshape``, ``permute``...); a view of a
  slot whose storage is fixed (the arena, a constant) is made once per workspace, not per
  call;
* :class:`ContiguousStep` -- makes an argument contiguous for a native kernel (a no-op for
  contiguous tensors);
* :class:`PackStep` -- keeps a persistent prepared copy of a weight view up to date (the
  backend supplies how to write it: a plain copy, or its GEMM's packed layout);
* :class:`PrepareStep` -- keeps persistent tensors written from several parameters up to
  date (a convolution's packed weight with a batch norm folded into it, and its bias);
* :class:`ReleaseStep` -- drops tensors after their last use.

The step types live in :mod:`.steps` (re-exported here).

The plan knows its device through its :class:`Allocator`: the arena, the persistent
buffers and the fresh outputs are all allocated by it (``HOST``, :class:`TorchDeviceAllocator`
for ``"cpu"``, allocates host memory; ``TorchDeviceAllocator("cuda")`` goes through torch's
CUDA caching allocator), and constants are moved to its device once, when the plan is made.

A *workspace* holds what one thread needs to run the plan: the arena tensor (one
allocation holding every planned intermediate at its planned offset), tensor views of it
for each planned slot, the pointer arrays of the native calls (arena pointers filled in
once) and the bound call records.  Workspaces are per thread (``threading.local``), so
**concurrent calls from several threads are safe**: they never share intermediate
buffers.  Each thread pays for its own arena.

Per call, the plan copies the slot template, stores the arguments, allocates the graph
outputs that steps write into (fresh tensors: outputs escape to the caller), and runs one
loop over the bound records.  Nothing else is proportional to the graph size.  A caller
may pass ``out`` (output position -> tensor): such an output, when it is a fresh buffer of
that shape and dtype, is written into the caller's tensor instead (the caller sees which
outputs came back as its own tensors; they must not share memory with the arguments).

With ``poison=True`` (a testing aid) the arena and every fresh output are filled with
``0xFF`` bytes (NaN for floats) before each call, so reading memory before writing it
cannot go unnoticed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .steps import (BoundCall, ContiguousStep, ForeignKernel, HostLauncher, KernelCall, KernelLauncher, NativeRunStep,
                    PackStep, PrepareStep, ReleaseStep, Slots, Step, TorchStep, ViewStep, split_arguments)
from .timing import best_time

# ------------------------------------------------------------------------------ device
class Allocator(Protocol):
    """Where a call plan's tensors live: every tensor the plan allocates comes from here."""

    device: torch.device

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of ``shape`` and ``dtype`` on :attr:`device`."""
        ...


class TorchDeviceAllocator:
    """Allocates through torch on ``device``: host memory for ``"cpu"``, torch's caching
    allocator for ``"cuda"`` (so plans share the cache with the rest of the program)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def __repr__(self) -> str:
        return f"TorchDeviceAllocator({str(self.device)!r})"


HOST = TorchDeviceAllocator("cpu")
"""The host allocator (host backends' plans)."""


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


# ------------------------------------------------------------------------------ the plan
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
        constants: slot -> tensor fixed at build time (graph constants, folded values);
            moved to the allocator's device once.
        planned: slots living in the arena (``offset`` set), allocated fresh per call, or
            persistent per workspace.
        arena_bytes: size of the arena.
        steps: the steps, in execution order.
        outputs: slots returned, in graph-output order.
        allocator: where every tensor the plan allocates lives (default :data:`HOST`).
    """

    def __init__(self, *, num_slots: int, num_args: int, constants: dict[int, torch.Tensor],
                 planned: Sequence[SlotSpec], arena_bytes: int, steps: Sequence[Step],
                 outputs: Sequence[int], name: str = "graph", poison: bool = False,
                 allocator: Allocator = HOST):
        self.poison = poison
        self.allocator = allocator
        self.device = allocator.device
        self._device_type = torch.device(self.device).type
        self.num_slots = num_slots
        self.num_args = num_args
        self.constants = {slot: t.to(self.device) for slot, t in constants.items()}
        self.arena_specs = [s for s in planned if s.offset is not None]
        self.persistent_specs = [s for s in planned if s.persistent]
        self.fresh_specs = [(s.slot, s.shape, s.dtype) for s in planned if s.offset is None and not s.persistent]
        self._fresh = {slot: (shape, dtype) for slot, shape, dtype in self.fresh_specs}
        self.arena_bytes = arena_bytes
        self.steps = list(steps)
        self.outputs = list(outputs)
        self.name = name
        self._empty = allocator.empty
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

    def _make_workspace(self, arena: torch.Tensor | None = None,
                        persistent: dict[tuple, torch.Tensor] | None = None) -> Workspace:
        """A new workspace, in its own arena or in ``arena`` (at least ``arena_bytes`` long);
        persistent tensors come from (and go into) ``persistent`` when given, keyed by slot,
        shape and dtype, so plans of one build at several sizes share their packed weights."""
        empty = self._empty
        if arena is None:
            arena = empty((max(self.arena_bytes, 1),), torch.uint8)
        template: Slots = [None] * self.num_slots
        static: set[int] = set()
        for slot, tensor in self.constants.items():
            template[slot] = tensor
            static.add(slot)
        # persistent tensors get version counters even when the first call runs in inference
        # mode: a pack reading one (a GEMM's panels of a weight's bf16 copy) sees its updates
        with torch.inference_mode(False):
            for spec in self.persistent_specs:
                if persistent is None:
                    template[spec.slot] = empty(spec.shape, spec.dtype)
                else:
                    key = (spec.slot, spec.shape, spec.dtype)
                    if key not in persistent:
                        persistent[key] = empty(spec.shape, spec.dtype)
                    template[spec.slot] = persistent[key]
                static.add(spec.slot)
        for spec in self.arena_specs:
            nbytes = _numel(spec.shape) * spec.dtype.itemsize
            raw = arena[spec.offset: spec.offset + nbytes]
            template[spec.slot] = raw.view(spec.dtype).view(spec.shape) if nbytes else empty(spec.shape, spec.dtype)
            static.add(spec.slot)
        calls, labels = [], []
        for step in self.steps:
            call = step.bind(static, template)
            if call is not None:
                calls.append(call)
                labels.append(f"{type(step).__name__}: {getattr(step, 'label', '')}")
        return Workspace(arena, template, calls, labels)

    def _slots(self, ws: Workspace, args: Sequence[torch.Tensor]) -> Slots:
        slots = ws.template.copy()
        slots[: self.num_args] = args
        empty = self._empty
        for slot, shape, dtype in self.fresh_specs:
            slots[slot] = empty(shape, dtype)
        return slots

    def __call__(self, args: Sequence[torch.Tensor], out: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        return self.run_in(self.workspace(), args, self.poison, out)

    def run_in(self, ws: Workspace, args: Sequence[torch.Tensor], poison: bool,
               out: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """One call in workspace ``ws`` (the per-call path: :meth:`_slots`, inline); ``out``
        as in the module docstring."""
        slots = ws.template.copy()
        slots[: self.num_args] = args
        empty, given = self._empty, self._given(out) if out else {}
        for slot, shape, dtype in self.fresh_specs:
            tensor = given.get(slot)
            slots[slot] = tensor if tensor is not None else empty(shape, dtype)
        if poison:
            self._poison(ws, slots)
        for call in ws.calls:
            call(slots)
        return [slots[i] for i in self.outputs]

    def _given(self, out: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The caller's tensors that fresh output slots can be written into: contiguous, on the
        plan's device, of the slot's shape and dtype."""
        given = {}
        for position, tensor in out.items():
            slot = self.outputs[position]
            if (self._fresh.get(slot) == (tuple(tensor.shape), tensor.dtype) and tensor.is_contiguous()
                    and tensor.device.type == self._device_type):
                given[slot] = tensor
        return given

    def profile(self, args: Sequence[torch.Tensor], repeat: int = 3) -> list[tuple[str, float]]:
        """Seconds each bound call takes (:func:`kiln.runtime.timing.best_time`: the best of
        ``repeat`` runs, one after the other, of each call in plan order), with what it runs."""
        ws = self.workspace()
        slots = self._slots(ws, args)
        times = [best_time(lambda call=call: call(slots), repeat=repeat, warmup=0) for call in ws.calls]
        return list(zip(ws.labels, times))

    def _poison(self, ws: Workspace, slots: Slots) -> None:
        """Fill the arena and the fresh outputs with garbage (NaN bytes), so a kernel that reads
        memory before writing it fails its test instead of passing on lucky zeros."""
        ws.arena.fill_(0xFF)
        for slot, _, _ in self.fresh_specs:
            if slots[slot].numel():
                slots[slot].reshape(-1).view(torch.uint8).fill_(0xFF)


@dataclass
class _SizedWorkspace:
    """One thread's arena (grown to the largest plan seen) and its bound plans by size key."""

    arena: torch.Tensor | None = None
    bound: dict[tuple[int, ...], tuple[CallPlan, Workspace]] = field(default_factory=dict)
    persistent: dict[Any, dict[tuple, torch.Tensor]] = field(default_factory=dict)
    """Persistent tensors (packed weights) by the plans' ``persistent_group``: made once."""


class DynamicCallPlan:
    """Runs a graph with symbolic shapes at the sizes of each call.

    ``bind(args)`` returns the call's size key (the values of the named sizes), having
    checked every argument's shape against the graph's symbolic types and every size
    against its range (it raises otherwise, so a wrong size never runs).  ``instance(key)``
    makes the static :class:`CallPlan` of one key (the backend's memory plan and steps at
    those sizes); it is made once per key and kept (``max_sizes`` keys at most, then the
    oldest is dropped).  Each thread binds an instance once per key into its workspace,
    whose single arena grows to the largest instance seen and is never allocated again
    below that size; persistent tensors (packed weights) are made once per thread and
    ``persistent_group`` of the instances (plans of one build share their layouts).  A call at a key seen before costs the binding, one dictionary look-up
    and the same steps as a static plan.
    """

    def __init__(self, *, num_args: int, bind: Callable[[Sequence[torch.Tensor]], tuple[int, ...]],
                 instance: Callable[[tuple[int, ...]], CallPlan], name: str = "graph", poison: bool = False,
                 allocator: Allocator = HOST, max_sizes: int = 64):
        self.num_args = num_args
        self.bind = bind
        self.instance = instance
        self.name = name
        self.poison = poison
        self.allocator = allocator
        self.device = allocator.device
        self.max_sizes = max_sizes
        self._instances: dict[tuple[int, ...], CallPlan] = {}
        self._local = threading.local()
        self._workspaces = 0
        self._lock = threading.Lock()

    @property
    def workspaces(self) -> int:
        return self._workspaces

    @property
    def instances(self) -> dict[tuple[int, ...], CallPlan]:
        """The static plans made so far, by size key."""
        return dict(self._instances)

    def plan_for(self, key: tuple[int, ...]) -> CallPlan:
        """The static plan of size key ``key`` (made on first use)."""
        plan = self._instances.get(key)
        if plan is None:
            with self._lock:
                plan = self._instances.get(key)
                if plan is None:
                    plan = self.instance(key)
                    if len(self._instances) >= self.max_sizes:
                        self._instances.pop(next(iter(self._instances)))
                    self._instances[key] = plan
        return plan

    def _enter(self, key: tuple[int, ...]) -> tuple[CallPlan, Workspace]:
        ws = getattr(self._local, "ws", None)
        if ws is None:
            ws = self._local.ws = _SizedWorkspace()
            with self._lock:
                self._workspaces += 1
        entry = ws.bound.get(key)
        if entry is not None:
            return entry
        plan = self.plan_for(key)
        if ws.arena is None or ws.arena.numel() < plan.arena_bytes:
            ws.arena = self.allocator.empty((max(plan.arena_bytes, 1),), torch.uint8)
            ws.bound.clear()  # bound pointers referred to the old arena
        if len(ws.bound) >= self.max_sizes:
            ws.bound.pop(next(iter(ws.bound)))
        shared = ws.persistent.setdefault(getattr(plan, "persistent_group", None), {})
        entry = ws.bound[key] = (plan, plan._make_workspace(ws.arena, shared))
        return entry

    def __call__(self, args: Sequence[torch.Tensor], out: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
        key = self.bind(args)
        ws = getattr(self._local, "ws", None)
        entry = ws.bound.get(key) if ws is not None else None
        if entry is None:
            entry = self._enter(key)
        plan, w = entry
        return plan.run_in(w, args, self.poison, out)

    def profile(self, args: Sequence[torch.Tensor], repeat: int = 3) -> list[tuple[str, float]]:
        """:meth:`CallPlan.profile` of the plan at these arguments' sizes."""
        plan, w = self._enter(self.bind(args))
        slots = plan._slots(w, args)
        times = [best_time(lambda call=call: call(slots), repeat=repeat, warmup=0) for call in w.calls]
        return list(zip(w.labels, times))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["HOST", "Allocator", "BoundCall", "CallPlan", "ContiguousStep", "DynamicCallPlan", "ForeignKernel",
           "HostLauncher", "KernelCall", "KernelLauncher", "NativeRunStep", "PackStep", "PrepareStep", "ReleaseStep",
           "SlotSpec", "Slots", "Step", "TorchDeviceAllocator", "TorchStep", "ViewStep", "Workspace", "split_arguments"]
