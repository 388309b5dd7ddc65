"""GPU kernels in the loop IR: kernel form, launch geometry and the kernel verifier.

A kernel is a :class:`~kiln.ir.loops.program.Program` without parameters (static shapes)
whose body is exactly

* perfectly nested *block loops* ``for bx in [0, X) @mapped("blockIdx.x")`` (axes
  ``blockIdx.x|y|z``, lower bound 0, constant upper bound = the grid size along that axis),
* whose single body is perfectly nested *thread loops* ``@mapped("threadIdx.x|y|z")``
  (lower bound 0, constant upper bound = the block size along that axis),
* whose body is the per-thread code: loops, ifs, stores, reductions, task loops, warp
  shuffles, vector copies, barriers and the commits and waits of asynchronous copies.

Each axis appears at most once and ``x`` is the innermost loop of its group.  The launch is
grid = block-loop extents, block = thread-loop extents (:func:`kernel_launch`).  Buffers
are ``global`` (the kernel's arguments, in ``program.buffers`` order), ``shared`` (one copy
per block) or ``register`` (one copy per thread); a kernel has no ``local`` buffer.  Threads
form warps of 32 consecutive linear thread ids, ``x + X * (y + Y * z)``
(:func:`linear_thread`).

:func:`verify_kernel` checks everything above plus the rules a GPU imposes and the
emulation relies on (its docstring lists them).  Every error names the kernel, the loop,
buffer or statement at fault and how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import VerificationError
from .expr import Binary, Const, Expr, Load, Select, Unary, Var, walk
from .interp import eval_index
from .program import (
    WARP_SIZE, Barrier, Buffer, CopyCommit, CopyWait, If, Loop, Node, Program, Reduce, Shuffle, Store, TaskLoop,
    VectorCopy,
)
from .tasks import lower_mappings

BLOCK_AXES = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
THREAD_AXES = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
MAX_THREADS = 1024
"""Threads per block."""
MAX_BLOCK = (1024, 1024, 64)
"""Largest block extent along x, y, z."""
MAX_GRID = (2**31 - 1, 65535, 65535)
"""Largest grid extent along x, y, z."""
MAX_SHARED_BYTES = 48 * 1024
"""Static shared memory per block."""
VECTOR_BYTES = 16
"""The widest vector access: 128 bits."""
ASYNC_COPY_BYTES = (4, 8, 16)
"""The sizes one ``cp.async`` copies."""


@dataclass(frozen=True)
class Launch:
    """A kernel's launch geometry: ``grid`` blocks of ``block`` threads, each ``(x, y, z)``."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]

    @property
    def threads(self) -> int:
        """Threads per block."""
        return math.prod(self.block)

    @property
    def blocks(self) -> int:
        """Blocks in the grid."""
        return math.prod(self.grid)


@dataclass(frozen=True)
class _Form:
    blocks: tuple[Loop, ...]
    threads: tuple[Loop, ...]
    body: tuple[Node, ...]


def _where(program: Program) -> str:
    return f"kernel '{program.name}'"


def _describe(nodes: tuple[Node, ...]) -> str:
    if not nodes:
        return "nothing"
    kinds = []
    for n in nodes:
        if isinstance(n, Loop):
            ann = n.annotation
            kinds.append(f"loop '{n.name}'" + (f' @mapped("{ann.axis}")' if ann.mode == "mapped" else ""))
        else:
            kinds.append(type(n).__name__)
    return f"{len(nodes)} node(s): {', '.join(kinds)}"


def _is_mapped(n: Node, axes: tuple[str, ...]) -> bool:
    return isinstance(n, Loop) and n.annotation.mode == "mapped" and n.annotation.axis in axes


def _group(program: Program, nodes: tuple[Node, ...], axes: tuple[str, ...], kind: str) -> tuple[list[Loop], tuple[Node, ...]]:
    """The perfectly nested loops mapped to ``axes`` at the top of ``nodes`` and the body below them."""
    where = _where(program)
    loops: list[Loop] = []
    while len(nodes) == 1 and _is_mapped(nodes[0], axes):
        lp = nodes[0]
        assert isinstance(lp, Loop)
        if not (isinstance(lp.lower, Const) and lp.lower.dtype.is_integer and lp.lower.value == 0):
            raise VerificationError(f"{where}: {kind} loop '{lp.name}' starts at {lp.lower}; a {kind} loop runs "
                                    f"over [0, extent): shift its iterator in the body instead")
        if not (isinstance(lp.upper, Const) and lp.upper.dtype.is_integer and lp.upper.value >= 1):
            raise VerificationError(f"{where}: {kind} loop '{lp.name}' has upper bound {lp.upper}; a {kind} loop "
                                    f"needs a constant extent >= 1 (the launch size along {lp.annotation.axis})")
        if lp.step != 1:
            raise VerificationError(f"{where}: {kind} loop '{lp.name}' has step {lp.step}; a {kind} loop has "
                                    f"step 1: scale its iterator in the body instead")
        for other in loops:
            if other.annotation.axis == lp.annotation.axis:
                raise VerificationError(f"{where}: axis {lp.annotation.axis} is mapped twice, by loops "
                                        f"'{other.name}' and '{lp.name}'; map each axis once (fuse the loops)")
        loops.append(lp)
        nodes = lp.body
    for lp in loops[:-1]:
        if lp.annotation.axis.endswith(".x"):
            raise VerificationError(f"{where}: loop '{lp.name}' mapped to {lp.annotation.axis} must be the "
                                    f"innermost {kind} loop (x varies fastest); move it inside "
                                    f"'{loops[-1].name}'")
    return loops, nodes


def _form(program: Program) -> _Form:
    """The kernel-form parts of ``program``; raises :class:`VerificationError` when it is not
    in kernel form or its launch exceeds the limits."""
    where = _where(program)
    if program.params:
        names = ", ".join(p.name for p in program.params)
        raise VerificationError(f"{where}: has parameters ({names}); kernels have static shapes: substitute "
                                f"the sizes into bounds, indices and shapes before building the kernel")
    if len(program.body) != 1 or not _is_mapped(program.body[0], BLOCK_AXES):
        raise VerificationError(f"{where}: not in kernel form: the body must be exactly one loop "
                                f'@mapped("blockIdx.x|y|z"), found {_describe(program.body)}; wrap the '
                                f"code in block loops (extent 1 for a single block) and thread loops")
    blocks, rest = _group(program, program.body, BLOCK_AXES, "block")
    if len(rest) != 1 or not _is_mapped(rest[0], THREAD_AXES):
        raise VerificationError(f"{where}: not in kernel form: the body of block loop '{blocks[-1].name}' "
                                f'must be exactly one loop @mapped("threadIdx.x|y|z"), found {_describe(rest)}; '
                                f"put per-thread code inside the thread loops")
    threads, body = _group(program, rest, THREAD_AXES, "thread")
    for n, _ in _walk_nodes(body):
        if isinstance(n, Loop) and n.annotation.mode == "mapped":
            raise VerificationError(f'{where}: loop \'{n.name}\' @mapped("{n.annotation.axis}") is inside the '
                                    f"per-thread code; block loops must be perfectly nested outermost and "
                                    f"thread loops directly inside them")
    form = _Form(tuple(blocks), tuple(threads), body)
    launch = _launch(form)
    if launch.threads > MAX_THREADS:
        raise VerificationError(f"{where}: {launch.threads} threads per block (block {launch.block}) exceed "
                                f"{MAX_THREADS}; give each thread more work (a repeat in the task mapping)")
    for i, axis in enumerate("xyz"):
        if launch.block[i] > MAX_BLOCK[i]:
            raise VerificationError(f"{where}: block extent {launch.block[i]} along {axis} exceeds "
                                    f"{MAX_BLOCK[i]}; map the threads to another axis")
        if launch.grid[i] > MAX_GRID[i]:
            raise VerificationError(f"{where}: grid extent {launch.grid[i]} along {axis} exceeds "
                                    f"{MAX_GRID[i]}; map the blocks to blockIdx.x")
    return form


def _walk_nodes(nodes: tuple[Node, ...]) -> Iterator[tuple[Node, int]]:
    """Every node below ``nodes``, pre-order (program order), with its depth."""
    stack = [(n, 0) for n in reversed(nodes)]
    while stack:
        n, depth = stack.pop()
        yield n, depth
        kids: tuple[Node, ...] = ()
        if isinstance(n, (Loop, TaskLoop)):
            kids = n.body
        elif isinstance(n, If):
            kids = n.then + n.orelse
        stack.extend((k, depth + 1) for k in reversed(kids))


def _launch(form: _Form) -> Launch:
    def dims(loops: tuple[Loop, ...]) -> tuple[int, int, int]:
        ext = {lp.annotation.axis[-1]: int(lp.upper.value) for lp in loops}
        return (ext.get("x", 1), ext.get("y", 1), ext.get("z", 1))

    return Launch(dims(form.blocks), dims(form.threads))


# ----------------------------------------------------------------------------- public views
def kernel_launch(program: Program) -> Launch:
    """The grid and block of kernel ``program`` (axes without a loop have extent 1)."""
    return _launch(_form(program))


def block_loops(program: Program) -> tuple[Loop, ...]:
    """The block loops of kernel ``program``, outermost first."""
    return _form(program).blocks


def thread_loops(program: Program) -> tuple[Loop, ...]:
    """The thread loops of kernel ``program``, outermost first."""
    return _form(program).threads


def kernel_body(program: Program) -> tuple[Node, ...]:
    """The per-thread code of kernel ``program``: the body of its innermost thread loop."""
    return _form(program).body


def linear_thread(program: Program) -> Expr:
    """The linear thread id ``x + X * (y + Y * z)`` of kernel ``program`` in its thread
    iterators (axes without a loop contribute 0); warps are 32 consecutive ids."""
    out: Expr | None = None
    for lp in sorted(_form(program).threads, key=lambda lp: lp.annotation.axis, reverse=True):
        # Horner from the slowest axis: x + X * (y + Y * z)
        var = Var(lp.iterator)
        out = var if out is None else Binary("+", var, Binary("*", Const(int(lp.upper.value)), out))
    assert out is not None
    return out


def shared_bytes(program: Program) -> int:
    """Bytes of static shared memory kernel ``program`` declares (one block's copy)."""
    return sum(_bytes(b) for b in program.buffers if b.scope == "shared")


def _bytes(b: Buffer) -> int:
    return math.prod(_const(d) for d in b.shape) * b.dtype.numpy.itemsize


def _const(d: Expr) -> int:
    return int(eval_index(d, {}))


# ----------------------------------------------------------------------------- the verifier
def verify_kernel(program: Program) -> None:
    """Raise :class:`VerificationError` unless ``program`` is a kernel a GPU runs as written.

    Checks, in this order: kernel form (module docstring; no parameters, perfectly nested
    block then thread loops over ``[0, constant)`` with step 1, each axis once, ``x``
    innermost, no mapped loop in the per-thread code); launch limits (at most
    :data:`MAX_THREADS` threads, :data:`MAX_BLOCK` and :data:`MAX_GRID` per axis); no
    ``local`` buffer; static shared memory of at most :data:`MAX_SHARED_BYTES`; then, on
    the program with its task loops lowered (:func:`~kiln.ir.loops.tasks.lower_mappings`):

    * per-thread loops are ``serial``, ``unrolled`` or ``vectorized`` (never ``parallel``);
    * a ``register`` buffer is indexed only by expressions that depend on no thread or
      block iterator (it is per-thread already);
    * every :class:`Barrier` and :class:`Shuffle` sits only under loops whose bounds and
      ifs whose conditions depend on no thread iterator and no loaded value (uniform
      control flow: every thread of the block reaches it);
    * a shuffle's width divides the block's thread count (its lane groups are complete);
    * a :class:`VectorCopy` moves at most :data:`VECTOR_BYTES` bytes (an asynchronous
      one exactly 4, 8 or 16), its last indices are provably multiples of its width and the
      last dimension of each multi-dimensional buffer it touches is a multiple of the width
      (the vector access is aligned);
    * the last asynchronous copy (in program order) is followed by ``commit_copies`` and
      then ``wait_copies 0`` before the end of the kernel.
    """
    form = _form(program)
    where = _where(program)
    for b in program.buffers:
        if b.scope == "local":
            raise VerificationError(f"{where}: buffer '{b.name}' is local; kernels have no local buffers: make "
                                    f"it 'shared' (one copy per block) or 'register' (one copy per thread)")
    used = shared_bytes(program)
    if used > MAX_SHARED_BYTES:
        sizes = ", ".join(f"'{b.name}' {_bytes(b)}" for b in program.buffers if b.scope == "shared")
        raise VerificationError(f"{where}: {used} bytes of shared memory ({sizes}) exceed the static limit of "
                                f"{MAX_SHARED_BYTES}; use smaller tiles")
    lowered = lower_mappings(program)
    lowered_form = _form(lowered) if lowered is not program else form
    _Checker(lowered, _launch(form), lowered is not program).nodes(lowered_form.body, _Env.start(lowered_form), ())
    _check_async(program, form.body)


def _say(taint) -> str:
    words = {"thread": "thread iterator", "block": "block iterator", "load": "a value loaded from"}
    parts = sorted(f"{words[k]} '{n}'" for k, n in taint)
    return ", ".join(parts)


@dataclass(frozen=True)
class _Env:
    taints: dict[str, frozenset]
    divisors: dict[str, int]

    @staticmethod
    def start(form: _Form) -> _Env:
        taints = {lp.iterator: frozenset({("block", lp.iterator)}) for lp in form.blocks}
        taints.update({lp.iterator: frozenset({("thread", lp.iterator)}) for lp in form.threads})
        return _Env(taints, {})

    def bind(self, it: str, taint: frozenset, divisor: int) -> _Env:
        return _Env({**self.taints, it: taint}, {**self.divisors, it: divisor})


def taint_of(expr: Expr, taints: dict[str, frozenset]) -> frozenset:
    """What ``expr`` depends on: ``(kind, name)`` pairs of the variables' entries in
    ``taints`` and ``("load", buffer)`` for every load it makes."""
    out: set = set()
    for e in walk(expr):
        if isinstance(e, Var):
            out |= taints.get(e.name, frozenset())
        elif isinstance(e, Load):
            out.add(("load", e.buffer))
    return frozenset(out)


def known_divisor(e: Expr, divisors: dict[str, int]) -> int:
    """An integer ``g`` such that integer expression ``e`` is always a multiple of ``g``
    (``0`` when ``e`` is always 0); variables missing from ``divisors`` count 1."""
    if isinstance(e, Const):
        return abs(int(e.value)) if e.dtype.is_integer else 1
    if isinstance(e, Var):
        return divisors.get(e.name, 1)
    if isinstance(e, Unary) and e.op == "-":
        return known_divisor(e.operand, divisors)
    if isinstance(e, Select):
        return math.gcd(known_divisor(e.if_true, divisors), known_divisor(e.if_false, divisors))
    if isinstance(e, Binary):
        a, b = known_divisor(e.lhs, divisors), known_divisor(e.rhs, divisors)
        if e.op in ("+", "-", "min", "max", "floormod", "%"):
            return math.gcd(a, b)
        if e.op == "*":
            return a * b
        if e.op in ("floordiv", "/") and a == 0:
            return 0
    return 1


class _Checker:
    """The per-thread rules of :func:`verify_kernel`, on a kernel without task loops."""

    def __init__(self, program: Program, launch: Launch, has_tasks: bool):
        self.program = program
        self.has_tasks = has_tasks
        self.where = _where(program)
        self.scopes = {b.name: b.scope for b in program.buffers}
        self.launch = launch

    def nodes(self, nodes: tuple[Node, ...], env: _Env, ctx: tuple[tuple[str, frozenset], ...]) -> None:
        for n in nodes:
            if isinstance(n, Loop):
                if n.annotation.mode not in ("serial", "unrolled", "vectorized"):
                    raise VerificationError(f"{self.where}: per-thread loop '{n.name}' is @{n.annotation.mode}; a "
                                            f"thread runs its loops in order: make it serial (or unrolled)")
                self.exprs((n.lower, n.upper), env, f"the bounds of loop '{n.name}'")
                taint = taint_of(n.lower, env.taints) | taint_of(n.upper, env.taints)
                divisor = math.gcd(known_divisor(n.lower, env.divisors), n.step)
                self.nodes(n.body, env.bind(n.iterator, taint, divisor), ctx + ((f"loop '{n.name}'", taint),))
            elif isinstance(n, If):
                self.exprs((n.cond,), env, f"if ({n.cond})")
                taint = taint_of(n.cond, env.taints)
                inner = ctx + ((f"if ({n.cond})", taint),)
                self.nodes(n.then, env, inner)
                self.nodes(n.orelse, env, inner)
            elif isinstance(n, Barrier):
                self.uniform("barrier" + ("" if n.scope == "block" else f" {n.scope}"), ctx)
            elif isinstance(n, Shuffle):
                what = f"shuffle {n.name}"
                self.uniform(what, ctx)
                self.exprs((n.target, n.value, n.offset), env, what)
                if self.launch.threads % n.width:
                    raise VerificationError(f"{self.where}: {what} has width {n.width}, which does not divide the "
                                            f"{self.launch.threads} threads of a block; make the block a multiple "
                                            f"of {n.width} threads")
            elif isinstance(n, VectorCopy):
                self.vector_copy(n, env)
            elif isinstance(n, (Store, Reduce)):
                self.exprs((n.target, n.value), env, f"statement {n.name}")
            elif isinstance(n, TaskLoop):  # pragma: no cover - lower_mappings removed them
                raise AssertionError("task loop left after lower_mappings")

    def uniform(self, what: str, ctx: tuple[tuple[str, frozenset], ...]) -> None:
        for desc, taint in reversed(ctx):
            bad = {t for t in taint if t[0] in ("thread", "load")}
            if bad:
                hint = ""
                if self.has_tasks and desc.startswith("if"):
                    hint = (" (a task loop whose mapping has fewer workers than the threads running it is "
                            "guarded so: give it one worker per thread)")
                raise VerificationError(f"{self.where}: {what} is under {desc}{hint}, which depends on {_say(bad)}: "
                                        f"not every thread of the block reaches it (a GPU deadlocks); move it out, "
                                        f"or make the loop bounds or condition uniform and guard the statements "
                                        f"instead")

    def exprs(self, exprs, env: _Env, what: str) -> None:
        for expr in exprs:
            for e in walk(expr):
                if isinstance(e, Load) and self.scopes.get(e.buffer) == "register":
                    for i in e.indices:
                        bad = {t for t in taint_of(i, env.taints) if t[0] in ("thread", "block")}
                        if bad:
                            raise VerificationError(
                                f"{self.where}: register buffer '{e.buffer}' is indexed by {i} in {what}, which "
                                f"depends on {_say(bad)}; a register buffer is per-thread already: index it by "
                                f"constants or serial loops (the repeat part of a task mapping)")

    def vector_copy(self, n: VectorCopy, env: _Env) -> None:
        what = f"vector copy {n.name}"
        self.exprs((Load(n.dst, n.dst_indices), Load(n.src, n.src_indices)), env, what)
        dst = self.program.buffer(n.dst)
        size = n.width * dst.dtype.numpy.itemsize
        if n.asynchronous and size not in ASYNC_COPY_BYTES:
            raise VerificationError(f"{self.where}: asynchronous {what} moves {size} bytes ({n.width} x "
                                    f"{dst.dtype.short}); cp.async copies 4, 8 or 16 bytes: change the width")
        if size > VECTOR_BYTES:
            raise VerificationError(f"{self.where}: {what} moves {size} bytes ({n.width} x {dst.dtype.short}); "
                                    f"the widest vector access is {VECTOR_BYTES} bytes: use a smaller width")
        for name, indices in ((n.dst, n.dst_indices), (n.src, n.src_indices)):
            buf = self.program.buffer(name)
            if not indices:
                if n.width > 1:
                    raise VerificationError(f"{self.where}: {what} copies {n.width} cells of 0-d buffer '{name}'")
                continue
            last = indices[-1]
            g = known_divisor(last, env.divisors)
            if g % n.width:
                raise VerificationError(f"{self.where}: {what}: cannot prove the index {last} of '{name}' is a "
                                        f"multiple of the width {n.width}, so the vector access may be "
                                        f"misaligned; write it as {n.width} * (...)")
            if buf.rank > 1 and _const(buf.shape[-1]) % n.width:
                raise VerificationError(f"{self.where}: {what}: the last dimension of '{name}' ({buf.shape[-1]}) is "
                                        f"not a multiple of the width {n.width}, so rows after the first are "
                                        f"misaligned; pad the buffer or use a smaller width")


def _check_async(program: Program, body: tuple[Node, ...]) -> None:
    events = [n for n, _ in _walk_nodes(body) if isinstance(n, (VectorCopy, CopyCommit, CopyWait))]
    last = max((i for i, n in enumerate(events) if isinstance(n, VectorCopy) and n.asynchronous), default=None)
    if last is None:
        return
    commit = next((i for i in range(last + 1, len(events)) if isinstance(events[i], CopyCommit)), None)
    wait = None if commit is None else next(
        (i for i in range(commit + 1, len(events)) if isinstance(events[i], CopyWait) and events[i].pending == 0), None)
    if wait is None:
        name = events[last].name
        raise VerificationError(f"{_where(program)}: asynchronous copy {name} is not followed by 'commit_copies' "
                                f"and then 'wait_copies 0' before the end of the kernel, so it may still be in "
                                f"flight; add them (and a barrier before other threads read the copied cells)")


__all__ = [
    "ASYNC_COPY_BYTES", "BLOCK_AXES", "Launch", "MAX_BLOCK", "MAX_GRID", "MAX_SHARED_BYTES", "MAX_THREADS",
    "THREAD_AXES", "VECTOR_BYTES", "WARP_SIZE", "block_loops", "kernel_body", "kernel_launch", "known_divisor",
    "linear_thread", "shared_bytes", "taint_of", "thread_loops", "verify_kernel",
]
