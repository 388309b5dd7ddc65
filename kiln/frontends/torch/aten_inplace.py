"""ATen -> kiln rules for the in-place ops of the un-decomposed export IR.

``torch.export.export`` returns PyTorch's training IR, which still holds in-place calls such
as ``relu_`` (``nn.ReLU(inplace=True)``) and ``add_`` (``out += identity``).  kiln graphs are
pure, so an in-place call is lowered as its functional form (``relu_`` -> ``relu``).  That is
exact only when nothing can observe the difference, which :func:`inplace_check` proves
structurally; the mutated tensor (``self``) must

* be made inside the graph by an op that always returns a new tensor (:data:`FRESH_OPS`), or
  by an in-place call that itself passed this check -- so no user input, parameter, buffer,
  constant or view of one is ever written;
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
    lowers,
    optional_ops,
    rule_for,
)

FRESH_OPS: frozenset[Any] = frozenset(
    getattr(aten, name) for name in (
        "conv1d", "conv2d", "conv3d", "convolution", "batch_norm", "layer_norm", "group_norm",
        "linear", "addmm", "mm", "bmm", "add", "sub", "rsub", "mul", "div", "neg", "relu",
        "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "clamp", "exp", "pow",
        "where", "clone", "cat", "max_pool2d", "avg_pool2d", "max_pool3d", "avg_pool3d",
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "embedding",
        "scaled_dot_product_attention", "softmax", "log_softmax",
    ) if hasattr(aten, name)
)
"""Op packets whose result never shares memory with an operand.  (Not every op without an
alias annotation qualifies: ``dropout`` in eval mode returns its input itself.)"""

_INPLACE_OPS = (
    "relu_", "hardtanh_", "leaky_relu_", "silu_", "sigmoid_", "tanh_", "gelu_", "neg_",
    "add_.Tensor", "add_.Scalar", "sub_.Tensor", "sub_.Scalar", "mul_.Tensor", "mul_.Scalar",
    "div_.Tensor", "div_.Scalar", "clamp_", "clamp_min_", "clamp_max_",
)


def _owns_storage(node: Any) -> bool:
    """Whether ``node`` (an FX argument) is a tensor made in the graph that aliases nothing."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet in FRESH_OPS:
        return True
    return target in _FUNCTIONAL_OF and inplace_check(node) is None


def inplace_check(node: torch.fx.Node) -> str | None:
    """``None`` when the in-place call ``node`` may be lowered functionally (see the module
    docstring), else why not."""
    target = node.args[0] if node.args else None
    if not _owns_storage(target):
        return (f"{node.target} writes to a tensor that is an input, parameter, buffer or may be "
                "a view of one; kiln lowers in-place ops only on fresh intermediate tensors")
    later = set(target.users) - {node}
    for user in later:
        if getattr(user.target, "overloadpacket", None) not in FRESH_OPS:
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
        as_functional = LoweringContext(ctx.graph, _AsFunctional(ctx.node, functional), ctx.loc)
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
