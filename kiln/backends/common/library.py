"""Library calls on torch tensors: the record a backend's library table produces, and the
zero-copy torch equivalent of each graph ``view`` op.

A backend's library table (the cpu backend's :data:`kiln.backends.cpu.library.LIBRARY`) is
keyed by op name and turns a node into a :class:`LibraryCall`; the partition
(:mod:`.partition`) makes a plan operation of it and the call plan a
:class:`kiln.runtime.call_plan.TorchStep`.  :data:`VIEWS` holds torch view functions,
which work on a tensor of any device, so every backend shares them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ir import Node
from kiln.ir.sizes import concrete
from kiln.ir.types import normalize_dim


@dataclass(frozen=True)
class LibraryCall:
    """``function(*inputs, *outputs)`` when ``writes_into``, else ``function(*inputs)``
    returning the result(s); ``channels_last`` results are NCHW tensors stored NHWC."""

    function: Callable[..., object]
    writes_into: bool
    label: str
    channels_last: bool = False
    """The (4-d or 5-d) result comes back in channels-last memory order."""
    native: Any = None
    """The backend's native form of the call, when it has one (the cpu backend plans kiln's
    convolutions as foreign kernels of its native runs, :mod:`kiln.backends.cpu.conv_plan`)."""


ViewFunction = Callable[[torch.Tensor], torch.Tensor]
Sizes = Mapping[str, int] | None
"""Values of a symbolic graph's named sizes: view functions are made at them (``None``:
static shapes)."""


def _at(value, sizes: Sizes):
    return value if sizes is None else concrete(value, sizes)


def _reshape(node: Node, sizes: Sizes = None) -> ViewFunction:
    shape = tuple(_at(tuple(node.outputs[0].shape), sizes))
    return lambda t: t.reshape(shape)


def _permute(node: Node, sizes: Sizes = None) -> ViewFunction:
    rank = node.inputs[0].type.rank
    dims = tuple(normalize_dim(d, rank) for d in node.attrs["dims"])
    return lambda t: t.permute(dims)


def _expand(node: Node, sizes: Sizes = None) -> ViewFunction:
    shape = tuple(_at(tuple(node.outputs[0].shape), sizes))
    return lambda t: t.expand(shape)


def _slice(node: Node, sizes: Sizes = None) -> ViewFunction:
    axis = normalize_dim(node.attrs["dim"], node.inputs[0].type.rank)
    start, end, step = (_at(node.attrs[k], sizes) for k in ("start", "end", "step"))
    index = (slice(None),) * axis + (slice(start, end, step),)
    return lambda t: t[index]


def _select(node: Node, sizes: Sizes = None) -> ViewFunction:
    dim, index = node.attrs["dim"], _at(node.attrs["index"], sizes)
    return lambda t: t.select(dim, index)


VIEWS: dict[str, Callable[..., ViewFunction]] = {
    "reshape": _reshape, "permute": _permute, "expand": _expand, "slice": _slice, "select": _select,
}
"""View op -> builder of its zero-copy torch function, ``VIEWS[op](node, sizes=None)``, at
the symbolic sizes ``sizes`` of a dynamic graph (``reshape`` copies only when torch must,
exactly as ``Tensor.reshape`` does)."""


__all__ = ["VIEWS", "LibraryCall", "ViewFunction"]
