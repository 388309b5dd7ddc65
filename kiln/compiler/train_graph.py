"""How ``kiln.compile_train`` prepares the captured step graph before differentiating it:
readable parameter names, tied parameters merged, the loss checked, and the parameters the
loss reaches (those autograd would give a ``.grad``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.ir import Graph, KilnError, Value
from kiln.ir.ops.vjp import is_nondifferentiable
from kiln.runtime.module import BUFFER_UPDATE_PREFIX, buffer_updates


def count_targets(loss_fn: Callable[..., Any]) -> int:
    """Required positional parameters of ``loss_fn`` after the model output (default 1)."""
    fn = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return 1
    required = [p for p in positional if p.default is p.empty]
    return max(len(required) - 1, 0)


def check_loss(graph: Graph) -> int:
    """The captured step returns the loss, its auxiliary outputs, then only buffer updates
    (train-mode batch norm's running statistics: :func:`kiln.runtime.module.buffer_updates`).
    Returns the number of auxiliary outputs."""
    user = graph.outputs[: len(graph.outputs) - len(buffer_updates(graph))]
    if not user or user[0].type.rank != 0 or not user[0].dtype.is_floating:
        got = ", ".join(str(v.type) for v in user) or "nothing"
        raise KilnError(f"kiln.compile_train: loss_fn must return a floating-point scalar tensor "
                        f"(or a tuple (loss, *aux) starting with one), but the captured step returns "
                        f"{got}; reduce the loss with .mean() or .sum()")
    return len(user) - 1


def readable_names(graph: Graph, params: dict[str, torch.Tensor], positions: Sequence[int],
                    num_inputs: int) -> tuple[Graph, dict[str, torch.Tensor]]:
    """The captured step with the model's own parameter names (``fc1.weight``, not
    ``model.fc1.weight``) and inputs named ``input<i>`` / ``target<j>``."""
    taken = {v.name for v in graph.values()}
    renames: dict[str, str] = {}
    for position, v in zip(positions, graph.inputs):
        renames[v.name] = f"input{position}" if position < num_inputs else f"target{position - num_inputs}"
    for v in graph.params:
        if v.name.startswith("model."):
            renames[v.name] = v.name[len("model."):]
    for _, param in buffer_updates(graph):  # buffer_update.model.bn.running_mean -> ...bn.running_mean
        if param in renames:
            renames[BUFFER_UPDATE_PREFIX + param] = BUFFER_UPDATE_PREFIX + renames[param]
    if set(renames.values()) & (taken - set(renames)):
        return graph, dict(params)  # a clash: keep the captured names
    out = Graph(graph.name)
    out.sizes = dict(graph.sizes)
    env: dict[Value, Value] = {}
    for v in graph.inputs:
        env[v] = out.add_input(renames.get(v.name, v.name), v.type)
    for v in graph.params:
        env[v] = out.add_param(renames.get(v.name, v.name), v.type)
    for c in graph.constants:
        env[c] = out.add_constant(c.data, c.dtype, c.name, dedup=False)
    for node in graph.nodes:
        copy = out.add_node(node.op, [env[v] for v in node.inputs], node.attrs,
                            names=[renames.get(v.name, v.name) for v in node.outputs], loc=node.loc)
        env.update(zip(node.outputs, copy.outputs))
    out.set_outputs([env[v] for v in graph.outputs])
    return out, {renames.get(name, name): tensor for name, tensor in params.items()}


def merge_tied_params(graph: Graph, params: dict[str, torch.Tensor]
                       ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """One graph param per live tensor: params bound to the same tensor (tied weights such as
    GPT-2's ``lm_head``/``wte``) are merged into the first, so their gradients add up."""
    first: dict[int, Value] = {}
    duplicates: list[tuple[Value, Value]] = []
    for v in graph.params:
        tensor = params[v.name]
        if id(tensor) in first:
            duplicates.append((v, first[id(tensor)]))
        else:
            first[id(tensor)] = v
    if not duplicates:
        return graph, dict(params)
    g, vmap = graph.clone_with_map()
    for dup, keep in duplicates:
        g.replace_all_uses(vmap[dup], vmap[keep])
        g.params.remove(vmap[dup])
    live = {v.name: params[v.name] for v in g.params}
    return g, live


def params_reaching_loss(graph: Graph) -> set[str]:
    """Float params the loss (output 0) depends on through differentiable ops -- the params
    PyTorch's autograd would give a ``.grad``."""
    reached: dict[Value, set[str]] = {p: {p.name} for p in graph.params if p.dtype.is_floating}
    for node in graph.nodes:
        if is_nondifferentiable(node.op.vjp):
            continue
        sources = set().union(*(reached.get(v, set()) for v in node.inputs))
        if not sources:
            continue
        for v in node.outputs:
            if v.dtype.is_floating:
                reached[v] = sources
    return set(reached.get(graph.outputs[0], set()))


__all__ = ["check_loss", "count_targets", "merge_tied_params", "params_reaching_loss", "readable_names"]
