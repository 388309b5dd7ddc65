"""ATen -> kiln rules for the in-place ops of the un-decomposed export IR.

``torch.export.export`` returns PyTorch's training IR, which still holds in-place calls such
as ``relu_`` (``nn.ReLU(inplace=True)``) and ``add_`` (``out += identity``).  kiln graphs are
pure, so an in-place call is lowered as its functional form (``relu_`` -> ``relu``).  That is
exact only when nothing can observe the difference, which :func:`inplace_check` proves
structurally; the mutated tensor (``self``) must

* be made inside the graph by an op that always returns a new tensor (its rule says
  ``fresh=True``, :func:`kiln.frontends.torch.aten.is_fresh`), or by an in-place call that
  itself passed this check -- so no user input, parameter, buffer, constant or view of one
  is ever written;
* have no user after the in-place call, and only users that return new tensors before it
  (a view taken earlier would see the write).

A call failing the check is unsupported, so :func:`kiln.frontends.torch.capture.export_program`
functionalizes and decomposes the program with ``run_decompositions`` as before.  See
:mod:`kiln.frontends.torch.aten` for how rules are declared.
"""

from __future__ import annotations

from typing import Any

import torch

from . import aten_layout, aten_math, aten_nn  # noqa: F401  (the functional rules come first)
from .aten import (
    ATEN_TABLE,
    AtenRule,
    LoweringContext,
    aten,
    is_fresh,
    lowers,
    optional_ops,
    rule_for,
)

_INPLACE_OPS = (
    "relu_", "hardtanh_", "leaky_relu_", "silu_", "sigmoid_", "tanh_", "gelu_", "neg_",
    "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Tensor", "mul_.Scalar",
    "div_.Tensor", "div_.Scalar", "clamp_", "clamp_min_", "clamp_max_",
)


def _owns_storage(node: Any) -> bool:
    """Whether ``node`` (an FX argument) is a tensor made in the graph that aliases nothing."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if is_fresh(node.target):
        return True
    return node.target in _FUNCTIONAL_OF and inplace_check(node) is None


def inplace_check(node: torch.fx.Node) -> str | None:
    """``None`` when the in-place call ``node`` may be lowered functionally (see the module
    docstring), else why not."""
    target = node.args[0] if node.args else None
    if not _owns_storage(target):
        return (f"{node.target} writes to a tensor that is an input, parameter, buffer or may be "
                "a view of one; kiln lowers in-place ops only on fresh intermediate tensors")
    later = set(target.users) - {node}
    for user in later:
        if not is_fresh(user.target):
            return (f"{node.target} writes to a tensor that {user.name} ({user.target}) may alias; "
                    "kiln lowers in-place ops only on tensors nothing else refers to")
    cursor = node.next
    while cursor.op != "root":
        if cursor in later:
            return f"{node.target} writes to a tensor that {cursor.name} reads afterwards"
        cursor = cursor.next
    return None


class _AsFunctional:
    """An FX node seen as its functional overload (lowerings may branch on ``node.target``)."""

    def __init__(self, node: torch.fx.Node, target: Any):
        self._node = node
        self.target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)


def _inplace_rule(functional: Any, functional_rule: AtenRule) -> AtenRule:
    def check(node: torch.fx.Node, *args: Any) -> str | None:
        reason = inplace_check(node)
        if reason is not None or functional_rule.check is None:
            return reason
        return functional_rule.check(_AsFunctional(node, functional), *args)

    def lower(ctx: LoweringContext, *args: Any) -> Any:
        as_functional = LoweringContext(ctx.graph, _AsFunctional(ctx.aten_node, functional), ctx.loc)
        return functional_rule.lower(as_functional, *args)

    return AtenRule(lower, check)


_FUNCTIONAL_OF: dict[Any, Any] = {}
for _inplace in optional_ops(*_INPLACE_OPS):
    _packet = getattr(aten, _inplace.overloadpacket.__name__.removesuffix("_"), None)
    _functional = getattr(_packet, _inplace._overloadname, None)
    _rule = rule_for(_functional)
    if _rule is None or _inplace in ATEN_TABLE:
        continue
    _FUNCTIONAL_OF[_inplace] = _functional
    ATEN_TABLE[_inplace] = _inplace_rule(_functional, _rule)


@lowers(*optional_ops("detach_"))
def _detach_(ctx: LoweringContext, x: Any) -> Any:
    """``detach_`` changes autograd metadata only, never values: the tensor itself.  (Export
    emits it for tensors a module builds with ``torch.tensor(...)``.)"""
    return x
