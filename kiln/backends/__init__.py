"""Backends: the protocol and registry (:mod:`kiln.backends.base`) and the backends.

``reference`` (numpy, op by op) is registered here; later backends register the same way.
"""

from .base import (
    DEFAULT_BACKEND,
    Backend,
    BackendError,
    Executable,
    ReferenceBackend,
    available_backends,
    get_backend,
    register_backend,
)

__all__ = [
    "DEFAULT_BACKEND", "Backend", "BackendError", "Executable", "ReferenceBackend",
    "available_backends", "get_backend", "register_backend",
]
