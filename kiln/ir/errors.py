"""Errors raised by the IR layer. Every message names what failed and how to go on."""

from __future__ import annotations


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class UnknownOpError(KilnError):
    """An op name that is not in the registry."""


class OpTypeError(KilnError):
    """Shape/dtype inference rejected a node's operands or attributes.

    Raised while a node is being built, so an ill-typed graph cannot exist.
    """

    def __init__(self, op: str, message: str, input_types=(), attrs=None, loc: str | None = None):
        self.op = op
        self.input_types = tuple(input_types)
        self.attrs = dict(attrs or {})
        self.loc = loc
        operands = ", ".join(str(t) for t in self.input_types)
        text = f"{op}({operands}): {message}"
        if loc:
            text += f"\n  at {loc}"
        super().__init__(text)


class VerificationError(KilnError):
    """The verifier found a violation; the message names node, operand, got and expected."""


class ParseError(KilnError):
    """Malformed IR text. Carries the 1-based line and column of the offending token."""

    def __init__(self, message: str, line: int, col: int, source_line: str = ""):
        self.line = line
        self.col = col
        text = f"line {line}, column {col}: {message}"
        if source_line:
            text += f"\n  {source_line}\n  {' ' * (col - 1)}^"
        super().__init__(text)


class ScheduleError(KilnError):
    """A schedule primitive was misapplied: an unknown loop, loops that are not perfectly
    nested, a bad factor.  The schedule is left unchanged."""


class IllegalTransformError(KilnError):
    """A schedule transformation would break a dependence of the program.

    ``explanation`` says in words which dependence breaks (statement instances, the array
    cell, the dependence kind, the distance); ``violation`` is the same fact as a record.
    The schedule is left unchanged.
    """

    def __init__(self, explanation: str, violation: object | None = None):
        self.explanation = explanation
        self.violation = violation
        super().__init__(explanation)
