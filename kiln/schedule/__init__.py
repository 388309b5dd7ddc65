"""Model-level schedules: one-device and distributed training plans applied to an unchanged
``nn.Module`` ([docs/schedules.md](../../docs/schedules.md)).

::

    sch = kiln.schedule(model)                       # a tree mirroring model's modules
    sch["transformer.h.0.mlp.c_fc"].shard("weight", 1)
    sch["transformer.h.0"].checkpoint()
    model, opt = sch.build(optimizer=torch.optim.SGD)
    kiln.schedule.verify(sch, (ids,))                # outputs and gathered gradients vs the original

``kiln.schedule`` is this package, callable: ``kiln.schedule(model, world_size=None,
rank=None)`` is :class:`Schedule` (world size and rank default to torch.distributed's, else
1 and 0).  Also here: :func:`verify`, :func:`compile_train` (``kiln.compile_train`` of a
scheduled model: checkpoints become kiln's rematerialization, collectives IR ops),
:func:`data_parallel` and :class:`GradientBuckets`, :class:`PipelineModule` (what ``build``
returns for a schedule with pipeline cuts), :func:`plan_microbatches`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .build import STATE, ScheduleInfo, shard_tensor, unshard_tensor
from .data_parallel import GradientBuckets, data_parallel
from .microbatch import MicrobatchPlan, plan_microbatches
from .pipeline import PipelineModule
from .tree import FunctionModule, Schedule
from .verify import ScheduleMismatch, VerifyReport, verify


def schedule(model: Any, *, world_size: int | None = None, rank: int | None = None) -> Schedule:
    """The schedule tree of ``model`` (see :class:`Schedule`)."""
    return Schedule(model, world_size=world_size, rank=rank)


def compile_train(model: Any, loss_fn: Any, optimizer: Any, example_inputs: Any, **options: Any) -> Any:
    """``kiln.compile_train`` of a built, scheduled model as one graph: the collectives the
    schedule added are kiln IR ops, and checkpointed modules make ``remat`` default to on
    (kiln's rematerialization pass over the training graph instead of
    ``torch.utils.checkpoint``).  Other options are ``kiln.compile_train``'s."""
    from kiln.compiler.train import compile_train as kiln_compile_train
    from kiln.ir.errors import ScheduleError

    info = getattr(model, "kiln_schedule", None)
    if isinstance(model, PipelineModule):
        raise ScheduleError("kiln.schedule.compile_train: a pipeline stage trains through "
                            "PipelineModule.train_step; compile its blocks with .fuse() instead")
    if info is not None and info.grad_sync is not None:
        raise ScheduleError("kiln.schedule.compile_train: a sequence-parallel model sums its in-region gradients "
                            "over the ranks after the backward, which a compiled step (that updates parameters "
                            "in place) has no place for; train it eagerly, or use tensor parallelism")
    if "remat" not in options:
        options["remat"] = bool(info is not None and info.checkpointed)
    STATE.exporting = True
    try:
        return kiln_compile_train(model, loss_fn, optimizer, example_inputs, **options)
    finally:
        STATE.exporting = False


class _CallablePackage(types.ModuleType):
    def __call__(self, model: Any, **kwargs: Any) -> Schedule:
        return schedule(model, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["FunctionModule", "GradientBuckets", "MicrobatchPlan", "PipelineModule", "STATE", "Schedule",
           "ScheduleInfo", "ScheduleMismatch", "VerifyReport", "compile_train", "data_parallel",
           "plan_microbatches", "schedule", "shard_tensor", "unshard_tensor", "verify"]
