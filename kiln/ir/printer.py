"""Canonical text form of the graph IR. :mod:`kiln.ir.parser` reads it back exactly.

::

    graph @mlp(%x: f32[2, 64]) params(%fc1.weight: f32[128, 64]) {
      %c: f32[] = const 0.5
      %0: f32[64, 128] = permute(%fc1.weight) {dims=[1, 0]}
      %1: f32[2, 128] = matmul(%x, %0)
      %2: f32[2, 128] = mul(%1, %c)
      return %2
    }

Attributes equal to their declared default are omitted.  Constants with at most
``INLINE_LIMIT`` elements print as a flat list of values; larger ones as the hex of their
little-endian bytes, so the text always round-trips exactly.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from .types import DType, SymDim

INLINE_LIMIT = 32

PLAIN_GRAPH_NAME = re.compile(r"[A-Za-z0-9_.]+")
"""Graph names printed bare after ``@``; any other name is printed JSON-quoted."""

PLAIN_VALUE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|[0-9]+")
"""Value names printed bare after ``%``; any other name (names are data: ``0.weight``,
``blocks.a-b``, unicode) is printed JSON-quoted, ``%"0.weight"``."""


def format_value_name(name: str) -> str:
    """``%name`` as the text form writes it."""
    return f"%{name}" if PLAIN_VALUE_NAME.fullmatch(name) else f"%{json.dumps(name)}"


def format_scalar(x: Any, dtype: DType) -> str:
    if dtype == DType.bool:
        return "true" if bool(x) else "false"
    if dtype.is_integer:
        return str(int(x))
    f = float(x)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    text = str(dtype.numpy.type(x))  # shortest text that round-trips in that dtype
    if not any(c in text for c in ".enN"):
        text += ".0"
    return text


def format_const(data: np.ndarray, dtype: DType) -> str:
    if data.ndim == 0:
        return format_scalar(data[()], dtype)
    if data.size <= INLINE_LIMIT:
        return "[" + ", ".join(format_scalar(x, dtype) for x in data.reshape(-1)) + "]"
    raw = np.ascontiguousarray(data).astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
    return f'hex"{raw.hex()}"'


def format_attr(value: Any, indent: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, DType):
        return value.short
    if isinstance(value, SymDim):
        return f"size({value})"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(float(value))  # numpy float64 subclasses float but reprs differently
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(format_attr(v, indent) for v in value) + "]"
    if type(value).__name__ == "Graph":
        return format_graph(value, indent=indent)
    raise TypeError(f"attribute value {value!r} has no text form")


def format_graph_name(name: str) -> str:
    return name if PLAIN_GRAPH_NAME.fullmatch(name) else json.dumps(name)


def format_graph(graph, indent: str = "", locs: bool = False) -> str:
    inner = indent + "  "
    sig = ", ".join(f"{format_value_name(v.name)}: {v.type}" for v in graph.inputs)
    head = f"graph @{format_graph_name(graph.name)}({sig})"
    if graph.params:
        head += " params(" + ", ".join(f"{format_value_name(v.name)}: {v.type}" for v in graph.params) + ")"
    if graph.sizes:
        head += " sizes(" + ", ".join(f"{n}: {r}" for n, r in sorted(graph.sizes.items())) + ")"
    lines = [head + " {"]
    for c in graph.constants:
        lines.append(f"{inner}{format_value_name(c.name)}: {c.type} = const {format_const(c.data, c.dtype)}")
    for n in graph.nodes:
        outs = ", ".join(f"{format_value_name(v.name)}: {v.type}" for v in n.outputs)
        args = ", ".join(format_value_name(v.name) for v in n.inputs)
        text = f"{inner}{outs} = {n.op_name}({args})"
        defaults = n.op.default_attrs()
        shown = [(k, v) for k, v in n.attrs.items() if k not in defaults or not _same(defaults[k], v)]
        if shown:
            text += " {" + ", ".join(f"{k}={format_attr(v, inner)}" for k, v in shown) + "}"
        if locs and n.loc:
            text += f"  # {n.loc}"
        lines.append(text)
    ret = ", ".join(format_value_name(v.name) for v in graph.outputs)
    lines.append(f"{inner}return {ret}".rstrip())
    lines.append(indent + "}")
    return "\n".join(lines)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b
