"""A persisted table of timed choices: measured once, remembered across processes.

Both the implementation selector (:mod:`.select`) and the cpu GEMM tuner
(:mod:`kiln.backends.cpu.gemm`) keep one: a JSON file of ``key -> choice`` written
atomically (temp file + ``os.replace``, merged with what other processes wrote meanwhile). Entries the ``valid`` predicate
rejects are ignored on load, so a stale or corrupted file only costs timing again.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


class ChoiceStore:
    """Thread-safe ``key -> choice`` map persisted in ``path`` (in memory when ``None``)."""

    def __init__(self, path: Path | None, valid: Callable[[object], bool], prefix: str):
        self.path = path
        self._valid = valid
        self._prefix = prefix
        self._lock = threading.Lock()
        self._choices = self._load()

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._choices.get(key)

    def put(self, key: str, choice: str) -> None:
        with self._lock:
            self._choices[key] = choice
            self._save()

    def _load(self) -> dict[str, str]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return {k: v for k, v in data.items() if isinstance(v, str) and self._valid(v)}
        except (OSError, ValueError, AttributeError):
            return {}

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._load(), **self._choices}
            fd, tmp = tempfile.mkstemp(prefix=self._prefix, dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass  # an unwritable cache folder only costs timing again next time
