"""Symbolic sizes at run time: binding them from actual shapes, checking their ranges, and
substituting them into shapes, attributes and whole graphs.

A graph with symbolic shapes (:class:`~kiln.ir.types.SymDim`) is compiled once.  Each call
binds its named sizes from the shapes of the actual inputs (:func:`bind_sizes`), checks them
against the graph's recorded ranges (``Graph.sizes``), and runs with those values: kernels
take them as arguments, and reference implementations get attributes with the sizes
substituted (:func:`concrete_attrs`).  :func:`specialize` makes the static graph of one set
of sizes (used where a static variant measures faster, and by tests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sympy

from .errors import KilnError
from .types import SizeRange, SymDim, TensorType, as_dim, evaluate_shape, size_symbol, sizes_of

Sizes = dict[str, int]


class SizeError(KilnError):
    """An actual shape does not fit the symbolic shape a graph was compiled for."""


def graph_sizes(graph) -> frozenset[str]:
    """The named sizes of the shapes of ``graph``'s inputs and params."""
    out: set[str] = set()
    for v in (*graph.inputs, *graph.params):
        out |= sizes_of(v.type.shape)
    return frozenset(out)


def is_dynamic(graph) -> bool:
    """Whether ``graph`` has a symbolic input or param shape."""
    return any(not v.type.is_static for v in (*graph.inputs, *graph.params))


def bind_sizes(types: Sequence[TensorType], shapes: Sequence[Sequence[int]], names: Sequence[str],
               ranges: Mapping[str, SizeRange] | None = None) -> Sizes:
    """The value of every named size of ``types`` given the actual ``shapes`` (one per type;
    ``names`` name the operands in errors).  A size is read from the first axis where it
    appears alone; derived sizes (``2*seq``) are solved from their axis when no axis holds
    the name alone.  Every axis is then checked: static sizes must match exactly, symbolic
    ones must evaluate to the actual size, and every named size must lie in its range."""
    ranges = ranges or {}
    sizes: Sizes = {}
    pending: list[tuple[SymDim, int, str]] = []
    for t, shape, name in zip(types, shapes, names):
        if len(shape) != t.rank:
            raise SizeError(f"{name}: expected a rank-{t.rank} tensor {t}, got shape {list(shape)}")
        for axis, (d, n) in enumerate(zip(t.shape, shape)):
            where = f"{name} axis {axis}"
            if isinstance(d, SymDim):
                if d.is_symbol:
                    known = sizes.setdefault(d.name, int(n))
                    if known != n:
                        raise SizeError(f"size {d.name} is {known} but {where} has {n}; "
                                        f"the symbolic shape {t} needs equal sizes there")
                else:
                    pending.append((d, int(n), where))
            elif d != n:
                raise SizeError(f"{where} has size {n}, but the graph was compiled for a static {d} "
                                f"(type {t}); mark that axis dynamic to vary it")
    for d, n, where in pending:  # derived sizes: solve the ones with a single unknown
        unknown = d.symbols - sizes.keys()
        if len(unknown) == 1:
            (u,) = unknown
            sym = size_symbol(u)
            expr = d.expr.subs({size_symbol(k): v for k, v in sizes.items() if k in d.symbols})
            roots = [r for r in sympy.solve(sympy.Eq(expr, n), sym) if r.is_Integer and r > 0]
            if not roots:
                raise SizeError(f"{where} has size {n}, which is no value of {d} (from a positive "
                                f"integer {u})")
            sizes[u] = int(roots[0])
    for d, n, where in pending:
        missing = d.symbols - sizes.keys()
        if missing:
            raise SizeError(f"{where}: size {d} cannot be solved for {', '.join(sorted(missing))}")
        if d.evaluate(sizes) != n:
            raise SizeError(f"{where} has size {n}, but {d} is {d.evaluate(sizes)} at "
                            f"{format_sizes(sizes)}")
    for name, value in sizes.items():
        r = ranges.get(name, SizeRange())
        if value not in r:
            raise SizeError(f"size {name} = {value} is outside its range {r}"
                            + (" (sizes 0 and 1 are specialized: compile a static graph for them)"
                               if value < 2 and r.lo >= 2 else "")
                            + "; recompile with a wider range (e.g. Dim(..., max=...)) to accept it")
    return sizes


def format_sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items()))


def concrete(value: Any, sizes: Mapping[str, int]) -> Any:
    """``value`` (a dim, or a list/tuple/dict of attribute values) with every symbolic size
    evaluated at ``sizes``."""
    if isinstance(value, SymDim):
        return value.evaluate(dict(sizes))
    if isinstance(value, tuple):
        return tuple(concrete(v, sizes) for v in value)
    if isinstance(value, list):
        return [concrete(v, sizes) for v in value]
    if isinstance(value, dict):
        return {k: concrete(v, sizes) for k, v in value.items()}
    return value


def has_sizes(value: Any) -> bool:
    """Whether an attribute value holds a symbolic size."""
    if isinstance(value, SymDim):
        return True
    if isinstance(value, (tuple, list)):
        return any(has_sizes(v) for v in value)
    if isinstance(value, dict):
        return any(has_sizes(v) for v in value.values())
    return False


def concrete_attrs(attrs: Mapping[str, Any], sizes: Mapping[str, int]) -> dict[str, Any]:
    """``attrs`` with their symbolic sizes evaluated (graph-valued attributes unchanged)."""
    return {k: concrete(v, sizes) if has_sizes(v) else v for k, v in attrs.items()}


def concrete_type(t: TensorType, sizes: Mapping[str, int]) -> TensorType:
    return t if t.is_static else t.with_shape(evaluate_shape(t.shape, dict(sizes)))


def specialize(graph, sizes: Mapping[str, int]):
    """The static graph of ``graph`` at ``sizes``: every type and attribute evaluated.  The
    nodes are rebuilt through ``add_node``, so inference re-checks each one."""
    from .graph import Graph

    g = Graph(graph.name)
    vmap: dict = {}
    for v in graph.inputs:
        vmap[v] = g.add_input(v.name, concrete_type(v.type, sizes))
    for v in graph.params:
        vmap[v] = g.add_param(v.name, concrete_type(v.type, sizes))
    for c in graph.constants:
        vmap[c] = g.add_constant(c.data, c.dtype, c.name, dedup=False)
    for n in graph.nodes:
        attrs = concrete_attrs(n.attrs, sizes)
        attrs = {k: specialize(v, sizes) if type(v).__name__ == "Graph" else v for k, v in attrs.items()}
        new = g.add_node(n.op, [vmap[v] for v in n.inputs], attrs, names=[v.name for v in n.outputs],
                         loc=n.loc)
        vmap.update(zip(n.outputs, new.outputs))
    g.set_outputs([vmap[v] for v in graph.outputs])
    return g


TYPICAL_SIZE = 64
"""The value an unbounded named size takes in cost estimates (:func:`estimated_nbytes`)."""


def estimated_nbytes(t: TensorType, ranges: Mapping[str, SizeRange] | None = None) -> int:
    """Bytes of ``t``.  A symbolic shape is evaluated with each named size at the top of its
    range in ``ranges`` (or at :data:`TYPICAL_SIZE` when it is unbounded or not given): an
    estimate for cost decisions and reports, exact for a static shape."""
    if t.is_static:
        return t.nbytes
    ranges = ranges or {}
    sizes = {}
    for name in sizes_of(t.shape):
        r = ranges.get(name)
        sizes[name] = r.hi if r is not None and r.hi is not None else max(TYPICAL_SIZE, r.lo if r else 0)
    return concrete_type(t, sizes).nbytes


def dim_of(value: Any):
    """A ``Dim`` from an int, a SymDim or a sympy expression of named sizes."""
    return as_dim(value)


__all__ = ["SizeError", "Sizes", "bind_sizes", "concrete", "concrete_attrs", "concrete_type", "dim_of",
           "estimated_nbytes", "format_sizes", "graph_sizes", "has_sizes", "is_dynamic", "specialize"]
