"""Declarative pattern rewriting over the graph IR (reference: ``docs/passes.md``).

A rewrite is data: a pattern (what to look for) and a function (what to put instead)::

    @rewrite(op("mul", any_value("x"), const(value=1), commutative=True))
    def mul_by_one(match, builder):
        x = match["x"]
        return x if x.type == match.value.type else None  # None = no rewrite

* Patterns: :func:`op` (op names, positional operand sub-patterns, ``attrs``,
  ``commutative``), :func:`any_value` (wildcard) and :func:`const` (graph constants and
  ``full`` results; ``value=`` splat, ``data_where=`` predicate).  All take ``name``
  (capture; a repeated name must bind the same value), ``dtype``, ``shape``, ``rank``,
  ``one_use`` and ``where``.
* A rewrite function gets a :class:`Match` (captured values, their nodes, constants, use
  counts, the root) and a :class:`Builder` (inserts replacement nodes before the root) and
  returns the replacement value(s), which must have exactly the root's types, else
  :class:`RewriteError` names the rewrite.
* :func:`apply_patterns` applies a list of rewrites greedily to a fixpoint on a clone;
  :class:`PatternPass` / :func:`pattern_pass` make a registered pass of such a list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kiln.ir import DType, Graph, KilnError, Node, Value
from kiln.ir.builder import GraphBuilder
from kiln.ir.types import SymDim
from kiln.passes.base import Pass, PassResult, register_pass

FLOAT_DTYPES = frozenset({DType.float64, DType.float32, DType.float16, DType.bfloat16})
INT_DTYPES = frozenset({DType.int64, DType.int32, DType.int8, DType.uint8})

DTypeSpec = DType | Collection[DType] | Callable[[DType], bool] | None
ShapeSpec = tuple | Callable[[tuple], bool] | None
RankSpec = int | Callable[[int], bool] | None


class RewriteError(KilnError):
    """A rewrite function broke the rewrite contract (e.g. returned a value of another type)."""


# ---------------------------------------------------------------------------------- patterns
@dataclass(frozen=True, eq=False)
class Pat:
    """A pattern over one value. Build it with :func:`op`, :func:`any_value` or :func:`const`."""

    ops: frozenset[str] | None = None
    """Op names the producer must have; ``None`` = any value (input, param, const, result)."""
    operands: tuple[Pat, ...] | None = None
    name: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)
    commutative: bool = False
    one_use: bool = False
    dtype: DTypeSpec = None
    shape: ShapeSpec = None
    rank: RankSpec = None
    where: Callable[[Value], bool] | None = None
    is_const: bool = False
    const_value: Any = None
    data_where: Callable[[np.ndarray], bool] | None = None

    def names(self) -> set[str]:
        """Every capture name used in this pattern and its sub-patterns."""
        out = {self.name} if self.name else set()
        for p in self.operands or ():
            out |= p.names()
        return out


def op(
    ops: str | Collection[str],
    *operands: Pat,
    name: str | None = None,
    attrs: Mapping[str, Any] | None = None,
    commutative: bool = False,
    one_use: bool = False,
    dtype: DTypeSpec = None,
    shape: ShapeSpec = None,
    rank: RankSpec = None,
    where: Callable[[Value], bool] | None = None,
) -> Pat:
    """A value produced by a node whose op is ``ops`` (a name) or one of ``ops``.

    ``operands`` are positional sub-patterns, one per operand of the node; with none given
    the operands are unconstrained.
    """
    names = frozenset([ops] if isinstance(ops, str) else ops)
    if not names:
        raise ValueError("op pattern needs at least one op name")
    if commutative and len(operands) != 2:
        raise ValueError("commutative=True needs exactly two operand patterns")
    return Pat(ops=names, operands=tuple(operands) or None, name=name,
               attrs=dict(attrs or {}), commutative=commutative, one_use=one_use, dtype=dtype,
               shape=shape, rank=rank, where=where)


def any_value(name: str | None = None, *, one_use: bool = False, dtype: DTypeSpec = None,
              shape: ShapeSpec = None, rank: RankSpec = None,
              where: Callable[[Value], bool] | None = None) -> Pat:
    """A wildcard matching any value, optionally constrained and captured as ``name``."""
    return Pat(name=name, one_use=one_use, dtype=dtype, shape=shape, rank=rank, where=where)


def const(name: str | None = None, *, value: Any = None,
          data_where: Callable[[np.ndarray], bool] | None = None, one_use: bool = False,
          dtype: DTypeSpec = None, shape: ShapeSpec = None, rank: RankSpec = None,
          where: Callable[[Value], bool] | None = None) -> Pat:
    """A constant: a graph constant or the result of a ``full`` node.

    ``value=v`` requires every element to equal ``v`` (a splat); ``data_where`` is a
    predicate on the constant's data as a numpy array (for ``full`` the materialized array).
    """
    return Pat(name=name, one_use=one_use, dtype=dtype, shape=shape, rank=rank, where=where,
               is_const=True, const_value=value, data_where=data_where)


# ------------------------------------------------------------------------- constant helpers
def splat_value(value: Value) -> Any | None:
    """The single element value of a constant whose elements are all equal, else ``None``.

    Works for graph constants and ``full`` nodes; the result is a numpy scalar of the
    value's dtype.  Empty constants have no splat value.
    """
    if value.origin == "const":
        data = value.data
        if data.size == 0:
            return None
        first = data.reshape(-1)[0]
        if data.size == 1 or bool(np.all(data == first)):
            return first
        if value.dtype.is_floating and bool(np.all(np.isnan(data.astype(np.float32)))):
            return first
        return None
    if _full_of_a_number(value):
        return value.dtype.numpy.type(value.producer.attrs["value"])
    return None


def constant_data(value: Value, max_elements: int | None = None) -> np.ndarray | None:
    """The data of a constant value (graph constant or ``full`` node), else ``None``.

    A ``full`` with more than ``max_elements`` elements returns ``None`` rather than
    materializing it.
    """
    if value.origin == "const":
        return value.data
    if not _full_of_a_number(value) or not value.type.is_static:
        return None
    if max_elements is not None and value.type.numel > max_elements:
        return None
    return np.full(value.shape, value.producer.attrs["value"], dtype=value.dtype.numpy)


def is_constant(value: Value) -> bool:
    """True for graph constants and results of ``full`` nodes of a number (not of a
    symbolic size, whose value each call binds)."""
    return value.origin == "const" or _full_of_a_number(value)


def _full_of_a_number(value: Value) -> bool:
    producer = value.producer
    return producer is not None and producer.op_name == "full" and not isinstance(producer.attrs["value"], SymDim)


# -------------------------------------------------------------------------------- matching
class _UseCounter:
    """Use counts of the values of a graph (graph outputs count as uses), computed lazily."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._counts: dict[Value, int] | None = None

    def invalidate(self) -> None:
        self._counts = None

    def count(self, value: Value) -> int:
        if self._counts is None:
            counts: dict[Value, int] = {}
            for n in self.graph.nodes:
                for v in n.inputs:
                    counts[v] = counts.get(v, 0) + 1
            for v in self.graph.outputs:
                counts[v] = counts.get(v, 0) + 1
            self._counts = counts
        return self._counts.get(value, 0)


@dataclass
class Match:
    """The result of matching a pattern at ``root``: the captured values by name."""

    graph: Graph
    root: Node
    bindings: dict[str, Value]
    _uses: _UseCounter | None = field(default=None, repr=False, compare=False)

    def use_count(self, value: Value) -> int:
        """How many times ``value`` is used (as an operand, or as a graph output)."""
        if self._uses is None:
            self._uses = _UseCounter(self.graph)
        return self._uses.count(value)

    @property
    def value(self) -> Value:
        """The root node's (single) result."""
        return self.root.output

    def __getitem__(self, name: str) -> Value:
        try:
            return self.bindings[name]
        except KeyError:
            raise KeyError(f"pattern captured no value named {name!r}; "
                           f"captured: {sorted(self.bindings)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.bindings

    def node(self, name: str) -> Node:
        """The node producing captured value ``name`` (it must be a node result)."""
        v = self[name]
        if v.producer is None:
            raise KeyError(f"captured value %{v.name} ({name!r}) is a {v.origin}, not a node result")
        return v.producer

    def attrs(self, name: str) -> dict[str, Any]:
        """Attributes of the node producing captured value ``name``."""
        return self.node(name).attrs

    def const(self, name: str) -> np.ndarray:
        """Data of captured constant ``name`` (graph constant or materialized ``full``)."""
        data = constant_data(self[name])
        if data is None:
            raise KeyError(f"captured value {name!r} is not a constant")
        return data

    def splat(self, name: str) -> Any | None:
        """The element value of captured constant ``name`` if all its elements are equal."""
        return splat_value(self[name])


def _spec_ok(spec: Any, actual: Any) -> bool:
    if spec is None:
        return True
    if callable(spec) and not isinstance(spec, (DType, tuple)):
        return bool(spec(actual))
    if isinstance(spec, (DType, int, tuple)):
        return actual == spec
    return actual in spec


def _attr_ok(expected: Any, actual: Any) -> bool:
    if callable(expected) and not isinstance(expected, DType):
        return bool(expected(actual))
    if isinstance(expected, list):
        expected = tuple(expected)
    return actual == expected


def _local_ok(pat: Pat, value: Value, uses: _UseCounter) -> bool:
    if not (_spec_ok(pat.dtype, value.dtype) and _spec_ok(pat.shape, value.shape)
            and _spec_ok(pat.rank, value.type.rank)):
        return False
    if pat.one_use and uses.count(value) != 1:
        return False
    if pat.is_const and not _const_ok(pat, value):
        return False
    if pat.ops is not None:
        node = value.producer
        if node is None or node.op_name not in pat.ops:
            return False
        if pat.operands is not None and len(pat.operands) != len(node.inputs):
            return False
        for key, expected in pat.attrs.items():
            if key not in node.attrs or not _attr_ok(expected, node.attrs[key]):
                return False
    return pat.where is None or bool(pat.where(value))


def _const_ok(pat: Pat, value: Value) -> bool:
    if not is_constant(value):
        return False
    if pat.const_value is not None:
        splat = splat_value(value)
        if splat is None or not _equal_scalar(splat, pat.const_value):
            return False
    if pat.data_where is not None:
        data = constant_data(value, max_elements=1 << 20)
        if data is None or not pat.data_where(data):
            return False
    return True


def _equal_scalar(actual: Any, expected: Any) -> bool:
    """Exact comparison of a constant's element with a pattern's value (NaN equals NaN)."""
    integral = (int, bool, np.integer, np.bool_)
    if isinstance(actual, integral) and isinstance(expected, integral):
        return int(actual) == int(expected)
    a, e = float(actual), float(expected)  # also reads bfloat16 scalars
    return a == e or (math.isnan(a) and math.isnan(e))


def _matches(pat: Pat, value: Value, bound: dict[str, Value], uses: _UseCounter) -> Iterator[dict[str, Value]]:
    """Every consistent extension of ``bound`` under which ``pat`` matches ``value``."""
    if pat.name is not None and pat.name in bound and bound[pat.name] is not value:
        return
    if not _local_ok(pat, value, uses):
        return
    if pat.name is not None:
        bound = {**bound, pat.name: value}
    if pat.ops is None or pat.operands is None:
        yield bound
        return
    inputs = value.producer.inputs
    orders = [inputs]
    if pat.commutative and inputs[0] is not inputs[1]:
        orders.append(inputs[::-1])
    for order in orders:
        yield from _match_operands(pat.operands, order, bound, uses)


def _match_operands(pats: Sequence[Pat], values: Sequence[Value], bound: dict[str, Value],
                    uses: _UseCounter) -> Iterator[dict[str, Value]]:
    if not pats:
        yield bound
        return
    for b in _matches(pats[0], values[0], bound, uses):
        yield from _match_operands(pats[1:], values[1:], b, uses)


def match(pattern: Pat, value: Value, graph: Graph) -> Match | None:
    """Match ``pattern`` against ``value`` (a node result) in ``graph``; first match or None."""
    if value.producer is None:
        return None
    uses = _UseCounter(graph)
    for bindings in _matches(pattern, value, {}, uses):
        return Match(graph, value.producer, bindings, uses)
    return None


# ------------------------------------------------------------------------------- rewriting
class Builder(GraphBuilder):
    """Builds replacement nodes before the matched ``root``, at its source location, and
    records what it created (``created``); :class:`~kiln.ir.builder.GraphBuilder`'s
    vocabulary (``op``, ``node``, ``mul``, ``reshape``...) with the constants below."""

    def __init__(self, graph: Graph, root: Node):
        super().__init__(graph, loc=root.loc, before=root)
        self.root = root

    def const(self, data: Any, dtype: DType | Value | None = None) -> Value:
        """A graph constant (deduplicated by content, as :meth:`Graph.add_constant`) of
        ``dtype`` (a dtype, or a value whose dtype to take, as
        :meth:`GraphBuilder.const <kiln.ir.builder.GraphBuilder.const>`), or of the data's
        own dtype when ``None`` (Python floats: ``f32``)."""
        if dtype is None:
            return self.graph.add_constant(data)
        return super().const(data, dtype)

    def scalar(self, value: Any, dtype: DType) -> Value:
        """A rank-0 constant of ``dtype``."""
        return super().const(value, dtype)


RewriteFn = Callable[[Match, Builder], "Value | Sequence[Value] | None"]


@dataclass(frozen=True, eq=False)
class Rewrite:
    """A named (pattern, function) pair. The root of ``pattern`` must be an :func:`op` pattern."""

    name: str
    pattern: Pat
    fn: RewriteFn

    def __post_init__(self) -> None:
        if self.pattern.ops is None:
            raise ValueError(f"rewrite {self.name!r}: the root pattern must be op(...), not a wildcard")


def rewrite(pattern: Pat, name: str | None = None) -> Callable[[RewriteFn], Rewrite]:
    """Decorator: ``@rewrite(pattern)`` turns ``fn(match, builder)`` into a :class:`Rewrite`."""

    def wrap(fn: RewriteFn) -> Rewrite:
        return Rewrite(name or fn.__name__, pattern, fn)

    return wrap


def _is_pure(node: Node) -> bool:
    return not node.op.has("random")


def remove_dead(graph: Graph, candidates: Sequence[Node]) -> int:
    """Remove ``candidates`` (and, transitively, their producers) once they have no uses.

    Impure nodes (trait ``random``) are kept.  Returns the number of nodes removed.
    """
    uses = _UseCounter(graph)
    present = set(graph.nodes)
    stack = list(candidates)
    removed = 0
    while stack:
        node = stack.pop()
        if node not in present or not _is_pure(node):
            continue
        if any(uses.count(v) for v in node.outputs):
            continue
        graph.remove_node(node)
        present.discard(node)
        removed += 1
        uses.invalidate()
        stack.extend(v.producer for v in node.inputs if v.producer is not None)
    return removed


def _results(replacement: Value | Sequence[Value], root: Node, rw: Rewrite) -> tuple[Value, ...]:
    values = (replacement,) if isinstance(replacement, Value) else tuple(replacement)
    if len(values) != len(root.outputs):
        raise RewriteError(f"rewrite {rw.name!r} returned {len(values)} value(s) for "
                           f"{root.op_name} with {len(root.outputs)} result(s)")
    for old, new in zip(root.outputs, values):
        if not isinstance(new, Value):
            raise RewriteError(f"rewrite {rw.name!r} returned {type(new).__name__}, not a Value")
        if old.type != new.type:
            raise RewriteError(
                f"rewrite {rw.name!r} replaced {root.op_name} result %{old.name}: {old.type} with "
                f"%{new.name}: {new.type}; a rewrite must keep the exact result type "
                f"(return None when the types differ)")
    return values


def _try_rewrite(graph: Graph, node: Node, rw: Rewrite, uses: _UseCounter) -> bool:
    if rw.pattern.operands is not None and len(rw.pattern.operands) != len(node.inputs):
        return False
    root_value = node.outputs[0] if node.outputs else None
    if root_value is None:
        return False
    for bindings in _matches(rw.pattern, root_value, {}, uses):
        m = Match(graph, node, bindings, uses)
        builder = Builder(graph, node)
        replacement = rw.fn(m, builder)
        values = None if replacement is None else _results(replacement, node, rw)
        if values is None or all(new is old for new, old in zip(values, node.outputs)):
            if builder.created:
                remove_dead(graph, builder.created)
                uses.invalidate()
            continue
        for old, new in zip(node.outputs, values):
            graph.replace_all_uses(old, new)
        matched = [v.producer for v in bindings.values() if v.producer is not None]
        remove_dead(graph, [node, *matched, *builder.created])
        uses.invalidate()
        return True
    return False


def apply_patterns(graph: Graph, rewrites: Sequence[Rewrite], max_rounds: int = 32) -> PassResult:
    """Apply ``rewrites`` greedily to a fixpoint (at most ``max_rounds`` rounds).

    Guarantees: the input graph is untouched; every replacement has its root's exact type
    (else :class:`RewriteError`); matched nodes left without uses are removed (impure ones
    kept); the result is topologically sorted; ``changed`` is True iff a rewrite fired.
    """
    by_op: dict[str, list[Rewrite]] = {}
    for rw in rewrites:
        for name in sorted(rw.pattern.ops or ()):
            by_op.setdefault(name, []).append(rw)
    g = graph.clone()
    changed = False
    for _ in range(max_rounds):
        fired = False
        uses = _UseCounter(g)
        for node in list(g.nodes):
            if node not in g.nodes:  # removed by an earlier rewrite this round
                continue
            for rw in by_op.get(node.op_name, ()):
                if _try_rewrite(g, node, rw, uses):
                    fired = True
                    break
        if not fired:
            break
        changed = True
        g.sort()
    if changed:
        g.remove_unused_constants()
    return PassResult(g if changed else graph, changed)


# ---------------------------------------------------------------------------------- passes
@dataclass(frozen=True)
class PatternPass(Pass):
    """A pass that applies :meth:`rewrites` with :func:`apply_patterns`.

    Subclass it, set ``name`` and override :meth:`rewrites` (or use :func:`pattern_pass`).
    """

    name: ClassVar[str] = ""
    max_rounds: int = 32

    def rewrites(self) -> Sequence[Rewrite]:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, graph: Graph) -> PassResult:
        return apply_patterns(graph, self.rewrites(), max_rounds=self.max_rounds)


def pattern_pass(name: str, rewrites: Sequence[Rewrite], doc: str = "") -> type[PatternPass]:
    """Create and register a :class:`PatternPass` named ``name`` applying ``rewrites``."""
    fixed = tuple(rewrites)

    def _rewrites(self: PatternPass) -> Sequence[Rewrite]:
        return fixed

    cls_name = "".join(part.capitalize() for part in name.replace("_", "-").split("-")) + "Pass"
    cls = type(cls_name, (PatternPass,), {
        "name": name, "rewrites": _rewrites, "__doc__": doc or f"Pattern pass {name!r}.",
        "__annotations__": {"name": ClassVar[str]}, "__module__": __name__,
    })
    return register_pass(dataclass(frozen=True)(cls))


__all__ = [
    "FLOAT_DTYPES", "INT_DTYPES", "Builder", "Match", "Pat", "PatternPass", "Rewrite",
    "RewriteError", "any_value", "apply_patterns", "const", "constant_data", "is_constant",
    "match", "op", "pattern_pass", "remove_dead", "rewrite", "splat_value",
]
