"""The ``"tvm"`` backend: kiln's kernels as TVM TensorIR, built by ``tvm.compile`` (see
:mod:`kiln.backends.tvm.backend` and ``docs/tvm.md``).

Importing this package only registers the backend; TVM (``pip install "apache-tvm==0.27.*"``)
loads when a graph is first built, and a build without it fails with a
:class:`~kiln.backends.base.BackendError` saying how to install it.

Modules: :mod:`.backend` (the backend and its build pipeline), :mod:`.tir` (loop programs
as PrimFuncs: kiln's schedule loop for loop, or blocks for TVM's schedules),
:mod:`.schedules` (dlight defaults, MetaSchedule records and tuning), :mod:`.toolchain`
(target, module document, ``tvm.compile``, the cache artifact), :mod:`.launcher` (the call
plan's kernel launcher), :mod:`.compat` (TVM's renamed modules), :mod:`.tuning` (``kiln tune
--backend tvm``).
"""

from kiln.backends.base import Backend, BackendError, register_backend


def _tvm_backend() -> Backend:
    try:
        import tvm  # noqa: F401, PLC0415
    except ImportError as e:
        raise BackendError(f"kiln backend 'tvm' needs TVM, which cannot be imported ({e}); install it with "
                           f"pip install \"apache-tvm==0.27.*\", or use backend='cpu'") from e
    from .backend import TvmBackend  # noqa: PLC0415

    return TvmBackend()


register_backend("tvm", _tvm_backend)
