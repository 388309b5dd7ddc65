"""PyTorch capture: ATen-level programs (``torch.export`` or FX) to kiln graphs.

Entry points:

* :func:`capture` -- ``nn.Module`` + example inputs -> :class:`Captured` (export, decompose
  only if needed, lower);
* :func:`export_program` -- ``torch.export`` of a module: the training IR itself when kiln
  lowers every node of it, else the program decomposed with :func:`decomposition_table`;
* :func:`capture_program` -- an ``ExportedProgram`` from ``export_program`` -> ``Captured``;
* :func:`capture_fx` -- an ATen-level ``torch.fx.GraphModule`` whose placeholders are all
  tensors (the ``torch.compile`` path) -> ``Captured``;
* :func:`is_supported` -- whether kiln lowers one FX node (the fallback partitioner's test,
  :mod:`kiln.frontends.torch.aten_support`).

The node-by-node lowering itself is :class:`kiln.frontends.torch.lowering.Lowerer`.

Why the decomposition is skipped when it can be: ``run_decompositions`` re-traces the whole
program (on GPT-2 small it costs more than the export itself), and kiln's rules lower the
training IR's high-level ops (``linear``, ``layer_norm``, ``conv2d``, ``batch_norm``,
``scaled_dot_product_attention``, views, eval-mode ``dropout``...) directly.  In-place calls
are lowered functionally only where that is provably unobservable
(:mod:`kiln.frontends.torch.aten_inplace`); any other in-place call, any mutation of inputs or
buffers, and any op without a rule send the program through the decomposition, exactly as
before.  The result is the same kiln graph semantics either way.

Guarantees of a captured graph:

* every kiln value has exactly the shape and dtype PyTorch computed for the ATen value it
  stands for (a ``cast`` is inserted where kiln's promotion differs; a shape difference is a
  kiln bug and raises :class:`~kiln.frontends.errors.CaptureError`);
* parameters and buffers are graph params named by their module path, and
  ``Captured.params`` holds the live tensors of the model (never copies);
* lifted tensor constants become kiln constants;
* every node's ``loc`` is the user's source line, ``"file.py:LINE in fn: code"``, when
  PyTorch recorded a stack trace;
* any ATen op or argument combination kiln cannot lower raises
  :class:`~kiln.frontends.errors.UnsupportedOpError` naming the op, its operand types and the
  source line; only static shapes are supported today.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree

from kiln.frontends.errors import CaptureError, UnsupportedOpError
from kiln.ir import Graph, Value
from kiln.ir.sizes import graph_sizes
from kiln.runtime.module import INPUT_UPDATE_PREFIX

from .aten import LoweringContext, has_kiln_dtype, kept_ops, kiln_dtype, lowers
from .aten_support import (
    describe_value,
    is_supported,  # noqa: F401  (re-exported: the fallback partitioner's test)
    source_location,
    unsupported_reason,
)
from .lowering import (
    Lowerer,
    add_buffer_updates,
    bind_seed,
    drop_effect_tokens,
    fresh_name,
    placeholder_type,
    to_numpy,
)
from .symbolic import dim_names, naming, shape_env_of, size_ranges, to_dim


def decomposition_table() -> dict[Any, Any]:
    """The decomposition table kiln exports with: core ATen minus the ops kiln maps directly.

    Starts from ``torch.export.default_decompositions()`` and removes every op whose rule
    keeps it whole (``@lowers(..., keep=True)``, :func:`kiln.frontends.torch.aten.kept_ops`:
    silu, layer/group/RMS norm, softmax/log_softmax, scaled dot-product attention, every
    upsampling mode, matmul/linear, tril/triu, max/adaptive pooling, masked_fill, dropout,
    roll, diagonal, unfold...), so they reach kiln whole (gelu, conv, batch norm,
    embedding... are core ATen and stay whole anyway).  Returns a new plain dict (op
    overload -> decomposition) that callers may edit; usable with
    ``ExportedProgram.run_decompositions`` and ``make_fx(decomposition_table=...)``.
    """
    table = torch.export.default_decompositions()
    for op in kept_ops():
        if op in table:
            table.pop(op)
    return dict(table.items())


_UNDECOMPOSED = "kiln_undecomposed"  # graph_module.meta flag of programs export_program kept whole


def export_program(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                   decompose: bool | None = None, dynamic_shapes: Any = None
                   ) -> torch.export.ExportedProgram:
    """``torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=...)``,
    decomposed only if needed.

    ``dynamic_shapes`` is torch.export's argument (``{"x": {0: Dim("batch", min=2, max=64)}}``,
    ``Dim.AUTO``, ``Dim.DYNAMIC``); the names of the user's ``Dim`` objects are kept on the
    program (:data:`DIM_NAMES`) so that capture names its sizes after them.

    ``decompose=None`` (the default) returns the exported training IR itself when kiln lowers
    every node of it (:func:`lowering_blockers` is empty): re-tracing it through
    ``run_decompositions`` costs more than the export and changes nothing kiln needs.
    Otherwise -- and always with ``decompose=True`` -- it returns
    :func:`decompose_program` of it, functionalized and decomposed with
    :func:`decomposition_table`.  ``decompose=False`` never decomposes.
    """
    _refuse_cumulative_batch_norm(model)
    args, kwargs = _unaliased(tuple(args), dict(kwargs or {}))
    with marked_function_outputs():
        ep = torch.export.export(model, tuple(args), dict(kwargs or {}), strict=False,
                                 dynamic_shapes=dynamic_shapes)
    names = _dim_names(ep, _ordered_shapes(model, args, kwargs, dynamic_shapes), args, kwargs)
    if decompose is True or (decompose is None and lowering_blockers(ep)):
        ep = ep.run_decompositions(decomposition_table())
        ep.graph_module.meta[DIM_NAMES] = names
        return ep
    ep.graph_module.meta[_UNDECOMPOSED] = True
    ep.graph_module.meta[DIM_NAMES] = names
    return ep


DIM_NAMES = "kiln_dim_names"
"""``graph_module.meta`` key of an exported program's torch symbol -> ``Dim`` name map."""


def _unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs with every repeated tensor object replaced by a copy: torch.export
    traces one tensor passed twice (``(ids, ids)`` as input and target) as one input, so the
    program would read the second argument where the model reads the first."""
    seen: set[int] = set()

    def copy_repeat(t: torch.Tensor) -> torch.Tensor:
        if id(t) in seen:
            return t.detach().clone().requires_grad_(t.requires_grad)
        seen.add(id(t))
        return t

    return pytree.tree_map_only(torch.Tensor, copy_repeat, (args, kwargs))


def _ordered_shapes(model: torch.nn.Module, args: tuple, kwargs: dict | None, dynamic_shapes: Any) -> Any:
    """``dynamic_shapes`` as a list in the order of the flattened ``(args, kwargs)``: a dict
    keyed by argument names is ordered by ``forward``'s signature."""
    if not isinstance(dynamic_shapes, dict):
        return dynamic_shapes
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return dynamic_shapes
    positional = params[: len(args)]
    return [dynamic_shapes.get(p) for p in positional] + [dynamic_shapes.get(k) for k in (kwargs or {})]


def _dim_names(ep: torch.export.ExportedProgram, dynamic_shapes: Any, args: tuple,
               kwargs: dict | None) -> dict[str, str]:
    """torch symbol name (``s77``) -> the user's ``Dim`` name (``batch``) of every input axis
    ``dynamic_shapes`` names."""
    if dynamic_shapes is None:
        return {}
    from torch.export.graph_signature import InputKind

    flat = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    by_axis = dim_names(dynamic_shapes, flat, None)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = [n for n, spec in zip(placeholders, ep.graph_signature.input_specs)
            if spec.kind == InputKind.USER_INPUT]
    names: dict[str, str] = {}
    for (index, axis), name in by_axis.items():
        if index >= len(user):
            continue
        val = user[index].meta.get("val")
        if isinstance(val, torch.Tensor) and axis < val.dim():
            d = val.shape[axis]
            if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                names.setdefault(d.node.expr.name, name)
    return names


# ----------------------------------------------- torch.autograd.Function under export
# torch.export traces a torch.autograd.Function's forward inline and drops its backward;
# differentiating the inlined forward would silently replace the user's backward (a
# straight-through estimator's is deliberately not the forward's derivative).  While kiln
# exports, ``Function.apply`` therefore asks Dynamo for the Function's forward and backward
# bodies, as ``torch.compile`` sees them, and records the call as one
# ``kiln::autograd_function`` op (:func:`kiln.frontends.torch.autograd_function.export_function`),
# lowered to a ``custom_vjp`` node with the user's backward.  When Dynamo cannot trace the
# Function, every tensor it returns passes through ``kiln::function_output`` instead, which
# kiln lowers to a ``custom_vjp`` node without a backward: inference inlines it, and
# gradients through it raise a KilnError naming the Function and saying why its backward is
# unknown.


@torch.library.custom_op("kiln::function_output", mutates_args=())
def _function_output(x: torch.Tensor, name: str, why: str) -> torch.Tensor:
    """An output of the torch.autograd.Function ``name`` whose backward kiln does not know,
    for the reason ``why`` (identity)."""
    return x.clone()


@_function_output.register_fake
def _function_output_fake(x: torch.Tensor, name: str, why: str) -> torch.Tensor:
    return x.clone()


def _function_output_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return grad, None, None


_function_output.register_autograd(_function_output_backward)


class marked_function_outputs:
    """Context manager: ``torch.autograd.Function.apply`` of a user's Function records the
    call as ``kiln::autograd_function`` with the Function's own backward, or marks its tensor
    outputs with ``kiln::function_output`` when Dynamo cannot trace it (see above); restores
    ``apply`` on exit."""

    def __enter__(self) -> None:
        function = torch.autograd.Function
        self._original = function.__dict__["apply"]
        original = self._original.__func__

        def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
            from . import autograd_function as function_mod  # it captures with this module

            if str(getattr(cls, "__module__", "")).startswith("torch.") or function_mod.tracing_function():
                return original(cls, *args, **kwargs)  # torch's own Functions (custom ops' autograd...)
            try:
                return function_mod.export_function(cls, args, kwargs)
            except function_mod.FunctionNotTraced as e:
                why = str(e)
            out = original(cls, *args, **kwargs)
            name = getattr(cls, "__qualname__", "torch.autograd.Function")
            return pytree.tree_map_only(torch.Tensor, lambda t: _function_output(t, name, why), out)

        function.apply = classmethod(apply)

    def __exit__(self, *exc: object) -> None:
        torch.autograd.Function.apply = self._original


@lowers(torch.ops.kiln.function_output.default)
def _lower_function_output(ctx: LoweringContext, x: Value, name: str, why: str = "") -> Value:
    """A ``custom_vjp`` node whose forward is the identity and whose backward is unknown."""
    forward = Graph(f"{name}.forward")
    forward.set_outputs([forward.add_input("x", x.type)])
    return ctx.graph.add_node("custom_vjp", [x], {"forward": forward, "name": name, "why": why},
                              loc=ctx.loc).output


def _refuse_cumulative_batch_norm(model: torch.nn.Module) -> None:
    """Train-mode batch norm with ``momentum=None`` (a cumulative moving average) computes its
    update factor as ``1 / float(num_batches_tracked)``, from a buffer's value, which
    torch.export cannot trace: say so, naming the module, before torch.export fails."""
    from torch.nn.modules.batchnorm import _BatchNorm

    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) and module.training and module.track_running_stats \
                and module.momentum is None:
            raise UnsupportedOpError(
                f"{type(module).__name__} '{name or type(module).__name__}'", "momentum=None", None,
                "train-mode batch norm with momentum=None (a cumulative moving average) divides "
                "by the value of its num_batches_tracked buffer, which torch.export cannot trace",
                hint="Train it through torch.compile(model, backend='kiln'), which compiles this "
                "module; or give it a float momentum (e.g. momentum=0.1); or call model.eval() "
                "for inference.")


def is_undecomposed(ep: torch.export.ExportedProgram) -> bool:
    """Whether ``ep`` is a program :func:`export_program` returned without decomposing it."""
    return bool(ep.graph_module.meta.get(_UNDECOMPOSED))


def decompose_program(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` functionalized and decomposed with :func:`decomposition_table`, as
    :func:`export_program` does when it must; other programs are returned unchanged."""
    if not is_undecomposed(ep):
        return ep
    decomposed = ep.run_decompositions(decomposition_table())
    decomposed.graph_module.meta.pop(_UNDECOMPOSED, None)
    decomposed.graph_module.meta[DIM_NAMES] = ep.graph_module.meta.get(DIM_NAMES) or {}
    return decomposed


def lowering_blockers(ep: torch.export.ExportedProgram, limit: int = 8) -> list[str]:
    """Why kiln cannot lower the exported program ``ep`` as it is (at most ``limit`` reasons;
    empty when it can): nodes :func:`unsupported_reason` refuses, node kinds other than
    placeholders, calls and the output, inputs other than tensors, parameters, buffers and
    constants, outputs that update state or are not tensors."""
    from torch.export.graph_signature import InputKind, OutputKind

    reasons: list[str] = []
    for node in ep.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        reason = unsupported_reason(node) if node.op == "call_function" else f"FX node kind {node.op}"
        if reason is not None:
            reasons.append(f"{node.name} ({node.target}): {reason}")
    kept = (InputKind.USER_INPUT, InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR,
            InputKind.TOKEN)
    reasons += [f"input {s.arg} of kind {s.kind.name}" for s in ep.graph_signature.input_specs
                if s.kind not in kept]
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    for arg, spec in zip(out_node.args[0], ep.graph_signature.output_specs):
        if spec.kind == OutputKind.TOKEN:
            continue
        if spec.kind != OutputKind.USER_OUTPUT:
            reasons.append(f"output {spec.arg} of kind {spec.kind.name}")
        elif not isinstance(arg, torch.fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
            reasons.append(f"output {describe_value(arg)} is not a tensor")
    return reasons[:limit]


def user_input_types(ep: torch.export.ExportedProgram) -> tuple[dict[int, Any], dict[str, Any]]:
    """The kiln type of each tensor user input of ``ep`` (flat user-input index -> type,
    symbolic where the program is) and the ranges of their sizes."""
    from torch.export.graph_signature import InputKind

    from .aten import tensor_type

    types: dict[int, Any] = {}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = [n for n, spec in zip(placeholders, ep.graph_signature.input_specs)
            if spec.kind == InputKind.USER_INPUT]
    with naming(ep.graph_module.meta.get(DIM_NAMES) or {}):
        for i, node in enumerate(user):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and has_kiln_dtype(val.dtype):
                types[i] = tensor_type(val)
        names: set[str] = set()
        for t in types.values():
            names |= {n for d in t.shape if not isinstance(d, int) for n in d.symbols}
        sizes = size_ranges(ep.range_constraints, names)
    return types, sizes


@dataclass
class Captured:
    """A captured program: the kiln graph plus what is needed to call it like the model.

    Attributes:
        graph: the kiln graph; its inputs are the user's tensor inputs in call order, its
            params the model's parameters and buffers.
        params: graph param name -> the live parameter/buffer tensor (not a copy), in the
            order of ``graph.params``.
        input_names: names of ``graph.inputs``, in call order.
        in_spec, out_spec: pytree specs of the exported program's (args, kwargs) and outputs;
            ``None`` on the FX path.
        input_positions: for each graph input, its index among the flattened user inputs
            (non-tensor user inputs are specialized into the graph and have no graph input).
        user_input_names: the exported program's name of every flattened user input,
            tensors or not, in order; empty on the FX path.
        param_targets: graph param name -> the model attribute path of its tensor
            (``"fc1.weight"``), so a cached capture can bind a live model; empty on the FX path.
    """

    graph: Graph
    params: dict[str, torch.Tensor]
    input_names: list[str]
    in_spec: Any = None
    out_spec: Any = None
    input_positions: list[int] = field(default_factory=list)
    user_input_names: list[str] = field(default_factory=list)
    param_targets: dict[str, str] = field(default_factory=dict)
    size_inputs: dict[int, Any] = field(default_factory=dict)
    """FX path: placeholder index -> the kiln size of each size placeholder (a ``SymInt``
    Dynamo passes); not graph inputs, the sizes are bound from the tensors' shapes."""


# -------------------------------------------------------------- entry points
def capture_program(ep: torch.export.ExportedProgram, name: str = "main") -> Captured:
    """Lower an exported program from :func:`export_program` to a kiln graph.

    A program that ``export_program`` kept undecomposed and that still fails to lower is
    decomposed (:func:`decompose_program`) and lowered again, so the result, or the error,
    is the one the decomposed program gives.
    """
    try:
        return _lower_program(ep, name)
    except (UnsupportedOpError, CaptureError):
        if not is_undecomposed(ep):
            raise
    return _lower_program(decompose_program(ep), name)


def _lower_program(ep: torch.export.ExportedProgram, name: str) -> Captured:
    with naming(ep.graph_module.meta.get(DIM_NAMES) or {}):
        captured = _lower_program_named(ep, name)
        captured.graph.sizes = size_ranges(ep.range_constraints, set(graph_sizes(captured.graph)))
    return captured


def _lower_program_named(ep: torch.export.ExportedProgram, name: str) -> Captured:
    from torch.export.graph_signature import InputKind, OutputKind

    graph = Graph(name)
    drop_effect_tokens(ep.graph)
    lowerer = Lowerer(graph, ep.graph)
    used: set[str] = set()
    params: dict[str, torch.Tensor] = {}
    targets: dict[str, str] = {}
    input_names: list[str] = []
    user_names: list[str] = []
    positions: list[int] = []
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    input_of: dict[str, str] = {}  # placeholder name -> kiln input name
    user_index = 0
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        if spec.kind == InputKind.USER_INPUT:
            user_names.append(spec.arg.name)
            if isinstance(node.meta.get("val"), torch.Tensor):
                v = graph.add_input(fresh_name(node.name, used), placeholder_type(node))
                lowerer.bind(node, v)
                input_of[spec.arg.name] = v.name
                input_names.append(v.name)
                positions.append(user_index)
            user_index += 1
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            persistent = spec.kind == InputKind.PARAMETER or spec.persistent
            tensor = ep.state_dict[spec.target] if persistent else ep.constants[spec.target]
            v = graph.add_param(fresh_name(spec.target, used), placeholder_type(node))
            lowerer.bind(node, v)
            params[v.name] = tensor
            targets[v.name] = spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            data = to_numpy(ep.constants[spec.target])
            lowerer.bind(node, graph.add_constant(data, kiln_dtype(ep.constants[spec.target].dtype)))
        elif spec.kind == InputKind.TOKEN:  # see drop_effect_tokens
            lowerer.bind(node, None)
        else:
            raise UnsupportedOpError("placeholder", describe_value(node.meta.get("val")), None,
                                     f"input '{node.name}' of kind {spec.kind.name} is not supported",
                                     hint="Capture a model whose inputs are tensors, parameters and "
                                     "buffers only.")
    lowerer.lower_all(ep.graph)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    outputs = []
    updates: list[tuple[Any, str]] = []
    input_updates: list[tuple[Any, str]] = []
    param_of_target = {target: name for name, target in targets.items()}
    for arg, spec in zip(out_node.args[0], ep.graph_signature.output_specs):
        if spec.kind == OutputKind.TOKEN:
            continue
        if spec.kind == OutputKind.BUFFER_MUTATION and spec.target in param_of_target:
            updates.append((lowerer.output(out_node, arg, f"the new value of buffer {spec.target}"),
                            param_of_target[spec.target]))
            continue
        if spec.kind == OutputKind.USER_INPUT_MUTATION and spec.target in input_of:
            input_updates.append((lowerer.output(out_node, arg, f"the new value of input {spec.target}"),
                                  input_of[spec.target]))
            continue
        if spec.kind != OutputKind.USER_OUTPUT:
            raise UnsupportedOpError(
                str(getattr(arg, "target", "output")), describe_value(arg), source_location(arg)
                if isinstance(arg, torch.fx.Node) else None,
                f"the program updates {spec.kind.name.lower()} '{spec.target}' in place",
                hint="kiln compiles programs whose only in-place updates are of buffers and "
                "tensor inputs: avoid in-place updates of parameters.")
        outputs.append(lowerer.output(out_node, arg, "an output"))
    graph.set_outputs(outputs)
    add_buffer_updates(graph, updates)
    add_buffer_updates(graph, input_updates, INPUT_UPDATE_PREFIX)
    bind_seed(graph, params)
    return Captured(graph, params, input_names, ep.call_spec.in_spec, ep.call_spec.out_spec,
                    positions, user_names, targets)


def _ensure_meta(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Fill ``node.meta["val"]`` by fake-tensor propagation when the tracer left it out."""
    if all("val" in n.meta for n in gm.graph.nodes if n.op not in ("output", "get_attr")):
        return
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


def capture_fx(gm: torch.fx.GraphModule, example_inputs: list, *,
               param_indices: set[int] | frozenset[int] = frozenset(), name: str = "main"
               ) -> Captured:
    """Lower an ATen-level FX graph whose placeholders are all tensors.

    Placeholders at ``param_indices`` become graph params (``Captured.params`` maps their
    names to ``example_inputs[i]`` itself), the others user inputs in placeholder order.
    ``get_attr`` tensors become constants.  Outputs are the FX output's flattened values,
    which must all be tensors.
    """
    _ensure_meta(gm, example_inputs)
    graph = Graph(name)
    lowerer = Lowerer(graph, gm.graph)
    used: set[str] = set()
    params: dict[str, torch.Tensor] = {}
    input_names: list[str] = []
    positions: list[int] = []
    sizes: dict[int, Any] = {}
    index = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if is_size_placeholder(node):  # a size Dynamo passes: bound from tensor shapes
                lowerer.bind(node, to_dim(node.meta["val"]))
                sizes[index] = lowerer.env[node]
                index += 1
                continue
            if not isinstance(node.meta.get("val"), torch.Tensor):
                raise UnsupportedOpError("placeholder", describe_value(node.meta.get("val")), None,
                                         f"input '{node.name}' is not a tensor",
                                         hint="Pass an FX graph whose placeholders are all tensors.")
            if index in param_indices:
                v = graph.add_param(fresh_name(node.name, used), placeholder_type(node))
                params[v.name] = example_inputs[index]
            else:
                v = graph.add_input(fresh_name(node.name, used), placeholder_type(node))
                input_names.append(v.name)
                positions.append(index)
            lowerer.bind(node, v)
            index += 1
        elif node.op == "get_attr":
            attr = operator.attrgetter(node.target)(gm)
            if not isinstance(attr, torch.Tensor):
                raise UnsupportedOpError("get_attr", repr(attr), None,
                                         f"attribute '{node.target}' is not a tensor",
                                         hint="Pass an ATen-level graph (make_fx / aot_export).")
            lowerer.bind(node, graph.add_constant(to_numpy(attr), kiln_dtype(attr.dtype)))
        elif node.op == "call_function":
            lowerer.lower(node)
        elif node.op == "output":
            flat = pytree.tree_leaves(node.args[0], is_leaf=lambda x: x is None)
            graph.set_outputs([lowerer.output(node, a, f"output {i}") for i, a in enumerate(flat)])
            bind_seed(graph, params)
        else:
            raise UnsupportedOpError(node.op, str(node.target), source_location(node),
                                     f"FX node kind '{node.op}' is not supported",
                                     hint="Pass an ATen-level graph (make_fx / aot_export).")
    _record_ranges(graph, [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    _refuse_unbound_sizes(graph, sizes)
    return Captured(graph, params, input_names, None, None, positions, size_inputs=sizes)


def is_size_placeholder(node: torch.fx.Node) -> bool:
    """Whether an FX placeholder is a size (a ``SymInt`` or int Dynamo passes), not a tensor."""
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool)


def _record_ranges(graph: Graph, values: list[Any]) -> None:
    """``graph.sizes`` from the ShapeEnv behind ``values``' symbolic sizes."""
    env = shape_env_of(values)
    if env is not None and graph_sizes(graph):
        graph.sizes = size_ranges(env.var_to_range, set(graph_sizes(graph)))


def _refuse_unbound_sizes(graph: Graph, sizes: dict[int, Any]) -> None:
    """A size input that no tensor input's shape determines (a dynamic Python int) cannot be
    bound at run time from the shapes: refuse it, naming it."""
    known = graph_sizes(graph)
    for index, dim in sizes.items():
        if isinstance(dim, int):
            continue
        missing = dim.symbols - known
        if missing:
            raise UnsupportedOpError(
                "placeholder", str(dim), None,
                f"input {index} is a dynamic integer {dim} that no tensor input's shape holds",
                hint="Pass the number as a tensor, or mark it static "
                "(torch._dynamo.config.specialize_int = True, or torch.compile(dynamic=False)).")


def capture(model: torch.nn.Module, example_inputs: Sequence[Any],
            example_kwargs: dict | None = None) -> Captured:
    """Export ``model`` on the example inputs and lower it: ``capture_program(export_program(...))``."""
    return capture_program(export_program(model, tuple(example_inputs), example_kwargs))
