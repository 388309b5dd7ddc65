"""The ``"triton"`` backend: kiln's fused groups as generated Triton kernels, PyTorch library
calls and (when present) task-mapped CUDA kernels, chosen per group by rule or by timing
(see :mod:`kiln.backends.triton.backend` and ``docs/triton.md``).

Importing this package only registers the backend; Triton, the code generator and the
lowering load when a graph is first built.  On a machine without CUDA the kernels run in
Triton's interpreter on CPU tensors.

Modules: :mod:`.backend` (the backend, its build pipeline and partition), :mod:`.library`
(candidates, selection, PyTorch table), :mod:`.generate` (which generator for a kernel),
:mod:`.analysis` (phases, bands, registers, vector nests), :mod:`.printer` (loop-IR
expressions as Triton), :mod:`.rows` (pointwise, reduction and general kernels),
:mod:`.matmul` and :mod:`.attention` (templates), :mod:`.source` (the kernel module),
:mod:`.configs` (launch configurations and their tuner), :mod:`.toolchain` (cache artifact,
import, interpreter), :mod:`.launcher` (the call plan's kernel launcher), :mod:`.offline`
(compiling a module for a GPU target without a GPU).
"""

from kiln.backends.base import Backend, register_backend


def _triton_backend() -> Backend:
    from .backend import TritonBackend

    return TritonBackend()


register_backend("triton", _triton_backend)
