"""The JAX primitive -> kiln op table: how rules are declared, looked up and given their context.

Every JAX primitive kiln lowers has one :class:`PrimitiveRule` in :data:`PRIMITIVE_TABLE`,
declared with :func:`lowers` the way the PyTorch frontend declares its ATen rules
(:func:`kiln.frontends.torch.aten.lowers`):

* ``lower(ctx, *operands, **params)`` receives one kiln :class:`~kiln.ir.Value` per operand
  of the equation (literals become constants) and the equation's ``params`` as keyword
  arguments, and returns a ``Value`` or, for a primitive with several results, a sequence;
* ``check(eqn)``, optional, sees the raw :class:`jax.extend.core.JaxprEqn` and returns
  ``None`` when kiln can lower it, else the reason (e.g. a transposed convolution).

The rules live by family, one module each: :mod:`.prim_math` (elementwise arithmetic,
comparisons, ``select_n``, casts, powers, special functions), :mod:`.prim_layout` (broadcasts,
reshapes, slices, ``iota``, ``pad``), :mod:`.prim_indexing` (``gather``, the scatters,
``dynamic_update_slice``), :mod:`.prim_contract` (``dot_general``,
``conv_general_dilated``), :mod:`.prim_reduce` (reductions, arg-reductions, scans along an
axis) and :mod:`.prim_control` (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``cond``,
``scan``: inlined or unrolled through :meth:`JaxContext.inline`).

JAX's internal API changes between releases, so the versions this table is written against
are pinned (:data:`SUPPORTED_JAX`), and :func:`check_primitive_names` verifies at import that
every primitive named here still exists in the installed JAX under that name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir import DType, Graph, KilnError, TensorType, Value
from kiln.ir.builder import GraphBuilder

SUPPORTED_JAX = ((0, 10, 0), (0, 13, 0))
"""The JAX versions kiln's jaxpr frontend supports: ``>= 0.10.0, < 0.13.0``."""

LowerFn = Callable[..., Any]
CheckFn = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class PrimitiveRule:
    """How one JAX primitive becomes kiln nodes; see the module docstring."""

    lower: LowerFn
    check: CheckFn | None = None
    control: bool = False
    """The primitive holds sub-jaxprs (never constant-folded by the lowerer)."""


PRIMITIVE_TABLE: dict[str, PrimitiveRule] = {}


def lowers(*names: str, check: CheckFn | None = None,
           control: bool = False) -> Callable[[LowerFn], LowerFn]:
    """Decorator registering ``fn`` as the lowering of every JAX primitive in ``names``."""

    def wrap(fn: LowerFn) -> LowerFn:
        for name in names:
            if name in PRIMITIVE_TABLE:
                raise ValueError(f"JAX primitive {name} has two kiln lowerings")
            PRIMITIVE_TABLE[name] = PrimitiveRule(fn, check, control)
        return fn

    return wrap


def rule_for(name: str) -> PrimitiveRule | None:
    """The rule lowering JAX primitive ``name``, or ``None`` if kiln has none."""
    return PRIMITIVE_TABLE.get(name)


# ------------------------------------------------------------------------ dtypes
def kiln_dtype(dtype: Any) -> DType:
    """The kiln dtype of a JAX/numpy dtype; ``ValueError`` when kiln has none."""
    try:
        return DType.from_numpy(np.dtype(dtype))
    except (ValueError, TypeError):
        raise ValueError(f"dtype {dtype} has no kiln equivalent (kiln has "
                         f"{', '.join(d.name for d in DType)})") from None


def aval_type(aval: Any) -> TensorType:
    """The kiln type of a JAX abstract value (a ``ShapedArray``)."""
    shape = tuple(aval.shape)
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        raise ValueError(f"symbolic shape {shape}; kiln compiles static shapes only")
    return TensorType(tuple(int(d) for d in shape), kiln_dtype(aval.dtype))


def describe_aval(aval: Any) -> str:
    """``f32[2, 8]`` for a shaped array (JAX's own text for anything else)."""
    try:
        return str(aval_type(aval))
    except (ValueError, AttributeError):
        return str(aval)


# ------------------------------------------------------------------------ context
class JaxContext(GraphBuilder):
    """What a rule may use to emit kiln nodes for one JAX equation.

    A :class:`~kiln.ir.builder.GraphBuilder` appending to ``graph``, every node located at
    ``loc`` (the user's source line), plus the equation (``eqn``), the kiln types JAX computed
    for its results (:attr:`out`, :attr:`outs`), and :meth:`inline`, which lowers a
    sub-jaxpr (of ``jit``, ``cond``, ``scan``...) in place on given kiln values.
    """

    def __init__(self, graph: Graph, eqn: Any, loc: str | None,
                 inline: Callable[[Any, Sequence[Value]], list[Value]]):
        super().__init__(graph, loc=loc)
        self.eqn = eqn
        self._inline = inline

    def inline(self, closed_jaxpr: Any, args: Sequence[Value]) -> list[Value]:
        """The results of ``closed_jaxpr`` applied to ``args``, lowered into this graph."""
        return self._inline(closed_jaxpr, args)

    @property
    def outs(self) -> list[TensorType]:
        return [aval_type(v.aval) for v in self.eqn.outvars]

    @property
    def out(self) -> TensorType:
        return self.outs[0]

    def const(self, data: Any, like: Value | DType) -> Value:
        """A constant of ``like``'s dtype (a :class:`~kiln.ir.DType` or a value's)."""
        dtype = like.dtype if isinstance(like, Value) else like
        return self.graph.add_constant(np.asarray(data).astype(dtype.numpy), dtype)

    def broadcast_to(self, x: Value, shape: Sequence[int]) -> Value:
        """``x`` expanded to ``shape`` (trailing-aligned, numpy rules)."""
        shape = tuple(shape)
        if tuple(x.shape) == shape:
            return x
        if x.type.rank < len(shape):
            x = self.reshape(x, (1,) * (len(shape) - x.type.rank) + tuple(x.shape))
        return self.op("expand", x, shape=shape)

    def where_index(self, index: Value, cases: Sequence[Value]) -> Value:
        """``cases[index]`` elementwise (``index`` bool or integer), as nested ``where``."""
        if index.dtype == DType.bool:
            return self.where(index, cases[1], cases[0]) if len(cases) == 2 else cases[0]
        result = cases[-1]
        for i in range(len(cases) - 2, -1, -1):
            result = self.where(self.op("eq", index, self.const(i, index)), cases[i], result)
        return result


def constant_of(value: Value) -> np.ndarray | None:
    """The data of a kiln constant, or ``None`` for any other value."""
    return value.data if value.is_const else None


def static_int(value: Value, what: str) -> int | None:
    """The integer a scalar constant holds, or ``None`` when ``value`` is not a constant."""
    data = constant_of(value)
    if data is None:
        return None
    if data.size != 1:
        raise ValueError(f"{what} must be a scalar, got shape {list(data.shape)}")
    return int(data.reshape(()))


# ------------------------------------------------------------------------ versions
def jax_version() -> tuple[int, ...]:
    import jax

    return tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())


class JaxVersionError(KilnError):
    """The installed JAX is outside :data:`SUPPORTED_JAX`, or lacks a primitive kiln names."""


def check_jax_version() -> None:
    low, high = SUPPORTED_JAX
    version = jax_version()
    if not low <= version < high:
        import jax

        raise JaxVersionError(
            f"kiln's JAX frontend supports jax >= {'.'.join(map(str, low))}, < "
            f"{'.'.join(map(str, high))}; installed is jax {jax.__version__}. Install a supported "
            "release (pip install 'jax>=0.10,<0.13'); JAX's jaxpr API changes between releases.")


def installed_primitive_names() -> set[str]:
    """Names of the primitives the installed JAX defines: those ``jax.extend.core.primitives``
    exports, and the module-level primitives of JAX's loaded modules (``split`` is not
    exported)."""
    import sys

    import jax.extend.core as jcore
    from jax.extend.core import primitives

    modules = [primitives] + [m for name, m in list(sys.modules.items())
                              if m is not None and (name == "jax" or name.startswith("jax."))]
    return {p.name for m in modules for p in list(vars(m).values()) if isinstance(p, jcore.Primitive)}


def check_primitive_names() -> None:
    """Every primitive in :data:`PRIMITIVE_TABLE` exists in the installed JAX."""
    missing = sorted(set(PRIMITIVE_TABLE) - installed_primitive_names())
    if missing:
        import jax

        raise JaxVersionError(
            f"jax {jax.__version__} has no primitive(s) {', '.join(missing)}, which kiln's JAX rules "
            "name; this JAX release renamed or removed them. Install a supported release "
            "(pip install 'jax>=0.10,<0.13').")
