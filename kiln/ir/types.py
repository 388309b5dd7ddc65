"""Element types, dimensions and tensor types of the graph IR.

A dimension is either a static ``int`` or a :class:`SymDim`: a named size such as a
sequence length, or an integer expression of named sizes (``2*seq``).  Every
shape-manipulating rule works on ``Dim`` values; a graph's ``sizes`` record the range of
each named size (:class:`SizeRange`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Union

import ml_dtypes
import numpy as np
import sympy


class DType(enum.Enum):
    """Element types. The value is the short name used in the text form."""

    float64 = "f64"
    float32 = "f32"
    float16 = "f16"
    bfloat16 = "bf16"
    int64 = "i64"
    int32 = "i32"
    int8 = "i8"
    uint8 = "u8"
    bool = "bool"

    @property
    def short(self) -> str:
        return self.value

    @property
    def is_floating(self) -> bool:
        return self in _FLOATS

    @property
    def is_integer(self) -> bool:
        return self in _INTS

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY[self]

    @staticmethod
    def parse(text: str) -> DType:
        try:
            return _BY_SHORT[text]
        except KeyError:
            raise ValueError(f"unknown dtype {text!r}; known: {', '.join(_BY_SHORT)}") from None

    @staticmethod
    def from_numpy(dt: np.dtype) -> DType:
        try:
            return _BY_NUMPY[np.dtype(dt)]
        except KeyError:
            raise ValueError(f"numpy dtype {dt} has no kiln dtype") from None

    def __repr__(self) -> str:
        return f"DType.{self.name}"


_FLOATS = frozenset({DType.float64, DType.float32, DType.float16, DType.bfloat16})
_INTS = frozenset({DType.int64, DType.int32, DType.int8, DType.uint8})
_NUMPY = {
    DType.float64: np.dtype(np.float64),
    DType.float32: np.dtype(np.float32),
    DType.float16: np.dtype(np.float16),
    DType.bfloat16: np.dtype(ml_dtypes.bfloat16),
    DType.int64: np.dtype(np.int64),
    DType.int32: np.dtype(np.int32),
    DType.int8: np.dtype(np.int8),
    DType.uint8: np.dtype(np.uint8),
    DType.bool: np.dtype(np.bool_),
}
_BY_SHORT = {d.value: d for d in DType}
_BY_NUMPY = {v: k for k, v in _NUMPY.items()}

# Type promotion follows torch's categories: bool < integer < floating.
_RANK = {
    DType.bool: 0,
    DType.uint8: 1,
    DType.int8: 2,
    DType.int32: 3,
    DType.int64: 4,
    DType.float16: 5,
    DType.bfloat16: 5,
    DType.float32: 6,
    DType.float64: 7,
}


def promote(a: DType, b: DType) -> DType:
    """The result dtype of a binary arithmetic op on tensors of dtypes ``a`` and ``b``."""
    if a == b:
        return a
    if {a, b} == {DType.float16, DType.bfloat16}:
        return DType.float32
    if {a, b} == {DType.uint8, DType.int8}:
        return DType.int32
    return a if _RANK[a] > _RANK[b] else b


class SymDim:
    """A symbolic size: a named size (``SymDim("seq")``, printed as its bare name) or an
    integer expression of named sizes (``2*seq``, ``batch*seq``, ``floor(seq/2)``).

    Named sizes are positive integers.  Arithmetic with ``int`` and other ``SymDim`` values
    gives a ``SymDim``, or a plain ``int`` when the result is a constant, so shape rules
    written with ``*``, ``+``, ``//`` and ``==`` work on symbolic sizes unchanged.  Two
    sizes are equal when their canonical (sympy) forms are; ``==`` never guesses, so
    ``seq == 8`` is ``False`` and a rule that needs a concrete size still sees a ``SymDim``.
    """

    __slots__ = ("expr",)

    def __init__(self, name_or_expr: str | sympy.Expr):
        if isinstance(name_or_expr, str):
            expr = size_symbol(name_or_expr) if _IDENT.match(name_or_expr) else parse_size(name_or_expr)
        elif isinstance(name_or_expr, sympy.Expr):
            expr = name_or_expr
        else:
            raise TypeError(f"SymDim of {name_or_expr!r}: expected a name or a sympy expression")
        if expr.is_Integer:
            raise ValueError(f"SymDim of the constant {expr}: use the int")
        object.__setattr__(self, "expr", expr)

    def __setattr__(self, name, value):
        raise AttributeError("SymDim is immutable")

    @property
    def name(self) -> str:
        return str(self)

    @property
    def is_symbol(self) -> bool:
        """Whether this is one named size (not an expression of several)."""
        return self.expr.is_Symbol

    @property
    def symbols(self) -> frozenset[str]:
        """The names of the sizes this one depends on."""
        return frozenset(s.name for s in self.expr.free_symbols)

    def evaluate(self, sizes: dict[str, int]) -> int:
        """The value for concrete ``sizes`` (name -> int); every symbol must be given."""
        missing = self.symbols - sizes.keys()
        if missing:
            raise KeyError(f"size {self} needs {', '.join(sorted(missing))}")
        value = self.expr.subs({size_symbol(k): v for k, v in sizes.items() if k in self.symbols})
        if not value.is_Integer:
            raise ValueError(f"size {self} is {value} at {sizes}, not an integer")
        return int(value)

    def __str__(self) -> str:
        return format_size(self.expr)

    def __repr__(self) -> str:
        return f"SymDim({str(self)!r})"

    def __hash__(self) -> int:
        return hash(("SymDim", self.expr))

    def __eq__(self, other) -> bool:
        if isinstance(other, SymDim):
            return self.expr == other.expr
        return False

    def __ne__(self, other) -> bool:
        return not self == other

    def __reduce__(self):
        return (SymDim, (str(self),))

    # arithmetic: results are canonical; a constant result is a plain int
    def __add__(self, other):
        return _size(self.expr + _as_sympy(other))

    __radd__ = __add__

    def __sub__(self, other):
        return _size(self.expr - _as_sympy(other))

    def __rsub__(self, other):
        return _size(_as_sympy(other) - self.expr)

    def __mul__(self, other):
        return _size(self.expr * _as_sympy(other))

    __rmul__ = __mul__

    def __floordiv__(self, other):
        return _size(_floordiv(self.expr, _as_sympy(other)))

    def __rfloordiv__(self, other):
        return _size(_floordiv(_as_sympy(other), self.expr))

    def __mod__(self, other):
        return _size(sympy.Mod(self.expr, _as_sympy(other)))

    def __rmod__(self, other):
        return _size(sympy.Mod(_as_sympy(other), self.expr))

    def __neg__(self):
        return _size(-self.expr)

    # comparisons: decided for every value of the named sizes (each at least 2), or refused
    def __lt__(self, other) -> bool:
        return _decide(self.expr - _as_sympy(other), "<", self, other)

    def __le__(self, other) -> bool:
        return _decide(self.expr - _as_sympy(other), "<=", self, other)

    def __gt__(self, other) -> bool:
        return _decide(_as_sympy(other) - self.expr, "<", other, self)

    def __ge__(self, other) -> bool:
        return _decide(_as_sympy(other) - self.expr, "<=", other, self)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SYMBOLS: dict[str, sympy.Symbol] = {}


def size_symbol(name: str) -> sympy.Symbol:
    """The sympy symbol of the named size ``name`` (a positive integer)."""
    sym = _SYMBOLS.get(name)
    if sym is None:
        if not _IDENT.match(name) or name in _SIZE_FUNCTIONS:
            raise ValueError(f"bad size name {name!r}: sizes are named by identifiers")
        sym = _SYMBOLS[name] = sympy.Symbol(name, integer=True, positive=True)
    return sym


class UndecidedSizeError(TypeError):
    """A comparison of symbolic sizes whose answer depends on their values."""


def _decide(diff: sympy.Expr, op: str, a, b) -> bool:
    """Whether ``diff < 0`` (``op="<"``) or ``diff <= 0`` holds for every value of the named
    sizes, each at least :data:`MIN_SIZE`; raises :class:`UndecidedSizeError` when it holds
    for some values only."""
    shifted = diff.subs({s: s + MIN_SIZE for s in diff.free_symbols})  # s >= MIN_SIZE
    if op == "<":
        yes, no = shifted.is_negative, shifted.is_nonnegative
    else:
        yes, no = shifted.is_nonpositive, shifted.is_positive
    if yes:
        return True
    if no:
        return False
    raise UndecidedSizeError(f"whether {a} {op} {b} depends on the sizes' values")


MIN_SIZE = 2
"""Every named size is at least 2: sizes 0 and 1 are specialized at capture (a size-1 axis
broadcasts, so a graph valid at 1 is a different graph)."""


def _as_sympy(x) -> sympy.Expr:
    if isinstance(x, SymDim):
        return x.expr
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"size arithmetic with {x!r}: expected an int or a SymDim")
    return sympy.Integer(int(x))


def _floordiv(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
    if b == 0:
        raise ZeroDivisionError(f"size {a} // 0")
    q = a / b
    return q if q.is_integer else sympy.floor(q)


def _size(expr: sympy.Expr):
    """``expr`` as a dimension: an int when it is constant, else a SymDim."""
    expr = sympy.expand(expr) if not expr.has(sympy.floor, sympy.Mod, sympy.Max, sympy.Min) else expr
    if expr.is_Integer:
        return int(expr)
    if expr.free_symbols and expr.is_nonpositive:
        raise ValueError(f"size {format_size(expr)} is never positive")
    return SymDim(expr)


def as_dim(x):
    """``x`` (an int, a SymDim, or a sympy expression of named sizes) as a ``Dim``."""
    if isinstance(x, SymDim):
        return x
    if isinstance(x, sympy.Expr):
        return _size(x)
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return int(x)
    raise TypeError(f"dimension {x!r} is neither an int nor a symbolic size")


_SIZE_FUNCTIONS = {"floor": sympy.floor, "Mod": sympy.Mod, "Max": sympy.Max, "Min": sympy.Min,
                   "ceiling": sympy.ceiling}


def format_size(expr: sympy.Expr) -> str:
    """The canonical text of a symbolic size (no spaces, so it reads back as one dimension)."""
    return sympy.sstr(expr, order="lex").replace(" ", "")


def parse_size(text: str) -> sympy.Expr:
    """A size expression read from text (``2*seq``, ``floor(seq/2)+1``); names are sizes."""
    from sympy.parsing.sympy_parser import parse_expr

    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)) - set(_SIZE_FUNCTIONS)
    local = {n: size_symbol(n) for n in names}
    local.update(_SIZE_FUNCTIONS)
    if not re.fullmatch(r"[A-Za-z0-9_+\-*/%() ,]+", text):
        raise ValueError(f"bad size expression {text!r}")
    try:
        expr = parse_expr(text.replace("//", "/"), local_dict=local, global_dict={"Integer": sympy.Integer,
                                                                                   "Symbol": sympy.Symbol})
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad size
        raise ValueError(f"bad size expression {text!r}: {e}") from None
    if "//" in text:
        raise ValueError(f"size expression {text!r}: write floor(a/b) for a floor division")
    return expr


def sizes_of(shape) -> frozenset[str]:
    """The named sizes a shape depends on."""
    out: set[str] = set()
    for d in shape:
        if isinstance(d, SymDim):
            out |= d.symbols
    return frozenset(out)


def evaluate_shape(shape, sizes: dict[str, int]) -> tuple[int, ...]:
    """``shape`` with every symbolic size evaluated at ``sizes``."""
    return tuple(d.evaluate(sizes) if isinstance(d, SymDim) else int(d) for d in shape)


Dim = Union[int, SymDim]


@dataclass(frozen=True)
class TensorType:
    """Shape and element type of a tensor value. A rank-0 shape ``()`` is a scalar."""

    shape: tuple[Dim, ...]
    dtype: DType

    def __post_init__(self) -> None:
        for d in self.shape:
            if isinstance(d, bool) or not isinstance(d, (int, SymDim)):
                raise TypeError(f"dimension {d!r} is neither an int nor a SymDim")
            if isinstance(d, int) and d < 0:
                raise ValueError(f"negative dimension {d} in shape {self.shape}")
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype {self.dtype!r} is not a kiln DType")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    @property
    def numel(self) -> int:
        """Number of elements; only defined for static shapes."""
        n = 1
        for d in self.shape:
            if not isinstance(d, int):
                raise ValueError(f"numel of symbolic shape {self}")
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def size(self) -> Dim:
        """Number of elements as a ``Dim`` (symbolic for a symbolic shape)."""
        n: Dim = 1
        for d in self.shape:
            n = n * d
        return n

    def with_shape(self, shape: tuple[Dim, ...]) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def with_dtype(self, dtype: DType) -> TensorType:
        return TensorType(self.shape, dtype)

    def __str__(self) -> str:
        return f"{self.dtype.short}[{', '.join(str(d) for d in self.shape)}]"


def broadcast_shapes(*shapes: tuple[Dim, ...]) -> tuple[Dim, ...]:
    """Numpy broadcasting over ``Dim`` values; raises ``ValueError`` when incompatible."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dim: Dim = 1
        for s in shapes:
            j = i - (rank - len(s))
            if j < 0:
                continue
            d = s[j]
            if d == 1:
                continue
            if dim == 1:
                dim = d
            elif dim != d:
                raise ValueError(f"shapes {', '.join(map(_fmt_shape, shapes))} do not broadcast")
        out.append(dim)
    return tuple(out)


def _fmt_shape(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def normalize_dim(dim: int, rank: int) -> int:
    """Map a possibly negative axis into ``[0, rank)``; raises ``ValueError`` if out of range."""
    r = max(rank, 1)
    if not -r <= dim < r:
        raise ValueError(f"dimension {dim} is out of range for rank {rank}")
    return dim % r


@dataclass(frozen=True)
class SizeRange:
    """The values a named size may take: ``lo <= size <= hi`` (``hi=None``: unbounded)."""

    lo: int = 2
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.lo < 0 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(f"bad size range [{self.lo}, {self.hi}]")

    def __contains__(self, value: int) -> bool:
        return self.lo <= value and (self.hi is None or value <= self.hi)

    def __str__(self) -> str:
        return f"[{self.lo}, {'inf' if self.hi is None else self.hi}]"
