"""The collectives as PyTorch operators (``torch.ops.kiln_dist.*``) and their kiln lowerings.

Every communication a schedule adds to a model goes through one of these four operators.
Eagerly they call ``torch.distributed`` on the default group (through
:func:`kiln.ir.ops.collectives.torch_collective`, the same function the cpu backend's library
call runs), and their autograd formulas are the gradient rules of the kiln ops of the same
names (:mod:`kiln.ir.ops.collectives`).  Under ``torch.export`` they stay single operators,
and the lowering rules below turn each into the kiln op, so ``kiln.compile_train`` captures
a sharded training step, collectives included, as one kiln graph.

Arguments mirror the kiln ops' attributes: ``all_reduce(x, world_size, fwd, bwd)``,
``all_gather(x, world_size, dim, grad)``, ``reduce_scatter(x, world_size, dim, mode)``,
``all_to_all(x, world_size, split_dim, concat_dim)``.
"""

from __future__ import annotations

import torch

from kiln.frontends.torch.aten import lowers
from kiln.ir.ops.collectives import torch_collective

_LIB = "kiln_dist"


def _run(op: str, x: torch.Tensor, **attrs) -> torch.Tensor:
    return torch_collective(op, attrs)(x)


@torch.library.custom_op(f"{_LIB}::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, world_size: int, fwd: bool, bwd: bool) -> torch.Tensor:
    """Sum over the ranks (identity forward when ``fwd`` is false)."""
    return _run("all_reduce", x, world_size=world_size, fwd=fwd, bwd=bwd)


@torch.library.custom_op(f"{_LIB}::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, world_size: int, dim: int, grad: str) -> torch.Tensor:
    """The ranks' tensors concatenated along ``dim``."""
    return _run("all_gather", x, world_size=world_size, dim=dim, grad=grad)


@torch.library.custom_op(f"{_LIB}::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, world_size: int, dim: int, mode: str) -> torch.Tensor:
    """The rank's slice along ``dim`` of the sum over ranks (``mode="sum"``) or of ``x``."""
    return _run("reduce_scatter", x, world_size=world_size, dim=dim, mode=mode)


@torch.library.custom_op(f"{_LIB}::all_to_all", mutates_args=())
def all_to_all(x: torch.Tensor, world_size: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Chunk ``j`` along ``split_dim`` to rank ``j``, received chunks concatenated."""
    return _run("all_to_all", x, world_size=world_size, split_dim=split_dim, concat_dim=concat_dim)


def _resized(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


@all_reduce.register_fake
def _(x, world_size, fwd, bwd):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@all_gather.register_fake
def _(x, world_size, dim, grad):
    return _resized(x, dim, x.shape[dim] * world_size)


@reduce_scatter.register_fake
def _(x, world_size, dim, mode):
    return _resized(x, dim, x.shape[dim] // world_size)


@all_to_all.register_fake
def _(x, world_size, split_dim, concat_dim):
    out = _resized(x, split_dim, x.shape[split_dim] // world_size)
    return _resized(out, concat_dim, out.shape[concat_dim] * world_size)


def _keep(ctx, inputs, output):
    ctx.args = inputs[1:]


def _all_reduce_bwd(ctx, g):
    world_size, fwd, bwd = ctx.args
    return all_reduce(g.contiguous(), world_size, bwd, fwd), None, None, None


def _all_gather_bwd(ctx, g):
    world_size, dim, grad = ctx.args
    return reduce_scatter(g.contiguous(), world_size, dim, grad), None, None, None


def _reduce_scatter_bwd(ctx, g):
    world_size, dim, mode = ctx.args
    return all_gather(g.contiguous(), world_size, dim, mode), None, None, None


def _all_to_all_bwd(ctx, g):
    world_size, split_dim, concat_dim = ctx.args
    return all_to_all(g.contiguous(), world_size, concat_dim, split_dim), None, None, None


all_reduce.register_autograd(_all_reduce_bwd, setup_context=_keep)
all_gather.register_autograd(_all_gather_bwd, setup_context=_keep)
reduce_scatter.register_autograd(_reduce_scatter_bwd, setup_context=_keep)
all_to_all.register_autograd(_all_to_all_bwd, setup_context=_keep)


def _axis(dim: int, x) -> int:
    return dim + len(x.shape) if dim < 0 else dim


_ops = torch.ops.kiln_dist


@lowers(_ops.all_reduce.default, fresh=True)
def _lower_all_reduce(ctx, x, world_size, fwd, bwd):
    return ctx.op("all_reduce", x, world_size=world_size, fwd=fwd, bwd=bwd)


@lowers(_ops.all_gather.default, fresh=True)
def _lower_all_gather(ctx, x, world_size, dim, grad):
    return ctx.op("all_gather", x, world_size=world_size, dim=_axis(dim, x), grad=grad)


@lowers(_ops.reduce_scatter.default, fresh=True)
def _lower_reduce_scatter(ctx, x, world_size, dim, mode):
    return ctx.op("reduce_scatter", x, world_size=world_size, dim=_axis(dim, x), mode=mode)


@lowers(_ops.all_to_all.default, fresh=True)
def _lower_all_to_all(ctx, x, world_size, split_dim, concat_dim):
    return ctx.op("all_to_all", x, world_size=world_size, split_dim=_axis(split_dim, x),
                  concat_dim=_axis(concat_dim, x))


__all__ = ["all_gather", "all_reduce", "all_to_all", "reduce_scatter"]
