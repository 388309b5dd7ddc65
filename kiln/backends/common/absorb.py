"""Strided views read by generated kernels are absorbed into the kernels, not copied.

A loop kernel reads its inputs as contiguous arrays.  When an input is a strided view of a
contiguous value (a ``permute`` of a matrix, a ``slice`` of the last axis, the NCHW view of
a channels-last convolution result), :func:`absorb_views` rewrites the kernel's node into a
``fused`` node whose body starts with the same view ops applied to the contiguous value.
Lowering turns those views into index arithmetic (their compute definitions), so the
kernel reads the original memory directly: one pass instead of a copy and a pass.

Only views made by graph view ops (or by the backend's own ``permute`` of a channels-last
result) are absorbed; what cannot be absorbed is still copied by the partition
(:mod:`.partition`).

:func:`permute_result` is the converse: a kernel writes its result in another memory order
(channels-last, for the channels-last convolutions that read it), and its consumers see the
usual order through a view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.ir import Graph, Node, Value

if TYPE_CHECKING:
    from .partition import PlanOp, PlanValue


def view_chain(pv: PlanValue) -> tuple[PlanValue, list[Node]] | None:
    """The nearest contiguous ancestor of the strided view ``pv`` and the view nodes leading
    from it to ``pv`` (in order), or ``None`` when ``pv`` is contiguous or not a chain of
    graph views."""
    chain: list[Node] = []
    v = pv
    while not v.meta.is_contiguous():
        if v.origin != "view" or v.view_node is None or v.base is None:
            return None
        chain.append(v.view_node)
        v = v.base
    return (v, chain[::-1]) if chain else None


def absorb_views(op: PlanOp) -> bool:
    """Absorb the strided view inputs of kernel ``op`` (see the module docstring); returns
    whether ``op`` changed.  For a GEMM kernel only the epilogue's inputs are considered."""
    node = op.node
    if node is None:
        return False
    gemm = op.gemm is not None
    operands: list[PlanValue | None] = [None, *op.inputs[2:]] if gemm else list(op.inputs)
    chains = [view_chain(pv) if pv is not None else None for pv in operands]
    if not any(chains):
        return False
    body = Graph(f"{_body_name(node)}_absorbed")
    inputs: dict[object, Value] = {}
    sources: list[PlanValue | None] = []
    logical: list[Value] = []
    for j, (value, pv, chain) in enumerate(zip(node.inputs, operands, chains)):
        source = chain[0] if chain else pv
        key = "gemm-result" if source is None else source.slot
        if key not in inputs:
            inputs[key] = body.add_input(f"a{len(inputs)}", value.type if source is None else source.type)
            sources.append(source)
        current = inputs[key]
        for view in (chain[1] if chain else ()):
            current = body.add_node(view.op, [current], view.attrs).outputs[0]
        logical.append(current)
    outputs, template = _replay(node, body, logical, op.template)
    body.set_outputs(outputs)
    scratch = Graph("absorbed")
    operands_in = [scratch.add_input(v.name, v.type) for v in body.inputs]
    op.node = scratch.add_node("fused", operands_in, {"template": template, "body": body})
    op.inputs = [*op.inputs[:2], *sources[1:]] if gemm else list(sources)
    return True


def _body_name(node: Node) -> str:
    return node.attrs["body"].name if node.op_name == "fused" else node.op_name


def _replay(node: Node, body: Graph, logical: list[Value], template: str) -> tuple[list[Value], str]:
    """Add ``node``'s computation to ``body`` on the ``logical`` operands; its outputs and template."""
    if node.op_name != "fused":
        return list(body.add_node(node.op, logical, node.attrs).outputs), template
    inner: Graph = node.attrs["body"]
    mapped: dict[Value, Value] = dict(zip(inner.inputs, logical))
    for c in inner.constants:
        mapped[c] = body.add_constant(c.data, c.dtype, name=c.name)
    for n in inner.nodes:
        new = body.add_node(n.op, [mapped[v] for v in n.inputs], n.attrs)
        mapped.update(zip(n.outputs, new.outputs))
    return [mapped[v] for v in inner.outputs], node.attrs["template"]




def permute_result(op: PlanOp, dims: list[int]) -> None:
    """Rewrite kernel ``op`` so that it writes ``permute(result, dims)`` instead of its
    (single) result: the loop nest then runs over the permuted index space, writing
    contiguously in the new order (channels-last results for channels-last consumers)."""
    node = op.node
    assert node is not None and len(node.outputs) == 1
    body = Graph(f"{_body_name(node)}_permuted")
    inputs: dict[int, Value] = {}
    logical: list[Value] = []
    for value, pv in zip(node.inputs, op.inputs):
        if pv.slot not in inputs:
            inputs[pv.slot] = body.add_input(f"a{len(inputs)}", value.type)
        logical.append(inputs[pv.slot])
    outputs, template = _replay(node, body, logical, op.template)
    body.set_outputs([body.add_node("permute", outputs, {"dims": list(dims)}).outputs[0]])
    scratch = Graph("permuted")
    operands = [scratch.add_input(v.name, v.type) for v in body.inputs]
    op.node = scratch.add_node("fused", operands, {"template": template, "body": body})
    op.inputs = list(dict.fromkeys(op.inputs))


__all__ = ["absorb_views", "permute_result", "view_chain"]
