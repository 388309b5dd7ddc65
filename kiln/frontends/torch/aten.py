"""The ATen -> kiln op table: how rules are declared, looked up and given their context.

Every ATen op kiln lowers has one :class:`AtenRule` in :data:`ATEN_TABLE`: a ``lower``
function that emits kiln nodes and an optional ``check`` that says why a particular call
cannot be lowered (e.g. a transposed convolution).  The same table answers both "lower this
node" (:mod:`kiln.frontends.torch.capture`) and "can kiln run this node?" (the fallback partitioner,
through :func:`kiln.frontends.torch.capture.is_supported`), so the two can never disagree.

A rule also states two facts about its ATen ops, so that an op's facts are declared once,
where kiln lowers it:

* ``keep=True`` -- kiln lowers the op whole and better than torch's decomposition of it
  (``silu``, ``layer_norm``, ``scaled_dot_product_attention``...): the op is left out of
  :func:`kiln.frontends.torch.export.decomposition_table`, so it reaches this rule;
* ``fresh=True`` -- the op's result never shares memory with an operand (``conv2d``,
  ``add``, ``clone``...), which lets :mod:`kiln.frontends.torch.aten_inplace` prove an
  in-place write to it unobservable.  :func:`lowers` refuses the flag on an op whose schema
  says otherwise (a result with an alias annotation, or a mutated argument); the schema
  alone does not prove it, since composite ops may return an operand itself (``dropout``
  in eval mode, ``type_as``), so the flag is a reviewed declaration, not a derivation.

Both functions receive the ATen call's arguments bound to its schema, in schema order, with
defaults filled in (keyword-only arguments included).  ``check(node, *args)`` sees the raw FX
arguments (``torch.fx.Node`` for tensors) and returns ``None`` when the call is supported or
the reason when it is not.  ``lower(ctx, *args)`` sees kiln :class:`~kiln.ir.Value` objects in
place of tensors and returns a ``Value``, or a sequence for multi-result ops whose entries may
be zero-argument callables, built only if a ``getitem`` asks for them.

The rules themselves live by family, one module each: :mod:`~kiln.frontends.torch.aten_math`
(elementwise arithmetic, casts, reductions, softmax), :mod:`~kiln.frontends.torch.aten_special`
(special functions, float manipulation, norms, determinants and solves), :mod:`~kiln.frontends.torch.aten_layout`
(layout, creation, padding), :mod:`~kiln.frontends.torch.aten_indexing` (sorting, scans, scatters,
index writes), :mod:`~kiln.frontends.torch.aten_linalg` (factorizations and solvers),
:mod:`~kiln.frontends.torch.aten_nn` (matmul, conv, pooling, upsampling, embedding),
:mod:`~kiln.frontends.torch.aten_norm` (batch/layer/group/RMS norm, dropout),
:mod:`~kiln.frontends.torch.aten_attention` (attention), :mod:`~kiln.frontends.torch.aten_transformer`
(``nn.TransformerEncoderLayer``'s and ``nn.MultiheadAttention``'s fused inference ops),
:mod:`~kiln.frontends.torch.aten_random` (random numbers), :mod:`~kiln.frontends.torch.aten_statistics`
(histograms, mode, median, segment reductions) and :mod:`~kiln.frontends.torch.aten_sampling`
(grid sampling, antialiased resizing, embedding bags, pdist); in-place calls are in
:mod:`~kiln.frontends.torch.aten_inplace`.  Importing this module registers all of them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.ir import DType, Graph, TensorType, Value
from kiln.ir.builder import GraphBuilder

from .symbolic import to_dim

aten = torch.ops.aten

LowerFn = Callable[..., Any]
CheckFn = Callable[..., "str | None"]


@dataclass(frozen=True)
class AtenRule:
    """How one ATen overload becomes kiln nodes, and what kiln knows about the overload; see
    the module docstring."""

    lower: LowerFn
    check: CheckFn | None = None
    keep: bool = False
    """Kept whole: left out of the export decomposition table."""
    fresh: bool = False
    """The result never shares memory with an operand."""


ATEN_TABLE: dict[Any, AtenRule] = {}

IGNORED_OPS: set[Any] = set()
"""ATen ops with no result that only assert facts PyTorch already checked; dropped."""


def lowers(*ops: Any, check: CheckFn | None = None, keep: bool = False,
           fresh: bool = False) -> Callable[[LowerFn], LowerFn]:
    """Decorator registering ``fn`` as the lowering of every ATen overload in ``ops``, with
    the facts ``keep`` and ``fresh`` (see the module docstring) about each of them."""
    if fresh:
        for op in ops:
            reason = _not_fresh_by_schema(op)
            if reason is not None:
                raise ValueError(f"ATen op {op} cannot be declared fresh: {reason}")

    def wrap(fn: LowerFn) -> LowerFn:
        for op in ops:
            if op in ATEN_TABLE:
                raise ValueError(f"ATen op {op} has two kiln lowerings")
            ATEN_TABLE[op] = AtenRule(fn, check, keep=keep, fresh=fresh)
        return fn

    return wrap


def _not_fresh_by_schema(op: Any) -> str | None:
    """Why ``op``'s schema contradicts "its result is a new tensor", or ``None``."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return "it has no schema"
    if schema.is_mutable:
        return "it writes one of its arguments"
    if any(r.alias_info is not None for r in schema.returns):
        return "its schema says a result aliases an argument"
    return None


def kept_ops() -> frozenset[Any]:
    """The ATen overloads whose rules keep them whole (``keep=True``)."""
    return frozenset(op for op, rule in ATEN_TABLE.items() if rule.keep)


def is_fresh(target: Any) -> bool:
    """Whether ATen overload ``target`` always returns a new tensor (its rule says
    ``fresh=True``); ``False`` for an op kiln has no rule for."""
    rule = ATEN_TABLE.get(target)
    return rule is not None and rule.fresh


def optional_ops(*names: str) -> list[Any]:
    """ATen overloads by ``"name.overload"``, skipping ones this torch build lacks."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return found


# ------------------------------------------------------------------------ dtypes
_TORCH_TO_KILN = {
    torch.float64: DType.float64,
    torch.float32: DType.float32,
    torch.float16: DType.float16,
    torch.bfloat16: DType.bfloat16,
    torch.int64: DType.int64,
    torch.int32: DType.int32,
    torch.int8: DType.int8,
    torch.uint8: DType.uint8,
    torch.bool: DType.bool,
}


def kiln_dtype(dtype: torch.dtype) -> DType:
    """The kiln dtype of a torch dtype; ``ValueError`` when kiln has none (e.g. complex)."""
    try:
        return _TORCH_TO_KILN[dtype]
    except KeyError:
        known = ", ".join(str(d).removeprefix("torch.") for d in _TORCH_TO_KILN)
        raise ValueError(f"dtype {dtype} has no kiln equivalent (kiln has {known})") from None


def has_kiln_dtype(dtype: torch.dtype) -> bool:
    return dtype in _TORCH_TO_KILN


def tensor_type(t: torch.Tensor) -> TensorType:
    """The kiln type of a (fake or real) tensor; symbolic sizes (``torch.SymInt``) become
    kiln sizes (:func:`kiln.frontends.torch.symbolic.to_dim`)."""
    return TensorType(tuple(to_dim(d) for d in t.shape), kiln_dtype(t.dtype))


def dims(shape: Sequence[Any]) -> tuple[Any, ...]:
    """A shape of ints, torch sizes (``SymInt``) or kiln sizes as kiln ``Dim`` values."""
    return tuple(to_dim(d) for d in shape)


def _scalar_kind(x: Any) -> int:
    if isinstance(x, bool):
        return 0
    if isinstance(x, int):
        return 1
    return 2


def _dtype_kind(d: DType) -> int:
    if d == DType.bool:
        return 0
    return 1 if d.is_integer else 2


def scalar_dtype(x: bool | int | float, tensor_dtype: DType) -> DType:
    """The dtype torch gives a python scalar used with a tensor of ``tensor_dtype``.

    A scalar of a lower or equal category (bool < int < float) takes the tensor's dtype;
    a higher one takes torch's default for its category (int64, or the default float dtype).
    """
    kind = _scalar_kind(x)
    if kind <= _dtype_kind(tensor_dtype):
        return tensor_dtype
    if kind == 1:
        return DType.int64
    return kiln_dtype(torch.get_default_dtype())


_HALF_TYPES = (DType.float16, DType.bfloat16)


# ------------------------------------------------------------------------ context
class LoweringContext(GraphBuilder):
    """What a lowering function may use to emit kiln nodes for one ATen node.

    A :class:`~kiln.ir.builder.GraphBuilder` appending to ``graph``, every node located at
    ``loc`` (the ATen node's source line), plus the ATen node itself (``aten_node``, and the
    types PyTorch computed for it, ``out`` and ``outs``) and torch's scalar rules
    (:meth:`scalar`, :meth:`operands`).  Three methods widen the base class's:
    :meth:`const` wraps integers into the dtype, as torch does, where the base would refuse
    them; :meth:`cast` accepts ``None`` (no cast); :meth:`reshape` accepts torch sizes.
    """

    def __init__(self, graph: Graph, node: torch.fx.Node, loc: str | None):
        super().__init__(graph, loc=loc)
        self.aten_node = node
        """The FX node of the ATen call being lowered."""

    def const(self, data: Any, like: Value | DType) -> Value:
        """A constant of ``like``'s dtype (a :class:`~kiln.ir.DType` or a value's), integers
        wrapped into it as torch does (``const(256, DType.uint8)`` is 0)."""
        dtype = like.dtype if isinstance(like, Value) else like
        arr = np.asarray(data)
        if dtype.is_integer and arr.dtype.kind in "iub":
            arr = arr.astype(np.int64).astype(dtype.numpy)
        else:
            arr = arr.astype(dtype.numpy)
        return self.graph.add_constant(arr, dtype)

    def scalar(self, x: bool | int | float, like: DType) -> Value:
        """A 0-d constant for python scalar ``x`` used together with a ``like`` tensor.

        torch computes float16/bfloat16 ops in float32 with the scalar unrounded; a scalar
        that the half type cannot hold exactly therefore stays float32 (the op's result is
        cast back to the half type by the caller's type check).
        """
        dtype = scalar_dtype(x, like)
        if dtype in _HALF_TYPES:
            with np.errstate(over="ignore"):  # a scalar beyond the half range stays float32
                exact = float(np.asarray(x).astype(dtype.numpy)) == float(x)
            if not exact:
                dtype = DType.float32
        return self.const(x, dtype)

    def operands(self, a: Any, b: Any) -> tuple[Value, Value]:
        """Both operands of a binary op as values; a python scalar follows the tensor."""
        if not isinstance(a, Value):
            a = self.scalar(a, b.dtype)
        if not isinstance(b, Value):
            b = self.scalar(b, a.dtype)
        return a, b

    def cast(self, x: Value, dtype: DType | None) -> Value:
        """``x`` converted to ``dtype`` (no node when it already has it, or dtype is None)."""
        return x if dtype is None else super().cast(x, dtype)

    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        """``x`` reshaped to ``shape`` (ints of any kind, torch sizes, kiln sizes)."""
        return super().reshape(x, dims(shape))

    @property
    def out(self) -> TensorType:
        """The type PyTorch computed for the node's (first) tensor result."""
        return tensor_type(self.outs[0])

    @property
    def outs(self) -> list[torch.Tensor]:
        val = self.aten_node.meta["val"]
        return list(val) if isinstance(val, (tuple, list)) else [val]


def dtype_arg(dtype: torch.dtype | None) -> DType | None:
    return None if dtype is None else kiln_dtype(dtype)


def meta(x: Any) -> Any:
    """The example value of an FX argument (its fake tensor), or ``x`` itself."""
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def only_first_result_used(node: torch.fx.Node, *_: Any) -> str | None:
    """Check for multi-result ops kiln computes only the first result of."""
    for user in node.users:
        if user.target is operator.getitem and not user.users:
            continue  # a dead getitem is never lowered
        if user.target is not operator.getitem or user.args[1] != 0:
            used = user.args[1] if user.target is operator.getitem else "the whole tuple"
            return f"only result 0 of {node.target} is supported, but result {used} is used"
    return None


def dims_arg(dim: int | Sequence[int] | None) -> tuple[int, ...]:
    """An ATen ``int[1]? dim`` as kiln ``dims`` (empty = every axis)."""
    if dim is None:
        return ()
    if isinstance(dim, int):
        return (dim,)
    return tuple(dim)


def rule_for(target: Any) -> AtenRule | None:
    """The rule lowering ATen overload ``target``, or ``None`` if kiln has none."""
    return ATEN_TABLE.get(target)


from . import (  # noqa: E402,F401  (register the rules)
    aten_attention,
    aten_indexing,
    aten_inplace,
    aten_layout,
    aten_linalg,
    aten_math,
    aten_nn,
    aten_norm,
    aten_random,
    aten_sampling,
    aten_special,
    aten_statistics,
    aten_transformer,
)
