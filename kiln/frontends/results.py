"""The check every frontend makes of a rule's result against the framework's own type."""

from __future__ import annotations

from kiln.ir import Graph, TensorType, Value

from .errors import CaptureError


def match_result(graph: Graph, value: Value, want: TensorType, what: str, framework: str,
                 loc: str | None) -> Value:
    """``value``, cast to ``want``'s dtype when only the dtype differs; a shape that differs
    is a kiln bug, reported for ``what`` (``ATen op aten.add.Tensor(f32[2])``) against what
    ``framework`` computes."""
    if tuple(value.shape) != want.shape:
        raise CaptureError(
            f"kiln's lowering of {what} has type {value.type}, but {framework} computes {want}\n"
            f"  at {loc or '<unknown source line>'}\n  This is a kiln bug; please report it.")
    if value.dtype != want.dtype:
        value = graph.op("cast", value, loc=loc, dtype=want.dtype)
    return value


__all__ = ["match_result"]
