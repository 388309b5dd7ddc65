"""Ops that exist only after graph passes: fused kernels and composite-only ops.

``fused(*operands) {template, body}`` is one kernel.  ``body`` is a graph with inputs only (no
params; constants and creation ops allowed inside) whose inputs take the operands in order
and whose outputs are the node's results.  ``template`` names the kernel template a backend
should use: ``elementwise``, ``reduction``, ``matmul``, ``conv`` or ``opaque``.  The
``fuse`` pass (:mod:`kiln.passes.fusion`) builds these nodes; the text form prints the body
inline::

    %3: f32[2, 8] = fused(%x, %w, %b) {template="matmul", body=graph @matmul_0(%x: f32[2, 4], ...) {
        %1: f32[2, 8] = matmul(%x, %w)
        %3: f32[2, 8] = add(%1, %b)
        return %3
      }}

``silu_mul(a, b)`` is ``silu(a) * b`` with broadcasting: the gate of a SiLU-gated MLP
(``silu(x @ W1) * (x @ W3)``).  The ``composites`` pass (:mod:`kiln.passes.composites`)
produces it; it is elementwise, so fusion folds it into the epilogue of a matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.special

from ..graph import Graph, Value
from ..registry import Attr, defop
from ..types import DType, TensorType
from ._infer import broadcast_float
from .compute import (
    broadcast_index,
    call,
    compute_graph,
    const,
    defcompute,
    float_compute_dtype,
)
from .cost import per_element
from .vjp import defvjp, unbroadcast

FUSED_TEMPLATES = ("elementwise", "reduction", "matmul", "conv", "opaque")
"""Kernel templates a ``fused`` node may ask for."""


def _fused_infer(types: Sequence[TensorType], *, template: str, body: Graph) -> tuple[TensorType, ...]:
    if template not in FUSED_TEMPLATES:
        raise ValueError(f"template {template!r} is not one of {', '.join(FUSED_TEMPLATES)}")
    if body.params:
        names = ", ".join(f"%{p.name}" for p in body.params)
        raise ValueError(f"body @{body.name} has params ({names}); pass them as operands instead")
    if len(types) != len(body.inputs):
        raise ValueError(f"body @{body.name} takes {len(body.inputs)} inputs, "
                         f"got {len(types)} operands")
    for i, (t, v) in enumerate(zip(types, body.inputs)):
        if t != v.type:
            raise ValueError(f"operand {i} is {t} but body input %{v.name} is {v.type}")
    if not body.outputs:
        raise ValueError(f"body @{body.name} returns nothing")
    return tuple(v.type for v in body.outputs)


def run_body(body: Graph, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run ``body`` on ``arrays`` with the registry's reference implementations.

    Every result is cast to its inferred dtype, so results have exactly the IR types.  When
    float operands arrive as float64 although the body declares a narrower float type (the
    float64 oracle mode of the reference executor), float values stay float64 throughout.
    """
    oracle = any(
        a.dtype == np.float64 and v.dtype.is_floating and v.dtype != DType.float64
        for a, v in zip(arrays, body.inputs)
    )
    env: dict[Value, np.ndarray] = dict(zip(body.inputs, arrays))
    for c in body.constants:
        env[c] = _as_type(c.data, c.type, oracle)
    for node in body.nodes:
        result = node.op.reference(*(env[v] for v in node.inputs), **node.attrs)
        results = result if isinstance(result, tuple) else (result,)
        for value, array in zip(node.outputs, results):
            env[value] = _as_type(np.asarray(array), value.type, oracle)
    return [env[v] for v in body.outputs]


def _as_type(array: np.ndarray, type: TensorType, oracle: bool) -> np.ndarray:
    if oracle and type.dtype.is_floating:
        return array.astype(np.float64, copy=False)
    return array.astype(type.dtype.numpy, copy=False)


@defop(
    "fused",
    infer=_fused_infer,
    attrs={"template": Attr("str"), "body": Attr("graph")},
    num_inputs=(0, None),
)
def fused(*arrays: np.ndarray, template: str, body: Graph) -> Any:
    """Run the kernel's body graph on the operands; one array per body output."""
    results = run_body(body, arrays)
    return results[0] if len(results) == 1 else tuple(results)


def _decompose_silu_mul(builder, node):
    """``silu(a) * b``."""
    a, b = node.inputs
    return [builder.mul(builder.op("silu", a), b)]


@defop("silu_mul", infer=broadcast_float, num_inputs=2, traits=("elementwise",),
       decompose=_decompose_silu_mul, cost=per_element(7))
def silu_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``silu(a) * b`` elementwise with broadcasting (half precision computed in float32)."""
    lowp = (np.float16, np.dtype("bfloat16"))
    a = a.astype(np.float32) if a.dtype in lowp else a
    b = b.astype(np.float32) if b.dtype in lowp else b
    return a * scipy.special.expit(a) * b


@defvjp("silu_mul")
def _silu_mul_vjp(builder, inputs, outputs, cotangents, attrs):
    """``d/da = g * b * silu'(a)``, ``d/db = g * silu(a)``, summed over broadcast axes."""
    (a, b), g = inputs, cotangents[0]
    s = builder.op("sigmoid", a)
    one = builder.const(1.0, s)
    dsilu = builder.mul(s, builder.add(one, builder.mul(a, builder.sub(one, s))))
    da = unbroadcast(builder, builder.mul(g, builder.mul(b, dsilu)), a) if a.dtype.is_floating else None
    db = unbroadcast(builder, builder.mul(g, builder.mul(a, s)), b) if b.dtype.is_floating else None
    return [da, db]


# --------------------------------------------------------------- compute rules (lowering)
@defcompute("fused")
def _fused_compute(ctx, *inputs, template, body):
    """The body's nodes, each by its own rule; producers inline into consumers."""
    return tuple(compute_graph(ctx.builder, body, inputs))


@defcompute("silu_mul")
def _silu_mul_compute(ctx, a, b):
    t = float_compute_dtype(ctx.out.dtype)

    def element(i):
        x = a.at(broadcast_index(i, a.shape), t)
        return x / (const(1, t) + call("exp", -x)) * b.at(broadcast_index(i, b.shape), t)

    return ctx.tensor(ctx.out_shape, ctx.out.dtype, element)
