"""The steps of a call plan and how native kernels are launched (see :mod:`.call_plan`).

Every step type has ``bind(static, template)``: for one workspace, it returns the call that
runs the step on a call's slots (or ``None`` when there is nothing to do per call), with
everything that depends only on static slots (constants, the arena, persistent tensors)
computed once.  :class:`HostLauncher` runs a sequence of native kernels in one foreign call:
kernels of its artifact's table and *foreign* kernels (:class:`ForeignKernel`: a native
function of another shared object, such as kiln's convolution entry, with the same
``void f(void *const *ptrs)`` signature), registered in the artifact's table at load time.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

Slots = list[Any]
BoundCall = Callable[[Slots], None]


@dataclass(frozen=True)
class ForeignKernel:
    """A native ``void f(void *const *ptrs)`` outside the launcher's artifact (kiln's
    convolution entry of the cpu backend): ``address`` is the function's; the artifact
    registers it in its kernel table when it is loaded (``kiln_add_kernel``)."""

    address: int
    name: str


KernelCall = tuple["int | ForeignKernel", tuple[int, ...], tuple[int, ...]]
"""One kernel launch: (index in the artifact's kernel table, or a :class:`ForeignKernel`;
slots of its pointer arguments; byte offsets added to them, ``()`` for none -- a kernel
reads a view as its root's pointer plus the view's offset)."""


class KernelLauncher(Protocol):
    """How the native kernels of one loaded artifact are launched.

    :meth:`bind` prepares, for one workspace, a call that launches ``kernels`` in order
    (everything static -- pointers of slots in ``static``, whose tensors sit in
    ``template`` -- precomputed), so a call costs one launch plus the pointers of the
    dynamic slots.
    """

    def bind(self, kernels: Sequence[KernelCall], static: set[int], template: Slots) -> BoundCall: ...


def split_arguments(slots: Sequence[int], offsets: Sequence[int] | None, static: set[int], template: Slots,
                    bind: Callable[[torch.Tensor, int], Any]) -> tuple[list[Any], list[tuple[int, int, int]]]:
    """One kernel's arguments for :meth:`KernelLauncher.bind`: ``bind(tensor, offset)`` for
    each slot in ``static`` (its tensor from ``template``) and ``None`` where a dynamic slot
    goes, with the ``(position, slot, offset)`` of each dynamic one."""
    fixed: list[Any] = []
    dynamic: list[tuple[int, int, int]] = []
    for position, (slot, offset) in enumerate(zip(slots, offsets or (0,) * len(slots))):
        if slot in static:
            fixed.append(bind(template[slot], offset))
        else:
            fixed.append(None)
            dynamic.append((position, slot, offset))
    return fixed, dynamic


class HostLauncher:
    """Host kernels of one shared object, through its table runner
    ``runner(calls, n, ptrs)`` (a ctypes function of ``(const long *, long, void *const *)``),
    which runs kernel ``table[calls[2i]]`` -- a ``void f(void *const *ptrs)`` -- on
    ``ptrs + calls[2i+1]`` for ``i < n``.  ``ptrs`` concatenates every kernel's pointers, so
    a run of kernels costs one foreign call (which releases the GIL).  ``foreign`` maps the
    address of each :class:`ForeignKernel` the plan launches to its row of the table."""

    def __init__(self, runner: Any, foreign: dict[int, int] | None = None):
        self.runner = runner
        self.foreign = dict(foreign or {})

    def _row(self, index: int | ForeignKernel) -> int:
        if not isinstance(index, ForeignKernel):
            return index
        row = self.foreign.get(index.address)
        if row is None:
            raise RuntimeError(f"kiln bug: foreign kernel {index.name} was not registered in the kernel table")
        return row

    def bind(self, kernels: Sequence[KernelCall], static: set[int], template: Slots) -> BoundCall:
        total = sum(len(slots) for _, slots, _ in kernels)
        ptrs = (ctypes.c_void_p * max(total, 1))()
        calls = (ctypes.c_long * max(2 * len(kernels), 1))()
        dynamic = []
        pos = 0
        for i, (index, slots, offsets) in enumerate(kernels):
            calls[2 * i], calls[2 * i + 1] = self._row(index), pos
            for slot, offset in zip(slots, offsets or (0,) * len(slots)):
                if slot in static:
                    ptrs[pos] = template[slot].data_ptr() + offset
                else:
                    dynamic.append((pos, slot, offset))
                pos += 1
        # Plain addresses: ctypes converts ints faster than array objects.
        runner = _RUNNER_PROTOTYPE(ctypes.cast(self.runner, ctypes.c_void_p).value)
        n, calls_at, ptrs_at = len(kernels), ctypes.addressof(calls), ctypes.addressof(ptrs)
        keep = (calls, ptrs)  # the arrays live as long as the bound call

        if not dynamic:
            return lambda slots, _keep=keep: runner(calls_at, n, ptrs_at)

        def call(slots: Slots, _keep=keep) -> None:
            for p, slot, off in dynamic:
                ptrs[p] = slots[slot].data_ptr() + off
            runner(calls_at, n, ptrs_at)
        return call


_RUNNER_PROTOTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p)


# ------------------------------------------------------------------------------ steps
@dataclass(frozen=True)
class NativeRunStep:
    """Consecutive native kernels launched by ``launcher`` as one call (see
    :class:`KernelLauncher`; on the host, :class:`HostLauncher`)."""

    launcher: KernelLauncher
    kernels: tuple[KernelCall, ...]
    label: str = ""

    def bind(self, static: set[int], template: Slots) -> BoundCall:
        return self.launcher.bind(self.kernels, static, template)


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
class PackStep:
    """Keep ``target`` (a persistent tensor of the workspace) equal to ``write(view, target)``
    of the view ``view = (shape, strides, offset)`` of the tensor in ``source``: it is
    written again only when that tensor's storage or version counter changed since the
    last call, so a weight prepared for a GEMM follows in-place updates of the parameter.
    ``write`` is the backend's (a plain copy, or the layout of its own GEMM)."""

    source: int
    view: tuple[tuple[int, ...], tuple[int, ...], int]
    target: int
    write: Callable[[torch.Tensor, torch.Tensor], None]
    label: str = ""

    def bind(self, static: set[int], template: Slots) -> BoundCall:
        target = template[self.target]
        shape, strides, offset = self.view
        source, write = self.source, self.write
        last: list[object] = [None, None]  # the key, and the tensor (a freed one's address is soon reused)

        def call(slots: Slots) -> None:
            w = slots[source]
            try:
                key: object = (w.data_ptr(), w._version)
            except RuntimeError:  # inference tensors have no version counter: always copy
                key = None
            if key is None or key != last[0]:
                write(torch.as_strided(w, shape, strides, w.storage_offset() + offset), target)
                last[0], last[1] = key, w
        return call


@dataclass(frozen=True)
class PrepareStep:
    """Keep the persistent tensors in ``targets`` equal to ``write(sources, targets)`` of the
    tensors in ``sources`` (parameters: a convolution's weight and the batch norm folded into
    it, written as its kernel reads them): written again only when one of the sources'
    storage or version counter changed since the last call.  Consecutive prepare steps are
    one step (``parts``): one bound call checks them all."""

    parts: tuple[tuple[tuple[int, ...], tuple[int, ...], Callable[[list, list], None], str], ...]

    @property
    def label(self) -> str:
        return "; ".join(part[3] for part in self.parts)

    def bind(self, static: set[int], template: Slots) -> BoundCall:
        bound = [(sources, [template[t] for t in targets], write, [None, None])
                 for sources, targets, write, _ in self.parts]
        every = tuple(dict.fromkeys(s for sources, _, _, _ in self.parts for s in sources))
        seen: list = [None, None, None]  # every source tensor, its version and address at the last check

        def call(slots: Slots) -> None:
            # the common case first: every source at the version and address of the last check
            # (two passes over the tensors, no per-part keys: 170 tensors in a MobileNet, half
            # the time of the parts' keys)
            tensors = [slots[s] for s in every]
            if seen[0] is not None:
                try:
                    if [t._version for t in tensors] == seen[1] and [t.data_ptr() for t in tensors] == seen[2]:
                        return
                except RuntimeError:  # an inference tensor: no version counter
                    pass
            for sources, targets, write, last in bound:
                part = [slots[s] for s in sources]
                try:
                    key: object = tuple((t.data_ptr(), t._version) for t in part)
                except RuntimeError:  # inference tensors have no version counter: always write
                    key = None
                if key is None or key != last[0]:
                    write(part, targets)
                    last[0], last[1] = key, part  # the tensors kept: a freed one's address is soon reused
            try:  # the tensors kept, like the parts' (a freed tensor's address is soon reused)
                seen[:] = tensors, [t._version for t in tensors], [t.data_ptr() for t in tensors]
            except RuntimeError:
                seen[0] = None
        return call


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


Step = NativeRunStep | TorchStep | ViewStep | ContiguousStep | PackStep | PrepareStep | ReleaseStep


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
