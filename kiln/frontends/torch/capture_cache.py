"""The capture cache: captured and optimized kiln graphs reused across compiles and processes.

A warm ``kiln.compile`` of a model it has compiled before skips ``torch.export`` and the
passes: it parses the cached graphs, binds the live model's tensors and goes on to the
backend (whose own compile cache then loads the shared object).  Two kinds of documents
live in the compile-cache folder (:class:`kiln.runtime.cache.DocumentCache`):

* ``<key>.capture.json`` -- key: :func:`~kiln.frontends.torch.fingerprint.model_fingerprint` of
  the model and the example inputs (no tracing).  Body: the captured graph's text, its
  nodes' source locations, graph param name -> model attribute path, the input names and
  positions, and the pytree specs of the inputs and outputs
  (``torch.utils._pytree.treespec_dumps``).
* ``<key>.passes.json`` -- key: the captured graph's text, the pass pipeline's text
  (``PassManager.spec()`` plus its iteration options) and kiln's source identity.  Body:
  the graph after the passes, and its nodes' locations.

Guarantees: a hit gives the graphs the same capture and passes would give: the fingerprint
describes everything the program's code can read (see :mod:`kiln.frontends.torch.fingerprint`,
which also lists the little it does not see), and a program it cannot describe is always
traced.  An entry that cannot be used -- damaged, or naming a parameter the live model
lacks or has with another shape -- is a miss, and the next store overwrites it.  The cache
is off with the ``kiln.compile`` argument ``cache=False`` (every cache kiln has, any backend:
:mod:`kiln.frontends.options`) or ``capture_cache=False`` (this cache only), or with
``KILN_CAPTURE_CACHE=0``; its folder is ``cache_dir`` or ``KILN_CACHE_DIR`` (default
``~/.cache/kiln``).  Pipelines other than pass-manager
pipelines of registered passes (e.g. ``"learned"``, custom objects), and pipelines asked
to dump IR (``KILN_DUMP_IR``), always run.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.ir import Graph, KilnError, parse
from kiln.runtime.cache import DocumentCache

from .aten import has_kiln_dtype, tensor_type
from .capture import Captured
from .fingerprint import kiln_source_identity, model_fingerprint
from .symbolic import describe_dynamic_shapes

CAPTURE_KIND = "capture"
PASSES_KIND = "passes"
ENV_SWITCH = "KILN_CAPTURE_CACHE"
_OFF = ("0", "false", "no", "off")


class CaptureCache:
    """Captured and optimized graphs in a :class:`~kiln.runtime.cache.DocumentCache`."""

    def __init__(self, documents: DocumentCache):
        self.documents = documents

    @classmethod
    def open(cls, enabled: bool = True, directory: str | None = None) -> CaptureCache:
        """The cache in ``directory`` (``None``: ``KILN_CACHE_DIR`` or ``~/.cache/kiln``), on
        when ``enabled`` and ``KILN_CAPTURE_CACHE`` allows it.  It reads no backend option:
        ``kiln.compile`` passes its own switches (:mod:`kiln.frontends.options`)."""
        on = bool(enabled) and os.environ.get(ENV_SWITCH, "1").lower() not in _OFF
        return cls(DocumentCache(directory, enabled=on))

    @property
    def enabled(self) -> bool:
        return self.documents.enabled

    # ----------------------------------------------------------------- captures
    def capture_key(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                    name: str, dynamic_shapes: Any = None) -> str | None:
        """The key of a model's capture, ``None`` when the cache is off or the model cannot
        be fingerprinted.  ``dynamic_shapes`` (torch.export's argument) is part of the key,
        so a dynamic capture and a static one never share an entry."""
        if not self.enabled:
            return None
        extra = f"graph name {name}"
        if dynamic_shapes is not None:
            extra += f"; dynamic shapes {describe_dynamic_shapes(dynamic_shapes)}"
        return model_fingerprint(model, args, kwargs, extra=extra)

    def load_capture(self, key: str | None, model: torch.nn.Module) -> Captured | None:
        """The cached capture bound to ``model``'s live tensors, or ``None``."""
        if key is None:
            return None
        body = self.documents.lookup(CAPTURE_KIND, key)
        if body is None:
            return None
        try:
            return _captured_from(body, model)
        except (KilnError, KeyError, TypeError, ValueError, AttributeError, NotImplementedError):
            return None  # an unusable entry is a miss; the next store replaces it

    def store_capture(self, key: str | None, captured: Captured) -> None:
        """Remember ``captured`` under ``key`` (nothing when the key is ``None`` or the
        capture cannot be serialized)."""
        if key is None or captured.in_spec is None:
            return
        try:
            body = {
                "graph": str(captured.graph), "locs": _locs(captured.graph),
                "param_targets": dict(captured.param_targets), "input_names": list(captured.input_names),
                "input_positions": list(captured.input_positions),
                "user_input_names": list(captured.user_input_names),
                "in_spec": pytree.treespec_dumps(captured.in_spec),
                "out_spec": pytree.treespec_dumps(captured.out_spec),
            }
        except (TypeError, ValueError, NotImplementedError):
            return  # e.g. an output type pytree cannot serialize: always traced
        self.documents.store(CAPTURE_KIND, key, body)

    # ----------------------------------------------------------------- passes
    def passes_key(self, graph_text: str, pipeline: str | None) -> str | None:
        if not self.enabled or pipeline is None or os.environ.get("KILN_DUMP_IR"):
            return None
        h = hashlib.sha256()
        for part in (graph_text, pipeline, kiln_source_identity()):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def load_optimized(self, key: str | None) -> Graph | None:
        """The cached graph after the passes, or ``None``."""
        if key is None:
            return None
        body = self.documents.lookup(PASSES_KIND, key)
        if body is None:
            return None
        try:
            return _graph_from(body)
        except (KilnError, KeyError, TypeError, ValueError):
            return None

    def store_optimized(self, key: str | None, graph: Graph) -> None:
        if key is not None:
            self.documents.store(PASSES_KIND, key, {"graph": str(graph), "locs": _locs(graph)})


def _locs(graph: Graph) -> list[str | None]:
    return [node.loc for node in graph.nodes]


def _graph_from(body: Mapping[str, Any]) -> Graph:
    graph = parse(body["graph"])
    locs = body.get("locs") or []
    if len(locs) == len(graph.nodes):
        for node, loc in zip(graph.nodes, locs):
            node.loc = loc
    return graph


def _captured_from(body: Mapping[str, Any], model: torch.nn.Module) -> Captured | None:
    graph = _graph_from(body)
    targets = dict(body["param_targets"])
    params: dict[str, torch.Tensor] = {}
    for value in graph.params:
        tensor = _live_tensor(model, targets[value.name])
        if tensor is None or not has_kiln_dtype(tensor.dtype) or tensor_type(tensor) != value.type:
            return None
        params[value.name] = tensor
    return Captured(graph, params, list(body["input_names"]), pytree.treespec_loads(body["in_spec"]),
                    pytree.treespec_loads(body["out_spec"]), list(body["input_positions"]),
                    list(body["user_input_names"]), targets)


def _live_tensor(model: torch.nn.Module, target: str) -> torch.Tensor | None:
    for getter in (model.get_parameter, model.get_buffer):
        try:
            return getter(target)
        except AttributeError:
            continue
    return None


__all__ = ["CAPTURE_KIND", "ENV_SWITCH", "PASSES_KIND", "CaptureCache"]
