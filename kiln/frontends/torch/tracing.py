"""Tracing torch-level programs to functional ATen graphs with kiln's decompositions.

:func:`lower_to_aten` turns the torch-level FX graph Dynamo hands the ``"kiln"`` backend
(:mod:`kiln.frontends.torch.dynamo`) into an ATen graph; :func:`trace_functional` traces any
callable the same way (the bodies of a ``torch.autograd.Function``,
:mod:`kiln.frontends.torch.autograd_function`).  Both trace with ``make_fx`` and
:func:`kiln.frontends.torch.capture.decomposition_table`, functionalized, so in-place ops
become out-of-place ones plus a final ``copy_`` into a placeholder (a buffer update).

:class:`TracingInterpreter` runs the program for the trace with the calls whose effects ATen
hides spelled out: train-mode batch norm's running-statistics update, dropout as
``native_dropout``, and a ``torch.autograd.Function`` call (Dynamo's
``autograd_function_apply``) as one ``kiln::autograd_function`` op.  Placeholders get
readable names from Dynamo's (:func:`readable_name`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.ir import KilnError

from .aten_support import describe_inputs, source_location
from .capture import decomposition_table

FUNCTION_APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)
"""Dynamo's higher-order op for a ``torch.autograd.Function`` call (``None`` on a torch
without it)."""


def lower_to_aten(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """Trace a torch-level FX graph to a functional ATen graph with kiln's decompositions.

    Node metadata (``stack_trace``) is carried over so fallback warnings and errors name the
    user's source lines.  The result is pure apart from final ``copy_`` calls into
    placeholders (buffer updates, which :mod:`kiln.frontends.torch.fallback` lifts into outputs):
    see :func:`trace_functional`.
    """
    def run(*args: torch.Tensor) -> Any:
        return TracingInterpreter(gm).run(*args)

    fake = symbolic_inputs(gm, example_inputs)
    if fake is not None:  # dynamic shapes: trace on Dynamo's fake inputs, keeping its sizes
        inputs, _mode = fake
        traced = trace_functional(run, inputs, tracing_mode="symbolic")
        name_placeholders_like(traced, gm)
        traced.recompile()
        return traced
    traced = trace_functional(run, example_inputs)
    name_placeholders_like(traced, gm)
    traced.recompile()
    return traced


def symbolic_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[list[Any], Any] | None:
    """Dynamo's fake inputs of ``gm`` and their fake mode when the graph has symbolic sizes
    (a ``SymInt`` input, or a placeholder whose example value has a symbolic shape); ``None``
    for a static graph.  Tracing on them keeps Dynamo's size symbols (``s0``), so the ATen
    graph's sizes are the ones Dynamo's guards speak of."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    symbolic = any(isinstance(v, torch.SymInt) for v in (*example_inputs, *fakes)) or any(
        isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape) for v in fakes)
    if not symbolic or len(fakes) != len(example_inputs) or any(v is None for v in fakes):
        return None
    modes = {id(m): m for m in (getattr(v, "fake_mode", None) for v in fakes) if m is not None}
    if len(modes) != 1:
        return None
    return fakes, next(iter(modes.values()))


_MAX_REFUNCTIONALIZE = 3


def trace_functional(fn: Callable[..., Any], example_inputs: Sequence[Any], *,
                     tracing_mode: str = "real") -> fx.GraphModule:
    """``fn`` traced with ``make_fx`` to ATen, functionalized and decomposed with kiln's table.

    make_fx applies decompositions below the functionalization layer, so a decomposition
    that writes in place (circular ``pad`` fills slices of an ``empty`` tensor with
    ``copy_``) would reach kiln as unfunctionalized writes; the traced graph is therefore
    functionalized again until no mutating op is left but the final ``copy_`` into a
    placeholder (a buffer update).  A graph that still mutates after that raises
    :class:`KilnError` naming the op: a write is never dropped or lowered as if pure.
    """
    table = decomposition_table()
    traced = _trace_once(fn, example_inputs, table, tracing_mode)
    for _ in range(_MAX_REFUNCTIONALIZE):
        if not _mutations(traced):
            return traced
        previous = traced
        traced = _trace_once(lambda *args, gm=previous: fx.Interpreter(gm).run(*args), example_inputs, table,
                             tracing_mode)
    left = _mutations(traced)
    if left:
        node = left[0]
        where = source_location(node) or "<unknown source line>"
        raise KilnError(
            f"kiln: the traced graph still writes in place with {node.target} "
            f"({describe_inputs(node)}) at {where} after functionalization; kiln "
            "never drops or reorders a write. Rewrite the code without the in-place update "
            "(e.g. torch.cat / torch.where instead of writing into a slice).")
    return traced


def _trace_once(fn: Callable[..., Any], example_inputs: Sequence[Any], table: dict[Any, Any],
                tracing_mode: str = "real") -> fx.GraphModule:
    functional = torch.func.functionalize(fn, remove="mutations")
    # Functionalization writes the traced program's buffer updates back into its real inputs;
    # trace on copies so compiling never changes the model's buffers (parameters are not
    # written by a forward and are traced as they are; nor are fake inputs).
    inputs = [x if isinstance(x, torch.nn.Parameter) or not isinstance(x, torch.Tensor) or tracing_mode != "real"
              else x.detach().clone() for x in example_inputs]
    grad_mode = torch.is_grad_enabled()
    try:
        with fx_traceback.preserve_node_meta(), torch.no_grad():
            traced = make_fx(functional, decomposition_table=table, tracing_mode=tracing_mode)(*inputs)
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


_LINEARS = {torch._C._nn.linear, torch.nn.functional.linear}


def _has_symbolic_shape(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of an input with symbolic sizes as ``matmul`` (+ ``bias``): ATen's linear
    of a batched input reads its sizes as ints in C++, which would specialize them."""
    y = torch.matmul(x, weight.t())
    return y if bias is None else y + bias


class TracingInterpreter(fx.Interpreter):
    """Runs a Dynamo graph for tracing, with calls whose in-place effects ATen hides
    (train-mode batch norm) replaced by explicit functional forms, and a
    ``torch.autograd.Function`` call recorded as one ``kiln::autograd_function`` op."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target in _BATCH_NORMS:
            return _train_batch_norm(*args, **kwargs)
        if target in _DROPOUTS:
            return _dropout(*args, **kwargs)
        if target in _LINEARS and _has_symbolic_shape(args[0]):
            return _linear(*args, **kwargs)
        if target is FUNCTION_APPLY and target is not None:
            from .autograd_function import apply_function  # it traces with this module

            return apply_function(args[0], args[1], args[2:], kwargs)
        return super().call_function(target, args, kwargs)


def readable_name(dynamo_name: str) -> str:
    """``L_self_modules_fc1_parameters_weight_`` -> ``fc1.weight``; ``L_x_`` -> ``x``."""
    name = re.sub(r"^L_+|_+$", "", dynamo_name)
    name = re.sub(r"_(modules|parameters|buffers)_", ".", name)
    return re.sub(r"^(self|fn)\.", "", name) or dynamo_name


def name_placeholders_like(traced: fx.GraphModule, source: fx.GraphModule | Sequence[fx.Node]) -> None:
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
