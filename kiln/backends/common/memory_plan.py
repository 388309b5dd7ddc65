"""The memory plan: intermediate buffers share one arena when their lifetimes do not overlap.

A buffer is requested with its size and its lifetime ``[first, last]`` in steps (the step
that writes it to the last step that reads it, or that reads a view of it).  Two buffers
whose lifetimes intersect never overlap in memory -- in particular a step's outputs never
share memory with its inputs, which is what lets generated kernels declare their
pointers ``restrict``.

Placement is *greedy by size* (as in TensorFlow Lite's arena planner): buffers are placed
largest first, each at the lowest aligned offset where it overlaps no already-placed
buffer that is alive at the same time.  ``MemoryPlan.arena_bytes`` is the planned peak;
``MemoryPlan.total_bytes`` is what one allocation per intermediate would take.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

ALIGNMENT = 64
"""Every buffer starts at a multiple of this many bytes (a cache line; AVX-512 friendly)."""


@dataclass(frozen=True)
class BufferRequest:
    """A buffer of ``nbytes`` alive from step ``first`` to step ``last`` (inclusive)."""

    key: Hashable
    nbytes: int
    first: int
    last: int

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.last < self.first:
            raise ValueError(f"bad buffer request {self}: needs nbytes >= 0 and first <= last")

    def overlaps_in_time(self, other: BufferRequest) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True)
class MemoryPlan:
    """Offsets into one arena; see the module docstring."""

    offsets: dict[Hashable, int]
    sizes: dict[Hashable, int]
    arena_bytes: int
    total_bytes: int

    @property
    def saved_bytes(self) -> int:
        return self.total_bytes - self.arena_bytes

    def report(self) -> str:
        """One line: planned peak beside the sum of all intermediates."""
        n = len(self.offsets)
        ratio = self.arena_bytes / self.total_bytes if self.total_bytes else 1.0
        return (f"memory plan: {n} intermediate buffers, planned peak {_fmt(self.arena_bytes)} "
                f"vs {_fmt(self.total_bytes)} without reuse ({ratio:.0%})")


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _fmt(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def plan_memory(requests: Sequence[BufferRequest]) -> MemoryPlan:
    """Place ``requests`` in one arena (greedy by size, see the module docstring)."""
    keys = [r.key for r in requests]
    if len(set(keys)) != len(keys):
        raise ValueError("plan_memory: buffer keys must be unique")
    placed: list[tuple[BufferRequest, int, int]] = []  # request, offset, aligned size
    offsets: dict[Hashable, int] = {}
    arena = 0
    order = sorted(requests, key=lambda r: (-r.nbytes, r.first, str(r.key)))
    for req in order:
        size = _align(max(req.nbytes, 1))
        busy = sorted((off, off + sz) for other, off, sz in placed if other.overlaps_in_time(req))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        placed.append((req, offset, size))
        offsets[req.key] = offset
        arena = max(arena, offset + size)
    total = sum(_align(max(r.nbytes, 1)) for r in requests)
    return MemoryPlan(offsets, {r.key: r.nbytes for r in requests}, arena, total)


@dataclass(frozen=True)
class SymbolicMemoryPlan:
    """The memory plan of buffers whose sizes are expressions of a graph's symbolic sizes.

    The placement is found once, greedily at sample sizes (:func:`plan_memory`); what is
    kept is its *order*: buffers sorted by their sample offset, and for each the buffers
    alive at the same time placed below it.  :meth:`evaluate` lays the buffers out in that
    order at actual sizes, each at the aligned end of the highest buffer below it, in one
    pass over the buffers and those pairs.  Two buffers alive together are ordered, so they
    never overlap, at any sizes."""

    keys: tuple[Hashable, ...]
    """Buffers in placement order."""
    below: tuple[tuple[int, ...], ...]
    """For each buffer (by position in ``keys``), the earlier positions it must sit above."""
    nbytes: Callable[[Sequence[int]], list[int]]
    """Byte sizes of ``keys`` from the size values."""

    def evaluate(self, sizes: Sequence[int]) -> tuple[dict[Hashable, int], int]:
        """Offsets (key -> bytes) and the arena size at the size values ``sizes``."""
        ends: list[int] = []
        offsets: dict[Hashable, int] = {}
        arena = 0
        for key, below, n in zip(self.keys, self.below, self.nbytes(sizes)):
            offset = max((ends[j] for j in below), default=0)
            end = offset + _align(max(n, 1))
            ends.append(end)
            offsets[key] = offset
            arena = max(arena, end)
        return offsets, arena


def plan_symbolic(requests: Sequence[BufferRequest],
                  nbytes: Callable[[Sequence[int]], list[int]]) -> SymbolicMemoryPlan:
    """The symbolic plan of ``requests`` (their ``nbytes`` taken at sample sizes; ``nbytes``
    gives each request's byte size, in request order, from the size values)."""
    sample = plan_memory(requests)
    order = sorted(range(len(requests)), key=lambda i: (sample.offsets[requests[i].key], i))
    position = {i: p for p, i in enumerate(order)}
    below = []
    for i in order:
        r = requests[i]
        below.append(tuple(sorted(position[j] for j in order[:position[i]] if requests[j].overlaps_in_time(r))))

    def ordered(sizes: Sequence[int]) -> list[int]:
        values = nbytes(sizes)
        return [values[i] for i in order]
    return SymbolicMemoryPlan(tuple(requests[i].key for i in order), tuple(below), ordered)


def check_plan(plan: MemoryPlan, requests: Sequence[BufferRequest]) -> None:
    """Raise ``AssertionError`` if two buffers alive at the same time overlap in memory."""
    reqs = list(requests)
    for i, a in enumerate(reqs):
        a_lo = plan.offsets[a.key]
        a_hi = a_lo + max(a.nbytes, 1)
        assert a_lo % ALIGNMENT == 0 and a_hi <= plan.arena_bytes, f"{a.key} is outside the arena"
        for b in reqs[i + 1:]:
            if not a.overlaps_in_time(b):
                continue
            b_lo = plan.offsets[b.key]
            b_hi = b_lo + max(b.nbytes, 1)
            assert a_hi <= b_lo or b_hi <= a_lo, f"{a.key} and {b.key} are alive together but overlap"


__all__ = ["ALIGNMENT", "BufferRequest", "MemoryPlan", "SymbolicMemoryPlan", "check_plan", "plan_memory",
           "plan_symbolic"]
