"""The ``cuda`` backend: task-mapped CUDA C kernels built by nvcc, cuBLAS/cuDNN library calls
through torch, and a host emulation of the same kernels (``emulate=True``) for machines
without a GPU (see :mod:`kiln.backends.cuda.backend` and ``docs/gpu.md``).

Importing this package only registers the backend; the printer, the kernel generators
(:mod:`kiln.backends.cuda.kernels`), nvcc and the emulation load when a graph is first built.
"""

from kiln.backends.base import Backend, register_backend


def _cuda_backend() -> Backend:
    from .backend import CudaBackend

    return CudaBackend()


register_backend("cuda", _cuda_backend)
