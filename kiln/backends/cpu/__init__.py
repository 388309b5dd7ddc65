"""The native CPU backend ``"cpu"``: generated C with OpenMP, ATen library calls, a memory
plan and a compile cache (see :mod:`kiln.backends.cpu.backend` and ``docs/backends.md``).

Importing this package only registers the backend; the code generator, the C toolchain and
the loop scheduler load when a graph is first built.
"""

from kiln.backends.base import Backend, register_backend


def _cpu_backend() -> Backend:
    from .backend import CpuBackend

    return CpuBackend()


register_backend("cpu", _cpu_backend)
