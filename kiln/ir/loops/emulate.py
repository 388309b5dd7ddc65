"""Host emulation of GPU kernels: the MCUDA transformation of a kernel into a serial program.

:func:`emulate` turns a kernel (:mod:`kiln.ir.loops.gpu`) into a plain loop program of
``Loop``/``If``/``Store``/``Reduce`` nodes that :func:`kiln.ir.loops.interp.run` runs and
:func:`kiln.ir.loops.cgen.to_c` prints, computing what the GPU computes:

* the kernel is verified (:func:`~kiln.ir.loops.gpu.verify_kernel`) and its task loops
  lowered (:func:`~kiln.ir.loops.tasks.lower_mappings`);
* block loops become serial loops (same iterators and names): blocks run one after another;
* ``shared`` buffers become ``local`` buffers of the same shape, one copy reused by every
  block; ``register`` buffers become ``local`` buffers with the thread-loop extents as
  leading dimensions (outermost thread loop first), every access indexed by the thread
  iterators first -- one copy per thread;
* the per-thread code is cut into *phases*, each run for every thread by a copy of the
  thread loops: ``for t { A; barrier; B }`` -> ``for t { A }; for t { B }``.  Control flow
  that depends on no thread iterator and no loaded value (uniform) is hoisted out of the
  thread loops with its body cut recursively -- ``for t { for k { A; barrier; B } }`` ->
  ``for k { for t { A }; for t { B } }`` -- barrier or not, so that the thread loops sit
  innermost where they can (the interpreter then runs them as whole-array operations);
* a warp shuffle ``r[i] = shfl_<mode>(v, off, w)`` becomes two phases through a
  per-thread exchange buffer (one per dtype, of the target's dtype): every thread stores
  ``v`` at its linear id, then reads its source lane's cell, as CUDA (PTX ``shfl.sync``)
  defines it -- lanes are ``linear_tid % 32``, ``off`` counts modulo 32: ``xor``: lane
  ``lane ^ off`` unless it lies in a later group of ``w`` lanes; ``down``: ``lane + off``
  within the group; ``up``: ``lane - off`` within the group; ``idx``: lane ``off % w`` of the
  group; a thread whose source lane is not valid gets its own value;
* a vector copy becomes ``width`` stores (asynchronous ones too: the emulation copies at
  once); ``commit_copies`` and ``wait_copies`` disappear.

Running the threads of a phase one after another, each in its program order, is one of the
interleavings a GPU may choose, so a race-free kernel (:func:`kiln.ir.poly.races.check_races`)
gives the GPU's results.  Every value that lives across a phase boundary must be in a buffer
(registers for per-thread state): the verifier guarantees that barriers are never inside
thread-dependent loops, so no iterator has to survive one.

The result has the kernel's name, no parameters, the kernel's global buffers unchanged
and in order first, then its shared and register buffers (now ``local``) in order, then the
exchange buffers.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import VerificationError
from ..names import claim_name
from .expr import Binary, Const, Expr, Load, Select, Var, map_expr, walk
from .gpu import WARP_SIZE, block_loops, kernel_body, linear_thread, thread_loops, verify_kernel
from .program import (
    Barrier, Buffer, CopyCommit, CopyWait, If, Loop, Node, Program, Shuffle, Store, TaskLoop, VectorCopy, map_nodes,
)
from .tasks import lower_mappings


def emulate(kernel: Program) -> Program:
    """The serial host program computing what GPU kernel ``kernel`` computes (module docstring).

    Raises :class:`~kiln.ir.errors.VerificationError` when ``kernel`` fails
    :func:`~kiln.ir.loops.gpu.verify_kernel`.
    """
    verify_kernel(kernel)
    lowered = lower_mappings(kernel)
    em = _Emulator(lowered)
    nodes = tuple(em.phases(em.expand(kernel_body(lowered))))
    for lp in reversed(block_loops(lowered)):
        nodes = (Loop(lp.iterator, 0, lp.upper, nodes, name=lp.name),)
    return Program(kernel.name, (), em.buffers(), nodes)


def _int(e: Expr) -> int | None:
    return int(e.value) if isinstance(e, Const) and e.dtype.is_integer else None


def _add(a: Expr, b: Expr) -> Expr:
    ca, cb = _int(a), _int(b)
    if ca is not None and cb is not None:
        return Const(ca + cb)
    if cb == 0:
        return a
    if ca == 0:
        return b
    if cb is not None and cb < 0:
        return Binary("-", a, Const(-cb))
    return Binary("+", a, b)


def _sub(a: Expr, b: Expr) -> Expr:
    cb = _int(b)
    if cb is not None:
        return _add(a, Const(-cb))
    return Binary("-", a, b)


def _mul(a: Expr, k: int) -> Expr:
    ca = _int(a)
    if ca is not None:
        return Const(ca * k)
    if k == 0:
        return Const(0)
    return a if k == 1 else Binary("*", Const(k), a)


def _fdiv(a: Expr, k: int) -> Expr:
    ca = _int(a)
    if ca is not None:
        return Const(ca // k)
    return a if k == 1 else Binary("floordiv", a, Const(k))


def _fmod(a: Expr, k: int) -> Expr:
    ca = _int(a)
    if ca is not None:
        return Const(ca % k)
    return Const(0) if k == 1 else Binary("floormod", a, Const(k))


def _bit(e: Expr, b: int) -> Expr:
    """Bit ``b`` of non-negative ``e``: ``floormod(floordiv(e, 2**b), 2)``."""
    return _fmod(_fdiv(e, 1 << b), 2)


_LANE_BITS = WARP_SIZE.bit_length() - 1


class _Emulator:
    def __init__(self, kernel: Program):
        self.kernel = kernel
        self.threads = thread_loops(kernel)
        self.thread_its = {lp.iterator for lp in self.threads}
        self.registers = {b.name for b in kernel.buffers if b.scope == "register"}
        self.count = 1
        for lp in self.threads:
            self.count *= int(lp.upper.value)
        self.lin = linear_thread(kernel)
        self.taken = {b.name for b in kernel.buffers} | {lp.iterator for lp in kernel.loops()}
        self.exchange: dict[object, Buffer] = {}

    # ----------------------------------------------------------------- buffers
    def buffers(self) -> tuple[Buffer, ...]:
        k = self.kernel
        out = [b for b in k.buffers if b.scope == "global"]
        prefix = tuple(lp.upper for lp in self.threads)
        for b in k.buffers:
            if b.scope == "shared":
                out.append(replace(b, scope="local"))
            elif b.scope == "register":
                out.append(Buffer(b.name, prefix + b.shape, b.dtype, "local"))
        return tuple(out) + tuple(self.exchange.values())

    def exchange_buffer(self, dtype) -> str:
        buf = self.exchange.get(dtype)
        if buf is None:
            name = claim_name(f"shfl_{dtype.short}", self.taken)
            buf = self.exchange[dtype] = Buffer(name, (self.count,), dtype, "local")
        return buf.name

    # ----------------------------------------------------------------- per-thread rewriting
    def expand(self, nodes: tuple[Node, ...]) -> tuple[Node, ...]:
        """``nodes`` with vector copies split into stores, copy commits and waits dropped and
        every register access indexed by the thread iterators first."""
        tids = tuple(Var(lp.iterator) for lp in self.threads)

        def per_thread(e: Expr) -> Expr | None:
            if isinstance(e, Load) and e.buffer in self.registers:
                return Load(e.buffer, tids + e.indices)
            return None

        return map_nodes(self._split_copies(nodes), lambda e: map_expr(e, per_thread))

    def _split_copies(self, nodes: tuple[Node, ...]) -> tuple[Node, ...]:
        out: list[Node] = []
        for n in nodes:
            if isinstance(n, VectorCopy):
                out += [Store(dst.buffer, dst.indices, src, name=n.name if v == 0 else "")
                        for v, (dst, src) in enumerate(n.lanes())]
            elif isinstance(n, (CopyCommit, CopyWait)):
                continue
            elif isinstance(n, Loop):
                out.append(replace(n, body=self._split_copies(n.body)))
            elif isinstance(n, If):
                out.append(If(n.cond, self._split_copies(n.then), self._split_copies(n.orelse)))
            elif isinstance(n, TaskLoop):  # pragma: no cover - lower_mappings removed them
                raise AssertionError("task loop left after lower_mappings")
            else:
                out.append(n)
        return tuple(out)

    # ----------------------------------------------------------------- phases
    def uniform(self, *exprs: Expr) -> bool:
        """Whether ``exprs`` have one value for every thread of a block: no thread iterator
        and no load (only uniform constructs are ever descended into, so no other iterator
        depends on a thread)."""
        return not any(isinstance(e, Load) or (isinstance(e, Var) and e.name in self.thread_its)
                       for x in exprs for e in walk(x))

    def nest(self, body: tuple[Node, ...]) -> Loop:
        """``body`` run by every thread of the block: a copy of the thread loops."""
        for lp in reversed(self.threads):
            body = (Loop(lp.iterator, 0, lp.upper, body),)
        return body[0]

    def phases(self, nodes: tuple[Node, ...]) -> list[Node]:
        out: list[Node] = []
        run: list[Node] = []

        def flush() -> None:
            if run:
                out.append(self.nest(tuple(run)))
                run.clear()

        for n in nodes:
            if isinstance(n, Barrier):
                flush()
            elif isinstance(n, Shuffle):
                flush()
                out += self.shuffle(n)
            elif isinstance(n, Loop) and self.uniform(n.lower, n.upper):
                flush()
                out.append(Loop(n.iterator, n.lower, n.upper, tuple(self.phases(n.body)), name=n.name, step=n.step))
            elif isinstance(n, If) and self.uniform(n.cond):
                flush()
                out.append(If(n.cond, tuple(self.phases(n.then)), tuple(self.phases(n.orelse))))
            else:
                if isinstance(n, (Loop, If)) and _has_collective(n):  # pragma: no cover - verify_kernel rejects it
                    raise VerificationError(f"kernel '{self.kernel.name}': a barrier or shuffle under "
                                            f"thread-dependent control flow cannot be emulated")
                run.append(n)
        flush()
        return out

    def shuffle(self, n: Shuffle) -> list[Node]:
        dtype = self.kernel.buffer(n.buffer).dtype
        x = self.exchange_buffer(dtype)
        send = Store(x, (self.lin,), n.value)
        receive = Store(n.buffer, n.indices, Load(x, (self.source(n),)), name=n.name)
        return [self.nest((send,)), self.nest((receive,))]

    def source(self, n: Shuffle) -> Expr:
        """The linear id of the thread whose value ``n`` delivers to the current thread."""
        lin, w = self.lin, n.width
        lane = lin if self.count <= WARP_SIZE else _fmod(lin, WARP_SIZE)
        in_group = lane if w >= min(self.count, WARP_SIZE) else _fmod(lin, w)  # w divides 32
        off = _int(n.offset)
        shift = _fmod(n.offset, WARP_SIZE) if off is None else Const(off % WARP_SIZE)
        b = _int(shift)
        valid: Expr | bool
        if n.mode == "idx":
            return _add(_sub(lin, in_group), _fmod(n.offset, w))
        if n.mode == "down":
            delta: Expr = shift
            valid = (b < w) if b is not None and (b == 0 or b >= w) else Binary("<", _add(in_group, shift), Const(w))
        elif n.mode == "up":
            delta = _mul(shift, -1)
            valid = (b < w) if b is not None and (b == 0 or b >= w) else Binary(">=", in_group, shift)
        else:  # xor: lane ^ m, bit by bit
            if b is not None:  # lane ^ m = lane + m - sum over the set bits of m of 2 * (lane & bit)
                flips = [_mul(_bit(lane, bit), 2 << bit) for bit in range(_LANE_BITS) if b >> bit & 1]
                source, j = _add(lin, Const(b)), _add(lane, Const(b))
                for f in flips:
                    source, j = _sub(source, f), _sub(j, f)
            else:
                j = Const(0)
                for bit in range(_LANE_BITS):
                    flipped = _fmod(_add(_fdiv(lane, 1 << bit), _fdiv(shift, 1 << bit)), 2)
                    j = _add(j, _mul(flipped, 1 << bit))
                source = _add(_sub(lin, lane), j) if lane is not lin else j
            if b is not None and b < w:
                return source
            return Select(Binary("<=", _fdiv(j, w), _fdiv(lane, w)), source, lin)
        if valid is True:
            return _add(lin, delta)
        if valid is False:
            return lin
        return Select(valid, _add(lin, delta), lin)


def _has_collective(n: Node) -> bool:
    stack = [n]
    while stack:
        m = stack.pop()
        if isinstance(m, (Barrier, Shuffle)):
            return True
        if isinstance(m, Loop):
            stack.extend(m.body)
        elif isinstance(m, If):
            stack.extend(m.then + m.orelse)
    return False


__all__ = ["emulate"]
