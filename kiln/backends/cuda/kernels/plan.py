"""The kernel plan of one lowered program: :class:`GpuPlan`, :class:`GpuKernel`,
:class:`KernelOptions` and :func:`plan_kernels`.

:func:`plan_kernels` splits the lowered program into its top-level nodes (one loop nest
each, consecutive loop-free statements grouped) and turns each into one or more kernels in
kernel form (see :mod:`kiln.ir.loops.gpu`).  Each nest goes to the first specialized kind
whose recognizer accepts it (``attention`` for a whole attention program, then ``matmul``,
``rows``, ``pointwise``), else to ``generic``, which accepts every nest.  The kernels run in
plan order on one stream, so the plan computes exactly what the lowered program computes in
its own order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from kiln.ir.loops import Buffer, Program

KINDS = ("pointwise", "rows", "matmul", "attention", "generic")
SPECIALIZED = ("attention", "matmul", "rows", "pointwise")
DEFAULT_ALIGNMENT = 16
"""Bytes: what torch's allocator guarantees for a tensor's storage."""


@dataclass(frozen=True)
class GpuKernel:
    """One launch: ``program`` is in kernel form; ``name`` is unique within its plan and a C
    identifier; ``kind`` says which generator made it."""

    name: str
    program: Program
    kind: str


@dataclass(frozen=True)
class GpuPlan:
    """The kernels of one lowered program, launched in order on one stream.

    ``arguments``: the lowered program's global buffers, in its ``buffers`` order;
    ``scratch``: global buffers that are neither inputs nor outputs (the lowered program's
    ``local`` buffers that a kernel did not keep in registers or shared memory), allocated
    zero-filled per call and freed after it; ``constants``: the lowered kernel's tensor
    constants.  Every global buffer of every kernel is one of ``arguments`` or ``scratch``
    with the same name, shape and dtype.
    """

    kernels: tuple[GpuKernel, ...]
    arguments: tuple[str, ...]
    scratch: tuple[Buffer, ...]
    constants: dict[str, np.ndarray] = field(default_factory=dict)

    def kinds(self) -> tuple[str, ...]:
        return tuple(k.kind for k in self.kernels)


@dataclass(frozen=True)
class KernelOptions:
    """Knobs of the generators.

    * ``block_size``: threads per block of the generic, pointwise and rows kinds;
    * ``max_blocks``: the cap of grid-stride launches (132 SMs x 16 resident blocks);
    * ``vector_width``: elements per vector access of the pointwise kind (1 turns it off);
    * ``matmul``: a :class:`~kiln.backends.cuda.kernels.matmul.MatmulConfig` forcing the tile
      configuration of matmul kernels (default: :func:`matmul_configs`' first legal choice);
    * ``attention_block``: query rows per block of attention kernels;
    * ``alignment``: bytes each global argument's base address is a multiple of (default
      16); the backend passes less for views at odd offsets;
    * ``kinds``: the specialized kinds that may be used (``()`` forces the generic path).
    """

    block_size: int = 256
    max_blocks: int = 132 * 16
    vector_width: int = 4
    matmul: object | None = None
    attention_block: int = 32
    alignment: Mapping[str, int] = field(default_factory=dict)
    kinds: Collection[str] = SPECIALIZED

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"KernelOptions: block_size must be in [1, 1024], got {self.block_size}")
        if self.vector_width not in (1, 2, 4, 8):
            raise ValueError(f"KernelOptions: vector_width must be 1, 2, 4 or 8, got {self.vector_width}")
        unknown = sorted(set(self.kinds) - set(KINDS))
        if unknown:
            raise ValueError(f"KernelOptions: unknown kernel kind(s) {unknown}; known: {', '.join(KINDS)}")

    def aligned(self, buffer: str) -> int:
        """The alignment in bytes of argument ``buffer``."""
        return int(self.alignment.get(buffer, DEFAULT_ALIGNMENT))

    def allows(self, kind: str) -> bool:
        return kind in self.kinds


def plan_kernels(lowered, *, template: str = "", node=None, options: KernelOptions | None = None) -> GpuPlan:
    """The :class:`GpuPlan` of ``lowered`` (a :class:`kiln.passes.lower.LoweredKernel`).

    ``template`` is the fused group's template (a hint only: kinds are chosen from the
    program's structure), ``node`` the graph node (attention reads its attributes).
    Guarantees: running the plan's kernels in order computes every global buffer of the
    lowered program exactly as running the program does (up to float reassociation in
    reductions), for every program the lowering produces.
    """
    from .common import PlanContext, top_level_groups
    from .generic import generic_kernels

    options = options or KernelOptions()
    program: Program = lowered.program
    ctx = PlanContext(program, options)
    kernels = None
    if options.allows("attention") and node is not None:
        from .attention import attention_kernels

        kernels = attention_kernels(ctx, node, lowered.inputs, lowered.outputs)
    if kernels is None:
        kernels = []
        groups = top_level_groups(program.body)
        ctx.count_uses(groups)
        for index, group in enumerate(groups):
            made = _specialized(ctx, group, index)
            if made is None:
                made = generic_kernels(ctx, group, index)
            kernels.extend(made)
    arguments = tuple(b.name for b in program.buffers if b.scope == "global")
    return GpuPlan(tuple(kernels), arguments, tuple(ctx.scratch.values()), dict(lowered.constants))


def _specialized(ctx, group: list, index: int):
    """The kernels of the first specialized kind that accepts ``group``, else ``None``."""
    from .matmul import matmul_kernels
    from .pointwise import pointwise_kernels
    from .rows import rows_kernels

    for kind, generator in (("matmul", matmul_kernels), ("rows", rows_kernels), ("pointwise", pointwise_kernels)):
        if ctx.options.allows(kind):
            made = generator(ctx, group, index)
            if made is not None:
                return made
    return None
