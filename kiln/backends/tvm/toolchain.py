"""The TVM toolchain: a graph's TensorIR module, built by ``tvm.compile``, cached and loaded.

:class:`TvmToolchain` implements :class:`kiln.backends.common.toolchain.Toolchain`:

* ``artifact = "tvm"`` -- its own artifact type in the compile cache: a zip archive
  holding the exported TVM library (``lib.so``, ``Executable.export_library``) and each
  kernel's constant buffers and scratch buffer shapes (``kernels.json``); ``source_suffix = "json"``: the source
  kept beside it is the module document (:func:`module_document`: the IRModule as
  TVMScript, the target, the constants and per-kernel notes; TVMScript because
  ``tvm.ir.save_json`` crashes on these modules in apache-tvm 0.27);
* ``identity()`` -- TVM's version, the target (kind, ``mcpu``, features) and the machine;
* ``build(source, folder)`` -- parses the IRModule from the document, builds it with one
  ``tvm.compile`` (one LLVM build for every kernel of the graph) and writes the archive;
  :meth:`TvmToolchain.build_module` does the same for a module already in memory (the
  backend's path, which skips parsing).

:func:`load_artifact` unpacks an archive into a private folder and loads the library with
``tvm.runtime.load_module``; loaded libraries are kept by path.
"""

from __future__ import annotations

import base64
import json
import os
import platform
import tempfile
import threading
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kiln.backends.base import BackendError

from .compat import compile_module, tvm

_LOADED: dict[str, tuple[Any, dict]] = {}
_LOCK = threading.Lock()


class TvmBuildError(BackendError):
    """``tvm.compile`` refused a generated module (a kiln bug); ``source_path`` keeps it."""

    def __init__(self, message: str, source_path: Path):
        super().__init__(message)
        self.source_path = source_path


def host_target(options: Mapping[str, Any] | None = None):
    """``tvm.target.Target({"kind": "llvm", "mcpu": <host CPU>, "num-cores": <CPUs>})``
    (MetaSchedule needs ``num-cores``); ``options`` (a dict of target attributes, or a
    ``Target``) override the defaults."""
    if isinstance(options, tvm.target.Target):
        return options
    spec: dict[str, Any] = {"kind": "llvm", "num-cores": max(1, os.cpu_count() or 1)}
    cpu_name = tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName", allow_missing=True)
    if cpu_name is not None:
        name = str(cpu_name())
        valid = tvm.get_global_func("target.llvm_is_valid_cpu", allow_missing=True)
        if name and name != "generic":
            spec["mcpu"] = name
            if valid is not None:
                try:
                    if not valid(name, tvm.target.Target({"kind": "llvm"})):
                        spec.pop("mcpu")
                except Exception:  # noqa: BLE001 - the check is advisory
                    pass
    spec.update(dict(options or {}))
    return tvm.target.Target(spec)


def target_text(target) -> str:
    return json.dumps(dict(target.export()), sort_keys=True, default=str)


def encode_array(array: np.ndarray) -> list:
    data = np.ascontiguousarray(array)
    return [list(data.shape), str(data.dtype), base64.b64encode(data.tobytes()).decode()]


def decode_array(entry: list) -> np.ndarray:
    shape, dtype, data = entry
    return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()


def module_document(module, target, kernels: Mapping[str, tuple[list[np.ndarray], list]],
                    notes: Mapping[str, str]) -> str:
    """The source text of a graph: its IRModule (TVMScript), target, each kernel's constants
    and scratch ``(shape, dtype)`` (``kernels``: symbol -> both), and notes."""
    return json.dumps({
        "format": "kiln-tvm-1",
        "target": target_text(target),
        "kernels": {symbol: {"constants": [encode_array(a) for a in arrays], "scratch": [list(x) for x in scratch]}
                    for symbol, (arrays, scratch) in kernels.items()},
        "notes": dict(notes),
        "module": module.script(),
    })


def document_module(text: str):
    """The IRModule of a module document (TVM's well-formedness check refuses the pointer
    wrapper around a scheduled root block, which ``tvm.compile`` builds)."""
    return tvm.script.from_source(json.loads(text)["module"], check_well_formed=False)


class TvmToolchain:
    """See the module docstring."""

    name = "tvm"
    artifact = "tvm"
    source_suffix = "json"

    def __init__(self, target):
        self.target = target
        self._identity: str | None = None

    def identity(self) -> str:
        if self._identity is None:
            self._identity = f"tvm {tvm.__version__} {target_text(self.target)} {platform.machine()}"
        return self._identity

    def build(self, source: str, folder: Path) -> Path:
        return self.build_module(None, source, folder)

    def build_module(self, module, source: str, folder: Path) -> Path:
        """Build ``module`` (``None``: parse it from the document ``source``) into an archive."""
        folder = Path(folder)
        doc = json.loads(source)
        try:
            if module is None:
                module = document_module(source)
            executable = compile_module(module, target=self.target)
            executable.export_library(str(folder / "lib.so"))
        except Exception as e:  # noqa: BLE001 - TVM raises its own error types
            kept = folder / "module.json"
            kept.write_text(source)
            raise TvmBuildError(f"kiln bug: tvm.compile refused the generated module ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:300] if str(e) else ''}); the module is kept at {kept}",
                                kept) from e
        artifact = folder / "kernels.tvm"
        with zipfile.ZipFile(artifact, "w", zipfile.ZIP_STORED) as archive:
            archive.write(folder / "lib.so", "lib.so")
            archive.writestr("kernels.json", json.dumps(doc["kernels"]))
        return artifact


def load_artifact(path: Path) -> tuple[Any, dict[str, tuple[list[np.ndarray], list]]]:
    """The loaded TVM library of an archive and, by kernel symbol, its constants and scratch specs."""
    key = str(path)
    with _LOCK:
        found = _LOADED.get(key)
        if found is not None:
            return found
        folder = Path(tempfile.mkdtemp(prefix="kiln-tvm-"))
        with zipfile.ZipFile(path) as archive:
            archive.extract("lib.so", folder)
            kernels = json.loads(archive.read("kernels.json"))
        library = tvm.runtime.load_module(str(folder / "lib.so"))
        loaded = (library, {s: ([decode_array(e) for e in k["constants"]], [(tuple(shape), dtype) for shape, dtype
                                                                         in k["scratch"]])
                            for s, k in kernels.items()})
        _LOADED[key] = loaded
        return loaded


def set_threads(threads: int) -> None:
    """Size TVM's thread pool (parallel loops run on it)."""
    config = tvm.get_global_func("runtime.config_threadpool", allow_missing=True)
    if config is not None:
        config(0, int(threads))


__all__ = ["TvmBuildError", "TvmToolchain", "decode_array", "document_module", "encode_array", "host_target",
           "load_artifact", "module_document", "set_threads", "target_text"]
