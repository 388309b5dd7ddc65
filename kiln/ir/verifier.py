"""The graph verifier: checks the invariants every pass must preserve.

The builders (``Graph.add_node`` and friends) make ill-formed graphs impossible to build, but
passes edit graphs in place (``node.inputs = ...``, reordering ``graph.nodes``), so a pass
manager runs :func:`verify` after each pass.  It raises :class:`VerificationError` for the
FIRST violation found, in this order:

1. value names are unique, and inputs, params and constants are recorded as such;
2. constants' data has exactly their declared dtype and shape;
3. for each node, in order: its op is the registered :class:`OpDef` of that name; every
   operand is a value defined earlier in the graph (no use before definition); its
   attributes match the op's schema; graph-valued attributes verify (recursively);
   inference on the operand types gives exactly the recorded result types; each result
   points back to the node with its index;
4. every graph output is defined in the graph.

Messages name the node (result names and op, plus its position), the operand or result
position, what was found and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import OpTypeError, VerificationError
from .graph import Graph, Node, Value
from .registry import get_op, has_op
from .types import DType, TensorType

__all__ = ["verify"]


def verify(graph: Graph) -> None:
    """Raise :class:`VerificationError` describing the first violated invariant of ``graph``."""
    if not isinstance(graph, Graph):
        raise TypeError(f"verify expects a kiln.ir.Graph, got {type(graph).__name__}")
    _verify_graph(graph, where=f"graph @{graph.name}")


def _verify_graph(graph: Graph, where: str) -> None:
    _check_names(graph, where)
    _check_definitions(graph, where)
    defined: set[Value] = set(graph.inputs) | set(graph.params) | set(graph.constants)
    later = {v: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    for index, node in enumerate(graph.nodes):
        _check_node(node, index, defined, later, where)
        defined.update(node.outputs)
    for i, v in enumerate(graph.outputs):
        if v not in defined:
            raise VerificationError(
                f"{where}: output {i} ({_name(v)}) is not defined in this graph; "
                "outputs must be inputs, params, constants or node results of the same graph"
            )


def _check_names(graph: Graph, where: str) -> None:
    seen: dict[str, str] = {}
    for v in _all_values(graph):
        if v.name in seen:
            raise VerificationError(
                f"{where}: value name %{v.name} is defined twice (as {seen[v.name]} and as "
                f"{_role(v)}); value names must be unique"
            )
        seen[v.name] = _role(v)


def _all_values(graph: Graph) -> Iterable[Value]:
    yield from graph.inputs
    yield from graph.params
    yield from graph.constants
    for n in graph.nodes:
        yield from n.outputs


def _check_definitions(graph: Graph, where: str) -> None:
    for kind, values in (("input", graph.inputs), ("param", graph.params), ("const", graph.constants)):
        for v in values:
            if v.origin != kind or v.producer is not None:
                raise VerificationError(
                    f"{where}: %{v.name} is listed among the {kind}s but is recorded as "
                    f"kind '{v.origin}'" + (f" produced by {v.producer!r}" if v.producer else "")
                )
            if not isinstance(v.type, TensorType):
                raise VerificationError(f"{where}: %{v.name} has type {v.type!r}, expected a TensorType")
    for c in graph.constants:
        if c.data is None:
            raise VerificationError(f"{where}: constant %{c.name}: {c.type} has no data")
        got = f"{_dtype_name(c.data.dtype)}[{', '.join(map(str, c.data.shape))}]"
        if c.data.shape != c.type.shape or _dtype_name(c.data.dtype) != c.type.dtype.short:
            raise VerificationError(
                f"{where}: constant %{c.name}: data is {got}, expected {c.type} as declared"
            )


def _dtype_name(dt: Any) -> str:
    try:
        return DType.from_numpy(dt).short
    except ValueError:
        return f"numpy {dt}"


def _check_node(node: Node, index: int, defined: set[Value], later: dict[Value, int], where: str) -> None:
    what = f"{where}: node #{index} ({_node_text(node)})"
    name = getattr(node.op, "name", None)
    if not isinstance(name, str) or not has_op(name):
        raise VerificationError(
            f"{what}: op {name!r} is not registered; declare it with kiln.ir.defop"
        )
    if get_op(name) is not node.op:
        raise VerificationError(
            f"{what}: op '{name}' is a different OpDef than the registered one; "
            "build nodes with kiln.ir.get_op(name)"
        )
    for i, v in enumerate(node.inputs):
        if not isinstance(v, Value):
            raise VerificationError(f"{what}: operand {i} is a {type(v).__name__}, expected a Value")
        if v in defined:
            continue
        if v in later:
            raise VerificationError(
                f"{what}: use before definition: operand {i} ({_name(v)}) is defined by node "
                f"#{later[v]}, after its use; expected a value defined earlier (try graph.sort())"
            )
        raise VerificationError(
            f"{what}: operand {i} ({_name(v)}) is not defined in this graph; expected an input, "
            "param, constant or earlier node result of the same graph"
        )
    _check_attrs(node, what)
    for key, value in node.attrs.items():  # inference may read a subgraph: check it first
        for j, sub in enumerate(_graphs_in(value)):
            _verify_graph(sub, where=f"{what}: attribute '{key}' graph {j} @{sub.name}")
    input_types = [v.type for v in node.inputs]
    try:
        inferred = node.op.infer_types(input_types, node.attrs)
    except OpTypeError as e:
        raise VerificationError(f"{what}: inference rejects the node: {e}") from None
    if len(inferred) != len(node.outputs):
        raise VerificationError(
            f"{what}: type mismatch: {len(node.outputs)} result(s) recorded, expected "
            f"{len(inferred)} from inference ({', '.join(map(str, inferred))})"
        )
    for i, (v, expected) in enumerate(zip(node.outputs, inferred)):
        if v.type != expected:
            operands = ", ".join(map(str, input_types))
            raise VerificationError(
                f"{what}: type mismatch: result {i} ({_name(v)}) has type {v.type}, expected "
                f"{expected} (inferred from operands {operands or 'none'})"
            )
        if v.producer is not node or v.index != i or v.origin != "result":
            raise VerificationError(
                f"{what}: result {i} ({_name(v)}) records producer {v.producer!r}, index {v.index}, "
                f"kind '{v.origin}'; expected this node, index {i}, kind 'result'"
            )


def _check_attrs(node: Node, what: str) -> None:
    schema = node.op.attrs
    unknown = sorted(set(node.attrs) - set(schema))
    if unknown:
        raise VerificationError(
            f"{what}: bad attribute: unknown attribute(s) {unknown}; expected only "
            f"{sorted(schema) or 'none'}"
        )
    for key, spec in schema.items():
        if key not in node.attrs:
            raise VerificationError(
                f"{what}: bad attribute: '{key}' is missing; expected a {spec.kind} "
                "(nodes built with Graph.add_node carry every attribute, defaults included)"
            )
        value = node.attrs[key]
        if not spec.required and _same_default(spec.default, value):
            continue
        try:
            spec.coerce(node.op.name, key, value)
        except OpTypeError as e:
            raise VerificationError(f"{what}: bad attribute: {e}") from None


def _same_default(default: Any, value: Any) -> bool:
    if default is value:
        return True
    try:
        return type(default) is type(value) and bool(default == value)
    except Exception:  # noqa: BLE001  (exotic attribute values may not compare)
        return False


def _graphs_in(value: Any) -> Iterable[Graph]:
    if isinstance(value, Graph):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _graphs_in(item)


def _node_text(node: Node) -> str:
    outs = ", ".join(_name(v) for v in node.outputs)
    op = node.op.name if hasattr(node.op, "name") else repr(node.op)
    return f"{outs} = {op}" if outs else op


def _name(v: Any) -> str:
    return f"%{v.name}" if isinstance(v, Value) else repr(v)


def _role(v: Value) -> str:
    if v.origin == "result" and v.producer is not None:
        return f"result {v.index} of {v.producer.op_name}"
    return {"input": "an input", "param": "a param", "const": "a constant"}.get(v.origin, v.origin)
