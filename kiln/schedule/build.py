"""Applying a schedule for one rank: sharded parameters, communication, checkpoints, regions.

:func:`build` turns the recorded directives of a :class:`~kiln.schedule.tree.Schedule` into
the scheduled copy of the model:

* **shards** -- each parameter, initialized at full shape in the copy of the model, is cut
  and this rank keeps its slice, so a sharded model starts from exactly the unsharded
  model's weights;
* **row-parallel ``nn.Linear`` / ``Conv1D``** with ``sync("fwd_post", "all_reduce")``: the
  forward computes the partial product without the bias, all-reduces it, then adds the bias
  once (a bias added before the reduction would count once per rank);
* **syncs** -- forward hooks calling the ``kiln_dist`` operators (:mod:`.collective_ops`);
* **sequence parallelism** (:mod:`.sequence`);
* **checkpoint** -- ``torch.utils.checkpoint`` around the module's forward, except while
  :func:`kiln.schedule.compile_train` exports the model (kiln's remat pass then does it);
* **fuse** -- :func:`kiln.compile` of the module, one compiled region per input signature;
* **pipeline cuts** -- :class:`~kiln.schedule.pipeline.PipelineModule` (:mod:`.pipeline`).
"""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.ir.errors import ScheduleError

from . import collective_ops as C
from .tree import Directives, Schedule, Sync, layout_kind


class _State(threading.local):
    exporting = False
    """Set while kiln exports the model: checkpoints and regions call straight through."""


STATE = _State()


@dataclass
class ScheduleInfo:
    """What a built model remembers of its schedule (``model.kiln_schedule``)."""

    world_size: int
    rank: int
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Full parameter name -> (axis, groups)."""
    checkpointed: list[str] = field(default_factory=list)
    fused: list[str] = field(default_factory=list)
    grad_sync: Any = None
    """The :class:`~kiln.schedule.data_parallel.GradientBuckets` summing the gradients of the
    parameters inside sequence-parallel regions over the ranks (``None``: none)."""


def shard_tensor(full: torch.Tensor, axis: int, groups: int, world: int, rank: int) -> torch.Tensor:
    """This rank's slice of ``full`` (see :meth:`Schedule.shard`)."""
    blocks = full.chunk(groups, dim=axis)
    return torch.cat([b.chunk(world, dim=axis)[rank] for b in blocks], dim=axis).clone()


def unshard_tensor(parts: list[torch.Tensor], axis: int, groups: int) -> torch.Tensor:
    """The full tensor from every rank's slice, in rank order (inverse of :func:`shard_tensor`)."""
    per_rank = [p.chunk(groups, dim=axis) for p in parts]
    return torch.cat([torch.cat([r[g] for r in per_rank], dim=axis) for g in range(groups)], dim=axis)


def build(sch: Schedule) -> nn.Module:
    model = sch._model
    world, rank = sch.world_size, sch.rank
    info = ScheduleInfo(world, rank)
    records = sorted(sch._records.items(), key=lambda kv: kv[0])
    for path, d in records:
        mod = model.get_submodule(path) if path else model
        for name, (axis, groups) in d.shards.items():
            full = getattr(mod, name)
            mod._parameters[name] = nn.Parameter(shard_tensor(full.detach(), axis, groups, world, rank),
                                                 requires_grad=full.requires_grad)
            info.shards[f"{path}.{name}" if path else name] = (axis, groups)
        _resize_attributes(mod)
        _apply_syncs(path, mod, d, world)
    from .sequence import apply_sequence_parallel
    regions = [(path, d.sequence_parallel, d.sequence_attention) for path, d in records
               if d.sequence_parallel is not None]
    if regions:
        info.grad_sync = apply_sequence_parallel(model, regions, world)
    for path, d in records:
        mod = model.get_submodule(path) if path else model
        if d.fuse:
            _fuse(mod, d.fuse_options)
            info.fused.append(path)
        if d.checkpoint:
            _checkpoint(mod)
            info.checkpointed.append(path)
    model.kiln_schedule = info
    cuts = [path for path, d in records if d.cut]
    if cuts:
        from .pipeline import PipelineModule
        return PipelineModule(model, cuts, world, rank)
    return model


def _resize_attributes(mod: nn.Module) -> None:
    """The size attributes of a module whose weight was sharded (``Conv1D`` reads ``nf``)."""
    w = getattr(mod, "weight", None)
    if isinstance(mod, nn.Linear):
        mod.out_features, mod.in_features = w.shape
    elif type(mod).__name__ == "Conv1D" and w is not None and w.dim() == 2 and hasattr(mod, "nf"):
        mod.nf = w.shape[1]


# ---------------------------------------------------------------------------- syncs
def collective(op: str, x: torch.Tensor, world: int, kwargs: dict[str, Any], *, where: str) -> torch.Tensor:
    """``x`` through ``op`` as a forward-side sync (see :meth:`Schedule.sync`)."""
    if not isinstance(x, torch.Tensor):
        raise ScheduleError(f"sync at {where}: expects a tensor to communicate, got {type(x).__name__}")
    x = x.contiguous()
    if op == "all_reduce":
        return C.all_reduce(x, world, True, False)
    if op == "all_gather":
        return C.all_gather(x, world, kwargs.get("dim", -1) % x.dim(), kwargs.get("grad", "slice"))
    if op == "reduce_scatter":
        dim = kwargs.get("dim", -1) % x.dim()
        if x.shape[dim] % world:
            raise ScheduleError(f"sync at {where}: reduce_scatter along axis {dim} of shape {tuple(x.shape)}: "
                                f"size {x.shape[dim]} does not divide over {world} ranks")
        return C.reduce_scatter(x, world, dim, "sum" if kwargs.get("reduce", True) else "slice")
    split, concat = kwargs["split_dim"] % x.dim(), kwargs["concat_dim"] % x.dim()
    if x.shape[split] % world:
        raise ScheduleError(f"sync at {where}: all_to_all splits axis {split} of shape {tuple(x.shape)}, "
                            f"size {x.shape[split]}, which does not divide over {world} ranks")
    return C.all_to_all(x, world, split, concat)


def map_first(value: Any, fn) -> Any:
    """``value`` with its first tensor (itself, or the first entry of a tuple/list) mapped."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return type(value)([fn(value[0]), *value[1:]])
    if hasattr(value, "to_tuple") and len(value) and isinstance(value[0], torch.Tensor):
        key = next(iter(value.keys()))
        value[key] = fn(value[key])
        return value
    raise ScheduleError(f"sync: found no tensor to communicate in a {type(value).__name__}")


def map_input(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    if args:
        return (map_first(args[0], fn), *args[1:]), kwargs
    for key in ("hidden_states", "x", "input"):
        if key in kwargs:
            return args, {**kwargs, key: map_first(kwargs[key], fn)}
    raise ScheduleError("sync on a module input: the module was called without a positional or "
                        "'hidden_states' argument")


def _apply_syncs(path: str, mod: nn.Module, d: Directives, world: int) -> None:
    kind = layout_kind(mod, d.shards)
    syncs = list(d.syncs)
    if kind == "column" and "bias" not in d.shards and getattr(mod, "bias", None) is not None:
        raise ScheduleError(f"build: column-parallel {path} splits its output features but not its bias "
                            f"(shape {tuple(mod.bias.shape)}); add .shard('bias', 0)")
    row_reduce = next((s for s in syncs if s.mode == "fwd_post" and s.op == "all_reduce"), None)
    if kind == "row":
        if getattr(mod, "bias", None) is not None and row_reduce is None:
            raise ScheduleError(f"build: row-parallel {path} has a bias but no .sync('fwd_post', 'all_reduce') of "
                                "its own; kiln adds the bias once, after that reduction, so put the sync on "
                                "this module")
        if row_reduce is not None:
            mod.forward = types.MethodType(_row_parallel_forward(world), mod)
            syncs.remove(row_reduce)
    for s in syncs:
        _install(path, mod, s, world)


def _row_parallel_forward(world: int):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self, nn.Linear):
            partial = F.linear(x, self.weight)
        else:  # transformers' Conv1D: weight [in, out]
            partial = torch.matmul(x, self.weight)
        out = C.all_reduce(partial.contiguous(), world, True, False)
        return out if self.bias is None else out + self.bias
    return forward


def _install(path: str, mod: nn.Module, s: Sync, world: int) -> None:
    where = f"{path or 'the model'} ({s.mode})"
    if s.mode == "bwd_post":
        def pre(module, args, kwargs):
            return map_input(args, kwargs, lambda t: C.all_reduce(t.contiguous(), world, False, True))
        mod.register_forward_pre_hook(pre, with_kwargs=True)
    elif s.mode == "fwd_pre":
        def pre(module, args, kwargs):
            return map_input(args, kwargs, lambda t: collective(s.op, t, world, s.kwargs, where=where))
        mod.register_forward_pre_hook(pre, with_kwargs=True)
    else:
        def post(module, args, output):
            return map_first(output, lambda t: collective(s.op, t, world, s.kwargs, where=where))
        mod.register_forward_hook(post)


# ---------------------------------------------------------------------- checkpoint, fuse
def _checkpoint(mod: nn.Module) -> None:
    inner = mod.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if STATE.exporting or not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)
    mod.forward = forward
    mod.kiln_checkpointed = True


class _Region(nn.Module):
    """The fused module's own forward, as the module kiln compiles."""

    def __init__(self, inner: nn.Module, forward):
        super().__init__()
        self.inner = inner
        self._forward = forward

    def forward(self, *args: Any) -> Any:
        n = self._nargs
        return self._forward(*args[:n], **dict(zip(self._keys, args[n:])))


def _signature(args: tuple, kwargs: dict) -> tuple:
    def key(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("t", tuple(v.shape), v.dtype, v.requires_grad)
        return ("v", v if isinstance(v, (int, float, bool, str, type(None))) else id(v))
    return tuple(key(a) for a in args) + tuple((k, key(v)) for k, v in sorted(kwargs.items()))


class FusedRegion:
    """The kiln-compiled forms of a fused module (``module.kiln_fused``), one per input
    signature (shapes, dtypes, requires-grad, non-tensor values)."""

    def __init__(self) -> None:
        self.compiled: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self.compiled)


def _fuse(mod: nn.Module, options: dict[str, Any]) -> None:
    import kiln
    inner = mod.forward
    region_cache = FusedRegion()  # not a dict attribute: torch.export restores those after tracing
    compiled = region_cache.compiled

    def forward(*args: Any, **kwargs: Any) -> Any:
        if STATE.exporting:
            return inner(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        sig = _signature(args, kwargs)
        fn = compiled.get(sig)
        if fn is None:
            region = _Region(mod, inner)
            object.__setattr__(region, "_nargs", len(args))
            object.__setattr__(region, "_keys", tuple(kwargs))
            STATE.exporting = True  # the region's own forward, without this wrapper
            try:
                fn = kiln.compile(region, (*args, *kwargs.values()), **options)
            finally:
                STATE.exporting = False
            compiled[sig] = fn
        return fn(*args, *kwargs.values())
    mod.forward = forward
    mod.kiln_fused = region_cache


__all__ = ["STATE", "ScheduleInfo", "build", "collective", "map_first", "map_input", "shard_tensor",
           "unshard_tensor"]
