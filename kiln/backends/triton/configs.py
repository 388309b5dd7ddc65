"""Launch configurations: a small space per kernel kind, one fixed choice in the interpreter,
timed choices on a GPU.

A configuration is a dict of launch parameters.  Every kind's launch function clamps them
to the kernel's extents (blocks never exceed the power of two covering what they tile), so
any configuration of the kind's space is valid for any kernel of that kind:

==========  ==========================================================================
kind        parameters
==========  ==========================================================================
pointwise   ``XBLOCK`` (lanes per program), ``num_warps``
reduction   ``XBLOCK`` (rows per program), ``RBLOCK`` (block of each vector nest; ``0``:
general     the whole extent, a persistent reduction), ``TILE`` (bound on
            ``XBLOCK * RBLOCK``), ``num_warps``
matmul      ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M`` (tile rows per swizzle
            group), ``num_warps``, ``num_stages``
attention   ``BLOCK_M`` (queries per program), ``BLOCK_N`` (keys per step), ``num_warps``,
            ``num_stages``
==========  ==========================================================================

The first configuration of a space is the default when nothing is timed.  In the
interpreter (kernels run on the CPU through numpy, one program after the other) every
kernel of a kind uses :data:`INTERPRET`: few, large programs.  On a GPU,
:class:`ConfigTuner` times every configuration of a kernel's space once (on random operands
of the kernel's argument types) and keeps the fastest in ``triton_configs.json`` of the
compile cache folder (a :class:`kiln.backends.common.choices.ChoiceStore`), keyed by the
device, Triton's version and the kernel's source; later builds reuse it untimed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from kiln.backends.common.choices import ChoiceStore

KINDS = ("pointwise", "reduction", "general", "matmul", "attention")


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def space(kind: str, info: dict) -> list[dict]:
    """The configurations of a kernel of ``kind``; ``info`` holds its extents (``xnumel``,
    ``rnumel`` -- the widest vector nest -- for row kernels; ``m``, ``n``, ``k`` for matmuls;
    ``lq``, ``lk``, ``d`` for attention)."""
    if kind == "pointwise":
        return [{"XBLOCK": 1024, "num_warps": 4}, {"XBLOCK": 512, "num_warps": 4},
                {"XBLOCK": 256, "num_warps": 2}, {"XBLOCK": 2048, "num_warps": 8}]
    if kind in ("reduction", "general"):
        rnumel = _pow2(max(1, info.get("rnumel", 1)))
        configs = []
        if rnumel <= 8192:
            configs.append({"XBLOCK": max(1, 2048 // rnumel), "RBLOCK": 0, "TILE": 4096,
                            "num_warps": 8 if rnumel >= 2048 else 4})
            configs.append({"XBLOCK": max(1, 512 // rnumel), "RBLOCK": 0, "TILE": 8192, "num_warps": 4})
        configs += [{"XBLOCK": 1, "RBLOCK": 2048, "TILE": 4096, "num_warps": 8},
                    {"XBLOCK": 8, "RBLOCK": 256, "TILE": 4096, "num_warps": 4},
                    {"XBLOCK": 32, "RBLOCK": 64, "TILE": 4096, "num_warps": 4}]
        return configs
    if kind == "matmul":
        small_m = info.get("m", 64) <= 32
        configs = [{"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
                   {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
                   {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
                   {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
                   {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 2, "num_stages": 5}]
        if small_m:
            configs.insert(0, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
                               "num_stages": 3})
        return configs
    if kind == "attention":
        return [{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
                {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
                {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 2, "num_stages": 2}]
    raise ValueError(f"unknown Triton kernel kind {kind!r}; known: {', '.join(KINDS)}")


INTERPRET: dict[str, dict] = {
    "pointwise": {"XBLOCK": 4096, "num_warps": 1},
    "reduction": {"XBLOCK": 64, "RBLOCK": 1024, "TILE": 1 << 16, "num_warps": 1},
    "general": {"XBLOCK": 64, "RBLOCK": 1024, "TILE": 1 << 16, "num_warps": 1},
    "matmul": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 1, "num_stages": 1},
    "attention": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 1, "num_stages": 1},
}
"""The one configuration per kind in the interpreter."""


def describe(cfg: dict) -> str:
    """``XBLOCK=128, num_warps=4``."""
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


class ConfigTuner:
    """Chooses a kernel's configuration by timing (module docstring).

    ``path``: the JSON store (``None``: remember nothing across processes); ``machine``:
    the device and Triton identity, part of every key; ``tune``: whether to time at all
    (else the space's first configuration).
    """

    def __init__(self, path: Path | None, machine: str, tune: bool = True):
        self.machine = machine
        self.tune = tune
        self.timed = 0
        self._store = ChoiceStore(path, _valid, ".triton-configs.")

    def key(self, source: str) -> str:
        return f"{self.machine}|{hashlib.sha256(source.encode()).hexdigest()[:32]}"

    def choose(self, source: str, configs: list[dict],
               measure: Callable[[dict], float]) -> tuple[dict, float | None, str]:
        """``(configuration, seconds or None, how it was chosen)`` for the kernel whose text
        is ``source``; ``measure(cfg)`` times one launch with ``cfg``."""
        if len(configs) <= 1 or not self.tune:
            return (configs[0] if configs else {}), None, "default"
        key = self.key(source)
        known = self._store.get(key)
        if known is not None:
            cfg = json.loads(known)
            if cfg in configs:
                return cfg, None, "timed earlier"
        times: list[tuple[float, int]] = []
        for index, cfg in enumerate(configs):
            try:
                times.append((measure(cfg), index))
            except Exception:  # noqa: BLE001 - a configuration that does not compile or run is skipped
                continue
        if not times:
            return configs[0], None, "default (no configuration could be timed)"
        best, index = min(times)
        self.timed += 1
        self._store.put(key, json.dumps(configs[index], sort_keys=True))
        return configs[index], best, f"timed {len(times)} configurations"


def _valid(value: object) -> bool:
    try:
        return isinstance(json.loads(value), dict)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


__all__ = ["INTERPRET", "KINDS", "ConfigTuner", "describe", "space"]
