"""FX nodes to kiln nodes: the machinery under :mod:`kiln.frontends.torch.capture`.

:class:`Lowerer` walks the ``call_function`` nodes of one ATen-level FX graph and calls each
node's rule (:mod:`kiln.frontends.torch.aten`) with a
:class:`~kiln.frontends.torch.aten.LoweringContext`, checking every result against the type
PyTorch computed (a ``cast`` where only the dtype differs; a shape difference raises
:class:`~kiln.frontends.errors.CaptureError`).  Dead nodes are skipped, but a node that
writes in place is always lowered or refused (:func:`is_mutating`).  Also here: the
helpers capture uses around it -- placeholder types and names, tensor constants
(:func:`to_numpy`), buffer- and input-update outputs (:func:`add_buffer_updates`), the
random seed param (:func:`bind_seed`) and the effect tokens of ignored checks
(:func:`drop_effect_tokens`).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

from kiln.frontends.errors import CaptureError, UnsupportedOpError
from kiln.frontends.results import match_result
from kiln.ir import Graph, OpTypeError, TensorType, Value
from kiln.ir.names import claim_name
from kiln.ir.ops.random import RNG_SEED_PARAM
from kiln.runtime.module import BUFFER_UPDATE_PREFIX, INPUT_UPDATE_PREFIX

from .aten import IGNORED_OPS, LoweringContext, rule_for, tensor_type
from .symbolic import to_dim
from .aten_support import (
    bad_value,
    bind_arguments,
    describe_inputs,
    describe_value,
    is_size_node,
    source_location,
    unsupported_reason,
)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class Lowerer:
    """Lowers the call_function nodes of one FX graph into a kiln graph."""

    def __init__(self, graph: Graph, fx_graph: torch.fx.Graph):
        self.graph = graph
        self.env: dict[torch.fx.Node, Any] = {}
        self.live = _live_nodes(fx_graph)

    def bind(self, node: torch.fx.Node, value: Value) -> None:
        self.env[node] = value

    def lower_all(self, fx_graph: torch.fx.Graph) -> None:
        for node in fx_graph.nodes:
            if node.op == "call_function":
                self.lower(node)

    def value(self, arg: Any) -> Any:
        """An FX argument with nodes replaced by their kiln values (lists mapped through)."""
        if isinstance(arg, torch.fx.Node):
            return self.env[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.value(a) for a in arg)
        return arg

    def lower(self, node: torch.fx.Node) -> None:
        if node not in self.live:  # dead code (make_fx keeps it); writes are always live
            self.env[node] = None
            return
        loc = source_location(node)
        reason = unsupported_reason(node)
        if reason is not None:
            raise UnsupportedOpError(str(node.target), describe_inputs(node), loc, reason)
        if node.target in IGNORED_OPS:
            self.env[node] = None
            return
        if is_size_node(node):  # a size, not a tensor: bind the kiln size itself
            val = node.meta["val"]
            self.env[node] = None if isinstance(val, torch.SymBool) else to_dim(val)
            return
        if node.target is operator.getitem:
            self.env[node] = self._getitem(node, loc)
            return
        ctx = LoweringContext(self.graph, node, loc)
        args = [self.value(a) for a in bind_arguments(node)]
        try:
            result = rule_for(node.target).lower(ctx, *args)
        except (OpTypeError, ValueError, TypeError) as e:
            raise CaptureError(
                f"kiln failed to lower ATen op {node.target}({describe_inputs(node)}): {e}\n"
                f"  at {loc or '<unknown source line>'}\n  This is a kiln bug; please report it "
                "with the op and operand types above.") from e
        if isinstance(result, Value):
            result = self._match_meta(node, result, node.meta.get("val"), loc)
        self.env[node] = result

    def _getitem(self, node: torch.fx.Node, loc: str | None) -> Value:
        source, index = node.args
        results = self.env[source]
        entry = results[index]
        if callable(entry) and not isinstance(entry, Value):
            entry = entry()
            results = list(results)
            results[index] = entry
            self.env[source] = tuple(results)
        return self._match_meta(node, entry, node.meta.get("val"), loc)

    def _match_meta(self, node: torch.fx.Node, value: Value, expected: Any, loc: str | None) -> Value:
        """Check ``value`` against PyTorch's result; cast when only the dtype differs."""
        if not isinstance(expected, torch.Tensor):
            return value
        return match_result(self.graph, value, tensor_type(expected),
                            f"ATen op {node.target}({describe_inputs(node)})", "PyTorch", loc)

    def output(self, node: torch.fx.Node, arg: Any, what: str) -> Value:
        if not isinstance(arg, torch.fx.Node) or not isinstance(self.env.get(arg), Value):
            raise UnsupportedOpError(
                "output", describe_value(arg), source_location(node),
                f"{what} is {describe_value(arg)}, not a tensor; kiln graphs return tensors only",
                hint="Return only tensors from the captured function (wrap the model if needed).")
        return self.env[arg]


def _live_nodes(fx_graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes the output depends on, and every call that writes in place (with what it
    reads): a write is an effect even when nothing uses its result, so it is lowered -- its
    rule decides whether the write is unobservable (:mod:`kiln.frontends.torch.aten_inplace`) -- or
    refused, never dropped."""
    live: set[torch.fx.Node] = set()
    for node in reversed(fx_graph.nodes):
        if node.op == "output" or is_mutating(node) or any(user in live for user in node.users):
            live.add(node)
    return live


def is_mutating(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls an op whose schema writes one of its arguments."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def fresh_name(name: str, used: set[str]) -> str:
    """A valid, unused kiln value name close to ``name``."""
    base = re.sub(r"[^A-Za-z0-9_.]", "_", name)
    if not re.match(r"^[A-Za-z_]", base):
        base = "v_" + base
    return claim_name(base, used)


_STATIC_HINT = ("Pass inputs whose shapes follow from the input shapes and whose dtypes kiln has "
                "(f32, f16, bf16, f64, integers, bool).")


def placeholder_type(node: torch.fx.Node) -> TensorType:
    val = node.meta.get("val")
    reason = bad_value(val)
    if reason:
        raise UnsupportedOpError("placeholder", describe_value(val), None, f"input '{node.name}': {reason}",
                                 hint=_STATIC_HINT)
    return tensor_type(val)


def drop_effect_tokens(fx_graph: torch.fx.Graph) -> None:
    """torch.export threads an effect token (a TOKEN input and output) through calls of ops
    with side effects, wrapped in ``with_effects``.  The only such ops kiln meets are checks
    it ignores (:data:`IGNORED_OPS`, e.g. ``_linalg_check_errors`` of a factorization):
    their calls are dropped and the token passes through, so the TOKEN input and output are
    unused and skipped.  A ``with_effects`` call of any other op stays, and is refused."""
    effects = getattr(torch.ops.higher_order, "with_effects", None)
    for node in list(fx_graph.nodes):
        if node.op != "call_function" or node.target is not effects or node.args[1] not in IGNORED_OPS:
            continue
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(node.args[0])
                fx_graph.erase_node(user)
        if not node.users:
            fx_graph.erase_node(node)


def add_buffer_updates(graph: Graph, updates: Sequence[tuple[Value, str]],
                       prefix: str = BUFFER_UPDATE_PREFIX) -> None:
    """Append the new value of each updated buffer (graph param name) to ``graph``'s
    outputs, named ``buffer_update.<param>`` (:func:`kiln.runtime.buffer_updates` reads the
    names back, also from a graph parsed from text); with ``prefix=INPUT_UPDATE_PREFIX``,
    the same for updated graph inputs.  An update that returns the value itself changes
    nothing and is dropped."""
    outputs = list(graph.outputs)
    for value, param in updates:
        if value.origin in ("param", "input") and value.name == param:
            continue
        name = prefix + param
        if value.origin != "result" or value in outputs or value.name.startswith((BUFFER_UPDATE_PREFIX,
                                                                                 INPUT_UPDATE_PREFIX)):
            value = graph.op("reshape", value, shape=tuple(value.shape))  # a value of its own
        graph._names.discard(value.name)
        value.name = graph._claim(name)
        outputs.append(value)
    graph.set_outputs(outputs)


def bind_seed(graph: Graph, params: dict[str, torch.Tensor]) -> None:
    """Give the random ops' seed param (added by the dropout rules) a tensor of its own;
    the runtime refills it before every call."""
    for value in graph.params:
        if value.name == RNG_SEED_PARAM and value.name not in params:
            params[value.name] = torch.zeros((), dtype=torch.int64)
