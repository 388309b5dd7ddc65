"""Fresh names: the one rule every pass, lowering and printer uses to avoid a clash.

``unique_name("x", taken)`` is ``x`` if that is free, else the first free of ``x_1``,
``x_2``, ...; ``claim_name`` also adds the result to ``taken``.
"""

from __future__ import annotations

from collections.abc import Container


def unique_name(base: str, taken: Container[str]) -> str:
    """``base``, or the first of ``base_1``, ``base_2``, ... not in ``taken``."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def claim_name(base: str, taken: set[str]) -> str:
    """:func:`unique_name`, added to ``taken``."""
    name = unique_name(base, taken)
    taken.add(name)
    return name


__all__ = ["claim_name", "unique_name"]
