"""``torch.compile(model, backend="kiln")``: kiln as a TorchDynamo backend.

Dynamo hands :func:`kiln_backend` a torch-level FX graph whose placeholders are the frame's
tensors, parameters and buffers included (``inline_inbuilt_nn_modules``), with real example
tensors.  kiln lowers it to ATen with ``make_fx`` and kiln's decomposition table
(functionalized, so in-place ops become out-of-place ones plus a final copy;
:func:`kiln.frontends.torch.tracing.lower_to_aten`), marks the parameter/buffer
placeholders, and compiles it with per-op fallback
(:func:`kiln.frontends.torch.fallback.compile_fx`).

Options travel through ``torch.compile(..., options={...})``, which Dynamo forwards to the
backend as one keyword argument ``options`` (and ``mode`` as ``mode=``, ignored here)::

    torch.compile(model, backend="kiln", options={"strict": True, "backend": "reference",
                                                  "passes": "cse,dce", "float64": False})

``strict`` raises :class:`~kiln.frontends.errors.UnsupportedOpError` instead of falling back;
``backend`` picks the kiln backend; ``passes`` is a pass pipeline (default: the default
pipeline, ``None`` for none); ``cache`` and ``cache_dir`` are kiln's cache switch
(:mod:`kiln.frontends.options`), accepted whatever the backend; every other key is an
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
(:mod:`kiln.frontends.torch.autograd_function`; the ``torch.export`` path gets the same op).
Decompositions that write in place are functionalized again
(:func:`~kiln.frontends.torch.tracing.trace_functional`): no write reaches kiln
unfunctionalized.

Dynamic shapes: when Dynamo marks sizes dynamic (after a second distinct size, or with
``dynamic=True``) the graph has ``SymInt`` inputs and fake tensors with symbolic shapes.
kiln traces it on Dynamo's fake inputs (:func:`kiln.frontends.torch.tracing.symbolic_inputs`),
so its sizes are Dynamo's symbols (``s0``) with the ShapeEnv's ranges (``graph.sizes``), and
compiles it once.  The compiled callable takes the size arguments Dynamo passes; it binds
the sizes from the tensor arguments' shapes and checks them (ranges, and the size arguments'
values) before running (:class:`kiln.frontends.torch.fallback.SizeGuard`).  Dynamo's guards
cover the ranges it recorded, so a size outside them recompiles in Dynamo before it reaches
kiln.

The backend is registered under the name ``kiln`` in two ways: the ``torch_dynamo_backends``
entry point of the installed package, and :func:`install_registration` (run by
``import kiln``), which registers it as soon as ``torch._dynamo`` is imported, so a source
tree that is not installed works too.  Importing kiln does not import ``torch._dynamo``.
"""


from __future__ import annotations

import importlib.abc
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import fx

from kiln.backends import DEFAULT_BACKEND, get_backend
from kiln.frontends.options import CacheSwitch
from kiln.ir import KilnError
from kiln.passes.pipeline import resolve_passes

from . import autograd_function  # noqa: F401  (the lowering of kiln::autograd_function)
from .fallback import KilnFallbackWarning, compile_fx
from .tracing import lower_to_aten

BACKEND_NAME = "kiln"
_PARAM_NAME_RE = re.compile(r"_(parameters|buffers)_")


def kiln_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The Dynamo backend: returns a callable taking the graph's inputs (see module docstring)."""
    switch, options = CacheSwitch.split(kwargs.get("options") or {})
    strict = bool(options.pop("strict", False))
    backend = get_backend(options.pop("backend", DEFAULT_BACKEND))
    transform = resolve_passes(options.pop("passes", "default"))
    options = switch.for_backend(backend, options)
    backend.resolve_options(options)  # unknown options fail before any tracing
    name = _graph_name(gm)
    reason = _eager_reason(example_inputs)
    if reason is not None:
        if strict:
            raise KilnError(f"kiln: cannot compile graph '{name}' with strict=True: {reason}")
        warnings.warn(f"kiln: graph '{name}' runs eagerly in PyTorch: {reason}", KilnFallbackWarning,
                      stacklevel=2)
        return gm.forward
    params = param_indices(gm, example_inputs)

    def build(graph: fx.GraphModule) -> Callable[..., Any]:
        return compile_fx(lower_to_aten(graph, example_inputs), list(example_inputs), param_indices=params,
                          backend=backend, options=options, strict=strict, transform=transform, name=name)

    scalars = read_scalars(gm, example_inputs, params)
    if scalars:
        return ScalarSpecialized(gm, scalars, example_inputs, build)
    return build(gm)


# ------------------------------------------------------------------ lifted Python scalars
def read_scalars(gm: fx.GraphModule, example_inputs: Sequence[Any], params: frozenset[int]) -> list[int]:
    """Positions of the 0-d tensor inputs the graph reads with ``.item()``.

    With ``dynamic=True`` Dynamo lifts a module's Python float attributes (a norm's ``eps``,
    an embedding's ``norm_type``, a dropout's ``p``) to 0-d tensor inputs, and the graph
    reads them back with ``.item()``: a value the trace cannot know.  kiln specializes such
    a graph on the values (:class:`ScalarSpecialized`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if i in params or not isinstance(value, torch.Tensor) or value.dim() != 0:
            continue
        if any(_is_item(user) for user in node.users):
            found.append(i)
    return found


def _is_item(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "item") or \
        (node.op == "call_function" and node.target in (torch.Tensor.item, torch.ops.aten._local_scalar_dense.default))


def _with_values(gm: fx.GraphModule, positions: Sequence[int], values: Sequence[Any]) -> fx.GraphModule:
    """A copy of ``gm`` whose ``.item()`` reads of the inputs at ``positions`` are the constants
    ``values`` (the inputs stay: other uses still read them as tensors)."""
    copy = fx.GraphModule(gm, copy_graph(gm.graph))
    placeholders = [n for n in copy.graph.nodes if n.op == "placeholder"]
    for position, value in zip(positions, values):
        for item in [u for u in placeholders[position].users if _is_item(u)]:
            for user in list(item.users):
                user.args = fx.node.map_arg(user.args, lambda a, item=item, value=value: value if a is item else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a, item=item, value=value: value if a is item else a)
            copy.graph.erase_node(item)
    copy.recompile()
    return copy


def copy_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


class ScalarSpecialized:
    """A Dynamo graph compiled for the values of its lifted scalars (:func:`read_scalars`),
    with kiln's own guard: each call reads those inputs, and a call with other values builds
    (once) the graph for them.  A norm's ``eps`` never changes, so one build serves every
    size; a scalar that does change (a decaying dropout rate) costs one build per value."""

    def __init__(self, gm: fx.GraphModule, positions: Sequence[int], example_inputs: Sequence[Any],
                 build: Callable[[fx.GraphModule], Callable[..., Any]]):
        self.gm = gm
        self.positions = tuple(positions)
        self.build = build
        self.builds: dict[tuple, Callable[..., Any]] = {}
        key = self._key(example_inputs)
        self.key, self.compiled = key, self._compile(key)

    def _key(self, args: Sequence[Any]) -> tuple:
        return tuple(args[i].item() for i in self.positions)

    def _compile(self, key: tuple) -> Callable[..., Any]:
        compiled = self.builds.get(key)
        if compiled is None:
            compiled = self.builds[key] = self.build(_with_values(self.gm, self.positions, key))
        return compiled

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        if key != self.key:
            self.key, self.compiled = key, self._compile(key)
        return self.compiled(*args)

    def __getattr__(self, name: str) -> Any:  # graphs, report, module: those of the current build
        if name in ("compiled", "gm", "positions", "build", "builds", "key"):
            raise AttributeError(name)
        return getattr(self.compiled, name)


def _graph_name(gm: fx.GraphModule) -> str:
    """``dynamo_<frame>_<recompile>`` from Dynamo's compile id, e.g. ``dynamo_0_0``."""
    compile_id = getattr(gm, "meta", {}).get("dynamo_compile_id")
    return "dynamo_" + re.sub(r"[^A-Za-z0-9]+", "_", str(compile_id)) if compile_id else "dynamo"


def _eager_reason(example_inputs: Sequence[Any]) -> str | None:
    """Why kiln cannot compile a graph with these inputs, or ``None``: inputs other than
    tensors and sizes (``SymInt``/int, which dynamic shapes add)."""
    for i, x in enumerate(example_inputs):
        if not isinstance(x, (torch.Tensor, torch.SymInt, int)) or isinstance(x, bool):
            return f"input {i} is a {type(x).__name__}, neither a tensor nor a size"
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
