"""A computation with a user-defined gradient: ``custom_vjp``.

``custom_vjp(*operands) {forward, backward, outputs, nondiff, grads, name}`` is a
``torch.autograd.Function`` in kiln's IR.  ``forward`` is a graph (inputs only, no params)
taking the operands and returning the Function's ``outputs`` results followed by the tensors
its backward reads (the *saved* tensors); the node's results are all of them, in that order.
``backward`` is a graph taking one cotangent per Function output, then the saved tensors, and
returning gradients; ``grads[i]`` is the index of the backward result that is operand ``i``'s
gradient, or ``-1`` when the Function gives it none.  ``nondiff`` lists the outputs marked
non-differentiable: their cotangent is always zero.  ``name`` names the Function in messages,
``why`` says why ``backward`` is absent (when it is).

Semantics:

* the results are ``forward``'s results (the reference runs the forward graph);
* the gradient rule is the backward graph, inlined: it never differentiates ``forward``, so a
  backward that is deliberately not the forward's derivative (a straight-through estimator)
  is honoured.  A backward result whose shape only broadcasts to the operand's is summed back
  to it and cast to the operand's dtype, as ``torch.autograd`` does; the saved results carry
  no gradient of their own (the Function's backward is ``once_differentiable``);
* ``backward`` may be absent (``none``): the Function's forward is known but its backward is
  not (a Function Dynamo cannot trace, seen through ``torch.export``, which keeps only the
  forward); differentiating through the node then raises :class:`~kiln.ir.KilnError` naming
  the Function and ``why``;
* the ``inline-custom-vjp`` pass (:mod:`kiln.passes.inline_custom_vjp`) replaces the node by its forward
  graph once autodiff has run, so backends generate code for the forward ops as usual.

The text form prints both graphs inline, as ``fused`` does::

    %y, %s = custom_vjp(%x) {forward=graph @STE.forward(%x: f32[4]) {...},
                             backward=graph @STE.backward(...) {...}, outputs=1, grads=[0]}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import KilnError
from ..graph import Graph, Node, Value
from ..registry import Attr, defop
from ..types import TensorType
from .fused import run_body
from .vjp import GradBuilder, defvjp, unbroadcast


def _sums_to(grad: TensorType, operand: TensorType) -> bool:
    """Whether ``grad`` sums back to ``operand``'s shape (``operand`` broadcasts to it)."""
    lead = grad.rank - operand.rank
    if lead < 0:
        return False
    return all(d == 1 or d == g for d, g in zip(operand.shape, grad.shape[lead:]))


def _custom_vjp_infer(types: Sequence[TensorType], *, forward: Graph, backward: Graph | None,
                      outputs: int, nondiff: tuple[int, ...], grads: tuple[int, ...],
                      name: str, why: str) -> tuple[TensorType, ...]:
    what = f"torch.autograd.Function {name}" if name else "custom_vjp"
    for label, body in (("forward", forward), ("backward", backward)):
        if body is not None and body.params:
            raise ValueError(f"{label} graph @{body.name} of {what} has params; pass them as operands")
    if len(types) != len(forward.inputs):
        raise ValueError(f"forward graph @{forward.name} takes {len(forward.inputs)} inputs, "
                         f"got {len(types)} operands")
    for i, (t, v) in enumerate(zip(types, forward.inputs)):
        if t != v.type:
            raise ValueError(f"operand {i} is {t} but forward input %{v.name} is {v.type}")
    if not 1 <= outputs <= len(forward.outputs):
        raise ValueError(f"outputs={outputs} but forward graph @{forward.name} returns "
                         f"{len(forward.outputs)} values")
    bad = [i for i in nondiff if not 0 <= i < outputs]
    if bad:
        raise ValueError(f"nondiff indices {bad} are not outputs (0..{outputs - 1})")
    if backward is not None:
        expected = [v.type for v in forward.outputs]
        got = [v.type for v in backward.inputs]
        if got != expected:
            raise ValueError(
                f"backward graph @{backward.name} must take the {outputs} output cotangent(s) then "
                f"the {len(expected) - outputs} saved tensor(s), typed {[str(t) for t in expected]}; "
                f"it takes {[str(t) for t in got]}")
        if len(grads) != len(types):
            raise ValueError(f"grads has {len(grads)} entries for {len(types)} operands")
        for i, (k, t) in enumerate(zip(grads, types)):
            if k == -1:
                continue
            if not 0 <= k < len(backward.outputs):
                raise ValueError(f"grads[{i}]={k} but backward graph @{backward.name} returns "
                                 f"{len(backward.outputs)} values")
            g = backward.outputs[k].type
            if not _sums_to(g, t):
                raise ValueError(f"the gradient of operand {i} ({t}) from backward result {k} has "
                                 f"type {g}, which does not sum back to the operand's shape")
    return tuple(v.type for v in forward.outputs)


@defop(
    "custom_vjp",
    infer=_custom_vjp_infer,
    attrs={"forward": Attr("graph"), "backward": Attr("graph", None, optional=True),
           "outputs": Attr("int", 1), "nondiff": Attr("ints", ()), "grads": Attr("ints", ()),
           "name": Attr("str", ""), "why": Attr("str", "")},
    num_inputs=(0, None),
)
def custom_vjp(*arrays: np.ndarray, forward: Graph, backward: Graph | None, outputs: int,
               nondiff: tuple[int, ...], grads: tuple[int, ...], name: str, why: str) -> Any:
    """Run the forward graph on the operands: the outputs, then the saved tensors."""
    results = run_body(forward, arrays)
    return results[0] if len(results) == 1 else tuple(results)


def inline_body(graph: Graph, body: Graph, operands: Sequence[Value], *, loc: str | None = None,
                before: Node | None = None) -> list[Value]:
    """Copy ``body``'s nodes into ``graph`` (before ``before``, else at the end) with its
    inputs bound to ``operands``; returns the values of ``body``'s outputs.  Nodes keep their
    own source location, or take ``loc``."""
    env: dict[Value, Value] = dict(zip(body.inputs, operands))
    for c in body.constants:
        env[c] = graph.add_constant(c.data, c.dtype)
    for n in body.nodes:
        new = graph.add_node(n.op, [env[v] for v in n.inputs], n.attrs, loc=n.loc or loc,
                             before=before)
        env.update(zip(n.outputs, new.outputs))
    return [env[v] for v in body.outputs]


@defvjp("custom_vjp")
def _custom_vjp_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """The Function's own backward graph, inlined: output cotangents (zeros for the
    non-differentiable and integer outputs) and the saved results in, one gradient per
    operand out (summed back to the operand's shape and cast to its dtype)."""
    backward: Graph | None = attrs["backward"]
    n = attrs["outputs"]
    if backward is None:
        name = attrs["name"] or "a torch.autograd.Function"
        where = f" (at {b.loc})" if b.loc else ""
        because = f" because {attrs['why']}" if attrs["why"] else ""
        raise KilnError(
            f"autodiff: gradients flow through torch.autograd.Function {name}{where}, but its "
            f"backward is not known here: kiln could not obtain it while exporting{because} "
            "(torch.export keeps only a Function's forward), and kiln never re-derives a custom "
            "backward. Make the Function traceable by TorchDynamo (tensor arguments and outputs, "
            "no data-dependent Python control flow), or train through torch.compile(model, "
            "backend=\"kiln\"), or run this model under torch.no_grad() for inference.")
    nondiff = set(attrs["nondiff"])
    cts = [ct if i not in nondiff and v.dtype.is_floating else b.zeros(v.type)
           for i, (v, ct) in enumerate(zip(outputs[:n], cotangents[:n]))]
    results = inline_body(b.graph, backward, [*cts, *outputs[n:]], loc=b.loc)
    grads: list[Value | None] = []
    for i, (x, k) in enumerate(zip(inputs, attrs["grads"])):
        if k < 0 or not x.dtype.is_floating or not b.wants(i):
            grads.append(None)
        else:
            grads.append(unbroadcast(b, results[k], x))
    grads += [None] * (len(inputs) - len(grads))
    return grads


__all__ = ["custom_vjp", "inline_body"]
