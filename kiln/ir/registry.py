"""The op registry: every op kiln knows is declared here once, with all its rules.

An :class:`OpDef` carries the attribute schema, shape/dtype inference (run whenever a node
is built) and a numpy reference implementation.  Later layers hang more rules on the same
declaration instead of switching on op names elsewhere:

* ``vjp``      -- gradient rule (autodiff),
* ``amp``      -- mixed-precision policy: ``"low"``, ``"float32"`` or ``"follow"``,
* ``compute``  -- element-wise compute definition used to lower to loop IR,
* ``cost``     -- FLOP / byte estimate.

Implementations live with the backends: a backend's library table names the ops it has a
library call for (e.g. :data:`kiln.backends.cpu.library.LIBRARY`); an op never names a backend.

Declaring an op::

    @defop("relu", traits={"elementwise"}, infer=unary_same)
    def relu(x):
        return np.maximum(x, 0)

The reference function receives the operand arrays positionally and the attributes as
keyword arguments, and returns one array or a tuple of arrays (one per result).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import OpTypeError, UnknownOpError
from .types import DType, TensorType

_REQUIRED = object()

ATTR_KINDS = ("int", "float", "bool", "str", "ints", "floats", "dtype", "graph", "scalar", "any")


@dataclass(frozen=True)
class Attr:
    """Schema of one attribute: its kind, default (absent = required), and optionality.

    Kinds: ``int``, ``float`` (ints accepted), ``bool``, ``str``, ``ints`` (tuple of int),
    ``floats``, ``dtype``, ``graph`` (a nested :class:`~kiln.ir.graph.Graph`), ``scalar``
    (int, float or bool) and ``any``.  ``optional`` admits ``None``.
    """

    kind: str
    default: Any = _REQUIRED
    optional: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ATTR_KINDS:
            raise ValueError(f"unknown attribute kind {self.kind!r}")

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
        if k == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif k == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif k == "bool":
            ok = isinstance(value, bool)
        elif k == "str":
            ok = isinstance(value, str)
        elif k == "ints":
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
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
            ok = isinstance(value, (int, float, bool))
        elif k == "graph":
            ok = type(value).__name__ == "Graph"
        if not ok:
            raise OpTypeError(op, f"attribute '{name}' expects {k}, got {value!r}")
        return value


InferFn = Callable[..., "TensorType | Sequence[TensorType]"]


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
    """``elementwise``, ``commutative``, ``reduction``, ``view``, ``creation``, ``matmul``,
    ``conv``, ``random`` (impure), ``composite`` (has a decomposition), ``normalization``
    (reduces along axes and broadcasts back to the input shape: softmax, layer norm) and
    ``pointwise`` (each result element reads only the operand elements at its position and
    per-channel parameters, without numpy broadcasting: inference batch norm).  Fusion
    groups ``normalization`` ops like reductions and ``pointwise`` ops like elementwise ones."""
    doc: str = ""
    # Rules added by later layers, all optional.
    vjp: Callable[..., Any] | None = None
    amp: str | None = None
    compute: Callable[..., Any] | None = None
    cost: Callable[..., Any] | None = None

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
