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
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..errors import VerificationError
from ..types import DType
from .expr import INDEX, Expr, Load, Var, as_expr, dtype_of, free_vars, walk

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SCOPES = ("global", "local", "shared")
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


Statement = Store | Reduce


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


Node = Loop | If | Store | Reduce


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
        elif isinstance(n, If):
            yield from _walk(n.then, loops)
            yield from _walk(n.orelse, loops)


# ----------------------------------------------------------------------------- naming
def _assign_names(body: tuple[Node, ...]) -> tuple[Node, ...]:
    taken_loops: set[str] = set()
    taken_stmts: set[str] = set()
    for n, _ in _walk(body, ()):
        names = taken_loops if isinstance(n, Loop) else taken_stmts if isinstance(n, (Store, Reduce)) else None
        if names is None or not n.name:
            continue
        if n.name in names:
            kind = "loop" if isinstance(n, Loop) else "statement"
            raise VerificationError(f"two {kind}s are named '{n.name}'; names must be unique")
        names.add(n.name)
    counter = [0]

    def loop_name(base: str) -> str:
        name, k = base, 0
        while name in taken_loops:
            k += 1
            name = f"{base}_{k}"
        taken_loops.add(name)
        return name

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
