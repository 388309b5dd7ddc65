"""Which FX nodes kiln lowers, and how nodes are described in errors.

:func:`unsupported_reason` is the one test both capture (:mod:`kiln.frontends.torch.capture`) and
the fallback partitioner (through :func:`is_supported`) use, so they always agree: a
``call_function`` node is supported when the ATen table has a rule for its target, every
tensor it touches has a kiln dtype and a shape that follows from the input shapes, and the rule's ``check`` accepts the
call.  :func:`source_location` names the user's source line of a node.
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils import _pytree as pytree

from .aten import IGNORED_OPS, has_kiln_dtype, kiln_dtype, meta, rule_for

# ------------------------------------------------------------------ locations
_FRAME_RE = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>[^\n]+)\n(?P<code>[^\n]*)')
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (torch.__file__, os.path.dirname(os.path.abspath(__file__)))
)


def source_location(node: torch.fx.Node) -> str | None:
    """``"file.py:LINE in fn: code"`` of the innermost user frame of the node's stack trace
    (frames inside torch and kiln are skipped), or ``None`` if PyTorch recorded none."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    user_frames = [m for m in _FRAME_RE.finditer(trace)
                   if not os.path.abspath(m["file"]).startswith(_LIBRARY_DIRS)]
    if not user_frames:
        return None
    m = user_frames[-1]
    return f"{os.path.basename(m['file'])}:{m['line']} in {m['fn'].strip()}: {m['code'].strip()}"


# ------------------------------------------------------------ node checking
def describe_value(x: Any) -> str:
    if isinstance(x, torch.fx.Node):
        return describe_value(x.meta.get("val", f"%{x.name}"))
    if isinstance(x, torch.Tensor):
        dtype = kiln_dtype(x.dtype).short if has_kiln_dtype(x.dtype) else str(x.dtype)
        return f"{dtype}[{', '.join(str(d) for d in x.shape)}]"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(describe_value(v) for v in x) + "]"
    return repr(x)


def describe_inputs(node: torch.fx.Node) -> str:
    """The node's operands as text: tensors as kiln types (``f32[2, 8]``), others by repr."""
    parts = [describe_value(a) for a in node.args]
    parts += [f"{k}={describe_value(v)}" for k, v in node.kwargs.items()]
    return ", ".join(parts)


_DATA_DEPENDENT = ("its size depends on tensor values (an unbacked size such as u0, made by an "
                   "op like nonzero, masked_select, x[mask] or .item()); kiln compiles shapes that "
                   "follow from the input shapes: compute with a fixed shape instead "
                   "(torch.where(mask, x, other), x.masked_fill(~mask, value), a fixed-size topk), "
                   "or leave strict=False so that this part runs in PyTorch")
_SYMBOLIC_FLOAT = ("kiln's symbolic sizes are integers; compute the float in the tensor program "
                   "(e.g. torch.tensor(x.shape[-1]).float()) or mark that axis static")


def _is_data_dependent(val: Any) -> bool:
    """Whether a symbolic size or value is unbacked (made from tensor data, ``u0``) rather
    than a dynamic dimension the user asked for (``s0``)."""
    return bool(free_unbacked_symbols(val))


def bad_value(val: Any) -> str | None:
    """Why an example value (fake tensor, scalar, or nest of them) cannot enter kiln.
    Symbolic sizes that follow from the input shapes (``s0``, ``2*s0``) are fine; sizes made
    from tensor data (``u0``) and floats of sizes are not."""
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if _is_data_dependent(val):
            return f"the program computes a Python number ({val}) from tensor data: " + _DATA_DEPENDENT
        if isinstance(val, torch.SymFloat):
            return f"the program computes a float ({val}) from symbolic sizes; " + _SYMBOLIC_FLOAT
        return None
    if isinstance(val, torch.Tensor):
        if any(isinstance(d, torch.SymInt) for d in val.shape) and _is_data_dependent(val):
            return f"the tensor has a data-dependent shape {tuple(val.shape)}: " + _DATA_DEPENDENT
        if not has_kiln_dtype(val.dtype):
            return f"dtype {val.dtype} has no kiln equivalent"
        return None
    if isinstance(val, (list, tuple)):
        for v in val:
            reason = bad_value(v)
            if reason:
                return reason
    return None


def is_size_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes a size (``aten.sym_size.int``, ``operator.mul`` of sizes...)
    rather than a tensor: its example value is an int or a ``SymInt``/``SymBool``.  kiln
    binds such a node to the size itself (:func:`kiln.frontends.torch.symbolic.to_dim`)."""
    val = node.meta.get("val")
    if isinstance(val, bool) or not isinstance(val, (int, torch.SymInt, torch.SymBool)):
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is None or not any(isinstance(a.type, torch.TensorType) for a in schema.returns)


def bind_arguments(node: torch.fx.Node) -> list[Any]:
    """The node's arguments in schema order, defaults filled in."""
    schema = node.target._schema
    bound = []
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            bound.append(node.args[i])
        elif arg.name in node.kwargs:
            bound.append(node.kwargs[arg.name])
        elif arg.has_default_value():
            bound.append(arg.default_value)
        else:
            bound.append(None)
    return bound


def unsupported_reason(node: torch.fx.Node) -> str | None:
    """``None`` when kiln can lower this FX node, else why not (shared by lowering and
    :func:`is_supported`, so the fallback partitioner and capture always agree)."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return unsupported_reason(source) if isinstance(source, torch.fx.Node) else None
    if node.target in IGNORED_OPS:
        return None
    if is_size_node(node):
        return bad_value(node.meta.get("val"))
    rule = rule_for(node.target)
    if rule is None:
        return "the op is not supported by kiln"
    if "val" not in node.meta:
        return ("the node has no example value (meta['val']); trace it with make_fx or "
                "torch.export, or run FakeTensorProp first")
    for value in [node.meta.get("val"), *(meta(a) for a in _flat_args(node))]:
        reason = bad_value(value)
        if reason:
            # A rule that knows why this call cannot be lowered (e.g. x[mask]: a
            # data-dependent result) says it better than the generic shape message; its
            # check may not expect symbolic sizes, so a failing check leaves the generic one.
            return _rule_reason(rule, node) or reason
    if rule.check is not None:
        return rule.check(node, *bind_arguments(node))
    return None


def _rule_reason(rule: Any, node: torch.fx.Node) -> str | None:
    if rule.check is None:
        return None
    try:
        return rule.check(node, *bind_arguments(node))
    except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError, RuntimeError):
        return None  # a check written for static sizes, failing on a symbolic one


def _flat_args(node: torch.fx.Node) -> list[Any]:
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]


def is_supported(node: torch.fx.Node) -> bool:
    """Whether kiln can lower this FX ``call_function`` node (attribute conditions and
    static shapes included).  Placeholders, outputs and ``get_attr`` nodes are supported."""
    return unsupported_reason(node) is None
