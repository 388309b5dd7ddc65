"""kiln graphs inside torch autograd: kiln's own forward and backward graphs as one
``torch.autograd.Function``.

:class:`DifferentiableGraph` wraps a captured kiln graph.  Called on tensors (graph inputs,
then params) it runs

* the plain inference graph when grad mode is off (``torch.no_grad()``,
  ``torch.inference_mode()``) or no floating-point tensor requires grad;
* otherwise the forward half of kiln's joint graph (which also returns the values the
  backward needs) inside :class:`KilnFunction`; ``.backward()`` then runs kiln's backward
  graph.  Gradients flow to exactly the tensors that require grad; the joint graph
  differentiates only with respect to them (one forward/backward pair is built per
  requires-grad pattern, on first use, and cached).

:class:`TrainableCompiledModule` is the :class:`~kiln.runtime.CompiledModule` that
:func:`kiln.compile` returns: the same module, taking part in autograd as above.  The
per-op fallback (:mod:`kiln.frontends.torch.fallback`) builds every kiln partition as a
``DifferentiableGraph`` too, so modules that run partly in PyTorch, and
``torch.compile(backend="kiln")`` graphs, train the same way.

Guarantees: gradients are kiln's (the autodiff pass over the captured ATen graph, never
AOTAutograd); outputs of integer or bool dtype are marked non-differentiable; a tensor
whose gradient kiln proves structurally zero (no differentiable path to any output) gets
``None``, as in PyTorch; passes given to the compiler run on the forward and backward graphs
separately, after differentiation (so they may fuse freely); the backward is
``once_differentiable`` (no double backward).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from kiln.backends import Backend
from kiln.ir import Graph, KilnError, TensorType
from kiln.ir.ops.vjp import is_nondifferentiable
from kiln.passes.autodiff import grad_graph, split_joint
from kiln.passes.inline_custom_vjp import inline_custom_vjp
from kiln.passes.pipeline import GraphTransform
from kiln.runtime import CompiledModule, torch_dtype

Executable = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


@dataclass
class _Pair:
    """The built forward/backward graphs for one set of differentiated tensors."""

    forward: Executable
    backward: Executable
    forward_graph: Graph
    backward_graph: Graph
    num_outputs: int
    wrt_positions: list[int]
    """Position (among the call's tensors) of each backward output, in backward output order."""
    cotangent_outputs: list[int]
    """Forward output index of each cotangent input of the backward, in order."""
    cotangent_types: list[TensorType]
    differentiable: list[bool]
    """Per forward output: floating-point (may carry a gradient)."""
    reaches: list[frozenset[int]]
    """Per backward output: the forward outputs its tensor has a differentiable path to."""
    saved_bytes: int


class DifferentiableGraph:
    """A kiln graph that takes part in autograd (see the module docstring).

    Args:
        graph: the captured graph *before* any passes (gradient rules are declared on the
            captured ops; fused kernels are made afterwards).
        inference: the built inference executable (the caller's, passes included).
        backend, options: build the forward and backward graphs.
        transform: the passes, run on the forward and the backward graph separately.
        policy: ``"save-all"`` or ``"remat"`` (see :func:`kiln.passes.autodiff.split_joint`).
    """

    def __init__(self, graph: Graph, inference: Executable, backend: Backend,
                 options: dict[str, Any] | None = None, transform: GraphTransform | None = None,
                 policy: str = "save-all"):
        self.graph = graph
        self.inference = inference
        self.backend = backend
        self.options = dict(options or {})
        self.transform = transform
        self.policy = policy
        self._names = [v.name for v in (*graph.inputs, *graph.params)]
        self._floating = [v.dtype.is_floating for v in (*graph.inputs, *graph.params)]
        # a graph without floating-point outputs (none at all: Dynamo returns views of the
        # inputs itself) has nothing to differentiate and always runs its inference build
        self._differentiable = any(v.dtype.is_floating for v in graph.outputs)
        self._pairs: dict[tuple[int, ...], _Pair] = {}

    def needs_grad(self, tensors: Sequence[torch.Tensor]) -> bool:
        if not torch.is_grad_enabled() or not self._differentiable:
            return False
        return any(f and t.requires_grad for f, t in zip(self._floating, tensors))

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Run on the graph's inputs then params; differentiable when :meth:`needs_grad`."""
        if not self.needs_grad(tensors):
            with torch.no_grad():
                return self.inference(tensors)
        key = tuple(i for i, (f, t) in enumerate(zip(self._floating, tensors)) if f and t.requires_grad)
        pair = self._pairs.get(key)
        if pair is None:
            pair = self._pairs[key] = self._build(key)
        return list(KilnFunction.apply(pair, *tensors))

    def pair(self, positions: Sequence[int]) -> _Pair:
        """The forward/backward pair differentiating the tensors at ``positions`` (built once)."""
        key = tuple(sorted(positions))
        if key not in self._pairs:
            self._pairs[key] = self._build(key)
        return self._pairs[key]

    def _build(self, positions: tuple[int, ...]) -> _Pair:
        wrt = [self._names[i] for i in positions]
        joint = grad_graph(self.graph, wrt=wrt, output_cotangents=True)
        forward, backward, info = split_joint(joint, policy=self.policy)
        # torch.autograd.Function nodes were differentiated with their own backward: from
        # here on they are their forward computation
        forward, backward = inline_custom_vjp(forward), inline_custom_vjp(backward)
        if self.transform is not None:
            forward = _checked(self.transform, forward)
            backward = _checked(self.transform, backward)
        position_of = {name: i for i, name in enumerate(self._names)}
        by_output = sorted(info.grad_outputs.items(), key=lambda item: item[1])
        cotangent_of = {name: index for index, name in joint.cotangent_inputs.items()}
        cotangent_outputs = [cotangent_of[name] for name in info.cotangent_inputs]
        outputs = self.graph.outputs
        reaches = [_outputs_reached(self.graph, name) for name, _ in by_output]
        cut = _outputs_cut_off(self.graph, [name for name, _ in by_output])
        return _Pair(
            forward=self.backend.build(forward, self.options),
            backward=self.backend.build(backward, self.options),
            forward_graph=forward, backward_graph=backward, num_outputs=len(outputs),
            wrt_positions=[position_of[name] for name, _ in by_output],
            cotangent_outputs=cotangent_outputs,
            cotangent_types=[outputs[i].type for i in cotangent_outputs],
            # an output that depends on the inputs only through an op whose result eager
            # never lets require grad (a detached value, LU's permutation) does not require grad
            differentiable=[v.dtype.is_floating and i not in cut for i, v in enumerate(outputs)],
            reaches=reaches,
            saved_bytes=info.saved_bytes,
        )


def _outputs_reached(graph: Graph, name: str) -> frozenset[int]:
    """Indices of the outputs of ``graph`` that depend on input/param ``name`` through
    floating-point values and differentiable ops."""
    source = next(v for v in (*graph.inputs, *graph.params) if v.name == name)
    reached = {source}
    for node in graph.nodes:
        if is_nondifferentiable(node.op.vjp) or not any(v in reached for v in node.inputs):
            continue
        reached.update(v for v in node.outputs if v.dtype.is_floating)
    return frozenset(i for i, v in enumerate(graph.outputs) if v in reached)


CUTTING_OPS = frozenset({"stop_gradient", "lu_permutation"})
"""Ops whose results never require grad in eager, whatever their inputs (``detach``, and
outputs PyTorch's derivative formulas declare non-differentiable)."""


def _outputs_cut_off(graph: Graph, names: Sequence[str]) -> frozenset[int]:
    """Indices of the outputs that depend on the inputs/params ``names`` only through
    :data:`CUTTING_OPS`."""
    sources = {v for v in (*graph.inputs, *graph.params) if v.name in names}

    def reach(skip: frozenset[str]) -> set:
        reached = set(sources)
        for node in graph.nodes:
            if node.op_name in skip or not any(v in reached for v in node.inputs):
                continue
            reached.update(node.outputs)
        return reached

    everything, kept = reach(frozenset()), reach(CUTTING_OPS)
    return frozenset(i for i, v in enumerate(graph.outputs) if v in everything and v not in kept)


def _checked(transform: GraphTransform, graph: Graph) -> Graph:
    result = transform(graph)
    if [v.type for v in result.inputs] != [v.type for v in graph.inputs] or \
            [v.type for v in result.outputs] != [v.type for v in graph.outputs]:
        raise KilnError(f"kiln: the passes changed the signature of graph @{graph.name}; passes "
                        "must keep a graph's inputs and outputs")
    return result


class KilnFunction(torch.autograd.Function):
    """Runs a :class:`_Pair`'s forward graph, saving what its backward graph reads."""

    @staticmethod
    def forward(ctx: Any, pair: _Pair, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = pair.forward(list(tensors))
        results = outputs[: pair.num_outputs]
        ctx.pair = pair
        ctx.num_tensors = len(tensors)
        ctx.set_materialize_grads(False)  # unused outputs arrive as None, not zeros
        ctx.save_for_backward(*outputs[pair.num_outputs:])
        ctx.mark_non_differentiable(*(r for r, d in zip(results, pair.differentiable) if not d))
        return tuple(results)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        pair: _Pair = ctx.pair
        cotangents = [_cotangent(grads[i], t) for i, t in zip(pair.cotangent_outputs, pair.cotangent_types)]
        results = pair.backward([*ctx.saved_tensors, *cotangents])
        out: list[torch.Tensor | None] = [None] * (1 + ctx.num_tensors)
        received = {i for i, g in enumerate(grads) if g is not None}
        for position, grad, reaches in zip(pair.wrt_positions, results, pair.reaches):
            if reaches & received:  # else PyTorch would not have differentiated it: None
                out[1 + position] = grad
        return tuple(out)


def _cotangent(grad: torch.Tensor | None, type_: TensorType) -> torch.Tensor:
    """The cotangent autograd passed, or zeros when the output was not used."""
    if grad is None:
        return torch.zeros(type_.shape, dtype=torch_dtype(type_.dtype))
    if grad.dtype != torch_dtype(type_.dtype):
        grad = grad.to(torch_dtype(type_.dtype))
    return grad.contiguous()


# --------------------------------------------------------------------- kiln.compile


class GradModeRunner:
    """Runs an executable with grad mode left on, for executables that are differentiable
    themselves (a graph module whose kiln partitions are :class:`DifferentiableGraph`)."""

    def __init__(self, executable: Executable):
        self.executable = executable

    def needs_grad(self, tensors: Sequence[torch.Tensor]) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.executable(tensors)


class TrainableCompiledModule(CompiledModule):
    """A :class:`~kiln.runtime.CompiledModule` whose outputs take part in autograd: when grad
    mode is on and an input or parameter requires grad, it runs through ``differentiable``
    (a :class:`DifferentiableGraph`, or a :class:`GradModeRunner` for modules with PyTorch
    fallback); otherwise exactly as the inference module."""

    def __init__(self, differentiable: DifferentiableGraph | GradModeRunner, executable: Executable,
                 **kwargs: Any):
        super().__init__(executable, **kwargs)
        self.differentiable = differentiable
        if isinstance(differentiable, DifferentiableGraph):
            # the captured graph keeps the names of its buffer-update outputs
            self.bind_state(differentiable.graph)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self._check(self._flatten(args, kwargs))
        if not torch.is_grad_enabled():
            return self._run(inputs)
        tensors = [*inputs, *self.params]
        if not self.differentiable.needs_grad(tensors):
            return self._run(inputs)
        start = time.perf_counter()
        if self.state is not None:
            self.state.before()
        outputs = self.differentiable(tensors)
        if self.state is not None:
            outputs = self.state.after(outputs, tensors)
        self._last_s = time.perf_counter() - start
        self._total_s += self._last_s
        self._calls += 1
        return self._structured(outputs)


__all__ = ["DifferentiableGraph", "GradModeRunner", "KilnFunction", "TrainableCompiledModule"]
