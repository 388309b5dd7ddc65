"""Collectives: ``all_reduce``, ``all_gather``, ``reduce_scatter`` and ``all_to_all``.

Each op is one step of an SPMD program run by ``world_size`` ranks (the processes of
torch.distributed's default group).  Every rank runs the same graph; an op's result on a
rank depends on the operands of all ranks:

* ``all_reduce(x) {world_size, fwd=true, bwd=true}`` -- the sum of ``x`` over the ranks.
  ``fwd=false`` makes the forward an identity (copy); ``bwd`` says whether the gradient is
  reduced.  The default (both) is the exact transpose of a sum; ``fwd=true, bwd=false`` is
  the reduction after a row-parallel linear whose result feeds a loss computed alike on
  every rank and counted once (Megatron's *g*), and ``fwd=false, bwd=true`` its partner
  before a column-parallel linear (Megatron's *f*).  The gradient of
  ``all_reduce{fwd=a, bwd=b}`` is ``all_reduce{fwd=b, bwd=a}``.
* ``all_gather(x) {world_size, dim, grad="sum"}`` -- the ranks' operands concatenated along
  ``dim`` in rank order.  Its gradient is ``reduce_scatter{mode=grad}``: ``"sum"`` sums the
  ranks' cotangents (the exact transpose), ``"slice"`` keeps the rank's own slice (the
  gathered result feeds a loss counted once).
* ``reduce_scatter(x) {world_size, dim, mode="sum"}`` -- ``mode="sum"``: the sum over ranks,
  of which each rank keeps slice ``rank`` along ``dim``; ``mode="slice"``: no reduction,
  the rank's own slice of its operand (splitting a replicated tensor, e.g. a sequence).
  Gradient: ``all_gather{grad=mode}``.
* ``all_to_all(x) {world_size, split_dim, concat_dim}`` -- ``x`` is cut into ``world_size``
  chunks along ``split_dim``; chunk ``j`` goes to rank ``j``, and each rank concatenates what
  it receives along ``concat_dim`` in rank order.  Gradient: ``all_to_all`` with the two
  axes swapped.

Execution.  When ``torch.distributed`` is initialized, the reference (and the cpu backend's
library calls, through :func:`torch_collective`) calls it on the default group, whose size
must equal ``world_size``.  Without a process group, the reference simulates a group of
``world_size`` ranks that all hold this process's operand, this process being rank 0: an
``all_reduce`` is then ``world_size * x``, an ``all_gather`` ``world_size`` copies.  Gloo has
no reduce-scatter: there ``mode="sum"`` is an all-reduce followed by the rank's slice.

The ops carry, like random draws, the ``random`` trait (impure; :data:`COLLECTIVES` names them):
a collective's result depends on the other ranks, so no pass folds it at compile time (that
would bake one rank's result into a graph), merges two of them or removes one, and every
rank runs the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..registry import Attr, defop
from ..types import TensorType, normalize_dim
from ._infer import fmt_shape
from .vjp import GradBuilder, defvjp

_TRAITS = ("random",)


def _check_world(op: str, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"{op}: world_size must be >= 1, got {world_size}")


def _divides(op: str, t: TensorType, dim: int, world_size: int, what: str) -> int:
    axis = normalize_dim(dim, t.rank)
    size = t.shape[axis]
    if not isinstance(size, int):
        raise ValueError(f"{op}: {what} {axis} of {t} must be static")
    if size % world_size:
        raise ValueError(f"{op}: {what} {axis} of shape {fmt_shape(t.shape)} has size {size}, which "
                         f"{world_size} ranks cannot split evenly; pad it to a multiple of {world_size} "
                         "or use a world size that divides it")
    return axis


def _resized(t: TensorType, axis: int, size: int) -> TensorType:
    shape = list(t.shape)
    shape[axis] = size
    return t.with_shape(tuple(shape))


# ------------------------------------------------------------------- torch.distributed
def _dist():
    """``torch.distributed`` when a default process group is up, else ``None``."""
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def _group_size(op: str, dist, world_size: int) -> int:
    size = dist.get_world_size()
    if size != world_size:
        raise RuntimeError(f"{op} was built for world_size={world_size}, but torch.distributed's default "
                           f"group has {size} ranks; rebuild the graph for {size} ranks")
    return size


def torch_collective(op: str, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    """The function running op ``op`` with ``attrs`` on a torch tensor through
    torch.distributed's default group (the cpu backend's library call and the reference's
    distributed path); without a process group, the single-process simulation."""
    import torch

    w = attrs["world_size"]

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        if attrs["fwd"]:
            dist = _dist()
            _group_size(op, dist, w)
            dist.all_reduce(out)
        return out

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        dist = _dist()
        _group_size(op, dist, w)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(w)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=attrs["dim"])

    def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        dist = _dist()
        _group_size(op, dist, w)
        rank = dist.get_rank()
        if attrs["mode"] == "slice":
            return x.chunk(w, dim=attrs["dim"])[rank].clone(memory_format=torch.contiguous_format)  # never a view of x
        if dist.get_backend() == "nccl":
            parts = [p.contiguous() for p in x.chunk(w, dim=attrs["dim"])]
            out = torch.empty_like(parts[0])
            dist.reduce_scatter(out, parts)
            return out
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total)  # gloo has no reduce-scatter
        return total.chunk(w, dim=attrs["dim"])[rank].contiguous()

    def all_to_all(x: torch.Tensor) -> torch.Tensor:
        dist = _dist()
        _group_size(op, dist, w)
        sends = [p.contiguous() for p in x.chunk(w, dim=attrs["split_dim"])]
        recvs = [torch.empty_like(p) for p in sends]
        dist.all_to_all(recvs, sends)
        return torch.cat(recvs, dim=attrs["concat_dim"])

    run = {"all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
           "all_to_all": all_to_all}[op]
    reference = globals()[op]

    def collective(x: torch.Tensor) -> torch.Tensor:
        if _dist() is None:  # no process group: the single-process simulation
            return torch.from_numpy(np.ascontiguousarray(reference(x.detach().numpy(), **attrs)))
        return run(x)
    return collective


def _run(op: str, x: np.ndarray, attrs: dict[str, Any], simulate: Callable[[], np.ndarray]) -> np.ndarray:
    """Through torch.distributed when a group is up, else the single-process simulation."""
    if _dist() is None:
        return simulate()
    import torch
    result = torch_collective(op, attrs)(torch.from_numpy(np.ascontiguousarray(x)))
    return result.numpy()


# ------------------------------------------------------------------------- all_reduce
def _all_reduce_infer(types: Sequence[TensorType], *, world_size: int, fwd: bool, bwd: bool) -> TensorType:
    _check_world("all_reduce", world_size)
    if not fwd and not bwd:
        raise ValueError("all_reduce with fwd=false and bwd=false reduces nothing; drop the node")
    return types[0]


@defop("all_reduce", infer=_all_reduce_infer, traits=_TRAITS,
       attrs={"world_size": Attr("int"), "fwd": Attr("bool", True), "bwd": Attr("bool", True)})
def all_reduce(x, *, world_size, fwd, bwd):
    """Sum of ``x`` over the ranks (identity when ``fwd`` is false)."""
    attrs = {"world_size": world_size, "fwd": fwd, "bwd": bwd}
    if not fwd:
        return np.array(x, copy=True)
    return _run("all_reduce", x, attrs, lambda: (x * world_size).astype(x.dtype))


@defvjp("all_reduce")
def _all_reduce_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``all_reduce{fwd=bwd, bwd=fwd}`` of the cotangent: the transpose of a sum over ranks
    is a sum over ranks; an identity side stays an identity (``bwd=false``: the cotangent
    itself, no node)."""
    if not inputs[0].dtype.is_floating:
        return [None]
    if not attrs["bwd"]:
        return [cotangents[0]]
    return [b.op("all_reduce", cotangents[0], world_size=attrs["world_size"], fwd=attrs["bwd"],
                 bwd=attrs["fwd"])]


# ------------------------------------------------------------------------- all_gather
def _grad_mode(op: str, value: str) -> None:
    if value not in ("sum", "slice"):
        raise ValueError(f"{op}: mode must be 'sum' or 'slice', got {value!r}")


def _all_gather_infer(types: Sequence[TensorType], *, world_size: int, dim: int, grad: str) -> TensorType:
    _check_world("all_gather", world_size)
    _grad_mode("all_gather", grad)
    t = types[0]
    axis = normalize_dim(dim, t.rank)
    if not isinstance(t.shape[axis], int):
        raise ValueError(f"all_gather: axis {axis} of {t} must be static")
    return _resized(t, axis, t.shape[axis] * world_size)


@defop("all_gather", infer=_all_gather_infer, traits=_TRAITS,
       attrs={"world_size": Attr("int"), "dim": Attr("int", 0, axes="axis"), "grad": Attr("str", "sum")})
def all_gather(x, *, world_size, dim, grad):
    """The ranks' operands concatenated along ``dim``, in rank order."""
    attrs = {"world_size": world_size, "dim": dim, "grad": grad}
    return _run("all_gather", x, attrs, lambda: np.concatenate([x] * world_size, axis=dim))


@defvjp("all_gather")
def _all_gather_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``reduce_scatter{mode=grad}`` of the cotangent."""
    if not inputs[0].dtype.is_floating:
        return [None]
    return [b.op("reduce_scatter", cotangents[0], world_size=attrs["world_size"], dim=attrs["dim"],
                 mode=attrs["grad"])]


# --------------------------------------------------------------------- reduce_scatter
def _reduce_scatter_infer(types: Sequence[TensorType], *, world_size: int, dim: int, mode: str) -> TensorType:
    _check_world("reduce_scatter", world_size)
    _grad_mode("reduce_scatter", mode)
    t = types[0]
    axis = _divides("reduce_scatter", t, dim, world_size, "axis")
    return _resized(t, axis, t.shape[axis] // world_size)


@defop("reduce_scatter", infer=_reduce_scatter_infer, traits=_TRAITS,
       attrs={"world_size": Attr("int"), "dim": Attr("int", 0, axes="axis"), "mode": Attr("str", "sum")})
def reduce_scatter(x, *, world_size, dim, mode):
    """Slice ``rank`` along ``dim`` of the sum over ranks (``mode="sum"``) or of ``x`` itself
    (``mode="slice"``)."""
    attrs = {"world_size": world_size, "dim": dim, "mode": mode}
    first = np.split(x, world_size, axis=dim)[0]

    def simulate() -> np.ndarray:
        return (first * world_size).astype(x.dtype) if mode == "sum" else np.array(first, copy=True)
    return _run("reduce_scatter", x, attrs, simulate)


@defvjp("reduce_scatter")
def _reduce_scatter_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``all_gather{grad=mode}`` of the cotangent."""
    if not inputs[0].dtype.is_floating:
        return [None]
    return [b.op("all_gather", cotangents[0], world_size=attrs["world_size"], dim=attrs["dim"],
                 grad=attrs["mode"])]


# ------------------------------------------------------------------------- all_to_all
def _all_to_all_infer(types: Sequence[TensorType], *, world_size: int, split_dim: int,
                      concat_dim: int) -> TensorType:
    _check_world("all_to_all", world_size)
    t = types[0]
    split = _divides("all_to_all", t, split_dim, world_size, "split axis")
    concat = normalize_dim(concat_dim, t.rank)
    out = _resized(t, split, t.shape[split] // world_size)
    return _resized(out, concat, out.shape[concat] * world_size)


@defop("all_to_all", infer=_all_to_all_infer, traits=_TRAITS,
       attrs={"world_size": Attr("int"), "split_dim": Attr("int", axes="axis"), "concat_dim": Attr("int")})
def all_to_all(x, *, world_size, split_dim, concat_dim):
    """Chunk ``j`` of ``x`` along ``split_dim`` to rank ``j``; received chunks concatenated
    along ``concat_dim`` in rank order."""
    attrs = {"world_size": world_size, "split_dim": split_dim, "concat_dim": concat_dim}
    first = np.split(x, world_size, axis=split_dim)[0]
    return _run("all_to_all", x, attrs, lambda: np.concatenate([first] * world_size, axis=concat_dim))


@defvjp("all_to_all")
def _all_to_all_vjp(b: GradBuilder, inputs, outputs, cotangents, attrs):
    """``all_to_all`` back: the split and concatenation axes swapped."""
    if not inputs[0].dtype.is_floating:
        return [None]
    rank = inputs[0].type.rank
    return [b.op("all_to_all", cotangents[0], world_size=attrs["world_size"],
                 split_dim=normalize_dim(attrs["concat_dim"], rank),
                 concat_dim=normalize_dim(attrs["split_dim"], rank))]


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

__all__ = ["COLLECTIVES", "all_gather", "all_reduce", "all_to_all", "reduce_scatter", "torch_collective"]
