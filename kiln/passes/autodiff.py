"""Reverse-mode automatic differentiation of kiln graphs, and the forward/backward split.

Public API (stable)::

    joint = grad_graph(graph, wrt=["fc1.weight", "x"], loss=0)
    joint.graph                    # one graph: forward outputs, then one gradient per wrt name
    joint.grad_outputs             # {"fc1.weight": 1, "x": 2}   (index into graph.outputs)
    joint.forward_outputs          # 1
    forward, backward, info = split_joint(joint, policy="remat")
    info.saved, info.saved_bytes   # what the forward hands to the backward, and its size

:func:`grad_graph` builds the joint graph:

* ``wrt`` names params or inputs to differentiate (default: every floating-point param);
  integer/bool values and unknown names are rejected with a :class:`KilnError`.
* With ``output_cotangents=False`` the output ``loss`` (default 0), which must hold a single
  floating-point element, is seeded with 1.  With ``output_cotangents=True`` the joint graph
  takes one extra input per floating-point output, named ``grad.<output name>``, holding that
  output's cotangent (``JointGraph.cotangent_inputs`` maps output index -> input name).
* Gradients of values used several times are summed; cotangents of broadcast operands are
  reduced to the operand's shape; only values on a path from a ``wrt`` value to a seeded
  output are differentiated, so unrelated params and inputs cost nothing.  A ``wrt`` value
  with no such path gets zeros (a ``full`` node).
* Every gradient has exactly the type of its ``wrt`` value.  Gradient rules live beside the
  op declarations (``kiln/ir/ops/*.py``, see :mod:`kiln.ir.ops.vjp`); reaching an op that has
  none raises :class:`KilnError` naming the op and the node's source location.
* ``fused`` nodes are inlined first (their bodies are differentiated); ``custom_vjp`` nodes
  (``torch.autograd.Function``) are not: their rule is the Function's own backward graph.
  Nodes no output needs are dropped.  The input graph is never modified.
* Only static shapes are differentiated; a value of symbolic shape on a differentiated path
  (e.g. the result of indexing with a bool mask) raises :class:`KilnError`.

:func:`split_joint` cuts the joint graph in two.  The forward part is every node the forward
outputs need; everything else is backward.

* ``forward``: same inputs and params as the original graph; outputs are the forward outputs
  followed by the saved values (``SavedInfo.saved`` names them, in order).
* ``backward``: inputs are the saved values (same names, params included when the backward
  reads them), then the cotangent inputs when the joint graph has them; outputs are the
  gradients in ``wrt`` order; no params.
* Policy ``"save-all"`` saves every forward value the backward reads.  Policy ``"remat"``
  recomputes cheap forward nodes (elementwise, view and copy ops, creation ops) in the
  backward when that lowers the bytes saved: a minimum cut over the forward graph, saving
  bytes first and recomputing as few nodes as possible second.
* ``SavedInfo.saved_bytes`` counts the saved intermediate results (graph inputs and params are
  alive anyway and cost nothing); ``saved_total_bytes`` counts them too.  With symbolic
  shapes both are estimates at the top of each size's range (``kiln.ir.sizes.estimated_nbytes``).

Autodiff is not a registered :class:`~kiln.passes.base.Pass`: it changes the graph's
signature (new outputs, possibly new inputs) and its result is more than a graph, so it is
called directly.  Run the usual pipeline (``cse``, ``simplify``, ``dce``, ``fuse``...) on the
joint graph or on the split graphs afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kiln.ir import Graph, KilnError, Node, OpTypeError, Value
from kiln.ir.ops.vjp import GradBuilder
from kiln.ir.sizes import estimated_nbytes, graph_sizes
from kiln.ir.types import sizes_of

POLICIES = ("save-all", "remat")


@dataclass(frozen=True)
class JointGraph:
    """A forward graph together with its gradients.

    ``graph.outputs`` are the ``forward_outputs`` forward outputs followed by one gradient
    per ``wrt`` name; ``grad_outputs`` maps each ``wrt`` name to its output index.
    ``cotangent_inputs`` maps a forward output index to the name of the graph input that
    seeds it (only with ``output_cotangents=True``); ``loss`` is the seeded output otherwise.
    """

    graph: Graph
    grad_outputs: dict[str, int]
    forward_outputs: int
    cotangent_inputs: dict[int, str] = field(default_factory=dict)
    loss: int | None = None

    @property
    def wrt(self) -> tuple[str, ...]:
        return tuple(self.grad_outputs)


@dataclass(frozen=True)
class SavedInfo:
    """What :func:`split_joint` decided. See the module docstring for the graph signatures."""

    policy: str
    saved: tuple[str, ...]
    """Names of the saved values: extra forward outputs, and the first backward inputs."""
    saved_origins: tuple[str, ...]
    """``"input"``, ``"param"`` or ``"result"`` per saved value."""
    saved_bytes: int
    """Bytes of the saved intermediate results (kind ``"result"``)."""
    saved_total_bytes: int
    """Bytes of every saved value, graph inputs and params included."""
    forward_outputs: int
    cotangent_inputs: tuple[str, ...]
    """Names of the backward inputs that follow the saved values (output cotangents)."""
    grad_outputs: dict[str, int]
    """``wrt`` name -> backward output index."""
    recomputed: int
    """Number of forward nodes the backward recomputes (0 for ``save-all``)."""


# ------------------------------------------------------------------------------ grad_graph
def grad_graph(graph: Graph, *, wrt: Sequence[str] | None = None, loss: int | None = None,
               output_cotangents: bool = False) -> JointGraph:
    """The joint forward+backward graph of ``graph``. See the module docstring."""
    if output_cotangents and loss is not None:
        raise KilnError("grad_graph: give either loss=<output index> or output_cotangents=True, "
                        "not both")
    joint = inline_fused(graph)
    if not joint.outputs:
        raise KilnError(f"grad_graph: graph @{graph.name} has no outputs to differentiate")
    wrt_values = _resolve_wrt(joint, wrt)
    forward_nodes = list(joint.nodes)
    num_forward = len(joint.outputs)
    seeds: list[tuple[Value, Value]] = []
    cotangent_inputs: dict[int, str] = {}
    if output_cotangents:
        for i, out in enumerate(joint.outputs):
            if not out.dtype.is_floating:
                continue
            seed = joint.add_input(_free_name(joint, f"grad.{out.name}"), out.type)
            cotangent_inputs[i] = seed.name
            seeds.append((out, seed))
    else:
        loss = 0 if loss is None else loss
        out = _loss_value(joint, loss)
        seeds.append((out, joint.add_constant(np.ones(_static(out), out.dtype.numpy), out.dtype)))
    cotangents = backprop(joint, forward_nodes, seeds, wrt_values)
    builder = GradBuilder(joint)
    grads = [cotangents.get(v) or builder.zeros(v.type) for v in wrt_values]
    joint.set_outputs(list(joint.outputs) + grads)
    remove_dead_nodes(joint)
    grad_outputs = {v.name: num_forward + i for i, v in enumerate(wrt_values)}
    return JointGraph(joint, grad_outputs, num_forward, cotangent_inputs,
                      None if output_cotangents else loss)


def backprop(graph: Graph, nodes: Sequence[Node], seeds: Iterable[tuple[Value, Value]],
             wrt: Iterable[Value]) -> dict[Value, Value]:
    """Reverse sweep over ``nodes`` (topologically ordered, all in ``graph``).

    ``seeds`` pairs values with their cotangents.  Appends backward nodes to ``graph`` and
    returns the accumulated cotangent of every value on a path from ``wrt`` to a seeded value
    that received one (a value missing from the result has a structurally zero gradient).
    """
    seeds = list(seeds)
    needed = _needed_values(nodes, set(wrt), {v for v, _ in seeds})
    _refuse_data_dependent_sizes(graph, nodes, needed)
    cotangent: dict[Value, Value] = {}

    def accumulate(value: Value, ct: Value, builder: GradBuilder) -> None:
        previous = cotangent.get(value)
        cotangent[value] = ct if previous is None else builder.add(previous, ct)

    root = GradBuilder(graph)
    for value, seed in seeds:
        if value in needed:
            accumulate(value, seed, root)
    for node in reversed(nodes):
        output_cts = [cotangent.get(v) for v in node.outputs]
        if all(ct is None for ct in output_cts):
            continue
        wants = [v in needed for v in node.inputs]
        if not any(wants):
            continue
        rule = node.op.vjp
        if rule is None:
            raise KilnError(
                f"autodiff: op '{node.op_name}' has no gradient rule, but node {_describe(node)} lies "
                f"between the differentiated values and the loss{_at(node)}. Declare one beside "
                "the op (defvjp in kiln/ir/ops), or keep the op off that path "
                "(e.g. narrow wrt=...).")
        builder = GradBuilder(graph, node.loc, wants)
        cts = tuple(ct if ct is not None else builder.zeros(v.type)
                    for ct, v in zip(output_cts, node.outputs))
        try:
            results = list(rule(builder, node.inputs, node.outputs, cts, dict(node.attrs)))
        except OpTypeError as e:
            raise KilnError(f"autodiff: the gradient rule of '{node.op_name}' built an ill-typed node "
                            f"for {_describe(node)}{_at(node)}: {e}") from e
        if len(results) != len(node.inputs):
            raise KilnError(f"kiln bug: the gradient rule of '{node.op_name}' returned {len(results)} "
                            f"cotangents for {len(node.inputs)} operands")
        for i, (value, ct, want) in enumerate(zip(node.inputs, results, wants)):
            if ct is None or not want:
                continue
            if ct.type != value.type:
                raise KilnError(
                    f"kiln bug: the gradient rule of '{node.op_name}' gave operand {i} "
                    f"(%{value.name}: {value.type}) a cotangent of type {ct.type}{_at(node)}")
            accumulate(value, ct, builder)
    return cotangent


def _needed_values(nodes: Sequence[Node], wrt: set[Value], seeded: set[Value]) -> set[Value]:
    """Floating-point values on a path from ``wrt`` to ``seeded`` (integer values cut paths)."""
    forward = {v for v in wrt if v.dtype.is_floating}
    for node in nodes:
        if any(v in forward for v in node.inputs):
            forward.update(v for v in node.outputs if v.dtype.is_floating)
    backward = set(seeded)
    for node in reversed(nodes):
        if any(v in backward for v in node.outputs):
            backward.update(node.inputs)
    return forward & backward


def _refuse_data_dependent_sizes(graph: Graph, nodes: Sequence[Node], needed: set[Value]) -> None:
    """Refuse data-dependent sizes on the differentiated path.  Sizes named by the graph's
    inputs (dynamic shapes) are fine: every gradient rule builds shapes from its operands,
    and they are bound again at each call."""
    bound = graph_sizes(graph)
    for node in nodes:
        for v in node.outputs:
            if v in needed and not sizes_of(v.type.shape) <= bound:
                raise KilnError(
                    f"autodiff: {_describe(node)} has a data-dependent shape on the path to the "
                    f"loss{_at(node)}; only sizes fixed by the inputs' shapes are differentiated "
                    "(a bool mask index can often be replaced by where())")


def _resolve_wrt(graph: Graph, wrt: Sequence[str] | None) -> list[Value]:
    if wrt is None:
        return [p for p in graph.params if p.dtype.is_floating]
    if isinstance(wrt, str):
        wrt = [wrt]
    by_name = {v.name: v for v in (*graph.inputs, *graph.params)}
    values: list[Value] = []
    for name in wrt:
        v = by_name.get(name)
        if v is None:
            known = ", ".join(sorted(by_name)) or "none"
            raise KilnError(f"grad_graph: wrt name '{name}' is not an input or param of graph "
                            f"@{graph.name} (known: {known})")
        if not v.dtype.is_floating:
            raise KilnError(f"grad_graph: cannot differentiate with respect to %{name}: {v.type}; "
                            "only floating-point inputs and params have gradients")
        if v in values:
            raise KilnError(f"grad_graph: wrt names '{name}' twice")
        values.append(v)
    return values


def _loss_value(graph: Graph, loss: int) -> Value:
    if not -len(graph.outputs) <= loss < len(graph.outputs):
        raise KilnError(f"grad_graph: loss={loss} but graph @{graph.name} has "
                        f"{len(graph.outputs)} outputs")
    out = graph.outputs[loss]
    if not out.dtype.is_floating:
        raise KilnError(f"grad_graph: loss output {loss} (%{out.name}: {out.type}) is not "
                        "floating-point")
    if _numel(out) != 1:
        raise KilnError(f"grad_graph: loss output {loss} (%{out.name}: {out.type}) is not a "
                        "scalar; reduce it (sum/mean) in the model, or pass "
                        "output_cotangents=True to supply its cotangent")
    return out


def _static(v: Value) -> tuple[int, ...]:
    if not v.type.is_static:
        raise KilnError(f"autodiff: %{v.name}: {v.type} has a symbolic shape; only static "
                        "shapes are differentiated today")
    return tuple(v.shape)


def _numel(v: Value) -> int:
    return int(np.prod(_static(v), dtype=np.int64))


def _free_name(graph: Graph, hint: str) -> str:
    taken = {v.name for v in graph.values()}
    name, n = hint, 1
    while name in taken:
        name, n = f"{hint}.{n}", n + 1
    return name


def _describe(node: Node) -> str:
    outs = ", ".join(f"%{v.name}: {v.type}" for v in node.outputs)
    args = ", ".join(f"%{v.name}: {v.type}" for v in node.inputs)
    return f"{outs} = {node.op_name}({args})"


def _at(node: Node) -> str:
    return f" (at {node.loc})" if node.loc else ""


# ------------------------------------------------------------------------- graph helpers
def inline_fused(graph: Graph) -> Graph:
    """A clone of ``graph`` with every ``fused`` node replaced by its body's nodes."""
    g = graph.clone()
    while any(n.op_name == "fused" for n in g.nodes):
        for node in [n for n in g.nodes if n.op_name == "fused"]:
            body: Graph = node.attrs["body"]
            env: dict[Value, Value] = dict(zip(body.inputs, node.inputs))
            for c in body.constants:
                env[c] = g.add_constant(c.data, c.dtype)
            for n in body.nodes:
                new = g.add_node(n.op, [env[v] for v in n.inputs], n.attrs,
                                 loc=n.loc or node.loc, before=node)
                env.update(zip(n.outputs, new.outputs))
            for out, body_out in zip(node.outputs, body.outputs):
                g.replace_all_uses(out, env[body_out])
            g.remove_node(node)
    return g


def remove_dead_nodes(graph: Graph) -> None:
    """Drop nodes none of whose results reach an output, then unused constants."""
    live = set(graph.outputs)
    dead: list[Node] = []
    for node in reversed(graph.nodes):
        if any(v in live for v in node.outputs):
            live.update(node.inputs)
        else:
            dead.append(node)
    for node in dead:
        graph.remove_node(node)
    graph.remove_unused_constants()


# ------------------------------------------------------------------------------ split
def split_joint(joint: JointGraph, policy: str = "save-all") -> tuple[Graph, Graph, SavedInfo]:
    """Split ``joint`` into forward and backward graphs. See the module docstring."""
    from kiln.passes.remat import choose_recomputation

    if policy not in POLICIES:
        raise KilnError(f"split_joint: unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    g = joint.graph
    forward_outs = g.outputs[:joint.forward_outputs]
    grads = g.outputs[joint.forward_outputs:]
    cotangent_names = set(joint.cotangent_inputs.values())
    cotangent_inputs = [v for v in g.inputs if v.name in cotangent_names]
    forward_inputs = [v for v in g.inputs if v.name not in cotangent_names]
    forward_set = _ancestors(g, forward_outs)
    forward_nodes = [n for n in g.nodes if n in forward_set]
    backward_nodes = [n for n in g.nodes if n not in forward_set]
    bad = set(cotangent_inputs) & {v for n in forward_nodes for v in n.inputs}
    if bad:
        raise KilnError(f"split_joint: forward nodes read cotangent input(s) "
                        f"{', '.join('%' + v.name for v in bad)}; the joint graph is malformed")
    recompute: set[Node] = set()
    if policy == "remat":
        recompute = choose_recomputation(forward_nodes, backward_nodes, grads)
    backward_all = [n for n in g.nodes if n in recompute or n not in forward_set]
    saved = _saved_values(g, backward_all, grads, set(cotangent_inputs))
    forward = _extract(g, f"{g.name}.forward", forward_inputs, list(g.params), forward_nodes,
                       list(forward_outs) + saved)
    backward = _extract(g, f"{g.name}.backward", saved + cotangent_inputs, [], backward_all, grads)
    info = SavedInfo(
        policy=policy,
        saved=tuple(v.name for v in saved),
        saved_origins=tuple(v.origin for v in saved),
        saved_bytes=sum(estimated_nbytes(v.type, g.sizes) for v in saved if v.origin == "result"),
        saved_total_bytes=sum(estimated_nbytes(v.type, g.sizes) for v in saved),
        forward_outputs=joint.forward_outputs,
        cotangent_inputs=tuple(v.name for v in cotangent_inputs),
        grad_outputs={name: i - joint.forward_outputs for name, i in joint.grad_outputs.items()},
        recomputed=len(recompute),
    )
    return forward, backward, info


def _ancestors(graph: Graph, values: Iterable[Value]) -> set[Node]:
    """Nodes whose results ``values`` depend on."""
    found: set[Node] = set()
    stack = [v.producer for v in values if v.origin == "result"]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(v.producer for v in node.inputs if v.origin == "result")
    return found


def _saved_values(graph: Graph, backward: Sequence[Node], grads: Sequence[Value],
                  cotangents: set[Value]) -> list[Value]:
    """Values the backward reads but does not compute, in definition order (no constants)."""
    computed = {v for n in backward for v in n.outputs}
    read = {v for n in backward for v in n.inputs} | set(grads)
    order = {v: i for i, v in enumerate(graph.values())}
    saved = [v for v in read
             if v not in computed and v not in cotangents and v.origin != "const"]
    return sorted(saved, key=order.__getitem__)


def _extract(graph: Graph, name: str, inputs: Sequence[Value], params: Sequence[Value],
             nodes: Sequence[Node], outputs: Sequence[Value]) -> Graph:
    """A new graph computing ``outputs`` from ``inputs``/``params`` with copies of ``nodes``
    (in order); constants are copied as needed; value names are kept."""
    out = Graph(name)
    env: dict[Value, Value] = {}
    for v in inputs:
        env[v] = out.add_input(v.name, v.type)
    for v in params:
        env[v] = out.add_param(v.name, v.type)
    named = graph_sizes(out)
    out.sizes = {k: r for k, r in graph.sizes.items() if k in named}
    used = {v for n in nodes for v in n.inputs} | set(outputs)
    for c in graph.constants:
        if c in used:
            env[c] = out.add_constant(c.data, c.dtype, name=c.name, dedup=False)
    for n in nodes:
        copy = out.add_node(n.op, [env[v] for v in n.inputs], n.attrs,
                            names=[v.name for v in n.outputs], loc=n.loc)
        env.update(zip(n.outputs, copy.outputs))
    out.set_outputs([env[v] for v in outputs])
    return out


__all__ = ["POLICIES", "JointGraph", "SavedInfo", "backprop", "grad_graph", "inline_fused",
           "remove_dead_nodes", "split_joint"]
