"""The error of a JAX primitive kiln cannot lower.

It is a :class:`kiln.UnsupportedOpError` (catch either), whose message names the JAX
primitive, its operand types and the user's source line (from ``eqn.source_info``), and says
how to go on.
"""

from __future__ import annotations

from kiln.frontends.errors import UnsupportedOpError

_HOW_TO_GO_ON = (
    "Compute this part with the jax.numpy / jax.lax operations kiln lowers (docs/jax.md has the "
    "table), or call it with plain jax.jit outside the kiln-compiled function; or file the "
    "primitive so kiln learns it.")


class UnsupportedPrimitiveError(UnsupportedOpError):
    """kiln cannot lower a JAX primitive (or one of its parameter combinations).

    Attributes as :class:`~kiln.frontends.errors.UnsupportedOpError`: ``op`` is the
    primitive's name (``"cumlogsumexp"``), ``input_types`` the operand types and parameters,
    ``source`` the user's line, ``reason`` and ``hint``.
    """

    kind = "JAX primitive"

    def __init__(self, primitive: str, input_types: str = "", source: str | None = None,
                 reason: str | None = None, hint: str | None = None):
        super().__init__(primitive, input_types, source,
                         reason or "the primitive is not supported by kiln", hint or _HOW_TO_GO_ON)
        self.reason = reason
