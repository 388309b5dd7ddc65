"""The one way code outside the parser adds nodes to a graph: :class:`GraphBuilder`.

Every rule that writes graph nodes -- gradient rules (``GradBuilder``), pattern rewrites
(``kiln.passes.pattern.Builder``), decompositions, optimizer updates, ATen lowering rules
(``kiln.frontends.torch.aten.LoweringContext``) -- builds through a subclass of it, so
they share one vocabulary: ``b.op(name, *inputs, **attrs)`` for a single-result node,
``b.node(...)`` for any node, constants, and the small arithmetic helpers below.

A builder carries where its nodes go (``before``: inserted before that node, else
appended), the source location they record (``loc``) and, with ``record=True``, the list of
nodes it made (``created``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .graph import Graph, Node, Value
from .types import Dim, DType, SymDim, TensorType


class GraphBuilder:
    """Adds nodes to ``graph`` at one place (before ``before``, else at the end), each located
    at ``loc``."""

    def __init__(self, graph: Graph, *, loc: str | None = None, before: Node | None = None):
        self.graph = graph
        self.loc = loc
        self.before = before
        self.created: list[Node] = []

    def node(self, op: str, inputs: Sequence[Value], attrs: Mapping[str, Any] | None = None, *,
             names: Sequence[str] | None = None) -> Node:
        """Add a node of ``op`` (types inferred as always) and return it."""
        n = self.graph.add_node(op, inputs, attrs, names=names, loc=self.loc, before=self.before)
        self.created.append(n)
        return n

    def op(self, op: str, *inputs: Value, **attrs: Any) -> Value:
        """Add a single-result node ``op(*inputs) {attrs}`` and return its result."""
        return self.node(op, inputs, attrs).output

    def const(self, value: Any, like: Value | DType) -> Value:
        """A constant ``value`` of ``like``'s dtype (so arithmetic does not promote)."""
        dtype = like.dtype if isinstance(like, Value) else like
        return self.graph.add_constant(np.asarray(value, dtype=dtype.numpy), dtype)

    def array(self, data: np.ndarray, dtype: DType) -> Value:
        """A constant tensor holding ``data`` converted to ``dtype``."""
        return self.graph.add_constant(np.asarray(data, dtype=dtype.numpy), dtype)

    def size(self, n: Dim, like: Value | DType) -> Value:
        """The size ``n`` (an int, or a symbolic size bound at each call) as a scalar of
        ``like``'s dtype: what a mean divides by."""
        dtype = like.dtype if isinstance(like, Value) else like
        if isinstance(n, SymDim):
            return self.full((), n, dtype)
        return self.const(n, dtype)

    def full(self, shape: Sequence[int], value: float | bool, dtype: DType) -> Value:
        return self.op("full", shape=tuple(shape), value=value, dtype=dtype)

    def zeros(self, type: TensorType) -> Value:
        return self.full(type.shape, 0.0 if type.dtype.is_floating else 0, type.dtype)

    # Small conveniences used by many rules.
    def mul(self, a: Value, b: Value) -> Value:
        return self.op("mul", a, b)

    def add(self, a: Value, b: Value) -> Value:
        return self.op("add", a, b)

    def sub(self, a: Value, b: Value) -> Value:
        return self.op("sub", a, b)

    def div(self, a: Value, b: Value) -> Value:
        return self.op("div", a, b)

    def neg(self, a: Value) -> Value:
        return self.op("neg", a)

    def cast(self, a: Value, dtype: DType) -> Value:
        return a if a.dtype == dtype else self.op("cast", a, dtype=dtype)

    def reshape(self, a: Value, shape: Sequence[int]) -> Value:
        return a if tuple(a.shape) == tuple(shape) else self.op("reshape", a, shape=tuple(shape))

    def sum(self, a: Value, dims: Sequence[int], keepdim: bool = False) -> Value:
        if not dims:
            return a
        return self.op("sum", a, dims=tuple(dims), keepdim=keepdim)

    def permute(self, a: Value, dims: Sequence[int]) -> Value:
        if tuple(dims) == tuple(range(len(dims))):
            return a
        return self.op("permute", a, dims=tuple(dims))

    def transpose(self, a: Value) -> Value:
        """Swap the last two axes."""
        r = a.type.rank
        return self.permute(a, (*range(r - 2), r - 1, r - 2))

    def where(self, cond: Value, a: Value, b: Value) -> Value:
        return self.op("where", cond, a, b)
