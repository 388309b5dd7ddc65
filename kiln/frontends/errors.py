"""Errors raised while turning PyTorch programs into kiln graphs.

Every message names the ATen op, the operand types and the user's source line, and says how
to go on.
"""

from __future__ import annotations

from kiln.ir import KilnError

_HOW_TO_GO_ON = (
    "To run it anyway, use torch.compile(model, backend='kiln') or kiln.compile(...) without "
    "strict=True: unsupported ops then run in PyTorch. Or file the op so kiln learns it."
)


class UnsupportedOpError(KilnError):
    """kiln cannot lower an ATen op (or one of its argument combinations).

    Attributes:
        op: the ATen op name, e.g. ``"aten.unfold.default"``.
        input_types: text of the operand shapes/dtypes, e.g. ``"f32[2, 8], 1, 2, 1"``.
        source: ``"file.py:LINE in fn: code"`` of the user's line, or ``None`` if unknown.
        reason: why the op is unsupported, when it is more specific than "not in the table".
        hint: how to go on, when running the op in PyTorch instead would not help.
    """

    kind = "ATen op"
    """What the frontend calls ``op`` in the message (the JAX frontend: ``"JAX primitive"``)."""

    def __init__(self, op: str, input_types: str = "", source: str | None = None,
                 reason: str | None = None, hint: str | None = None):
        self.op = op
        self.input_types = input_types
        self.source = source
        self.reason = reason
        self.hint = hint or _HOW_TO_GO_ON
        text = f"kiln cannot lower {self.kind} {op}({input_types})"
        text += f": {reason}" if reason else ": the op is not supported by kiln"
        text += f"\n  at {source}" if source else "\n  at <unknown source line>"
        text += "\n  " + self.hint
        super().__init__(text)


class CaptureError(KilnError):
    """A kiln bug found while lowering: the lowered node disagrees with PyTorch's own result
    type.  The message names the ATen op, both types and the source line."""


__all__ = ["CaptureError", "KilnError", "UnsupportedOpError"]
