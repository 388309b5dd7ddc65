"""The public entry points: :func:`compile` and :func:`capture`.

``kiln.compile(model, example_inputs)`` first looks the model up in the capture cache
(:mod:`kiln.frontends.torch.capture_cache`; key: a fingerprint of the model's classes, attributes,
parameter shapes and the example inputs, computed without tracing).  On a hit it parses
the cached kiln graph, binds the live parameters and goes on to the passes.  Otherwise it
exports the model with ``torch.export`` (decomposed only when kiln cannot lower the
training IR as it is, see :func:`kiln.frontends.torch.capture.export_program`), then

* when kiln supports every ATen node: captures the whole program into one kiln graph, runs
  the optional ``passes`` over it and builds it with the backend;
* otherwise: with ``strict=True`` raises the first node's
  :class:`~kiln.frontends.errors.UnsupportedOpError`; by default runs the exported graph with
  its supported partitions compiled by kiln and the rest in PyTorch, and warns once
  (:class:`~kiln.frontends.torch.fallback.KilnFallbackWarning`), exactly as
  ``torch.compile(backend="kiln")`` does.

Programs kiln cannot compile for a fixed input shape are refused at the export with
:class:`~kiln.frontends.errors.UnsupportedOpError`, saying why: an op whose result or result
shape depends on tensor values (``torch.equal``, ``allclose``, ``nonzero``...), a Python
branch on a tensor value; complex inputs (kiln has no complex dtypes) raise ``KilnError``.

The passes' result is cached too, keyed by the captured graph's text and the pipeline text.
A hit needs a fingerprint that describes everything the program's code can read (see
:mod:`kiln.frontends.torch.fingerprint`).  The cache switches are arguments of
:func:`compile`, not backend options, and every backend accepts them: ``cache=False`` turns
off every cache kiln has (this one and the backend's compile cache, where the backend has
one; :mod:`kiln.frontends.options`), ``capture_cache=False`` this one only, and
``KILN_CAPTURE_CACHE=0`` this one in every compile.  ``compiled.stats["capture_cache"]`` and
``["passes_cache"]`` say ``"hit"``, ``"miss"``, ``"off"`` or ``"uncacheable"``.

Either way the result is a :class:`~kiln.runtime.CompiledModule`: called like the model,
checks its inputs first, reads the model's live parameters at every call, and returns the
model's output structure.  It takes part in autograd
(:class:`~kiln.frontends.torch.autograd.TrainableCompiledModule`): under ``torch.no_grad()``, or
when nothing requires grad, it runs the inference graph; otherwise kiln's forward graph,
and ``.backward()`` runs kiln's backward graph.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from kiln.backends import DEFAULT_BACKEND, Backend, get_backend
from kiln.ir import Graph, KilnError
from kiln.passes.amp import AutoMixedPrecision, low_dtype
from kiln.passes.manager import PassManager
from kiln.passes.pipeline import (  # noqa: F401  (GraphTransform, resolve_passes: re-exported)
    GraphTransform, PassTransform, default_pipeline, resolve_passes,
)
from kiln.runtime import CompiledModule, InputSlot, tensor_type

from kiln.frontends.errors import CaptureError, UnsupportedOpError
from kiln.frontends.options import CacheSwitch
from kiln.frontends.torch import capture as capture_mod
from kiln.frontends.torch.aten import has_kiln_dtype
from kiln.frontends.torch.autograd import DifferentiableGraph, GradModeRunner, TrainableCompiledModule
from kiln.frontends.torch.capture_cache import CaptureCache
from kiln.frontends.torch.fallback import CompiledFx, build_for_sizes, compile_fx, unsupported_nodes
from kiln.frontends.torch.symbolic import naming


def compile(model_or_function: torch.nn.Module | Callable[..., Any], example_inputs: Any,
            backend: str | Backend = DEFAULT_BACKEND, *, passes: Any = "default", strict: bool = False,
            example_kwargs: Mapping[str, Any] | None = None, cache: bool = True,
            cache_dir: str | None = None, capture_cache: bool | None = None, amp: str | None = None,
            dynamic_shapes: Any = None, tune: float | None = None, **options: Any) -> CompiledModule:
    """Compile a module or function for inference with kiln (see the module docstring).

    Args:
        model_or_function: an ``nn.Module`` (put it in eval mode first) or a function of tensors
            (a plain function, a builtin such as ``torch.exp``, or an object with ``__call__``).
        example_inputs: the positional arguments (a tuple; a single tensor is accepted).
            Shapes and dtypes are fixed by them; non-tensor arguments are specialized.
        backend: a registered backend name (``kiln.backends.available_backends()``) or a
            :class:`~kiln.backends.Backend` instance.
        passes: ``"default"`` (:func:`kiln.passes.default_pipeline`), ``"learned"`` (passes
            ordered per graph by a trained policy, :func:`kiln.passes.learned_pipeline`),
            ``None`` for no passes,
            a pass pipeline text such as ``"cse,dce"``, a sequence of passes, or any object
            whose ``run(graph)`` returns a Graph or a result with ``.graph``.
        strict: raise :class:`UnsupportedOpError` instead of running unsupported ops in
            PyTorch.
        example_kwargs: keyword arguments of the example call.
        cache: ``False`` turns off every cache kiln has: the capture cache and the backend's
            compile cache, where the backend has one (a backend without one ignores it).
        cache_dir: the folder of those caches (default ``KILN_CACHE_DIR`` or
            ``~/.cache/kiln``).
        capture_cache: ``False`` turns off the capture cache only (default: as ``cache``).
        amp: ``None`` (float32 as given), ``"bf16"``/``"bfloat16"`` or ``"f16"``/``"float16"``:
            the ``amp`` pass (:mod:`kiln.passes.amp`) runs before fusion (:func:`amp_passes`),
            so matmuls, convolutions and attention compute in that dtype and reductions and
            normalizations in float32; inputs, parameters and outputs keep their dtypes.
        dynamic_shapes: ``torch.export``'s argument marking axes dynamic, e.g.
            ``{"x": {0: Dim("batch", min=2, max=64)}}`` (also ``Dim.AUTO``, ``Dim.DYNAMIC``).
            The graph is compiled once with symbolic sizes, named after the ``Dim`` objects,
            and their ranges (``graph.sizes``; the minimum is at least 2: torch and kiln
            specialize sizes 0 and 1).  Every call binds the sizes from the input shapes and
            checks them against the ranges before running: a size out of range raises
            :class:`~kiln.ir.sizes.SizeError` naming the input, axis, range and value.
        tune: seconds of loop-schedule autotuning (:func:`kiln.tuning.autotune.model.tune_model`,
            cpu backend) before the build: the tuned schedules are stored as records in the
            compile-cache folder, and this build (and every later one) replays them,
            legality re-checked.
        **options: options of the backend, e.g. ``float64=True`` for ``"reference"``.
    """
    module = as_module(model_or_function)
    args = as_args(example_inputs)
    if tune:
        from kiln.tuning.autotune.model import tune_model

        tune_model(module, args, float(tune), cache_dir=cache_dir, threads=options.get("threads"))
    kwargs = dict(example_kwargs or {})
    builder = get_backend(backend)
    switch = CacheSwitch(bool(cache), cache_dir)
    options = switch.for_backend(builder, options)
    builder.resolve_options(options)  # reject unknown options before the slow export
    captures = CaptureCache.open(switch.enabled if capture_cache is None else bool(capture_cache),
                                 cache_dir)
    transform = amp_passes(passes, amp)
    name = _model_name(model_or_function)
    key = captures.capture_key(module, args, kwargs, name, dynamic_shapes)
    captured = captures.load_capture(key, module)
    if captured is not None:
        return _compile_whole(captured, args, kwargs, builder, options, transform, name, captures, "hit")
    ep = _export(module, args, kwargs, dynamic_shapes)
    state = "miss" if key is not None else ("uncacheable" if captures.enabled else "off")
    if strict:  # capture raises the first unsupported node's UnsupportedOpError
        captured = capture_mod.capture_program(ep, name=name)
        captures.store_capture(key, captured)
        return _compile_whole(captured, args, kwargs, builder, options, transform, name, captures, state)
    if not unsupported_nodes(ep.graph_module):
        try:
            captured = capture_mod.capture_program(ep, name=name)
        except (UnsupportedOpError, CaptureError):
            pass  # e.g. an in-place buffer update, which the fallback runner applies
        else:
            captures.store_capture(key, captured)
            return _compile_whole(captured, args, kwargs, builder, options, transform, name, captures, state)
    ep = capture_mod.decompose_program(ep)  # the fallback runs the functional, decomposed program
    return _compile_with_fallback(module, ep, args, kwargs, builder, options, transform, name)


def amp_passes(passes: Any, amp: str | None) -> PassTransform | None:
    """``passes`` resolved (:func:`kiln.passes.pipeline.resolve_passes`) with the ``amp`` pass
    of dtype ``amp`` placed before fusion: for ``"default"``, the default pipeline's
    clean-ups to their fixpoint, then ``amp``, then ``fuse``; for pipeline text or a list of
    passes, right before its first ``fuse`` (at the end when it has none); for ``None``,
    alone; for any other pipeline object (``"learned"``, a custom ``run``), before it.
    ``amp=None`` leaves ``passes`` as they are.  The result's ``identity`` holds the amp pass
    with its dtype, so cached pass results never mix precisions."""
    if amp is None:
        return resolve_passes(passes)
    mixed = AutoMixedPrecision(low_dtype(amp).short)
    if isinstance(passes, str) and passes == "default":
        return _chain(resolve_passes(default_pipeline(fuse=False)), resolve_passes(PassManager([mixed, "fuse"])))
    if passes is None or (isinstance(passes, (str, list, tuple)) and passes != "learned"):
        manager = PassManager(passes if passes is not None else [])
        names = [getattr(p, "name", "") for p in manager.passes]
        at = names.index("fuse") if "fuse" in names else len(names)
        return resolve_passes(PassManager([*manager.passes[:at], mixed, *manager.passes[at:]]))
    return _chain(resolve_passes(PassManager([mixed])), resolve_passes(passes))


def _chain(first: PassTransform | None, second: PassTransform | None) -> PassTransform | None:
    """``second(first(graph))``; cacheable when both are."""
    stages = [t for t in (first, second) if t is not None]
    if not stages:
        return None
    identities = [t.identity for t in stages]
    identity = None if None in identities else " | ".join(identities)

    def run(graph: Graph) -> Graph:
        for stage in stages:
            graph = stage(graph)
        return graph
    return PassTransform(run, identity)


def capture(model: torch.nn.Module | Callable[..., Any], example_inputs: Any,
            example_kwargs: Mapping[str, Any] | None = None, *, dynamic_shapes: Any = None) -> Graph:
    """The kiln graph of ``model`` on the example inputs (symbolic where ``dynamic_shapes``,
    torch.export's argument, marks axes dynamic). Always strict: an ATen op kiln cannot
    lower raises :class:`UnsupportedOpError` naming the op and the source line."""
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    captured = capture_mod.capture_program(_export(as_module(model), args, kwargs, dynamic_shapes))
    return captured.graph


# ------------------------------------------------------------------ export errors

_DATA_DEPENDENT_HINT = (
    "kiln compiles programs whose shapes and control flow follow from the input shapes alone. "
    "Compute this part in PyTorch outside the compiled function, or use "
    "torch.compile(model, backend='kiln'), which runs it in PyTorch (a graph break)."
)


def _input_types(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    leaves = pytree.tree_leaves((args, kwargs))
    return ", ".join(str(tensor_type(t)) if isinstance(t, torch.Tensor) and has_kiln_dtype(t.dtype)
                     else (f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else repr(t))
                     for t in leaves)


def _check_input_dtypes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for i, t in enumerate(pytree.tree_leaves((args, kwargs))):
        if isinstance(t, torch.Tensor) and not has_kiln_dtype(t.dtype):
            what = "complex numbers" if t.is_complex() else f"dtype {t.dtype}"
            raise KilnError(
                f"kiln cannot compile a program with input {i} of type {t.dtype}{list(t.shape)}: kiln has "
                f"no {what} (inputs: {_input_types(args, kwargs)}). Pass real tensors (e.g. "
                "torch.view_as_real(x)) or run this program in PyTorch.")


def _export(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            dynamic_shapes: Any = None) -> ExportedProgram:
    """:func:`capture_mod.export_program`, with torch.export's refusals of data-dependent
    programs (an op whose result or shape depends on tensor values, or a branch on one)
    turned into :class:`UnsupportedOpError`."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import (
        GuardOnDataDependentSymNode,
        PendingUnbackedSymbolNotFound,
    )

    _check_input_dtypes(args, kwargs)
    try:
        return capture_mod.export_program(module, args, kwargs, dynamic_shapes=dynamic_shapes)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        func = getattr(e, "func", None)
        kind = "output shape" if isinstance(e, DynamicOutputShapeException) else "result"
        raise UnsupportedOpError(
            str(func) if func is not None else "<data-dependent op>", _input_types(args, kwargs), None,
            f"its {kind} depends on the values of its inputs, not only their shapes "
            "(a data-dependent op)", hint=_DATA_DEPENDENT_HINT) from e
    except (GuardOnDataDependentSymNode, PendingUnbackedSymbolNotFound) as e:
        first = str(e).strip().split("\n")[0]
        raise UnsupportedOpError(
            "<data-dependent program>", _input_types(args, kwargs), None,
            f"the program branches on, or sizes a result by, tensor values ({first})",
            hint=_DATA_DEPENDENT_HINT) from e


# ------------------------------------------------------------------ arguments


class _FunctionModule(torch.nn.Module):
    """A plain function as a module; its signature stays visible to ``torch.export``."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.forward = fn  # an instance attribute keeps the function's own parameter names


def _forwarding(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind a Python ``(*args, **kwargs)`` signature, named after it."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    call.__name__ = getattr(fn, "__name__", "function")
    return call


def as_module(model_or_function: Any) -> torch.nn.Module:
    """The model itself, or a plain callable wrapped in a parameterless module."""
    if isinstance(model_or_function, torch.nn.Module):
        return model_or_function
    if callable(model_or_function):
        call = vars(type(model_or_function)).get("__call__") or type(model_or_function).__call__
        if not hasattr(model_or_function, "__code__") and hasattr(call, "__code__"):
            # an object with a Python __call__: compile the bound method (torch.export reads
            # the signature from its code)
            return _FunctionModule(model_or_function.__call__)
        try:
            inspect.signature(model_or_function)
        except (TypeError, ValueError):
            # a builtin (torch.exp, F.gelu) has no signature torch.export could read
            return _FunctionModule(_forwarding(model_or_function))
        return _FunctionModule(model_or_function)
    raise TypeError(
        f"kiln.compile expects an nn.Module or a function, got {type(model_or_function).__name__}")


def as_args(example_inputs: Any) -> tuple[Any, ...]:
    """Example positional arguments as a tuple (a lone tensor becomes a 1-tuple)."""
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    raise TypeError(
        f"example_inputs must be a tuple of positional arguments (or one tensor), got "
        f"{type(example_inputs).__name__}; pass keyword arguments as example_kwargs"
    )


def _model_name(model_or_function: Any) -> str:
    """The class or function name, as a valid graph name (``<lambda>`` -> ``_lambda_``)."""
    if isinstance(model_or_function, torch.nn.Module):
        name = type(model_or_function).__name__
    else:
        name = getattr(model_or_function, "__name__", "function")
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


# ------------------------------------------------------------------ pipelines


def _flat_user_inputs(in_spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The example ``(args, kwargs)`` flattened as the exported program's ``in_spec`` orders them."""
    order = tuple(in_spec.children()[1].context or ()) if in_spec is not None else tuple(kwargs)
    return pytree.tree_leaves((args, {k: kwargs[k] for k in order}))


def _user_input_names(ep: ExportedProgram) -> list[str]:
    return [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def _input_slots(names: Sequence[str], in_spec: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 tensor_types: Mapping[int, Any]) -> list[InputSlot]:
    """One slot per flattened user input; ``tensor_types`` maps flat positions of tensors to
    their expected types, every other input is a specialized constant."""
    flat = _flat_user_inputs(in_spec, args, kwargs)
    if len(names) != len(flat):
        names = [f"input{i}" for i in range(len(flat))]
    return [InputSlot(name, tensor_types[i]) if i in tensor_types else InputSlot(name, None, value)
            for i, (name, value) in enumerate(zip(names, flat))]


def _optimized(graph: Graph, transform: GraphTransform | None, cache: CaptureCache) -> tuple[Graph, str]:
    """``transform(graph)``, from the capture cache when it holds the result; and whether it did."""
    if transform is None:
        return graph, "off"
    key = cache.passes_key(str(graph), getattr(transform, "identity", None))
    cached = cache.load_optimized(key)
    if cached is not None:
        return cached, "hit"
    result = transform(graph)
    cache.store_optimized(key, result)
    return result, "miss" if key is not None else "off"


def _compile_whole(captured: capture_mod.Captured, args: tuple[Any, ...], kwargs: dict[str, Any],
                   backend: Backend, options: dict[str, Any], transform: GraphTransform | None,
                   name: str, cache: CaptureCache, capture_state: str) -> CompiledModule:
    graph, passes_state = _optimized(captured.graph, transform, cache)
    missing = [v.name for v in graph.params if v.name not in captured.params]
    if missing:
        raise KilnError(f"kiln internal error: graph @{graph.name} names params {missing} the capture "
                        "did not provide")
    if len(graph.inputs) != len(captured.input_positions):
        raise KilnError(f"kiln internal error: the passes changed the inputs of graph @{graph.name}")
    types = dict(zip(captured.input_positions, (v.type for v in graph.inputs)))
    slots = _input_slots(captured.user_input_names, captured.in_spec, args, kwargs, types)
    executable = build_for_sizes(backend, graph, options)
    if [v.name for v in graph.params] != [v.name for v in captured.graph.params]:
        raise KilnError(f"kiln internal error: the passes reordered the params of graph @{graph.name}")
    params = [captured.params[v.name] for v in graph.params]
    differentiable = DifferentiableGraph(captured.graph, executable, backend, options, transform)
    return TrainableCompiledModule(differentiable, executable, inputs=slots, params=params,
                                   in_spec=captured.in_spec, out_spec=captured.out_spec,
                                   graphs=[graph], backend=backend.name, name=name,
                                   info={"fallback_ops": {}, "torch_nodes": 0, "capture_cache": capture_state,
                                         "passes_cache": passes_state},
                                   sizes=captured.graph.sizes)


def _state_tensor(module: torch.nn.Module, ep: ExportedProgram, target: str) -> torch.Tensor:
    """The live tensor behind a lifted parameter, buffer or constant of the exported program."""
    for getter in (module.get_parameter, module.get_buffer):
        try:
            return getter(target)
        except AttributeError:
            continue
    if target in ep.state_dict:
        return ep.state_dict[target]
    return ep.constants[target]


class _ProgramRunner:
    """Runs an exported graph module compiled with fallback, in the CompiledModule convention.

    Takes the user tensors then the parameters; fills in specialized non-tensor inputs,
    applies buffer mutations to the live buffers, and returns only the user outputs.
    """

    def __init__(self, compiled: CompiledFx, slots: Sequence[InputSlot], placeholders: int,
                 user_positions: Sequence[int], param_positions: Sequence[int],
                 user_outputs: Sequence[int], mutated: Sequence[tuple[int, torch.Tensor]]):
        self.compiled = compiled
        self.slots = list(slots)
        self.placeholders = placeholders
        self.user_positions = list(user_positions)
        self.param_positions = list(param_positions)
        self.user_outputs = list(user_outputs)
        self.mutated = list(mutated)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        values: list[Any] = [None] * self.placeholders
        it = iter(tensors)
        for pos, slot in zip(self.user_positions, self.slots):
            values[pos] = next(it) if slot.is_tensor else slot.value
        for pos in self.param_positions:
            values[pos] = next(it)
        outputs = self.compiled(*values)
        with torch.no_grad():  # a buffer update is not part of the autograd graph
            for index, buffer in self.mutated:
                buffer.copy_(outputs[index])
        return [outputs[i] for i in self.user_outputs]


def _compile_with_fallback(module: torch.nn.Module, ep: ExportedProgram, args: tuple[Any, ...],
                           kwargs: dict[str, Any], backend: Backend, options: dict[str, Any],
                           transform: GraphTransform | None, name: str) -> CompiledModule:
    specs = ep.graph_signature.input_specs
    user_positions = [i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT]
    param_positions = [i for i, s in enumerate(specs) if s.kind != InputKind.USER_INPUT]
    params = [_state_tensor(module, ep, specs[i].target) for i in param_positions]
    flat = _flat_user_inputs(ep.call_spec.in_spec, args, kwargs)
    example: list[Any] = [None] * len(specs)
    for pos, value in zip(user_positions, flat):
        example[pos] = value
    for pos, tensor in zip(param_positions, params):
        example[pos] = tensor
    with naming(ep.graph_module.meta.get(capture_mod.DIM_NAMES) or {}):
        compiled = compile_fx(ep.graph_module, example, param_indices=frozenset(param_positions),
                              backend=backend, options=options, strict=False, transform=transform,
                              name=name)
    types, sizes = capture_mod.user_input_types(ep)
    slots = _input_slots(_user_input_names(ep), ep.call_spec.in_spec, args, kwargs,
                         {i: types.get(i, tensor_type(v)) for i, v in enumerate(flat)
                          if isinstance(v, torch.Tensor)})
    out_specs = ep.graph_signature.output_specs
    user_outputs = [i for i, s in enumerate(out_specs) if s.kind == OutputKind.USER_OUTPUT]
    mutated = [(i, _state_tensor(module, ep, s.target)) for i, s in enumerate(out_specs)
               if s.kind == OutputKind.BUFFER_MUTATION]
    runner = _ProgramRunner(compiled, slots, len(specs), user_positions, param_positions, user_outputs,
                            mutated)
    return TrainableCompiledModule(GradModeRunner(runner), runner, inputs=slots, params=params,
                                   in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec,
                                   graphs=compiled.graphs, backend=backend.name, name=name,
                                   info=compiled.info, sizes=sizes)
