"""Backends: the protocol and registry (:mod:`kiln.backends.base`), the device-neutral core
of code-generating backends (:mod:`kiln.backends.common`) and the backends.

``reference`` (numpy, op by op), ``cpu`` (generated C + OpenMP, :mod:`kiln.backends.cpu`),
``cuda`` (CUDA C kernels, or their host emulation, :mod:`kiln.backends.cuda`), ``triton``
(generated Triton kernels, :mod:`kiln.backends.triton`) and ``tvm`` (TensorIR built by
``tvm.compile``, :mod:`kiln.backends.tvm`) are registered here; later backends register the
same way.
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
from . import cpu  # noqa: F401  (registers "cpu"; its heavy parts load on first build)
from . import cuda  # noqa: F401  (registers "cuda"; nvcc, kernels and emulation load on first build)
from . import triton  # noqa: F401  (registers "triton"; Triton itself loads on first build)
from . import tvm  # noqa: F401  (registers "tvm"; TVM itself loads on first build)

__all__ = [
    "DEFAULT_BACKEND", "Backend", "BackendError", "Executable", "ReferenceBackend",
    "available_backends", "get_backend", "register_backend",
]
