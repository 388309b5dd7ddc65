"""The artifact cache: built artifacts and their sources, reused across processes.

An artifact is what a toolchain (:mod:`kiln.backends.common.toolchain`) makes of source
text, named by its type: ``"so"`` (a host shared object, from the C compiler) today;
``"cubin"``, ``"ptx"`` or a Triton kernel when the backends that build them arrive.  One
:class:`CompileCache` holds every type.  Layout (one flat folder, ``KILN_CACHE_DIR`` or
``$XDG_CACHE_HOME/kiln`` or ``~/.cache/kiln``)::

    <key>.json                 the entry's manifest, written last: it commits the entry
    <key>.<digest>.<suffix>    the source (``.c`` for C)
    <key>.<digest>.<artifact>  the artifact (``.so``); <digest> = sha256 of its bytes (16 hex)

``key`` is the sha256 of everything that decides the artifact.  For a compiled graph
(:func:`cache_key`) that is the IR text, the backend options, the toolchain's identity (the
C compiler's ``--version`` text and flags, the machine) and the kiln build (version plus a
hash of the code-generating sources).  For a standalone source (:func:`artifact_key`) it is
the artifact type, the source text and the toolchain identity: the entry is addressed by its
content.  The manifest stores the artifact type and the digests of the source and of the
artifact; a lookup names the artifact type it wants, and an entry of another type is a miss.

Guarantees:

* **Atomic writes.**  Every file is written to a unique temporary name in the same folder
  and moved into place with ``os.replace``; the manifest moves last.  Readers therefore see
  either no entry or a complete one, and concurrent processes building the same entry each
  write whole files (the last one wins; both are valid).
* **Never load a damaged entry.**  :meth:`CompileCache.lookup` re-hashes the artifact and
  the source against the manifest; a missing, truncated or modified file, or an unreadable
  manifest, counts as a miss (``corrupt`` in the counters), so the caller rebuilds and
  :meth:`CompileCache.store` overwrites the entry.
* **Off switch.**  ``CompileCache(enabled=False)`` never reads or writes the folder:
  ``lookup`` misses and ``store`` keeps the files in a private temporary folder.

Counters (``COUNTERS``, process-wide, and ``cache.counters`` per instance): ``hits``,
``misses``, ``corrupt``, ``stores``.

:class:`DocumentCache` keeps small JSON documents (e.g. captured graphs, see
:mod:`kiln.frontends.torch.capture_cache`) in the same folder, as ``<key>.<kind>.json``, with the
same guarantees: atomic writes, a damaged or foreign document is a miss (``corrupt``) that
the next store overwrites, and ``enabled=False`` never touches the folder.  Its counters are
``DOCUMENT_COUNTERS`` (process-wide) and ``documents.counters``.

This module imports nothing from kiln, so tools can read the cache without loading kiln.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_VERSION = 1
COUNTERS: dict[str, int] = {"hits": 0, "misses": 0, "corrupt": 0, "stores": 0}
"""Process-wide cache counters (every :class:`CompileCache` adds to them)."""
_COUNTER_LOCK = threading.Lock()


def default_cache_dir() -> Path:
    """``$KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``."""
    env = os.environ.get("KILN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kiln"


def digest(data: bytes | str) -> str:
    """The sha256 hex digest of ``data`` (text is UTF-8 encoded)."""
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def _key(parts: list[str]) -> str:
    """sha256 over ``parts``, each length-prefixed so no two different tuples of parts hash
    the same text."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def cache_key(ir_text: str, options: Mapping[str, Any], compiler_identity: str, build_identity: str) -> str:
    """The key of a compiled graph: sha256 over the IR text, the options (sorted), the
    compiler identity and the kiln build identity, each length-prefixed so no two different
    tuples of parts hash the same text."""
    return _key([ir_text, json.dumps(dict(options), sort_keys=True, default=repr), compiler_identity,
                 build_identity])


def artifact_key(artifact: str, source: str, identity: str, *parts: str) -> str:
    """The content address of the ``artifact`` a toolchain with ``identity`` builds from
    ``source``: sha256 over the artifact type, the source, the identity and any further
    ``parts``, length-prefixed like :func:`cache_key`."""
    return _key(["artifact", artifact, source, identity, *parts])


_SUFFIX = re.compile(r"[a-z0-9_]{1,16}")


def _check_suffix(what: str, value: str) -> str:
    if not _SUFFIX.fullmatch(value):
        raise ValueError(f"artifact cache: {what} {value!r} is not 1-16 of [a-z0-9_] (it names files)")
    return value


@dataclass(frozen=True)
class CacheEntry:
    """A verified entry: the artifact (``library``: the built file, a shared object for
    ``artifact="so"``), its source and the stored manifest."""

    key: str
    library: Path
    source: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    artifact: str = "so"


class CompileCache:
    """A folder of built artifacts of every type, keyed by ``(artifact, key)``; see the
    module docstring."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, enabled: bool = True):
        self.enabled = enabled
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.counters: dict[str, int] = {"hits": 0, "misses": 0, "corrupt": 0, "stores": 0}
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    # ------------------------------------------------------------------ reading
    def lookup(self, key: str, artifact: str = "so") -> CacheEntry | None:
        """The verified ``artifact`` entry for ``key``, or ``None`` (a miss, a damaged entry,
        or an entry of another artifact type)."""
        _check_suffix("artifact", artifact)
        if not self.enabled:
            self._count("misses")
            return None
        manifest_path = self.directory / f"{key}.json"
        if not manifest_path.exists():
            self._count("misses")
            return None
        entry = self._verified(key, manifest_path)
        if entry is None:
            self._count("corrupt")
            self._count("misses")
            return None
        if entry.artifact != artifact:  # a whole entry, of another type: a plain miss
            self._count("misses")
            return None
        self._count("hits")
        return entry

    def _verified(self, key: str, manifest_path: Path) -> CacheEntry | None:
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("format") != MANIFEST_VERSION or manifest.get("key") != key:
                return None
            artifact = manifest.get("artifact", "so")  # entries written before types were named are "so"
            if not isinstance(artifact, str):
                return None
            library = self.directory / manifest["library"]
            source = self.directory / manifest["source"]
            if digest(library.read_bytes()) != manifest["library_sha256"]:
                return None
            if digest(source.read_bytes()) != manifest["source_sha256"]:
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return CacheEntry(key, library, source, manifest, artifact)

    # ------------------------------------------------------------------ writing
    def store(self, key: str, source: str, library: Path, manifest: Mapping[str, Any], *,
              artifact: str = "so", source_suffix: str = "c") -> CacheEntry:
        """Commit ``source`` and the built ``artifact`` at ``library`` under ``key``.

        ``manifest`` holds whatever the backend needs to use the entry without rebuilding
        (kernel symbols, argument lists); the artifact type and the integrity fields are
        added here.  ``source_suffix`` names the source file (``c``, ``cu``, ``py``).  With
        the cache off, or a cache folder that cannot be written (a warning says so), the files
        go to a private temporary folder that lives as long as this object.
        """
        _check_suffix("artifact", artifact)
        _check_suffix("source suffix", source_suffix)
        lib_bytes = Path(library).read_bytes()
        lib_digest = digest(lib_bytes)
        src_digest = digest(source)
        lib_name = f"{key}.{lib_digest[:16]}.{artifact}"
        src_name = f"{key}.{src_digest[:16]}.{source_suffix}"
        full = {**dict(manifest), "format": MANIFEST_VERSION, "key": key, "artifact": artifact, "library": lib_name,
                "source": src_name, "library_sha256": lib_digest, "source_sha256": src_digest}
        if self.enabled:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                _atomic_write(self.directory / src_name, source.encode())
                _atomic_write(self.directory / lib_name, lib_bytes)
                _atomic_write(self.directory / f"{key}.json", json.dumps(full, indent=1, sort_keys=True).encode())
            except OSError as e:  # a read-only or full cache folder costs a rebuild next time, not this build
                warnings.warn(f"kiln: cannot write the compile cache in {self.directory} ({e}); "
                              "set KILN_CACHE_DIR to a writable folder or pass cache=False", stacklevel=2)
            else:
                self._count("stores")
                return CacheEntry(key, self.directory / lib_name, self.directory / src_name, full, artifact)
        folder = self._scratch_dir()
        _atomic_write(folder / src_name, source.encode())
        _atomic_write(folder / lib_name, lib_bytes)
        return CacheEntry(key, folder / lib_name, folder / src_name, full, artifact)

    def scratch_dir(self) -> Path:
        """A private folder (removed with this object) for build temporaries."""
        return self._scratch_dir()

    def _scratch_dir(self) -> Path:
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="kiln-build-")
        return Path(self._scratch.name)

    def _count(self, name: str) -> None:
        with _COUNTER_LOCK:
            self.counters[name] += 1
            COUNTERS[name] += 1

    def __repr__(self) -> str:
        state = "on" if self.enabled else "off"
        return f"<CompileCache {self.directory} ({state}) {self.counters}>"


DOCUMENT_FORMAT = 1
DOCUMENT_COUNTERS: dict[str, int] = {"hits": 0, "misses": 0, "corrupt": 0, "stores": 0}
"""Process-wide counters of every :class:`DocumentCache`."""


class DocumentCache:
    """JSON documents keyed by ``(kind, key)`` in the compile-cache folder; see the module
    docstring.  A document file holds its format, kind, key, the sha256 of its body and the
    body (a JSON object, stored as text so that the digest covers its exact bytes)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None, enabled: bool = True):
        self.enabled = enabled
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.counters: dict[str, int] = {"hits": 0, "misses": 0, "corrupt": 0, "stores": 0}

    def path(self, kind: str, key: str) -> Path:
        """The file of document ``(kind, key)``."""
        return self.directory / f"{key}.{kind}.json"

    def lookup(self, kind: str, key: str) -> dict[str, Any] | None:
        """The verified body of document ``(kind, key)``, or ``None`` (a miss, or damaged)."""
        path = self.path(kind, key)
        if not self.enabled or not path.exists():
            self._count("misses")
            return None
        body = _verified_body(path, kind, key)
        if body is None:
            self._count("corrupt")
            self._count("misses")
            return None
        self._count("hits")
        return body

    def store(self, kind: str, key: str, body: Mapping[str, Any]) -> bool:
        """Write document ``(kind, key)`` atomically; ``False`` when the cache is off or the
        folder cannot be written (a warning says so: the document is rebuilt next time)."""
        if not self.enabled:
            return False
        text = json.dumps(dict(body), sort_keys=True)
        document = {"format": DOCUMENT_FORMAT, "kind": kind, "key": key, "sha256": digest(text), "body": text}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.path(kind, key), json.dumps(document).encode())
        except OSError as e:
            warnings.warn(f"kiln: cannot write the compile cache in {self.directory} ({e}); "
                          "set KILN_CACHE_DIR to a writable folder or pass cache=False", stacklevel=2)
            return False
        self._count("stores")
        return True

    def _count(self, name: str) -> None:
        with _COUNTER_LOCK:
            self.counters[name] += 1
            DOCUMENT_COUNTERS[name] += 1

    def __repr__(self) -> str:
        state = "on" if self.enabled else "off"
        return f"<DocumentCache {self.directory} ({state}) {self.counters}>"


def _verified_body(path: Path, kind: str, key: str) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_bytes())
        if (document.get("format"), document.get("kind"), document.get("key")) != (DOCUMENT_FORMAT, kind, key):
            return None
        text = document["body"]
        if digest(text) != document["sha256"]:
            return None
        body = json.loads(text)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return body if isinstance(body, dict) else None


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temporary file and ``os.replace``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["COUNTERS", "DOCUMENT_COUNTERS", "CacheEntry", "CompileCache", "DocumentCache", "artifact_key",
           "cache_key", "default_cache_dir", "digest"]
