"""``torch.compile(model, backend="kiln")``: kiln as a TorchDynamo backend.

Dynamo hands :func:`kiln_backend` a torch-level FX graph whose placeholders are the frame's
tensors, parameters and buffers included (``inline_inbuilt_nn_modules``), with real example
tensors.  kiln lowers it to ATen with ``make_fx`` and kiln's decomposition table
(functionalized, so in-place ops become out-of-place ones plus a final copy), marks the
parameter/buffer placeholders, and compiles it with per-op fallback
(:func:`kiln.frontends.torch.fallback.compile_fx`).

Options travel through ``torch.compile(..., options={...})``, which Dynamo forwards to the
backend as one keyword argument ``options`` (and ``mode`` as ``mode=``, ignored here)::

    torch.compile(model, backend="kiln", options={"strict": True, "backend": "reference",
                                                  "passes": "cse,dce", "float64": False})

``strict`` raises :class:`~kiln.frontends.errors.UnsupportedOpError` instead of falling back;
``backend`` picks the kiln backend; ``passes`` is a pass pipeline (default: the default
pipeline, ``None`` for none); every other key is an
option of that backend (unknown keys raise).

Training works too: when grad mode is on and an input (e.g. a parameter) requires grad, the
compiled graph still traces the forward computation only; every kiln partition then runs
kiln's forward graph inside a ``torch.autograd.Function`` and ``.backward()`` runs the
backward graph kiln derived from the ATen graph with its own autodiff pass
(:mod:`kiln.frontends.torch.autograd`; AOTAutograd is not involved).  Ops kiln does not support
run in PyTorch and differentiate there.

A ``torch.autograd.Function`` (Dynamo's ``autograd_function_apply``) is traced as one
``kiln::autograd_function`` op and lowered to a ``custom_vjp`` node holding kiln graphs of
its forward and backward bodies, so training uses the Function's own backward
(:mod:`kiln.ir.ops.custom`).  The ``torch.export`` path gets the same op:
:func:`export_function`, called by ``Function.apply`` while kiln exports, runs Dynamo on the
call to obtain the bodies.  Decompositions that write in place are functionalized again
(:func:`trace_functional`): no write reaches kiln unfunctionalized.

Graphs with dynamic shapes run eagerly, with one :class:`KilnFallbackWarning` each (pass
``dynamic=False``).

The backend is registered under the name ``kiln`` in two ways: the ``torch_dynamo_backends``
entry point of the installed package, and :func:`install_registration` (run by
``import kiln``), which registers it as soon as ``torch._dynamo`` is imported, so a source
tree that is not installed works too.  Importing kiln does not import ``torch._dynamo``.
"""

from __future__ import annotations

import importlib.abc
import operator
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from kiln.backends import DEFAULT_BACKEND, get_backend
from kiln.passes.pipeline import resolve_passes
from kiln.ir import Graph, KilnError, TensorType, Value
from kiln.runtime import torch_dtype

from . import capture as capture_mod
from .aten import LoweringContext, lowers, meta, tensor_type
from kiln.frontends.errors import CaptureError, UnsupportedOpError
from .fallback import KilnFallbackWarning, compile_fx

BACKEND_NAME = "kiln"
_PARAM_NAME_RE = re.compile(r"_(parameters|buffers)_")


def kiln_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The Dynamo backend: returns a callable taking the graph's inputs (see module docstring)."""
    options = dict(kwargs.get("options") or {})
    strict = bool(options.pop("strict", False))
    backend = get_backend(options.pop("backend", DEFAULT_BACKEND))
    transform = resolve_passes(options.pop("passes", "default"))
    backend.resolve_options(options)  # unknown options fail before any tracing
    name = _graph_name(gm)
    reason = _eager_reason(example_inputs)
    if reason is not None:
        if strict:
            raise KilnError(f"kiln: cannot compile graph '{name}' with strict=True: {reason}")
        warnings.warn(f"kiln: graph '{name}' runs eagerly in PyTorch: {reason}", KilnFallbackWarning,
                      stacklevel=2)
        return gm.forward
    aten_gm = lower_to_aten(gm, example_inputs)
    return compile_fx(aten_gm, list(example_inputs), param_indices=param_indices(gm, example_inputs),
                      backend=backend, options=options, strict=strict, transform=transform, name=name)


def _graph_name(gm: fx.GraphModule) -> str:
    """``dynamo_<frame>_<recompile>`` from Dynamo's compile id, e.g. ``dynamo_0_0``."""
    compile_id = getattr(gm, "meta", {}).get("dynamo_compile_id")
    return "dynamo_" + re.sub(r"[^A-Za-z0-9]+", "_", str(compile_id)) if compile_id else "dynamo"


def _eager_reason(example_inputs: Sequence[Any]) -> str | None:
    """Why kiln cannot compile a graph with these inputs yet, or ``None``."""
    if any(not isinstance(x, torch.Tensor) for x in example_inputs):
        return ("it has symbolic-size inputs (dynamic shapes), and kiln compiles static shapes only; "
                "pass dynamic=False to torch.compile")
    return None


def param_indices(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> frozenset[int]:
    """Positions of the placeholders that are parameters or buffers of a module."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = set()
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, torch.nn.Parameter) or _from_module_state(node) \
                or _PARAM_NAME_RE.search(str(node.target)):
            found.add(i)
    return frozenset(found)


def _from_module_state(node: fx.Node) -> bool:
    """Whether Dynamo's source of this placeholder is a module's parameter or buffer dict."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    while source is not None:
        if "ParamBuffer" in type(source).__name__:
            return True
        source = getattr(source, "base", None)
    return False


def lower_to_aten(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Trace a torch-level FX graph to a functional ATen graph with kiln's decompositions.

    Node metadata (``stack_trace``) is carried over so fallback warnings and errors name the
    user's source lines.  The result is pure apart from final ``copy_`` calls into
    placeholders (buffer updates, which :mod:`kiln.frontends.torch.fallback` lifts into outputs):
    see :func:`trace_functional`.
    """
    def run(*args: torch.Tensor) -> Any:
        return _Functional(gm).run(*args)

    traced = trace_functional(run, example_inputs)
    _name_placeholders_like(traced, gm)
    traced.recompile()
    return traced


_MAX_REFUNCTIONALIZE = 3


def trace_functional(fn: Callable[..., Any], example_inputs: Sequence[Any]) -> fx.GraphModule:
    """``fn`` traced with ``make_fx`` to ATen, functionalized and decomposed with kiln's table.

    make_fx applies decompositions below the functionalization layer, so a decomposition
    that writes in place (circular ``pad`` fills slices of an ``empty`` tensor with
    ``copy_``) would reach kiln as unfunctionalized writes; the traced graph is therefore
    functionalized again until no mutating op is left but the final ``copy_`` into a
    placeholder (a buffer update).  A graph that still mutates after that raises
    :class:`KilnError` naming the op: a write is never dropped or lowered as if pure.
    """
    table = capture_mod.decomposition_table()
    traced = _trace_once(fn, example_inputs, table)
    for _ in range(_MAX_REFUNCTIONALIZE):
        if not _mutations(traced):
            return traced
        previous = traced
        traced = _trace_once(lambda *args, gm=previous: fx.Interpreter(gm).run(*args), example_inputs, table)
    left = _mutations(traced)
    if left:
        node = left[0]
        where = capture_mod.source_location(node) or "<unknown source line>"
        raise KilnError(
            f"kiln: the traced graph still writes in place with {node.target} "
            f"({capture_mod.describe_inputs(node)}) at {where} after functionalization; kiln "
            "never drops or reorders a write. Rewrite the code without the in-place update "
            "(e.g. torch.cat / torch.where instead of writing into a slice).")
    return traced


def _trace_once(fn: Callable[..., Any], example_inputs: Sequence[Any], table: dict[Any, Any]
                ) -> fx.GraphModule:
    functional = torch.func.functionalize(fn, remove="mutations")
    # Functionalization writes the traced program's buffer updates back into its real inputs;
    # trace on copies so compiling never changes the model's buffers (parameters are not
    # written by a forward and are traced as they are).
    inputs = [x if isinstance(x, torch.nn.Parameter) or not isinstance(x, torch.Tensor)
              else x.detach().clone() for x in example_inputs]
    grad_mode = torch.is_grad_enabled()
    try:
        with fx_traceback.preserve_node_meta(), torch.no_grad():
            traced = make_fx(functional, decomposition_table=table, tracing_mode="real")(*inputs)
    finally:
        torch._C._set_grad_enabled(grad_mode)
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced


def _mutations(gm: fx.GraphModule) -> list[fx.Node]:
    """The mutating ATen calls of ``gm`` other than a final ``copy_`` into a placeholder."""
    found = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        if node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder" \
                and not node.users:
            continue
        found.append(node)
    return found


def _train_batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None,
                      running_var: torch.Tensor | None, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, training: bool = False,
                      momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
    """``F.batch_norm`` with the running-statistics update spelled out as ``copy_`` calls, so
    that functionalization sees it (ATen's ``native_batch_norm`` writes them without saying
    so, and a functionalized trace would drop the update)."""
    if not training or running_mean is None or running_var is None:
        return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias,
                                              training, momentum, eps)
    y, _, _, new_mean, new_var = torch.ops.aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return y


_BATCH_NORMS = {torch.nn.functional.batch_norm}
_DROPOUTS = {torch.nn.functional.dropout, torch.dropout}


def _dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
             ) -> torch.Tensor:
    """Dropout as ATen's ``native_dropout`` (which kiln lowers), not the CPU kernel's
    ``bernoulli_`` sequence."""
    if not training or p == 0:
        return x
    y = torch.ops.aten.native_dropout.default(x, float(p), True)[0]
    if inplace:
        return x.copy_(y)
    return y


class _Functional(fx.Interpreter):
    """Runs a Dynamo graph for tracing, with calls whose in-place effects ATen hides
    (train-mode batch norm) replaced by explicit functional forms."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in _BATCH_NORMS:
            return _train_batch_norm(*args, **kwargs)
        if target in _DROPOUTS:
            return _dropout(*args, **kwargs)
        if target is _FUNCTION_APPLY and target is not None:
            return _apply_function(args[0], args[1], args[2:], kwargs)
        return super().call_function(target, args, kwargs)


# ------------------------------------------------------- torch.autograd.Function

_FUNCTION_APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)


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
            return _Functional(body).run(*args)
    finally:  # the bodies switch grad mode on and off themselves
        torch._C._set_grad_enabled(grad_mode)


def _apply_function(forward: fx.GraphModule, backward: fx.GraphModule, args: Sequence[Any],
                    kwargs: dict[str, Any]) -> Any:
    """A Function call, traced as one ``kiln::autograd_function`` op (see :func:`_lower_function`)."""
    fn = _register_function(forward, backward, args, kwargs)
    return _call_function(fn, [args[i] for i in fn.tensor_positions])


def _register_function(forward: fx.GraphModule, backward: fx.GraphModule, args: Sequence[Any],
                       kwargs: dict[str, Any]) -> _Function:
    """A new :class:`_Function` for Dynamo's ``autograd_function_apply(forward, backward,
    *args, **kwargs)``, registered under a fresh key."""
    output = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    outs = output[0]
    single = not isinstance(outs, (tuple, list))
    loc = next((capture_mod.source_location(n) for n in forward.graph.nodes
                if capture_mod.source_location(n)), None)
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
    _name_placeholders_like(forward_gm, [placeholders[i] for i in fn.tensor_positions])
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
    _name_placeholders_like(backward_gm, [n for n in fn.backward.graph.nodes if n.op == "placeholder"])
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
    applies = [n for n in gm.graph.nodes if n.target is _FUNCTION_APPLY] if gm is not None else []
    if _FUNCTION_APPLY is None or len(applies) != 1:
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


def readable_name(dynamo_name: str) -> str:
    """``L_self_modules_fc1_parameters_weight_`` -> ``fc1.weight``; ``L_x_`` -> ``x``."""
    name = re.sub(r"^L_+|_+$", "", dynamo_name)
    name = re.sub(r"_(modules|parameters|buffers)_", ".", name)
    return re.sub(r"^(self|fn)\.", "", name) or dynamo_name


def _name_placeholders_like(traced: fx.GraphModule, source: fx.GraphModule | Sequence[fx.Node]) -> None:
    """Give make_fx's ``argN_1`` placeholders readable names from Dynamo's (FX sanitizes
    them into identifiers, so ``fc1.weight`` becomes ``fc1_weight``); ``source`` is the
    Dynamo graph or its placeholders."""
    rename = getattr(fx.Node, "_rename", None)
    if rename is None:  # names are cosmetic; keep make_fx's on a torch without it
        return
    originals = [n for n in source.graph.nodes if n.op == "placeholder"] \
        if isinstance(source, fx.GraphModule) else list(source)
    traced_inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for node, original in zip(traced_inputs, originals):
        rename(node, readable_name(str(original.target)))


# ---------------------------------------------------------------- registration


def register() -> None:
    """Register :func:`kiln_backend` with Dynamo as ``"kiln"`` (idempotent; imports Dynamo)."""
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry

    if isinstance(getattr(registry, "_BACKENDS", {}).get(BACKEND_NAME), EntryPoint):
        return  # Dynamo found the installed entry point and registers kiln when it loads it
    try:
        registry.register_backend(kiln_backend, name=BACKEND_NAME)
    except AssertionError:  # Dynamo's "duplicate name": already registered (e.g. entry point)
        pass


def _register_quietly() -> None:
    try:
        register()
    except Exception as e:  # noqa: BLE001 - never break torch's import because of kiln
        warnings.warn(f"kiln: could not register the torch.compile backend 'kiln': {e}", stacklevel=2)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``torch._dynamo`` to register kiln after it."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        _remove_hook()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register_quietly()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


_HOOK: _RegisterAfterImport | None = None


def _remove_hook() -> None:
    global _HOOK
    if _HOOK is not None and _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
    _HOOK = None


def install_registration() -> None:
    """Make ``torch.compile(backend="kiln")`` work without importing Dynamo now."""
    global _HOOK
    if "torch._dynamo" in sys.modules:
        _register_quietly()
        return
    if _HOOK is None:
        _HOOK = _RegisterAfterImport()
        sys.meta_path.insert(0, _HOOK)
