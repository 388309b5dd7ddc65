"""Loop programs: parameters, buffers, and a tree of loops, conditionals and statements.

A :class:`Program` is immutable.  Building one names what was left unnamed and verifies it:

* loops are named by their label, else by their iterator, made unique by appending
  ``_1``, ``_2``, ... (explicit labels are reserved first, then unlabeled loops are named in
  pre-order);
* statements are named by their label, else ``S0``, ``S1``, ... in pre-order, skipping names
  already taken;
* every variable is a parameter or an iterator of an enclosing loop, every load and store
  names a declared buffer with the right number of indices, bounds and indices are integers.

A loop runs its iterator over ``[lower, upper)`` by ``step`` (a positive integer).  A store
converts its value to the buffer's dtype, as C assignment does.  A reduction statement
``buf[idx] op= value`` combines the value into the cell with an associative, commutative
combiner whose identity is known (``+``: 0, ``*``: 1, ``max``: -inf, ``min``: +inf), which is
what lets later passes privatize or parallelize it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from ..errors import VerificationError
from ..names import claim_name
from ..types import DType
from .expr import INDEX, Expr, Load, Var, as_expr, dtype_of, free_vars, walk
from .mapping import TaskMapping

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SCOPES = ("global", "local", "shared", "register")
ANNOTATIONS = ("serial", "parallel", "vectorized", "unrolled", "mapped")
COMBINERS = ("+", "*", "max", "min")


@dataclass(frozen=True)
class Param:
    """A program parameter: an integer size (``i64``) or a scalar value of another dtype."""

    name: str
    dtype: DType = INDEX


@dataclass(frozen=True)
class Buffer:
    """An array: shape entries are integer expressions of the size parameters."""

    name: str
    shape: tuple[Expr, ...]
    dtype: DType = DType.float64
    scope: str = "global"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(as_expr(d) for d in self.shape))
        if self.scope not in SCOPES:
            raise ValueError(f"buffer '{self.name}': unknown scope {self.scope!r}; known: {', '.join(SCOPES)}")

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Annotation:
    """How a loop runs: ``serial``, ``parallel``, ``vectorized``, ``unrolled`` (with a factor)
    or ``mapped`` (to a hardware axis such as ``"threadIdx.x"``)."""

    mode: str = "serial"
    factor: int | None = None
    axis: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ANNOTATIONS:
            raise ValueError(f"unknown loop annotation {self.mode!r}; known: {', '.join(ANNOTATIONS)}")
        if self.mode == "unrolled" and (self.factor is None or self.factor < 1):
            raise ValueError(f"an unrolled loop needs a factor >= 1, got {self.factor}")
        if self.mode == "mapped" and not self.axis:
            raise ValueError("a mapped loop needs an axis name")

    @property
    def is_parallel(self) -> bool:
        """Whether iterations may run concurrently (what the legality check must prove)."""
        return self.mode in ("parallel", "vectorized", "mapped")


SERIAL = Annotation()


@dataclass(frozen=True)
class Store:
    """``name: buffer[indices] = value``."""

    buffer: str
    indices: tuple[Expr, ...]
    value: Expr
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(as_expr(i) for i in self.indices))
        object.__setattr__(self, "value", as_expr(self.value))

    @property
    def target(self) -> Load:
        return Load(self.buffer, self.indices)


@dataclass(frozen=True)
class Reduce:
    """``name: buffer[indices] op= value`` with ``op`` in :data:`COMBINERS`."""

    buffer: str
    indices: tuple[Expr, ...]
    combiner: str
    value: Expr
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(as_expr(i) for i in self.indices))
        object.__setattr__(self, "value", as_expr(self.value))
        if self.combiner not in COMBINERS:
            raise ValueError(f"unknown combiner {self.combiner!r}; known: {', '.join(COMBINERS)}")

    @property
    def target(self) -> Load:
        return Load(self.buffer, self.indices)

    def identity(self, dtype: DType) -> int | float | bool:
        """The combiner's neutral element in ``dtype``."""
        if self.combiner == "+":
            return 0
        if self.combiner == "*":
            return 1
        if dtype.is_floating:
            return -math.inf if self.combiner == "max" else math.inf
        info = _int_limits(dtype)
        return info[0] if self.combiner == "max" else info[1]


def _int_limits(dtype: DType) -> tuple[int, int]:
    import numpy as np

    if dtype == DType.bool:
        return (0, 1)
    info = np.iinfo(dtype.numpy)
    return (int(info.min), int(info.max))


SHUFFLE_MODES = ("xor", "down", "up", "idx")
BARRIER_SCOPES = ("block", "warp")
WARP_SIZE = 32


@dataclass(frozen=True)
class Shuffle:
    """``name: buffer[indices] = shfl_<mode>(value, offset, width)``: a warp shuffle.

    Every lane of a group of ``width`` lanes (a power of two, at most 32) evaluates
    ``value``; lane ``l`` receives the value of lane ``l ^ offset`` (``xor``), ``l + offset``
    (``down``), ``l - offset`` (``up``) or ``offset % width`` (``idx``, the lane within the
    group), or its own value when ``down``/``up`` leave the group.  As PTX ``shfl.sync``
    defines it, offsets count modulo 32 and ``xor`` may read an earlier group but not a later
    one (it keeps its own value then).  The value is converted to the target buffer's dtype
    before the exchange.  A collective: every thread of the
    block reaches it together (the verifier of kernels checks the control flow is uniform).
    """

    buffer: str
    indices: tuple[Expr, ...]
    value: Expr
    mode: str
    offset: Expr
    width: int = WARP_SIZE
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(as_expr(i) for i in self.indices))
        object.__setattr__(self, "value", as_expr(self.value))
        object.__setattr__(self, "offset", as_expr(self.offset))
        if self.mode not in SHUFFLE_MODES:
            raise ValueError(f"unknown shuffle mode {self.mode!r}; known: {', '.join(SHUFFLE_MODES)}")
        if not isinstance(self.width, int) or self.width < 1 or self.width > WARP_SIZE or self.width & (self.width - 1):
            raise ValueError(f"shuffle width must be a power of two in [1, {WARP_SIZE}], got {self.width!r}")

    @property
    def target(self) -> Load:
        return Load(self.buffer, self.indices)


@dataclass(frozen=True)
class VectorCopy:
    """``name: dst[d..., j] = vec<width>(src[s..., k])``: copies ``width`` consecutive cells
    of the last dimension, ``src[s..., k + v]`` to ``dst[d..., j + v]`` for ``v < width``, as
    one vector access.  ``asynchronous`` (printed ``async_vec``): a global -> shared copy that
    completes at a later :class:`CopyWait` (``cp.async``).  The first index of each last
    dimension must be a multiple of ``width`` for the access to be aligned (the code that
    builds the copy guarantees it)."""

    dst: str
    dst_indices: tuple[Expr, ...]
    src: str
    src_indices: tuple[Expr, ...]
    width: int
    asynchronous: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst_indices", tuple(as_expr(i) for i in self.dst_indices))
        object.__setattr__(self, "src_indices", tuple(as_expr(i) for i in self.src_indices))
        if self.width not in (1, 2, 4, 8, 16):
            raise ValueError(f"vector width must be 1, 2, 4, 8 or 16, got {self.width!r}")

    def lanes(self) -> list[tuple[Load, Load]]:
        """``(dst cell, src cell)`` of each lane, as loads."""
        return [(Load(self.dst, _bump(self.dst_indices, v)), Load(self.src, _bump(self.src_indices, v)))
                for v in range(self.width)]


def _bump(indices: tuple[Expr, ...], v: int) -> tuple[Expr, ...]:
    return indices if v == 0 else (*indices[:-1], indices[-1] + v)


@dataclass(frozen=True)
class Barrier:
    """``barrier`` (``__syncthreads()``) or ``barrier warp`` (``__syncwarp()``): no thread
    of the block (warp) passes it before all have reached it, and memory written before it
    is visible after it."""

    scope: str = "block"

    def __post_init__(self) -> None:
        if self.scope not in BARRIER_SCOPES:
            raise ValueError(f"unknown barrier scope {self.scope!r}; known: {', '.join(BARRIER_SCOPES)}")


@dataclass(frozen=True)
class CopyCommit:
    """``commit_copies``: closes the group of asynchronous copies issued since the last commit."""


@dataclass(frozen=True)
class CopyWait:
    """``wait_copies n``: waits until at most ``pending`` committed groups are still in flight
    (a barrier is still needed before other threads read the copied cells)."""

    pending: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.pending, int) or self.pending < 0:
            raise ValueError(f"wait_copies needs a count >= 0, got {self.pending!r}")


Statement = Store | Reduce
"""Statements of the polyhedral model: what schedules reorder."""
Action = Shuffle | VectorCopy
"""Statements of kernels that move data besides stores and reductions."""
Sync = Barrier | CopyCommit | CopyWait


@dataclass(frozen=True)
class Loop:
    """``name: for iterator in [lower, upper) step s @annotation { body }``."""

    iterator: str
    lower: Expr
    upper: Expr
    body: tuple[Node, ...]
    name: str = ""
    step: int = 1
    annotation: Annotation = SERIAL

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", as_expr(self.lower))
        object.__setattr__(self, "upper", as_expr(self.upper))
        object.__setattr__(self, "body", tuple(self.body))
        if not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"loop '{self.name or self.iterator}': step must be a positive int, got {self.step!r}")


@dataclass(frozen=True)
class If:
    """``if (cond) { then } else { orelse }``."""

    cond: Expr
    then: tuple[Node, ...]
    orelse: tuple[Node, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "cond", as_expr(self.cond))
        object.__setattr__(self, "then", tuple(self.then))
        object.__setattr__(self, "orelse", tuple(self.orelse))


@dataclass(frozen=True)
class TaskLoop:
    """``for (i, j) in <mapping> on <worker> { body }``: runs ``body`` for each task
    ``(i, j)`` that :class:`~kiln.ir.loops.mapping.TaskMapping` ``mapping`` gives worker
    ``worker`` (an integer expression), in the mapping's order; a worker outside
    ``[0, mapping.num_workers)`` does nothing.  :func:`kiln.ir.loops.lower_mappings` turns it into
    index arithmetic and serial loops."""

    mapping: TaskMapping
    worker: Expr
    iterators: tuple[str, ...]
    body: tuple[Node, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker", as_expr(self.worker))
        object.__setattr__(self, "iterators", tuple(self.iterators))
        object.__setattr__(self, "body", tuple(self.body))
        if not isinstance(self.mapping, TaskMapping):
            raise TypeError(f"a task loop needs a TaskMapping, got {type(self.mapping).__name__}")
        if len(self.iterators) != self.mapping.rank:
            raise ValueError(f"task loop over {self.mapping} (rank {self.mapping.rank}) names "
                             f"{len(self.iterators)} iterator(s)")
        if len(set(self.iterators)) != len(self.iterators):
            raise ValueError(f"task loop iterators {list(self.iterators)} repeat a name")


Node = Loop | If | Store | Reduce | TaskLoop | Shuffle | VectorCopy | Barrier | CopyCommit | CopyWait
NAMED = (Store, Reduce, Shuffle, VectorCopy)
"""Node types that carry a statement name."""


@dataclass(frozen=True)
class Program:
    """A named loop program. Construction names loops and statements and verifies."""

    name: str
    params: tuple[Param, ...]
    buffers: tuple[Buffer, ...]
    body: tuple[Node, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", tuple(self.params))
        object.__setattr__(self, "buffers", tuple(self.buffers))
        object.__setattr__(self, "body", _assign_names(tuple(self.body)))
        verify_program(self)

    # ----------------------------------------------------------------- lookups
    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"program '{self.name}' has no buffer '{name}'")

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"program '{self.name}' has no parameter '{name}'")

    @property
    def size_params(self) -> tuple[str, ...]:
        """Integer parameters: the ones bounds, indices and shapes may use."""
        return tuple(p.name for p in self.params if p.dtype.is_integer)

    def loops(self) -> list[Loop]:
        return [n for n, _ in self.walk() if isinstance(n, Loop)]

    def statements(self) -> list[Statement]:
        return [n for n, _ in self.walk() if isinstance(n, (Store, Reduce))]

    def walk(self) -> Iterator[tuple[Node, tuple[Loop, ...]]]:
        """Every node, pre-order, with its enclosing loops (outermost first)."""
        yield from _walk(self.body, ())

    def loop(self, name: str) -> Loop:
        for lp in self.loops():
            if lp.name == name:
                return lp
        raise KeyError(f"program '{self.name}' has no loop '{name}'; loops: {', '.join(l.name for l in self.loops())}")

    def replace(self, **changes) -> Program:
        return replace(self, **changes)

    def __str__(self) -> str:
        from .text import format_program

        return format_program(self)


def _walk(nodes: tuple[Node, ...], loops: tuple[Loop, ...]) -> Iterator[tuple[Node, tuple[Loop, ...]]]:
    for n in nodes:
        yield n, loops
        if isinstance(n, Loop):
            yield from _walk(n.body, loops + (n,))
        elif isinstance(n, TaskLoop):
            yield from _walk(n.body, loops)
        elif isinstance(n, If):
            yield from _walk(n.then, loops)
            yield from _walk(n.orelse, loops)


def map_nodes(nodes: tuple[Node, ...], fn: Callable[[Expr], Expr]) -> tuple[Node, ...]:
    """``nodes`` with ``fn`` applied to every expression they hold -- bounds, conditions,
    workers, values and each access as a whole :class:`~.expr.Load` (``fn`` may rename its
    buffer); loops, task loops and ifs are rebuilt around their mapped bodies."""
    def access(buffer: str, indices: tuple[Expr, ...]) -> tuple[str, tuple[Expr, ...]]:
        out = fn(Load(buffer, indices))
        if not isinstance(out, Load):
            raise TypeError(f"map_nodes: an access to '{buffer}' must map to a load, got {out}")
        return out.buffer, out.indices

    out: list[Node] = []
    for n in nodes:
        if isinstance(n, Loop):
            n = replace(n, lower=fn(n.lower), upper=fn(n.upper), body=map_nodes(n.body, fn))
        elif isinstance(n, If):
            n = replace(n, cond=fn(n.cond), then=map_nodes(n.then, fn), orelse=map_nodes(n.orelse, fn))
        elif isinstance(n, TaskLoop):
            n = replace(n, worker=fn(n.worker), body=map_nodes(n.body, fn))
        elif isinstance(n, (Store, Reduce)):
            buffer, indices = access(n.buffer, n.indices)
            n = replace(n, buffer=buffer, indices=indices, value=fn(n.value))
        elif isinstance(n, Shuffle):
            buffer, indices = access(n.buffer, n.indices)
            n = replace(n, buffer=buffer, indices=indices, value=fn(n.value), offset=fn(n.offset))
        elif isinstance(n, VectorCopy):
            dst, dst_indices = access(n.dst, n.dst_indices)
            src, src_indices = access(n.src, n.src_indices)
            n = replace(n, dst=dst, dst_indices=dst_indices, src=src, src_indices=src_indices)
        out.append(n)
    return tuple(out)


# ----------------------------------------------------------------------------- naming
def _assign_names(body: tuple[Node, ...]) -> tuple[Node, ...]:
    taken_loops: set[str] = set()
    taken_stmts: set[str] = set()
    for n, _ in _walk(body, ()):
        names = taken_loops if isinstance(n, Loop) else taken_stmts if isinstance(n, NAMED) else None
        if names is None or not n.name:
            continue
        if n.name in names:
            kind = "loop" if isinstance(n, Loop) else "statement"
            raise VerificationError(f"two {kind}s are named '{n.name}'; names must be unique")
        names.add(n.name)
    counter = [0]

    def loop_name(base: str) -> str:
        return claim_name(base, taken_loops)

    def stmt_name() -> str:
        while f"S{counter[0]}" in taken_stmts:
            counter[0] += 1
        name = f"S{counter[0]}"
        counter[0] += 1
        taken_stmts.add(name)
        return name

    def visit(nodes: tuple[Node, ...]) -> tuple[Node, ...]:
        out = []
        for n in nodes:
            if isinstance(n, Loop):
                name = n.name or loop_name(n.iterator)
                n = replace(n, name=name, body=visit(n.body))
            elif isinstance(n, If):
                n = replace(n, then=visit(n.then), orelse=visit(n.orelse))
            elif isinstance(n, TaskLoop):
                n = replace(n, body=visit(n.body))
            elif not isinstance(n, NAMED):
                pass
            elif not n.name:
                n = replace(n, name=stmt_name())
            out.append(n)
        return tuple(out)

    return visit(body)


# ----------------------------------------------------------------------------- verification
def verify_program(program: Program) -> None:
    """Raise :class:`VerificationError` naming the first problem found."""
    where = f"program '{program.name}'"
    if not _IDENT.match(program.name):
        raise VerificationError(f"{where}: the name must be an identifier ([A-Za-z_][A-Za-z0-9_]*)")
    params = {p.name: p for p in program.params}
    buffers = {b.name: b for b in program.buffers}
    if len(params) != len(program.params):
        raise VerificationError(f"{where}: duplicate parameter names")
    if len(buffers) != len(program.buffers):
        raise VerificationError(f"{where}: duplicate buffer names")
    clash = set(params) & set(buffers)
    if clash:
        raise VerificationError(f"{where}: {sorted(clash)} are both parameters and buffers")
    sizes = {n for n, p in params.items() if p.dtype.is_integer}
    for b in program.buffers:
        for d in b.shape:
            bad = free_vars(d) - sizes
            if bad or any(isinstance(e, Load) for e in walk(d)):
                raise VerificationError(f"{where}: shape of buffer '{b.name}' uses {sorted(bad) or 'a load'}; "
                                        f"shapes may use integer parameters only")
    var_dtypes = {n: p.dtype for n, p in params.items()}
    buf_dtypes = {n: b.dtype for n, b in buffers.items()}
    _verify_nodes(program.body, where, params, buffers, var_dtypes, buf_dtypes, scope=())


def _verify_nodes(nodes, where, params, buffers, var_dtypes, buf_dtypes, scope: tuple[str, ...]) -> None:
    for n in nodes:
        if isinstance(n, Loop):
            if n.iterator in params or n.iterator in buffers or n.iterator in scope:
                raise VerificationError(f"{where}: loop '{n.name}' reuses the name '{n.iterator}' "
                                        f"of a parameter, buffer or enclosing iterator")
            for label, bound in (("lower", n.lower), ("upper", n.upper)):
                _verify_expr(bound, f"{where}: {label} bound of loop '{n.name}'", params, buffers, scope,
                             var_dtypes, buf_dtypes, integer=True)
            inner = dict(var_dtypes)
            inner[n.iterator] = INDEX
            _verify_nodes(n.body, where, params, buffers, inner, buf_dtypes, scope + (n.iterator,))
        elif isinstance(n, If):
            _verify_expr(n.cond, f"{where}: if condition", params, buffers, scope, var_dtypes, buf_dtypes)
            _verify_nodes(n.then, where, params, buffers, var_dtypes, buf_dtypes, scope)
            _verify_nodes(n.orelse, where, params, buffers, var_dtypes, buf_dtypes, scope)
        elif isinstance(n, TaskLoop):
            _verify_expr(n.worker, f"{where}: worker of task loop over {n.mapping}", params, buffers, scope,
                         var_dtypes, buf_dtypes, integer=True)
            for it in n.iterators:
                if it in params or it in buffers or it in scope:
                    raise VerificationError(f"{where}: task loop over {n.mapping} reuses the name '{it}' "
                                            f"of a parameter, buffer or enclosing iterator")
            inner = dict(var_dtypes)
            inner.update({it: INDEX for it in n.iterators})
            _verify_nodes(n.body, where, params, buffers, inner, buf_dtypes, scope + n.iterators)
        elif isinstance(n, (Barrier, CopyCommit, CopyWait)):
            continue
        elif isinstance(n, Shuffle):
            what = f"{where}: shuffle {n.name}"
            _verify_expr(n.target, what, params, buffers, scope, var_dtypes, buf_dtypes)
            _verify_expr(n.value, what, params, buffers, scope, var_dtypes, buf_dtypes)
            _verify_expr(n.offset, what, params, buffers, scope, var_dtypes, buf_dtypes, integer=True)
        elif isinstance(n, VectorCopy):
            what = f"{where}: vector copy {n.name}"
            for buf, idx in ((n.dst, n.dst_indices), (n.src, n.src_indices)):
                _verify_expr(Load(buf, idx), what, params, buffers, scope, var_dtypes, buf_dtypes)
            if buffers[n.dst].dtype != buffers[n.src].dtype:
                raise VerificationError(f"{what}: copies {buffers[n.src].dtype.short} '{n.src}' into "
                                        f"{buffers[n.dst].dtype.short} '{n.dst}'; a vector copy keeps the dtype")
            if n.asynchronous and (buffers[n.src].scope != "global" or buffers[n.dst].scope != "shared"):
                raise VerificationError(f"{what}: an asynchronous copy goes from global to shared memory, "
                                        f"not from {buffers[n.src].scope} to {buffers[n.dst].scope}")
        else:
            what = f"{where}: statement {n.name}"
            _verify_expr(n.target, what, params, buffers, scope, var_dtypes, buf_dtypes)
            _verify_expr(n.value, what, params, buffers, scope, var_dtypes, buf_dtypes)


def _verify_expr(expr, what, params, buffers, scope, var_dtypes, buf_dtypes, integer: bool = False) -> None:
    for e in walk(expr):
        if isinstance(e, Var) and e.name not in params and e.name not in scope:
            known = sorted(set(params) | set(scope))
            raise VerificationError(f"{what}: unknown variable '{e.name}'; in scope: {', '.join(known) or 'none'}")
        if isinstance(e, Load):
            buf = buffers.get(e.buffer)
            if buf is None:
                raise VerificationError(f"{what}: unknown buffer '{e.buffer}'; buffers: {', '.join(buffers) or 'none'}")
            if len(e.indices) != buf.rank:
                raise VerificationError(f"{what}: buffer '{e.buffer}' has rank {buf.rank} "
                                        f"but is accessed with {len(e.indices)} index(es)")
            for i in e.indices:
                if not dtype_of(i, var_dtypes, buf_dtypes).is_integer:
                    raise VerificationError(f"{what}: index {i} of '{e.buffer}' is not an integer")
    if integer and not dtype_of(expr, var_dtypes, buf_dtypes).is_integer:
        raise VerificationError(f"{what}: {expr} is not an integer expression")
