"""Toolchains: what turns source text into a loadable artifact, and the one cache they share.

A :class:`Toolchain` is anything with

* ``name`` -- what it is called in messages (``"cc"``);
* ``artifact`` -- the type of what it builds, which names the file and keys the cache:
  ``"so"`` (a host shared object, loaded with ctypes);
* ``source_suffix`` -- the suffix of the source kept beside the artifact (``"c"``);
* ``identity()`` -- text that changes whenever the same source would build a different
  artifact: the compiler's version, its flags, the machine it targets;
* ``build(source, folder)`` -- build ``source`` into a file in ``folder`` (a scratch
  folder) and return its path, raising a :class:`~kiln.backends.base.BackendError` subclass
  when the source does not build.

Built artifacts live in the artifact cache, :class:`kiln.runtime.cache.CompileCache`, keyed
by artifact type: :func:`build_cached` looks the source up by its content address
(:func:`kiln.runtime.cache.artifact_key` of the artifact type, the source and the
toolchain's identity), builds on a miss and commits the result.  A backend that keys whole
graphs instead (the cpu backend: the key is the graph's text, so a warm build skips
lowering) calls :meth:`~kiln.runtime.cache.CompileCache.lookup` and
:meth:`~kiln.runtime.cache.CompileCache.store` itself with ``artifact=toolchain.artifact``.

The host C compiler is the toolchain that exists today:
:class:`kiln.backends.cpu.toolchain.CCompiler` (it lives with the cpu backend, whose flags,
``-march=native`` CPU identity and libmvec probing it carries).  A GPU backend brings its own
beside its code, e.g. an ``nvcc`` toolchain (``artifact="cubin"``, ``source_suffix="cu"``,
identity from ``nvcc --version``, the ``-arch=sm_XX`` flag and the driver version; ``build``
runs ``nvcc -cubin``), an NVRTC one (``"ptx"``, compiling in process) or Triton's compiler
(``"cubin"`` plus the launch metadata in the manifest, ``source_suffix="py"``).  Each finds
its program with :func:`find_tool` (``find_tool("NVCC", ("nvcc",))``), and their artifacts
share the cache folder, its atomic writes and its integrity checks with the C compiler's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kiln.runtime.cache import CacheEntry, CompileCache, artifact_key


@runtime_checkable
class Toolchain(Protocol):
    """Turns source text into a loadable artifact; see the module docstring."""

    name: str
    artifact: str
    source_suffix: str

    def identity(self) -> str:
        """What goes into cache keys: compiler version, flags, target machine."""
        ...

    def build(self, source: str, folder: Path) -> Path:
        """Build ``source`` into a new file in ``folder``; returns its path."""
        ...


def find_tool(env: str, candidates: Sequence[str]) -> str | None:
    """The program named by ``$env``, else the first of ``candidates`` on ``PATH``, else
    ``None``.  ``$env`` wins only when it names a program that exists."""
    for candidate in (os.environ.get(env), *candidates):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def build_cached(toolchain: Toolchain, source: str, cache: CompileCache, *,
                 manifest: Mapping[str, Any] | None = None) -> CacheEntry:
    """The verified cache entry of ``toolchain``'s artifact built from ``source``: looked up
    by content address, built with ``toolchain.build`` and stored (with ``manifest``) on a
    miss.  Build errors propagate; nothing is stored for a source that does not build."""
    key = artifact_key(toolchain.artifact, source, toolchain.identity())
    entry = cache.lookup(key, toolchain.artifact)
    if entry is None:
        built = toolchain.build(source, cache.scratch_dir())
        entry = cache.store(key, source, built, manifest or {}, artifact=toolchain.artifact,
                            source_suffix=toolchain.source_suffix)
    return entry


def sources_digest(paths: Iterable[Path], root: Path, seed: str = "") -> str:
    """A 24-digit digest of ``seed`` and of each file's path relative to ``root`` and bytes,
    in sorted order: the part of a build identity that changes whenever a backend's code does
    (so an edited kiln never loads an artifact built by an older one)."""
    h = hashlib.sha256(seed.encode())
    for path in sorted(paths):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:24]


__all__ = ["Toolchain", "build_cached", "find_tool", "sources_digest"]
