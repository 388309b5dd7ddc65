"""The schedule tree: one :class:`Schedule` per module of a model, and the primitives.

``kiln.schedule(model)`` copies the model (the original stays untouched, for
:func:`~kiln.schedule.verify`) and returns the root of a tree of sub-schedules mirroring the
module hierarchy: ``sch["transformer.h.0.attn"]`` (ModuleList indices are path components),
``sch.find(pattern)``.  Primitives record what to do to a module; :meth:`Schedule.build`
applies them for the calling rank (:mod:`kiln.schedule.build`).  ``replace`` and
``replace_all`` apply at once.  Every primitive checks its arguments when it is called and
raises :class:`~kiln.ir.ScheduleError` with the reason and a way on.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.ir.errors import ScheduleError

SYNC_MODES = ("fwd_pre", "fwd_post", "bwd_post")
SYNC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass
class Sync:
    """One communication on a module's input (``fwd_pre``, ``bwd_post``) or output."""

    mode: str
    op: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Directives:
    """What the build does to one module."""

    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Parameter name -> (axis, groups): the axis is cut in ``groups`` equal blocks (a fused
    q/k/v weight has 3) and every block split evenly over the ranks."""
    syncs: list[Sync] = field(default_factory=list)
    checkpoint: bool = False
    fuse: bool = False
    fuse_options: dict[str, Any] = field(default_factory=dict)
    sequence_parallel: int | None = None
    sequence_attention: tuple[type, ...] = ()
    """Module types taken as core attention inside a sequence-parallel container."""
    cut: bool = False


def layout_kind(module: nn.Module, shards: dict[str, tuple[int, int]]) -> str:
    """``"column"`` (output features split), ``"row"`` (input features split: the output is a
    partial sum), ``"replicated"`` (nothing sharded) or ``"other"``, for an ``nn.Linear``
    or a transformers ``Conv1D`` (weight ``[in, out]``); ``"other"`` for other modules
    with shards."""
    if "weight" not in shards:
        return "replicated" if not shards else "other"
    axis = shards["weight"][0]
    if isinstance(module, nn.Linear):
        return "column" if axis == 0 else "row"
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
            and module.weight.dim() == 2:
        return "column" if axis == 1 else "row"
    return "other"


class Schedule:
    """The schedule of one module (see the module docstring).  ``module`` is the module
    now at ``path`` in the scheduled copy; ``sch.original`` (the root's) is the user's."""

    def __init__(self, root_module: nn.Module | None = None, *, world_size: int | None = None,
                 rank: int | None = None, _root: Schedule | None = None, _path: str = ""):
        if _root is None:
            if not isinstance(root_module, nn.Module):
                raise ScheduleError(f"kiln.schedule: expects an nn.Module, got {type(root_module).__name__}")
            world, me = _world(world_size, rank)
            self.original = root_module
            self._model = copy.deepcopy(root_module)
            self.world_size, self.rank = world, me
            self._records: dict[str, Directives] = {}
            self._built: Any = None
        self._root = _root or self
        self.path = _path

    # ------------------------------------------------------------------ the tree
    @property
    def root(self) -> Schedule:
        return self._root

    @property
    def module(self) -> nn.Module:
        """The module now at this path of the scheduled copy."""
        model = self._root._model
        return model if not self.path else model.get_submodule(self.path)

    def __getitem__(self, path: str) -> Schedule:
        full = f"{self.path}.{path}" if self.path and path else (path or self.path)
        try:
            self._root._model.get_submodule(full) if full else None
        except AttributeError:
            names = [n for n, _ in self.module.named_children()]
            raise ScheduleError(f"schedule: no submodule {path!r} under {self.path or 'the model'!r}; "
                                f"its children are {names}") from None
        return Schedule(_root=self._root, _path=full)

    def children(self) -> list[Schedule]:
        return [self[name] for name, _ in self.module.named_children()]

    def walk(self) -> Iterator[Schedule]:
        """This schedule and every sub-schedule, parents first."""
        for name, _ in self.module.named_modules():
            yield self[name] if name else self

    def find(self, pattern: type | str | Callable[[str, nn.Module], bool]) -> list[Schedule]:
        """Sub-schedules (this one included) whose module matches ``pattern``: a module type
        (``isinstance``), a regular expression matched against the whole relative path
        (``r"h\\.\\d+\\.attn"``), or a predicate ``(path, module) -> bool``."""
        if isinstance(pattern, type):
            test = lambda p, m: isinstance(m, pattern)  # noqa: E731
        elif isinstance(pattern, str):
            regex = re.compile(pattern)
            test = lambda p, m: regex.fullmatch(p) is not None  # noqa: E731
        elif callable(pattern):
            test = pattern
        else:
            raise ScheduleError(f"find: pattern must be a module type, a regex string or a predicate, "
                                f"got {type(pattern).__name__}")
        found = []
        for name, mod in self.module.named_modules():
            if test(name, mod):
                found.append(self[name] if name else self)
        return found

    # ------------------------------------------------------------------ records
    @property
    def directives(self) -> Directives:
        return self._root._records.setdefault(self.path, Directives())

    def _check_open(self, what: str) -> None:
        if self._root._built is not None:
            raise ScheduleError(f"{what} on {self.path or 'the model'!r}: the schedule is already built; "
                                "make a new kiln.schedule(model) to change it")

    def __repr__(self) -> str:
        return f"Schedule({self.path or '<root>'}: {type(self.module).__name__})"

    # ------------------------------------------------------------------ primitives
    def replace(self, new: nn.Module | Callable[..., Any]) -> Schedule:
        """Put ``new`` (a module, or a function of the old module's inputs) in place of this
        module.  Directives recorded for the old module and its submodules are dropped."""
        self._check_open("replace")
        if not self.path:
            raise ScheduleError("replace: the root cannot be replaced; schedule the new model instead")
        if not isinstance(new, nn.Module):
            if not callable(new):
                raise ScheduleError(f"replace({self.path!r}): expects an nn.Module or a function, "
                                    f"got {type(new).__name__}")
            new = FunctionModule(new)
        parent_path, _, name = self.path.rpartition(".")
        parent = self._root._model.get_submodule(parent_path) if parent_path else self._root._model
        setattr(parent, name, new) if not isinstance(parent, (nn.ModuleList, nn.Sequential)) \
            else parent.__setitem__(int(name), new)
        for key in [k for k in self._root._records if k == self.path or k.startswith(self.path + ".")]:
            del self._root._records[key]
        return self

    def replace_all(self, kind: type, make: Callable[[nn.Module], nn.Module | Callable[..., Any]]) -> int:
        """Replace every submodule of type ``kind`` by ``make(old)``; returns how many."""
        targets = [s for s in self.find(kind) if s.path]
        if not targets and isinstance(self.module, kind) and not self.path:
            raise ScheduleError("replace_all: only the root matches; the root cannot be replaced")
        for sch in targets:
            sch.replace(make(sch.module))
        return len(targets)

    def checkpoint(self) -> Schedule:
        """Recompute this module's forward in the backward instead of keeping its activations:
        ``torch.utils.checkpoint`` eagerly; rematerialization in kiln's training graph under
        :func:`kiln.schedule.compile_train`."""
        self._check_open("checkpoint")
        if not self.path:
            raise ScheduleError("checkpoint: checkpointing the whole model saves nothing (its output is "
                                "needed by the loss); checkpoint its blocks")
        self.directives.checkpoint = True
        return self

    def fuse(self, **options: Any) -> Schedule:
        """Compile this module with kiln as one region (``kiln.compile(module, inputs,
        **options)``, gradients through kiln's backward graph), on first call and again per
        input signature."""
        self._check_open("fuse")
        if not any(True for _ in self.module.parameters()) and not list(self.module.children()) \
                and type(self.module).forward is nn.Module.forward:
            raise ScheduleError(f"fuse({self.path!r}): the module has no forward to compile")
        self.directives.fuse = True
        self.directives.fuse_options = dict(options)
        return self

    def shard(self, param: str, axis: int, *, groups: int = 1) -> Schedule:
        """Split parameter ``param`` of this module along ``axis`` over the ranks (each rank
        keeps its slice).  ``groups=k``: the axis holds ``k`` stacked blocks (a fused q/k/v
        projection has 3) and each block is split, so rank ``r`` holds block slices ``r``."""
        self._check_open("shard")
        mod = self.module
        p = mod._parameters.get(param)
        if p is None:
            own = sorted(n for n, v in mod._parameters.items() if v is not None)
            raise ScheduleError(f"shard({self.path!r}, {param!r}): {type(mod).__name__} has no parameter "
                                f"{param!r} of its own; its parameters are {own} (shard a submodule's "
                                "parameter on the submodule's schedule)")
        if not -p.dim() <= axis < p.dim():
            raise ScheduleError(f"shard({self.path}.{param}): axis {axis} is out of range for shape "
                                f"{tuple(p.shape)}")
        axis %= p.dim()
        w = self._root.world_size
        if groups < 1 or p.shape[axis] % (w * groups):
            raise ScheduleError(
                f"shard({self.path}.{param}, axis={axis}): size {p.shape[axis]} of shape {tuple(p.shape)} "
                f"does not divide into {groups} group(s) x {w} ranks; choose another axis or a world size "
                f"that divides {p.shape[axis] // max(groups, 1)}")
        d = self.directives
        if param in d.shards:
            raise ScheduleError(f"shard({self.path}.{param}): already sharded along axis {d.shards[param][0]}")
        if param == "bias" and layout_kind(mod, d.shards) == "row":
            raise ScheduleError(
                f"shard({self.path}.bias): {self.path} is row-parallel (its weight is split along the input "
                "features), so its output is a partial sum over ranks; keep the bias unsharded: the build "
                "adds it once, after the all_reduce")
        d.shards[param] = (axis, groups)
        if param == "weight" and "bias" in d.shards and layout_kind(mod, d.shards) == "row":
            del d.shards[param]
            raise ScheduleError(f"shard({self.path}.weight, axis={axis}): this makes {self.path} row-parallel "
                                "but its bias is sharded; keep the bias of a row-parallel module unsharded")
        return self

    def sync(self, mode: str = "fwd_post", op: str = "all_reduce", **kwargs: Any) -> Schedule:
        """Communicate this module's input (``fwd_pre``), output (``fwd_post``) or input
        gradient (``bwd_post``, all_reduce only) with collective ``op``.  Keyword arguments:
        ``dim`` (all_gather, reduce_scatter; default -1), all_gather's ``grad`` (``"slice"``,
        the default: the gathered value feeds a loss counted once; ``"sum"``), reduce_scatter's
        ``reduce`` (``True``; ``False`` only takes the rank's slice), ``split_dim`` and
        ``concat_dim`` (all_to_all)."""
        self._check_open("sync")
        where = f"sync({self.path or 'the model'!r}, mode={mode!r}, op={op!r})"
        if mode not in SYNC_MODES:
            raise ScheduleError(f"{where}: mode must be one of {SYNC_MODES}")
        if op not in SYNC_OPS:
            raise ScheduleError(f"{where}: op must be one of {SYNC_OPS}")
        if mode == "bwd_post" and op != "all_reduce":
            raise ScheduleError(f"{where}: a gradient keeps its tensor's shape, so only all_reduce can run "
                                "on it; gather or scatter the forward value instead (fwd_pre/fwd_post)")
        allowed = {"all_reduce": set(), "all_gather": {"dim", "grad"}, "reduce_scatter": {"dim", "reduce"},
                   "all_to_all": {"split_dim", "concat_dim"}}[op]
        unknown = set(kwargs) - allowed
        if unknown:
            raise ScheduleError(f"{where}: unknown argument(s) {sorted(unknown)}; {op} takes {sorted(allowed)}")
        if op == "all_to_all" and set(kwargs) != allowed:
            raise ScheduleError(f"{where}: all_to_all needs split_dim and concat_dim")
        d = self.directives
        kind = layout_kind(self.module, d.shards)
        if mode == "fwd_post" and op == "all_reduce" and kind == "column":
            raise ScheduleError(
                f"{where}: the output of column-parallel {self.path} is partitioned (each rank holds other "
                "output features), and summing different features is meaningless; all_gather it "
                "(op='all_gather', dim=-1) or feed it to a row-parallel module")
        if mode == "fwd_post" and op in ("all_gather", "reduce_scatter") and kind == "row" \
                and not kwargs.get("reduce", True):
            raise ScheduleError(f"{where}: the output of row-parallel {self.path} is a partial sum; "
                                "all_reduce it (or reduce_scatter with reduce=True)")
        if mode == "fwd_post" and op == "all_gather" and kind == "row":
            raise ScheduleError(f"{where}: the output of row-parallel {self.path} is a partial sum, not a "
                                "slice; all_reduce it instead")
        if mode == "fwd_post" and op == "all_reduce" and kind == "replicated" \
                and not list(self.module.children()):
            raise ScheduleError(f"{where}: {self.path} has no sharded parameter, so its output is the same "
                                "on every rank and an all_reduce would multiply it by the world size; "
                                "shard its weight along the input features first")
        if any(s.mode == mode and s.op == op for s in d.syncs):
            raise ScheduleError(f"{where}: recorded twice")
        d.syncs.append(Sync(mode, op, dict(kwargs)))
        return self

    def sequence_parallel(self, dim: int = 1, attention: type | tuple[type, ...] = ()) -> Schedule:
        """Ulysses sequence parallelism.  On a container (a block stack, an encoder): its input
        is split along the sequence axis ``dim`` so each rank holds one slice, its output is
        gathered back, and every attention inside runs an all_to_all to full sequence and
        ``heads / world_size`` heads and back.  The attention inside is every transformers
        attention module, and every module of a type in ``attention``: a core attention
        ``f(q, k, v, ...)`` on ``[batch, heads, seq, dim]`` tensors.  On an attention module:
        only that exchange (an enclosing container must split the sequence)."""
        self._check_open("sequence_parallel")
        kinds = attention if isinstance(attention, tuple) else (attention,)
        if not all(isinstance(k, type) and issubclass(k, nn.Module) for k in kinds):
            raise ScheduleError(f"sequence_parallel({self.path!r}): attention= takes module types, got "
                                f"{attention!r}")
        if self.directives.sequence_parallel is not None:
            raise ScheduleError(f"sequence_parallel({self.path!r}): recorded twice")
        for other, d in self._root._records.items():
            if d.sequence_parallel is not None and (other.startswith(self.path + ".") or
                                                    self.path.startswith(other + ".") or not other):
                raise ScheduleError(f"sequence_parallel({self.path!r}): {other!r} is already sequence parallel; "
                                    "nested regions would split the sequence twice")
        self.directives.sequence_parallel = dim
        self.directives.sequence_attention = kinds
        return self

    def cut_pipeline_stage(self) -> Schedule:
        """End a pipeline stage after this module (an element of a ModuleList of blocks)."""
        self._check_open("cut_pipeline_stage")
        parent_path, _, name = self.path.rpartition(".")
        parent = self._root._model.get_submodule(parent_path) if parent_path else None
        if not isinstance(parent, nn.ModuleList):
            raise ScheduleError(f"cut_pipeline_stage({self.path!r}): stages are cut between the blocks of a "
                                "ModuleList (e.g. 'transformer.h.1'); this module is not one")
        if int(name) == len(parent) - 1:
            raise ScheduleError(f"cut_pipeline_stage({self.path!r}): the last block of {parent_path} ends the "
                                "stack; cut after an earlier one")
        cuts = [p for p, d in self._root._records.items() if d.cut]
        if cuts and cuts[0].rpartition(".")[0] != parent_path:
            raise ScheduleError(f"cut_pipeline_stage({self.path!r}): earlier cuts are in {cuts[0].rpartition('.')[0]}"
                                "; all cuts must be in one block list")
        self.directives.cut = True
        return self

    def build(self, optimizer: Any = None) -> Any:
        """The scheduled model for this rank (and the optimizer over its parameters when
        ``optimizer`` is given: an optimizer class, a function ``params -> optimizer`` or an
        optimizer of the original model, re-created with its hyperparameters)."""
        from .build import build
        if self is not self._root:
            return self._root.build(optimizer)
        if self._built is None:
            self._built = build(self)
        model = self._built
        if optimizer is None:
            return model
        return model, _make_optimizer(optimizer, model)


class FunctionModule(nn.Module):
    """A function as a module (what :meth:`Schedule.replace` puts in for a function)."""

    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _world(world_size: int | None, rank: int | None) -> tuple[int, int]:
    import torch.distributed as dist
    up = dist.is_available() and dist.is_initialized()
    world = world_size if world_size is not None else (dist.get_world_size() if up else 1)
    me = rank if rank is not None else (dist.get_rank() if up else 0)
    if up and world != dist.get_world_size():
        raise ScheduleError(f"kiln.schedule: world_size={world} but torch.distributed has "
                            f"{dist.get_world_size()} ranks")
    if not 0 <= me < world:
        raise ScheduleError(f"kiln.schedule: rank {me} is not in 0..{world - 1}")
    return world, me


def _make_optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != 1:
            raise ScheduleError("build(optimizer=...): an optimizer with several param groups cannot be "
                                "re-created for the sharded parameters; pass a function params -> optimizer")
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        return type(optimizer)(params, **hyper)
    if callable(optimizer):
        return optimizer(params)
    raise ScheduleError(f"build(optimizer=...): expects an optimizer, its class or a function params -> "
                        f"optimizer, got {type(optimizer).__name__}")


__all__ = ["Directives", "FunctionModule", "SYNC_MODES", "SYNC_OPS", "Schedule", "Sync", "layout_kind"]
