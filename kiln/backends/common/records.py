"""Tuning records: the best schedule found for a kernel on a machine, reused by every build.

The autotuner (:mod:`kiln.tuning.autotune`) writes one JSON line per tuned kernel into
``schedule_records.jsonl`` of the compile-cache folder (``KILN_CACHE_DIR``, see
:func:`kiln.runtime.cache.default_cache_dir`); the cpu backend's default schedules
(:mod:`kiln.backends.cpu.schedules`) read it and replay the recorded trace through
``Schedule`` (so its legality is checked again) instead of the default strategy.

A record is keyed by

* ``key``: :func:`structural_key`, the sha256 of the loop program's text (the cpu backend's
  kernels are renamed to generated names first, so equal kernels of different models share
  a key) and, for programs with size parameters, of the sizes it was tuned at;
* ``machine``: :func:`machine_key`, the architecture, the CPU model and feature flags and
  the thread count the schedule was measured with.

Guarantees (as :mod:`kiln.runtime.cache`): each line carries the sha256 of its own body, so
a line that is truncated, edited or not JSON is detected, ignored with a warning naming the
file and the line, and never applied; lines are appended with one ``write`` under an
exclusive ``flock``, so processes tuning at once never interleave their lines.  When several
records share a key and a machine, the fastest measured one wins.

This module imports nothing from kiln above the runtime.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.cache import default_cache_dir

RECORD_FORMAT = 1
RECORDS_FILE = "schedule_records.jsonl"


def structural_key(program: Any, sizes: Mapping[str, int] | None = None) -> str:
    """The key of ``program`` (a loop :class:`~kiln.ir.loops.program.Program`): sha256 of its
    text and of the integer ``sizes`` it is tuned at (only those of its own size parameters)."""
    text = str(program)
    params = getattr(program, "size_params", ())
    used = {name: int(v) for name, v in sorted((sizes or {}).items()) if name in params}
    return hashlib.sha256(json.dumps([text, used]).encode()).hexdigest()


def _cpu_description() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = sorted({ln.strip() for ln in f if ln.startswith(("model name", "flags"))})
    except OSError:
        lines = [platform.processor() or "unknown"]
    return "\n".join(lines)


_CPU = None


def machine_key(threads: int) -> str:
    """The machine part of a record's key: architecture, CPU model and flags, ``threads``."""
    global _CPU
    if _CPU is None:
        _CPU = _cpu_description()
    text = f"{platform.machine()}\n{_CPU}\nthreads={int(threads)}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _body_digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(body), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Record:
    """One tuned schedule: its ``trace`` (a ``Schedule.trace``), measured ``time_s`` and the
    default schedule's ``default_s`` at the same sizes, and free-form ``meta`` (kernel kind,
    sizes, strategy, candidates tried)."""

    key: str
    machine: str
    trace: list[dict[str, Any]]
    time_s: float
    default_s: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.default_s / self.time_s if self.time_s > 0 else 1.0

    def body(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, "key": self.key, "machine": self.machine, "trace": self.trace,
                "time_s": self.time_s, "default_s": self.default_s, "meta": self.meta}


class RecordStore:
    """The record file of a folder (default: the compile-cache folder); see the module docstring."""

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.path = self.directory / RECORDS_FILE
        self.corrupt = 0
        self._cache: tuple[tuple[int, int], dict[tuple[str, str], Record]] | None = None

    # ------------------------------------------------------------------ reading
    def records(self) -> dict[tuple[str, str], Record]:
        """The best valid record per ``(key, machine)``; damaged lines are skipped with a warning."""
        try:
            stat = self.path.stat()
        except OSError:
            return {}
        stamp = (stat.st_mtime_ns, stat.st_size)
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1]
        best: dict[tuple[str, str], Record] = {}
        bad: list[int] = []
        try:
            data = self.path.read_bytes()
        except OSError:
            return {}
        for number, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            record = _parse_line(line)
            if record is None:
                bad.append(number)
                continue
            slot = (record.key, record.machine)
            if slot not in best or record.time_s <= best[slot].time_s:
                best[slot] = record
        self.corrupt = len(bad)
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
            warnings.warn(f"kiln: {len(bad)} damaged line(s) of the schedule records {self.path} ignored "
                          f"(line {shown}); those kernels use their default schedules. Re-tune them with "
                          f"`kiln tune`, or delete the file to start over", stacklevel=2)
        self._cache = (stamp, best)
        return best

    def lookup(self, key: str, machine: str) -> Record | None:
        """The best record of kernel ``key`` on ``machine``, or ``None``."""
        return self.records().get((key, machine))

    def digest(self, machine: str) -> str:
        """A digest of the records of ``machine`` (what a build's cache key includes, so a new
        record rebuilds the graphs whose kernels it may change)."""
        mine = sorted((k, _body_digest(r.body())) for (k, m), r in self.records().items() if m == machine)
        return hashlib.sha256(json.dumps(mine).encode()).hexdigest()[:24] if mine else "none"

    # ------------------------------------------------------------------ writing
    def add(self, record: Record) -> bool:
        """Append ``record``; ``False`` (with a warning) when the folder cannot be written."""
        body = record.body()
        line = json.dumps({"sha256": _body_digest(body), "body": body}, sort_keys=True) + "\n"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            warnings.warn(f"kiln: cannot write the schedule records {self.path} ({e}); set KILN_CACHE_DIR to "
                          "a writable folder", stacklevel=2)
            return False
        try:
            _lock(fd)
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self._cache = None
        return True


_STORES: dict[Path, RecordStore] = {}


def store_for(directory: str | os.PathLike[str] | None = None) -> RecordStore:
    """The process-wide store of ``directory`` (default: the compile-cache folder): its file is
    re-read only when it changes, so a damaged line is warned about once per change."""
    path = (Path(directory).expanduser() if directory is not None else default_cache_dir()).resolve()
    store = _STORES.get(path)
    if store is None:
        store = _STORES[path] = RecordStore(path)
    return store


def _lock(fd: int) -> None:
    try:
        import fcntl  # noqa: PLC0415 (POSIX only)
    except ImportError:
        return
    fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes


def _parse_line(line: bytes) -> Record | None:
    try:
        doc = json.loads(line)
        body = doc["body"]
        if not isinstance(body, dict) or doc["sha256"] != _body_digest(body) or body.get("format") != RECORD_FORMAT:
            return None
        trace = body["trace"]
        if not isinstance(trace, list) or not all(isinstance(s, dict) and "primitive" in s for s in trace):
            return None
        return Record(str(body["key"]), str(body["machine"]), trace, float(body["time_s"]),
                      float(body["default_s"]), dict(body.get("meta") or {}))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


__all__ = ["RECORDS_FILE", "RECORD_FORMAT", "Record", "RecordStore", "machine_key", "store_for", "structural_key"]
