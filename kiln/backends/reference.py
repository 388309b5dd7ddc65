"""The reference executor: runs a graph node by node with each op's numpy reference.

It is the semantic ground truth other backends are tested against.  Guarantees:

* every result has exactly its IR type: each op's result is converted to the node's inferred
  dtype, and a result whose shape differs from the inferred one raises :class:`KilnError`
  naming the node (that is a kiln bug, in the op's inference or its reference);
* intermediate arrays are released after their last use;
* with ``float64=True`` (oracle mode) every floating-point value -- inputs, params,
  constants and every floating result -- is held in float64, so the graph is evaluated with
  float64 arithmetic throughout; floating outputs are then float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kiln.ir import DType, Graph, KilnError, Node, TensorType, Value
from kiln.ir.sizes import bind_sizes, concrete_attrs, concrete_type, has_sizes, specialize


def _check_operand(what: str, value: Value, array: np.ndarray, float64: bool,
                   want: TensorType | None = None) -> np.ndarray:
    array = np.asarray(array)
    if tuple(array.shape) != tuple((want or value.type).shape):
        raise KilnError(f"run_graph: {what} %{value.name} expects {value.type} but got an array "
                        f"of shape {tuple(array.shape)}; pass arrays matching the graph signature")
    want = value.dtype.numpy
    if array.dtype != want:
        raise KilnError(f"run_graph: {what} %{value.name} expects {value.type} but got dtype "
                        f"{array.dtype}; convert it with .astype({want.name!r})")
    return _widen(array, float64)


_FLOAT_DTYPES = frozenset(DType(d).numpy for d in ("f64", "f32", "f16", "bf16"))


def _widen(array: np.ndarray, float64: bool) -> np.ndarray:
    """``array`` in float64 when oracle mode is on and it is floating-point."""
    if float64 and array.dtype in _FLOAT_DTYPES:
        return array.astype(np.float64)
    return array


def _as_type(node: Node, index: int, result: object, want: TensorType, float64: bool) -> np.ndarray:
    array = np.asarray(result)
    if tuple(array.shape) != tuple(want.shape):
        raise KilnError(
            f"kiln bug: node %{node.outputs[index].name} = {node.op_name}(...) produced shape "
            f"{tuple(array.shape)} but its inferred type is {want}; the reference or the "
            f"inference rule of op '{node.op_name}' is wrong")
    if float64 and want.dtype.is_floating:
        return array.astype(np.float64, copy=False)
    return array.astype(want.dtype.numpy, copy=False)


def _last_uses(graph: Graph) -> dict[Node, list[Value]]:
    """For each node, the values whose last use it is (graph outputs are never freed)."""
    last: dict[Value, Node] = {}
    for node in graph.nodes:
        for v in node.inputs:
            last[v] = node
    keep = set(graph.outputs)
    frees: dict[Node, list[Value]] = {}
    for v, node in last.items():
        if v not in keep and v.origin == "result":
            frees.setdefault(node, []).append(v)
    return frees


def run_graph(graph: Graph, inputs: Sequence[np.ndarray], params: Sequence[np.ndarray], *,
              float64: bool = False, sizes: Mapping[str, int] | None = None) -> list[np.ndarray]:
    """Execute ``graph`` on numpy arrays; returns one array per graph output.

    ``inputs`` follow ``graph.inputs`` and ``params`` follow ``graph.params``; each must have
    exactly the declared shape and dtype.  A graph with symbolic shapes runs at the sizes
    the arrays' shapes give (bound and checked against ``graph.sizes`` with
    :func:`kiln.ir.sizes.bind_sizes`, or given as ``sizes``): every node's reference gets
    its attributes at those sizes.  See the module docstring for the guarantees and for
    ``float64`` oracle mode.
    """
    if len(inputs) != len(graph.inputs) or len(params) != len(graph.params):
        raise KilnError(f"run_graph: graph @{graph.name} takes {len(graph.inputs)} inputs and "
                        f"{len(graph.params)} params, got {len(inputs)} and {len(params)}")
    operands = (*graph.inputs, *graph.params)
    if sizes is None and any(not v.type.is_static for v in operands):
        arrays = [np.asarray(a) for a in (*inputs, *params)]
        sizes = bind_sizes([v.type for v in operands], [a.shape for a in arrays],
                           [f"{'input' if i < len(graph.inputs) else 'param'} %{v.name}" for i, v in enumerate(operands)],
                           graph.sizes)
    sizes = dict(sizes or {})
    bodies: dict[int, Graph] = {}
    env: dict[Value, np.ndarray] = {}
    for v, a in zip(graph.inputs, inputs):
        env[v] = _check_operand("input", v, a, float64, concrete_type(v.type, sizes))
    for v, a in zip(graph.params, params):
        env[v] = _check_operand("param", v, a, float64, concrete_type(v.type, sizes))
    for c in graph.constants:
        env[c] = _widen(c.data, float64)
    frees = _last_uses(graph)
    for node in graph.nodes:
        reference = node.op.reference
        if reference is None:
            raise KilnError(f"run_graph: op '{node.op_name}' has no reference implementation")
        attrs = node_attrs(node, sizes, bodies) if sizes else node.attrs
        result = reference(*(env[v] for v in node.inputs), **attrs)
        results = result if isinstance(result, tuple) else (result,)
        if len(results) != len(node.outputs):
            raise KilnError(f"kiln bug: op '{node.op_name}' returned {len(results)} results for "
                            f"{len(node.outputs)} declared ones")
        for i, (v, r) in enumerate(zip(node.outputs, results)):
            env[v] = _as_type(node, i, r, concrete_type(v.type, sizes) if sizes else v.type, float64)
        for v in frees.get(node, ()):
            del env[v]
    return [env[v] for v in graph.outputs]


def node_attrs(node: Node, sizes: Mapping[str, int], bodies: dict[int, Graph] | None = None) -> dict[str, Any]:
    """``node``'s attributes at concrete ``sizes``: symbolic sizes evaluated, and graph-valued
    attributes (a fused kernel's body) with symbolic types specialized (cached in ``bodies``
    by the graph's identity)."""
    attrs = concrete_attrs(node.attrs, sizes) if any(has_sizes(v) for v in node.attrs.values()) else node.attrs
    for k, v in attrs.items():
        if isinstance(v, Graph) and _symbolic(v):
            if bodies is None:
                bodies = {}
            body = bodies.get(id(v))
            if body is None:
                body = bodies[id(v)] = specialize(v, sizes)
            attrs = {**attrs, k: body}
    return attrs


def _symbolic(graph: Graph) -> bool:
    if any(not v.type.is_static for v in (*graph.inputs, *graph.params)):
        return True
    return any(any(has_sizes(a) for a in n.attrs.values()) or any(not v.type.is_static for v in n.outputs)
               for n in graph.nodes)


__all__ = ["node_attrs", "run_graph"]
