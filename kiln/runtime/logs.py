"""Log switches in the style of ``TORCH_LOGS``: ``KILN_LOGS=kernels python train.py``.

``KILN_LOGS`` is a comma-separated list of topics (case and spaces ignored; ``all`` turns
every topic on).  Topics:

* ``kernels`` -- every kernel a code-generating backend builds: the backend, the kernel's
  name, the implementation (and configuration) chosen for it, its measured time when it
  was timed, and its source text.

Records go through :mod:`logging`, logger ``kiln.<topic>`` (``kiln.kernels``), at level
``INFO``.  When a topic is on and its logger has no handler of its own, one is added that
writes to the current ``sys.stderr`` (looked up at every record, so redirections of
``sys.stderr`` are honoured); such a logger does not propagate to the root logger, so a
program's own logging configuration does not print the records twice.  A program may
instead attach its own handlers to ``kiln.kernels`` before the first record.

The switch is read from the environment at every call of :func:`enabled`, so setting
``os.environ["KILN_LOGS"]`` inside a running program takes effect at the next build.

API (used by every backend)::

    from kiln.runtime.logs import enabled, kernel_log

    if enabled("kernels"):
        ...                                   # skip work that only the log needs
    kernel_log(backend="triton", name="kiln_k0", source=text, choice="triton", time_s=1.2e-5)
"""

from __future__ import annotations

import logging
import os
import sys
import threading

ENV_VAR = "KILN_LOGS"
TOPICS = ("kernels",)
"""The topics ``KILN_LOGS`` knows; ``all`` means every one of them."""

_LOCK = threading.Lock()
_CONFIGURED: set[str] = set()


def topics() -> frozenset[str]:
    """The topics ``KILN_LOGS`` turns on now (unknown names are kept: they match nothing)."""
    raw = os.environ.get(ENV_VAR, "")
    names = {part.strip().lower() for part in raw.split(",") if part.strip()}
    if "all" in names:
        names |= set(TOPICS)
    return frozenset(names)


def enabled(topic: str) -> bool:
    """Whether ``KILN_LOGS`` turns ``topic`` on (see the module docstring)."""
    return topic.lower() in topics()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record arrives."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def logger(topic: str) -> logging.Logger:
    """The logger of ``topic`` (``kiln.<topic>``), given a stderr handler on first use when
    it has none (module docstring)."""
    log = logging.getLogger(f"kiln.{topic}")
    with _LOCK:
        if topic not in _CONFIGURED:
            _CONFIGURED.add(topic)
            if not log.handlers:
                handler = _StderrHandler()
                handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
                log.addHandler(handler)
                log.propagate = False
            if log.level == logging.NOTSET or log.level > logging.INFO:
                log.setLevel(logging.INFO)
    return log


def format_time(time_s: float | None) -> str:
    """``12.3 us``, ``1.20 ms`` or ``-`` (not measured)."""
    if time_s is None:
        return "-"
    if time_s < 1e-3:
        return f"{time_s * 1e6:.1f} us"
    if time_s < 1.0:
        return f"{time_s * 1e3:.2f} ms"
    return f"{time_s:.2f} s"


def kernel_log(*, backend: str, name: str, source: str, choice: str, time_s: float | None = None) -> None:
    """Log one kernel on topic ``kernels`` (nothing happens when the topic is off): a header
    line ``<backend> kernel <name>: choice <choice>, time <time>`` and the source below it."""
    if not enabled("kernels"):
        return
    header = f"{backend} kernel {name}: choice {choice}, time {format_time(time_s)}"
    body = source.rstrip("\n")
    if body:
        logger("kernels").info("%s\n%s", header, body)
    else:
        logger("kernels").info("%s", header)


__all__ = ["ENV_VAR", "TOPICS", "enabled", "format_time", "kernel_log", "logger", "topics"]
