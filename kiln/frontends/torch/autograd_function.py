"""``torch.autograd.Function`` calls compiled with the user's own backward.

Under ``torch.compile``, Dynamo captures a Function call as ``autograd_function_apply`` with
torch-level FX graphs of its forward and backward bodies;
:class:`~kiln.frontends.torch.tracing.TracingInterpreter` records it as one
``kiln::autograd_function`` op (:func:`apply_function`), which runs the bodies when PyTorch
executes it (per-op fallback) and differentiates with the Function's own backward.  kiln
lowers the op to a ``custom_vjp`` node holding kiln graphs of both bodies
(:func:`function_bodies`, :mod:`kiln.ir.ops.custom`), so training uses the user's backward.

Under ``torch.export``, which inlines a Function's forward and drops its backward,
:func:`export_function` (called by ``Function.apply`` while kiln exports, see
:class:`kiln.frontends.torch.capture.marked_function_outputs`) runs Dynamo on the call to
obtain the same bodies and records the same op; when Dynamo cannot trace the call
(:class:`FunctionNotTraced` says why), capture marks the Function's outputs instead.  A
Function kiln cannot compile -- random numbers in a body, ``ctx.mark_dirty``, non-tensor
results -- is never compiled silently wrong: the op's check or a :class:`KilnError` names
the reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from kiln.frontends.errors import CaptureError, UnsupportedOpError
from kiln.ir import Graph, KilnError, TensorType, Value
from kiln.runtime import torch_dtype

from . import capture as capture_mod
from .aten import LoweringContext, lowers, meta, tensor_type
from .aten_support import source_location
from .tracing import FUNCTION_APPLY, TracingInterpreter, name_placeholders_like, trace_functional

@dataclass
class _Function:
    """One ``torch.autograd.Function`` call Dynamo captured: its forward and backward bodies
    (torch-level FX graphs) and what the call site fixed.

    ``forward(*args)`` returns ``(outputs, saved)``; ``backward(*grads, *saved)`` returns one
    gradient (or ``None``) per argument.  Only the tensor arguments travel through the
    ``kiln::autograd_function`` op; the others are constants of the call."""

    key: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    constants: dict[int, Any]
    tensor_positions: list[int]
    num_outputs: int
    single: bool
    """The Function returns one tensor, not a tuple."""
    nondiff: frozenset[int]
    loc: str | None
    bodies: dict[tuple[TensorType, ...], Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"autograd_function_{self.key}"

    def describe(self) -> str:
        return f"the torch.autograd.Function whose forward is at {self.loc or '<unknown source line>'}"

    def full_args(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        args: list[Any] = [None] * (len(self.constants) + len(tensors))
        for i, value in self.constants.items():
            args[i] = value
        for i, t in zip(self.tensor_positions, tensors):
            args[i] = t
        return args

    def run_forward(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The Function's outputs followed by its saved tensors (grad mode kept as it was)."""
        outputs, saved = _run_body(self.forward, self.full_args(tensors))
        outputs = [outputs] if self.single else list(outputs)
        results = [*outputs, *saved]
        bad = [type(r).__name__ for r in results if not isinstance(r, torch.Tensor)]
        if bad:
            raise KilnError(f"kiln: {self.describe()} returns or saves non-tensor values ({', '.join(bad)}); "
                            "kiln compiles Functions whose outputs are tensors")
        return results

    def run_backward(self, grads: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]
                     ) -> list[torch.Tensor | None]:
        """One gradient (or ``None``) per tensor argument."""
        result = _run_body(self.backward, [*grads, *saved])
        result = (result,) if not isinstance(result, (tuple, list)) else tuple(result)
        return [result[i] if i < len(result) else None for i in self.tensor_positions]


_FUNCTIONS: dict[int, _Function] = {}


def _run_body(body: fx.GraphModule, args: Sequence[Any]) -> Any:
    grad_mode = torch.is_grad_enabled()
    try:
        with torch.no_grad():
            return TracingInterpreter(body).run(*args)
    finally:  # the bodies switch grad mode on and off themselves
        torch._C._set_grad_enabled(grad_mode)


def apply_function(forward: fx.GraphModule, backward: fx.GraphModule, args: Sequence[Any],
                   kwargs: dict[str, Any]) -> Any:
    """A Function call, traced as one ``kiln::autograd_function`` op (see :func:`_lower_function`);
    :class:`~kiln.frontends.torch.tracing.TracingInterpreter` calls it for Dynamo's
    ``autograd_function_apply(forward, backward, *args, **kwargs)``."""
    fn = _register_function(forward, backward, args, kwargs)
    return _call_function(fn, [args[i] for i in fn.tensor_positions])


def _register_function(forward: fx.GraphModule, backward: fx.GraphModule, args: Sequence[Any],
                       kwargs: dict[str, Any]) -> _Function:
    """A new :class:`_Function` for Dynamo's ``autograd_function_apply(forward, backward,
    *args, **kwargs)``, registered under a fresh key."""
    output = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    outs = output[0]
    single = not isinstance(outs, (tuple, list))
    loc = next((source_location(n) for n in forward.graph.nodes
                if source_location(n)), None)
    fn = _Function(key=len(_FUNCTIONS), forward=forward, backward=backward,
                   constants={i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)},
                   tensor_positions=[i for i, a in enumerate(args) if isinstance(a, torch.Tensor)],
                   num_outputs=1 if single else len(outs), single=single,
                   nondiff=frozenset(kwargs.get("non_differentiable_idx") or ()), loc=loc)
    if kwargs.get("dirty_idx"):
        raise KilnError(f"kiln: {fn.describe()} modifies its inputs in place (ctx.mark_dirty); kiln "
                        "compiles Functions that return new tensors. Return a new tensor instead.")
    _FUNCTIONS[fn.key] = fn
    return fn


def _call_function(fn: _Function, tensors: Sequence[torch.Tensor]) -> Any:
    results = torch.ops.kiln.autograd_function(list(tensors), fn.key)
    return results[0] if fn.single else tuple(results[: fn.num_outputs])


@torch.library.custom_op("kiln::autograd_function", mutates_args=())
def _autograd_function(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """A ``torch.autograd.Function`` call: its outputs, then its saved tensors.  Kiln lowers it
    to a ``custom_vjp`` node; run in PyTorch (per-op fallback) it differentiates with the
    Function's own backward."""
    return [t.clone() for t in _FUNCTIONS[key].run_forward(tensors)]


@_autograd_function.register_fake
def _autograd_function_fake(tensors: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    return [t.clone() for t in _FUNCTIONS[key].run_forward(tensors)]


def _function_setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    fn = _FUNCTIONS[inputs[1]]
    ctx.key = fn.key
    ctx.types = [(o.shape, o.dtype) for o in output[: fn.num_outputs]]
    ctx.save_for_backward(*output[fn.num_outputs:])
    fixed = [o for i, o in enumerate(output)
             if i >= fn.num_outputs or i in fn.nondiff or not o.is_floating_point()]
    if fixed:
        ctx.mark_non_differentiable(*fixed)


def _function_backward(ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple[Any, None]:
    fn = _FUNCTIONS[ctx.key]
    cotangents = [torch.zeros(shape, dtype=dtype) if g is None or i in fn.nondiff else g
                  for i, ((shape, dtype), g) in enumerate(zip(ctx.types, grads))]
    return fn.run_backward(cotangents, ctx.saved_tensors), None


_autograd_function.register_autograd(_function_backward, setup_context=_function_setup)


def _example(t: TensorType) -> torch.Tensor:
    """A tensor of type ``t`` to trace a Function's body with (values do not matter: Dynamo's
    bodies have no data-dependent control flow)."""
    dtype = torch_dtype(t.dtype)
    if dtype.is_floating_point:
        return torch.randn(t.shape, dtype=torch.float64).to(dtype)
    return torch.zeros(t.shape, dtype=dtype)


def function_bodies(fn: _Function, types: Sequence[TensorType]) -> tuple[Graph, Graph, tuple[int, ...]]:
    """The kiln forward and backward graphs of ``fn`` for operands of ``types``, and for each
    operand the backward output that is its gradient (``-1``: none).  Built once per types."""
    key = tuple(types)
    cached = fn.bodies.get(key)
    if isinstance(cached, Exception):
        raise cached
    if cached is not None:
        return cached
    try:
        cached = _function_bodies(fn, types)
    except (UnsupportedOpError, CaptureError, KilnError) as e:
        fn.bodies[key] = e
        raise
    fn.bodies[key] = cached
    return cached


def _function_bodies(fn: _Function, types: Sequence[TensorType]) -> tuple[Graph, Graph, tuple[int, ...]]:
    examples = [_example(t) for t in types]
    forward_gm = trace_functional(lambda *tensors: tuple(fn.run_forward(tensors)), examples)
    placeholders = [n for n in fn.forward.graph.nodes if n.op == "placeholder"]
    name_placeholders_like(forward_gm, [placeholders[i] for i in fn.tensor_positions])
    forward = capture_mod.capture_fx(forward_gm, examples, name=f"{fn.name}.forward").graph
    if forward.params:
        raise KilnError(f"kiln: {fn.describe()} draws random numbers in its forward; kiln compiles "
                        "deterministic Functions only. Move the random op out of the Function.")
    returned: list[bool] = []

    def backward(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grads = fn.run_backward(tensors[: fn.num_outputs], tensors[fn.num_outputs:])
        returned[:] = [isinstance(g, torch.Tensor) for g in grads]
        return tuple(g for g in grads if isinstance(g, torch.Tensor))

    cotangents = [_example(v.type) for v in forward.outputs]
    backward_gm = trace_functional(backward, cotangents)
    name_placeholders_like(backward_gm, [n for n in fn.backward.graph.nodes if n.op == "placeholder"])
    backward_graph = capture_mod.capture_fx(backward_gm, cotangents, name=f"{fn.name}.backward").graph
    if backward_graph.params:
        raise KilnError(f"kiln: {fn.describe()} draws random numbers in its backward; kiln "
                        "compiles deterministic Functions only.")
    grads, index = [], 0
    for present in returned:
        grads.append(index if present else -1)
        index += present
    return forward, backward_graph, tuple(grads)


def _check_function(node: fx.Node, tensors: Sequence[Any], key: int) -> str | None:
    fn = _FUNCTIONS.get(key)
    if fn is None:
        return f"no torch.autograd.Function is registered under key {key} in this process"
    try:
        function_bodies(fn, [tensor_type(meta(t)) for t in tensors])
    except (UnsupportedOpError, CaptureError, KilnError) as e:
        return f"{fn.describe()} cannot be compiled: {str(e).splitlines()[0]}"
    return None


@lowers(torch.ops.kiln.autograd_function.default, check=_check_function)
def _lower_function(ctx: LoweringContext, tensors: Sequence[Value], key: int) -> list[Value]:
    """A ``custom_vjp`` node holding the Function's forward and backward graphs."""
    fn = _FUNCTIONS[key]
    forward, backward, grads = function_bodies(fn, [v.type for v in tensors])
    node = ctx.graph.add_node(
        "custom_vjp", list(tensors),
        {"forward": forward, "backward": backward, "outputs": fn.num_outputs,
         "nondiff": tuple(sorted(fn.nondiff)), "grads": grads, "name": fn.loc or fn.name},
        loc=ctx.loc or fn.loc)
    return list(node.outputs)


# ------------------------------------------- torch.autograd.Function under torch.export


class FunctionNotTraced(Exception):
    """Raised by :func:`export_function` when Dynamo gives no ``autograd_function_apply`` for
    a Function call; the message says why."""


@dataclass
class _ExportedCall:
    """How one kind of ``Fn.apply(*args)`` call under torch.export maps to a :class:`_Function`:
    ``sources[k]`` is the position in ``args`` of the Function's ``k``-th tensor operand;
    ``apply`` returns ``spec`` unflattened from ``leaves``, each the index of a result of the
    ``kiln::autograd_function`` op or, for a non-tensor, ``(value,)``."""

    fn: _Function
    sources: list[int]
    spec: Any
    leaves: list[Any]

    def call(self, args: Sequence[Any]) -> Any:
        results = torch.ops.kiln.autograd_function([args[i] for i in self.sources], self.fn.key)
        leaves = [leaf[0] if isinstance(leaf, tuple) else results[leaf] for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)


_EXPORTED: dict[Any, _ExportedCall | str] = {}
"""Per Function class, its methods, the tensor arguments' types and the other arguments:
the traced call, or why Dynamo could not trace it."""
_TRACING = False  # Dynamo is running on a Function for export_function


def tracing_function() -> bool:
    """Whether Dynamo is tracing a Function for :func:`export_function` now."""
    return _TRACING


def export_function(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``cls.apply(*args)`` while kiln exports: one ``kiln::autograd_function`` op whose
    bodies are the forward and backward Dynamo traces for the call, as under
    ``torch.compile`` (so the lowering, a ``custom_vjp`` node, keeps the user's backward).

    Dynamo runs once per Function class, argument types and non-tensor arguments, outside
    the export's fake and tracing modes, on random real tensors of the arguments' shapes and
    dtypes (floating ones requiring grad, so Dynamo captures the backward too).  Raises
    :class:`FunctionNotTraced` saying why when it gives no ``autograd_function_apply``
    (a graph break, keyword arguments, non-tensor outputs...)."""
    if _TRACING:
        raise FunctionNotTraced("it is called while Dynamo traces another Function")
    if kwargs:
        raise FunctionNotTraced(f"it is called with keyword arguments ({', '.join(kwargs)})")
    key = _export_key(cls, args)
    call = _EXPORTED.get(key) if key is not None else None
    if call is None:
        try:
            call = _trace_for_export(cls, args)
        except FunctionNotTraced as e:
            call = str(e)
        if key is not None:
            _EXPORTED[key] = call
    if isinstance(call, str):
        raise FunctionNotTraced(call)
    return call.call(args)


def _export_key(cls: type, args: tuple[Any, ...]) -> Any:
    """The cache key of a call, or ``None`` when an argument cannot be part of one."""
    methods = tuple(cls.__dict__.get(name) for name in ("forward", "backward", "setup_context", "vjp"))
    parts: list[Any] = [cls, tuple(methods)]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(("tensor", tuple(a.shape), a.dtype))
        else:
            parts.append((type(a), a))
    try:
        hash(tuple(parts))
    except TypeError:
        return None
    return tuple(parts)


def _real_example(t: torch.Tensor, position: int) -> torch.Tensor:
    if any(not isinstance(d, int) for d in t.shape):
        raise FunctionNotTraced(f"argument {position} has a symbolic shape {tuple(t.shape)}")
    if t.dtype.is_floating_point:
        return torch.randn(tuple(t.shape), dtype=torch.float64).to(t.dtype).requires_grad_(True)
    return torch.zeros(tuple(t.shape), dtype=t.dtype)


def _trace_for_export(cls: type, args: tuple[Any, ...]) -> _ExportedCall:
    global _TRACING
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not positions:
        raise FunctionNotTraced("it takes no tensor arguments")
    found: dict[str, Any] = {}

    def capture(gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
        found["gm"], found["inputs"] = gm, list(example_inputs)

        def run(*inputs: Any) -> Any:
            found["outputs"] = outputs = gm.forward(*inputs)
            return outputs

        return run

    with _outside_export():
        reals = {i: _real_example(args[i], i) for i in positions}
        names = {i: f"t{i}" for i in positions}
        scope: dict[str, Any] = {"_cls": cls, **{f"c{i}": a for i, a in enumerate(args) if i not in reals}}
        call = ", ".join(names.get(i, f"c{i}") for i in range(len(args)))
        # a code object of its own, so Dynamo's cache entry for it goes when it does
        code = compile(f"lambda {', '.join(names.values())}: _cls.apply({call})",
                       f"<kiln: {cls.__qualname__}.apply under torch.export>", "eval")
        traced = torch.compile(eval(code, scope), backend=capture, fullgraph=True, dynamic=False)
        _TRACING = True
        try:
            with torch.enable_grad():
                found["result"] = traced(*reals.values())
        except Exception as e:  # noqa: BLE001 - any Dynamo failure: the Function is not traced
            first = (str(e).strip().splitlines() or [""])[0]
            raise FunctionNotTraced(f"TorchDynamo cannot trace it ({type(e).__name__}: {first})") from None
        finally:
            _TRACING = False
    return _exported_call(found, reals)


def _exported_call(found: dict[str, Any], reals: dict[int, torch.Tensor]) -> _ExportedCall:
    """The ``autograd_function_apply`` of the graph Dynamo captured, as a :class:`_Function`."""
    gm = found.get("gm")
    applies = [n for n in gm.graph.nodes if n.target is FUNCTION_APPLY] if gm is not None else []
    if FUNCTION_APPLY is None or len(applies) != 1:
        raise FunctionNotTraced("TorchDynamo gave no single autograd_function_apply for it")
    node = applies[0]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position_of: dict[fx.Node, int] = {}
    for ph, value in zip(placeholders, found["inputs"]):
        match = [i for i, r in reals.items() if r is value]
        if match:
            position_of[ph] = match[0]
    hop_args: list[Any] = []
    sources: list[int] = []
    for a in node.args[2:]:
        if isinstance(a, fx.Node):
            if a not in position_of:
                raise FunctionNotTraced("its forward reads tensors other than its arguments "
                                        f"({a.name}); pass them to apply()")
            hop_args.append(reals[position_of[a]])
            sources.append(position_of[a])
        else:
            hop_args.append(a)
    forward, backward = (getattr(gm, str(b.target)) for b in node.args[:2])
    output = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    leaves = pytree.tree_leaves(output, is_leaf=lambda x: x is None)
    if any(not isinstance(leaf, fx.Node) for leaf in leaves):
        raise FunctionNotTraced("it returns or saves values other than tensors")
    if node.kwargs.get("dirty_idx"):
        raise FunctionNotTraced("it modifies its inputs in place (ctx.mark_dirty)")
    result_leaves, spec = pytree.tree_flatten(found["result"])
    graph_outputs = pytree.tree_leaves(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    returned = found.get("outputs") or ()
    leaves: list[Any] = []
    for leaf in result_leaves:
        if not isinstance(leaf, torch.Tensor):
            leaves.append((leaf,))
            continue
        at = [j for j, t in enumerate(returned) if t is leaf]
        out = graph_outputs[at[0]] if at and at[0] < len(graph_outputs) else None
        if not (isinstance(out, fx.Node) and out.target is operator.getitem and out.args[0] is node):
            raise FunctionNotTraced("it returns a tensor that is not one of its forward's outputs")
        leaves.append(out.args[1])
    fn = _register_function(forward, backward, hop_args, dict(node.kwargs))
    return _ExportedCall(fn, sources, spec, leaves)


class _outside_export:
    """Context manager: no fake, tracing or torch-function mode of a running torch.export
    (restored on exit), and Dynamo's "compiling"/"exporting" flags off, so ``torch.compile``
    traces for real."""

    def __enter__(self) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        self._dispatch = _disable_current_modes()
        self._dispatch.__enter__()
        self._function_modes = [torch._C._pop_torch_function_stack()
                                for _ in range(torch._C._len_torch_function_stack())]
        compiler = torch.compiler
        self._flags = (compiler._is_compiling_flag, compiler._is_exporting_flag,
                       fx._symbolic_trace._is_fx_tracing_flag)
        compiler._is_compiling_flag = compiler._is_exporting_flag = False
        fx._symbolic_trace._is_fx_tracing_flag = False

    def __exit__(self, *exc: object) -> None:
        compiler = torch.compiler
        (compiler._is_compiling_flag, compiler._is_exporting_flag,
         fx._symbolic_trace._is_fx_tracing_flag) = self._flags
        for mode in reversed(self._function_modes):
            torch._C._push_on_torch_function_stack(mode)
        self._dispatch.__exit__(*exc)
