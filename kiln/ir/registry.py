"""The op registry: every op kiln knows is declared here once, with all its rules.

An :class:`OpDef` carries the attribute schema, shape/dtype inference (run whenever a node
is built) and a numpy reference implementation.  Every other rule about the op hangs on the
same declaration, so no pass or backend keeps a list of op names:

* ``traits``    -- facts passes read (``elementwise``, ``view`` = the result aliases the
  operand's memory, ``reduction``, ...; see :attr:`OpDef.traits`),
* ``vjp``       -- gradient rule (autodiff, :mod:`kiln.ir.ops.vjp`),
* ``amp``       -- mixed-precision policy: ``"low"``, ``"float32"`` or ``"follow"``,
* ``compute``   -- element-wise compute definition used to lower to loop IR
  (:mod:`kiln.ir.ops.compute`),
* ``decompose`` -- the op written with simpler ops (the ``decompose`` pass),
* ``cost``      -- estimated FLOPs (the pass-ordering cost model; helpers in
  :mod:`kiln.ir.ops.cost`).

Implementations live with the backends: a backend's library table names the ops it has a
library call for (e.g. :data:`kiln.backends.cpu.library.LIBRARY`); an op never names a backend.

Declaring an op::

    @defop("relu", traits={"elementwise"}, infer=unary_same)
    def relu(x):
        return np.maximum(x, 0)

The reference function receives the operand arrays positionally and the attributes as
keyword arguments, and returns one array or a tuple of arrays (one per result).

A decomposition ``decompose(b, node) -> Sequence[Value]`` receives a
:class:`~kiln.ir.builder.GraphBuilder` that inserts before ``node`` and returns one value
per result, each of exactly that result's type.  A cost ``cost(input_types, output_types,
**attrs) -> float`` gives the op's floating-point operations from its operand and result
types and its attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import OpTypeError, UnknownOpError
from .types import DType, SymDim, TensorType

_REQUIRED = object()

ATTR_KINDS = ("int", "float", "bool", "str", "ints", "floats", "dtype", "graph", "scalar", "any")

AXES_FORMS: dict[str, str] = {"axis": "int", "seq": "ints", "set": "ints"}
"""Form of an attribute that holds axes -> the attribute kind it needs (see :class:`Attr`)."""


@dataclass(frozen=True)
class Attr:
    """Schema of one attribute: its kind, default (absent = required), and optionality.

    Kinds: ``int``, ``float`` (ints accepted), ``bool``, ``str``, ``ints`` (tuple of int),
    ``floats``, ``dtype``, ``graph`` (a nested :class:`~kiln.ir.graph.Graph`), ``scalar``
    (int, float or bool) and ``any``.  ``optional`` admits ``None``.

    ``axes`` marks an attribute that holds axes of the op's first operand (negative ones
    count from the end): ``"axis"`` one axis (kind ``int``), ``"seq"`` an ordered sequence
    of axes whose order matters (kind ``ints``, e.g. ``permute``'s ``dims``) or ``"set"`` an
    unordered set of axes (kind ``ints``, e.g. a reduction's ``dims``).  ``canonicalize``
    makes such axes non-negative, and sorts and deduplicates sets.
    """

    kind: str
    default: Any = _REQUIRED
    optional: bool = False
    axes: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTR_KINDS:
            raise ValueError(f"unknown attribute kind {self.kind!r}")
        if self.axes is not None and AXES_FORMS.get(self.axes) != self.kind:
            forms = ", ".join(f"{f!r} (kind {k!r})" for f, k in AXES_FORMS.items())
            raise ValueError(f"axes={self.axes!r} on an attribute of kind {self.kind!r}; "
                             f"axes forms: {forms}")

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    def coerce(self, op: str, name: str, value: Any) -> Any:
        """Check ``value`` against this schema and return it in canonical form."""
        if value is None:
            if self.optional:
                return None
            raise OpTypeError(op, f"attribute '{name}' must not be None (kind {self.kind})")
        k = self.kind
        ok = True
        if k == "int":  # sizes may be symbolic
            ok = isinstance(value, (int, SymDim)) and not isinstance(value, bool)
        elif k == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif k == "bool":
            ok = isinstance(value, bool)
        elif k == "str":
            ok = isinstance(value, str)
        elif k == "ints":
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(v, (int, SymDim)) and not isinstance(v, bool) for v in value
            )
            value = tuple(value) if ok else value
        elif k == "floats":
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
            )
            value = tuple(float(v) for v in value) if ok else value
        elif k == "dtype":
            ok = isinstance(value, DType)
        elif k == "scalar":
            ok = isinstance(value, (int, float, bool, SymDim))
        elif k == "graph":
            ok = type(value).__name__ == "Graph"
        if not ok:
            raise OpTypeError(op, f"attribute '{name}' expects {k}, got {value!r}")
        return value


InferFn = Callable[..., "TensorType | Sequence[TensorType]"]
DecomposeFn = Callable[..., Sequence[Any]]
"""``decompose(builder, node) -> Sequence[Value]``: one value per result of ``node``."""
CostFn = Callable[..., float]
"""``cost(input_types, output_types, **attrs) -> float``: estimated FLOPs."""


@dataclass
class OpDef:
    """Everything kiln knows about one op. See the module docstring."""

    name: str
    infer: InferFn
    reference: Callable[..., Any] | None = None
    attrs: Mapping[str, Attr] = field(default_factory=dict)
    num_inputs: int | tuple[int, int | None] = 1
    """Exact operand count, or ``(min, max)`` with ``max=None`` for variadic ops."""
    traits: frozenset[str] = frozenset()
    """``elementwise``, ``commutative``, ``reduction``, ``view`` (the result may alias the
    operand's memory: references may return views of it),
    ``creation``, ``matmul``, ``conv``, ``random`` (impure), ``composite`` (one op for a
    computation of several simpler ones; :attr:`decompose` expands it where given),
    ``normalization`` (reduces along axes and broadcasts back to the input shape: softmax,
    layer norm) and ``pointwise`` (each result element reads only the operand elements at
    its position and per-channel parameters, without numpy broadcasting: inference batch
    norm).  Fusion groups ``normalization`` ops like reductions and ``pointwise`` ops like
    elementwise ones.

    Facts single passes rely on (an op without the trait is treated as not having the
    property):

    * ``nonnegative`` -- every element of a floating-point result is ``>= 0`` or NaN, for
      any operands (a negative zero counts as ``>= 0``): exp, sqrt, sigmoid, abs, relu,
      softmax (not rsqrt: ``rsqrt(-0.0)`` is ``-inf``); ``simplify`` drops ``exp(log(x))``
      of such an ``x``;
    * ``copy`` -- each result element is an operand element, moved or converted, or a
      constant, at positions fixed by the attributes and shapes (cat, pad, flip, tril,
      repeat, cast): cheap to recompute, so ``remat`` may recompute it;
    * ``replayable`` -- a ``random`` op whose result is a pure function of its seed operand
      and attributes (a counter-based draw): a clone draws the same bits, so ``remat`` may
      recompute it within one call of a graph;
    * ``whole_view`` -- a ``view`` whose result reads every element of its operand, at
      positions fixed by its attributes (permute, reshape, expand): elementwise ops commute
      with it (``ew(view(a)) == view(ew(a))``) and touch no more elements before it than
      after it, so ``sink-views`` moves it past them."""
    doc: str = ""
    # Rules read by later layers, all optional.
    vjp: Callable[..., Any] | None = None
    amp: str | None = None
    compute: Callable[..., Any] | None = None
    decompose: DecomposeFn | None = None
    """The op written with simpler ops (see the module docstring); ``None``: none."""
    cost: CostFn | None = None
    """Estimated FLOPs (see the module docstring); ``None``: the cost model's default."""

    def has(self, trait: str) -> bool:
        return trait in self.traits

    def check_arity(self, n: int) -> None:
        if isinstance(self.num_inputs, int):
            if n != self.num_inputs:
                raise OpTypeError(self.name, f"expects {self.num_inputs} operand(s), got {n}")
            return
        lo, hi = self.num_inputs
        if n < lo or (hi is not None and n > hi):
            bound = f"at least {lo}" if hi is None else f"{lo} to {hi}"
            raise OpTypeError(self.name, f"expects {bound} operands, got {n}")

    def normalize_attrs(self, attrs: Mapping[str, Any]) -> dict[str, Any]:
        """Validate ``attrs`` against the schema, fill defaults, return them in schema order."""
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise OpTypeError(
                self.name,
                f"unknown attribute(s) {sorted(unknown)}; known: {sorted(self.attrs) or 'none'}",
            )
        out: dict[str, Any] = {}
        for name, spec in self.attrs.items():
            if name in attrs:
                out[name] = spec.coerce(self.name, name, attrs[name])
            elif spec.required:
                raise OpTypeError(self.name, f"missing required attribute '{name}'")
            else:
                out[name] = spec.default
        return out

    def infer_types(self, input_types: Sequence[TensorType], attrs: Mapping[str, Any]) -> tuple[TensorType, ...]:
        """Run shape/dtype inference; every failure becomes an :class:`OpTypeError`."""
        self.check_arity(len(input_types))
        try:
            result = self.infer(list(input_types), **attrs)
        except OpTypeError:
            raise
        except (ValueError, TypeError, IndexError) as e:
            raise OpTypeError(self.name, str(e), input_types, attrs) from None
        if isinstance(result, TensorType):
            return (result,)
        return tuple(result)

    def default_attrs(self) -> dict[str, Any]:
        return {k: a.default for k, a in self.attrs.items() if not a.required}


_REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in _REGISTRY:
        raise ValueError(f"op '{opdef.name}' is declared twice")
    _REGISTRY[opdef.name] = opdef
    return opdef


def defop(
    name: str,
    *,
    infer: InferFn,
    attrs: Mapping[str, Attr] | None = None,
    num_inputs: int | tuple[int, int | None] = 1,
    traits: Sequence[str] = (),
    **rules: Any,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator declaring op ``name`` with the decorated function as its reference."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        register(
            OpDef(
                name=name,
                infer=infer,
                reference=fn,
                attrs=dict(attrs or {}),
                num_inputs=num_inputs,
                traits=frozenset(traits),
                doc=(fn.__doc__ or "").strip(),
                **rules,
            )
        )
        return fn

    return wrap


def get_op(name: str) -> OpDef:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownOpError(f"unknown op '{name}': it is not declared in kiln.ir.ops") from None


def has_op(name: str) -> bool:
    _ensure_loaded()
    return name in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    _ensure_loaded()
    return dict(_REGISTRY)


def builtin_ops() -> dict[str, OpDef]:
    """The ops kiln itself declares (``kiln.ir.ops``), without ops added by user code or tests."""
    return {n: d for n, d in all_ops().items()
            if d.reference is None or d.reference.__module__.startswith("kiln.")}


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        from . import ops  # noqa: F401  (declares the built-in ops)
