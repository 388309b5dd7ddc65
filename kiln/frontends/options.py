"""Compile options that belong to kiln, not to a backend: the cache switch.

``cache=False`` turns off every cache kiln has -- a frontend's capture cache
(:mod:`kiln.frontends.torch.capture_cache`) and the backend's compile cache, where the
backend has one -- and ``cache_dir`` is the folder of all of them.  Every entry point takes
them whatever the backend: ``kiln.compile``, ``kiln.compile_train`` and the ``options`` of
``torch.compile(backend="kiln")``.

A backend has a cache of its own when it declares ``cache`` (and ``cache_dir``) among its
options (``Backend.option_defaults``, as the ``cpu`` backend does); :meth:`CacheSwitch.for_backend`
hands the switch to such a backend and leaves it out for one without, so ``cache=False``
with ``backend="reference"`` is accepted and changes nothing there.  The capture cache never
looks at backend options: it is opened from the switch itself
(:meth:`kiln.frontends.torch.capture_cache.CaptureCache.open`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CACHE_OPTIONS = ("cache", "cache_dir")
"""The option names of the switch."""


@dataclass(frozen=True)
class CacheSwitch:
    """Whether kiln's caches are on (``enabled``) and their folder (``directory``; ``None``:
    ``KILN_CACHE_DIR`` or ``~/.cache/kiln``)."""

    enabled: bool = True
    directory: str | None = None

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[CacheSwitch, dict[str, Any]]:
        """The switch given in ``options`` (``cache``, ``cache_dir``) and the other options."""
        rest = {k: v for k, v in options.items() if k not in CACHE_OPTIONS}
        return cls(bool(options.get("cache", True)), options.get("cache_dir")), rest

    def for_backend(self, backend: Any, options: Mapping[str, Any]) -> dict[str, Any]:
        """``options`` plus the switch, for the options of ``backend`` that take it (none for a
        backend without a cache of its own)."""
        declared = getattr(backend, "option_defaults", {})
        switch = {"cache": self.enabled, "cache_dir": self.directory}
        return {**options, **{k: v for k, v in switch.items() if k in declared}}


__all__ = ["CACHE_OPTIONS", "CacheSwitch"]
