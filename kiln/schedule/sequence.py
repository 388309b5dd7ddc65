"""Ulysses sequence parallelism: each rank holds a slice of the sequence, and full sequence
with ``heads / world_size`` heads inside attention.

A sequence-parallel *region* (a container module, or a ModuleList of blocks) gets its input
split along the sequence axis (``reduce_scatter{mode=slice}``: no communication; its gradient
gathers the slices back) and its output gathered (``all_gather{grad=slice}``).  Every
attention module inside exchanges ``q``, ``k`` and ``v`` (``[batch, heads, seq/w, dim]``)
with an ``all_to_all`` that scatters heads and gathers the sequence, runs its attention on
``[batch, heads/w, seq, dim]`` and exchanges the result back.  Per-token layers (norms,
MLPs, projections) run on the local slice, so the parameters inside the region see only a
slice's gradient: the build sums their gradients over the ranks
(:class:`~kiln.schedule.data_parallel.GradientBuckets`).

Attention modules are found three ways: transformers attention modules (those that dispatch
through ``config._attn_implementation``) get a per-module config whose implementation is
``"kiln_ulysses"``, which wraps the module's original implementation; the modules of the
types a container's ``.sequence_parallel(attention=...)`` names, and any other module given
``.sequence_parallel()`` directly, are taken to be a core attention ``f(q, k, v, ...)`` on
``[batch, heads, seq, dim]`` tensors and wrapped.  Causal masking is by position over the
full sequence inside attention; an explicit attention mask must cover the full sequence.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from kiln.ir.errors import ScheduleError

from . import collective_ops as C
from .build import map_first, map_input

ULYSSES = "kiln_ulysses"


def _to_heads(t: torch.Tensor, world: int) -> torch.Tensor:
    """``[B, H, S/w, D]`` -> ``[B, H/w, S, D]``."""
    if t.shape[1] % world:
        raise ScheduleError(f"sequence_parallel: attention has {t.shape[1]} heads, which {world} ranks cannot "
                            f"split; use a world size that divides the number of heads")
    return C.all_to_all(t.contiguous(), world, 1, 2)


def _ulysses_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    world = module.kiln_sequence_world
    inner_name = module.kiln_inner_attention
    if inner_name == "eager":
        from importlib import import_module
        inner = getattr(import_module(type(module).__module__), "eager_attention_forward")
    else:
        inner = ALL_ATTENTION_FUNCTIONS[inner_name]
    q, k, v = (_to_heads(t, world) for t in (query, key, value))
    if attention_mask is not None and attention_mask.shape[-2] != q.shape[-2] and attention_mask.shape[-2] != 1:
        raise ScheduleError(f"sequence_parallel: the attention mask covers {attention_mask.shape[-2]} queries but "
                            f"attention runs on the full sequence of {q.shape[-2]}; build the mask for the "
                            "full sequence")
    out, _ = inner(module, q, k, v, attention_mask, **kwargs)  # [B, S, H/w, D]
    return C.all_to_all(out.contiguous(), world, 1, 2), None  # -> [B, S/w, H, D]


def _register_ulysses() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    if ULYSSES not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(ULYSSES, _ulysses_attention)


def _is_hf_attention(mod: nn.Module) -> bool:
    cfg = getattr(mod, "config", None)
    code = getattr(inspect.unwrap(type(mod).forward), "__code__", None)
    return (cfg is not None and hasattr(cfg, "_attn_implementation") and code is not None
            and "ALL_ATTENTION_FUNCTIONS" in code.co_names)


def _hf_ulysses(mod: nn.Module, world: int) -> None:
    _register_ulysses()
    cfg = copy.copy(mod.config)
    inner = mod.config._attn_implementation or "eager"
    if inner == ULYSSES:
        return
    cfg._attn_implementation_internal = ULYSSES
    mod.config = cfg
    mod.kiln_inner_attention = inner
    mod.kiln_sequence_world = world


def _core_ulysses(path: str, mod: nn.Module, world: int) -> None:
    inner = mod.forward

    def forward(q, k, v, *args: Any, **kwargs: Any):
        out = inner(_to_heads(q, world), _to_heads(k, world), _to_heads(v, world), *args, **kwargs)
        back = lambda t: C.all_to_all(t.contiguous(), world, 2, 1)  # noqa: E731  [B,H/w,S,D] -> [B,H,S/w,D]
        return map_first(out, back)
    mod.forward = forward


def _split(world: int, dim: int):
    def split(t: torch.Tensor) -> torch.Tensor:
        axis = dim % t.dim()
        if t.shape[axis] % world:
            raise ScheduleError(f"sequence_parallel: the sequence axis {axis} of shape {tuple(t.shape)} has "
                                f"{t.shape[axis]} positions, which {world} ranks cannot split evenly; pad the "
                                f"sequence to a multiple of {world}")
        return C.reduce_scatter(t.contiguous(), world, axis, "slice")
    return split


def _gather(world: int, dim: int):
    return lambda t: C.all_gather(t.contiguous(), world, dim % t.dim(), "slice")


def apply_sequence_parallel(model: nn.Module, regions: list[tuple[str, int, tuple[type, ...]]], world: int):
    """Install the regions (``(path, sequence axis, core attention types)``) on ``model``;
    returns the gradient buckets summing the in-region parameters' gradients over the ranks."""
    from .data_parallel import GradientBuckets

    params: list[nn.Parameter] = []
    for path, dim, kinds in regions:
        mod = model.get_submodule(path) if path else model
        if _is_hf_attention(mod):
            _hf_ulysses(mod, world)
            continue
        attentions = [m for m in mod.modules() if _is_hf_attention(m)]
        cores = [(name, m) for name, m in mod.named_modules() if kinds and isinstance(m, kinds) and m is not mod]
        if not attentions and not cores and not isinstance(mod, nn.ModuleList) and not list(mod.children()):
            _core_ulysses(path, mod, world)
            continue
        if not attentions and not cores:
            raise ScheduleError(f"sequence_parallel({path!r}): found no attention module inside; apply it to a "
                                "container of transformers attention modules, name the core attention modules' "
                                "type with attention=, or apply it to a core attention module")
        for m in attentions:
            _hf_ulysses(m, world)
        for name, m in cores:
            _core_ulysses(f"{path}.{name}" if path else name, m, world)
        first, last = (mod[0], mod[len(mod) - 1]) if isinstance(mod, nn.ModuleList) else (mod, mod)
        split, gather = _split(world, dim), _gather(world, dim)
        first.register_forward_pre_hook(lambda m, a, k: map_input(a, k, split), with_kwargs=True)
        last.register_forward_hook(lambda m, a, out: map_first(out, gather))
        params += [p for p in mod.parameters() if p.requires_grad]
    return GradientBuckets(params, world, average=False) if params and world > 1 else None


__all__ = ["ULYSSES", "apply_sequence_parallel"]
