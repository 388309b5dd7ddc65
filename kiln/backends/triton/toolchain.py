"""The Triton toolchain: a graph's kernel module, checked, cached and imported.

:class:`TritonToolchain` implements :class:`kiln.backends.common.toolchain.Toolchain`:

* ``artifact = "triton"`` -- its own artifact type in the compile cache: the module text
  (``source_suffix = "py"`` for the source kept beside it).  Triton compiles each kernel to
  machine code on its first launch and keeps that in its own cache (``~/.triton/cache``);
* ``identity()`` -- Triton's version and the target: ``interpreter``, or the CUDA device's
  name and compute capability (a module generated for the interpreter calls other math
  helpers than one for a GPU);
* ``build(source, folder)`` -- compiles the text as Python (a syntax error is a kiln bug,
  reported as :class:`TritonSourceError` with the file kept) and writes the artifact.

:func:`import_kernels` imports an artifact as a module.  With ``interpret=True`` it sets
``TRITON_INTERPRET=1`` while the module's ``@triton.jit`` decorators run (Triton decides at
decoration time whether a function is interpreted), under a lock, and restores the
variable afterwards, so interpreted and compiled kernels coexist in one process.  Modules
are kept by path: importing the same artifact again returns the same module.

Triton's own library functions (``tl.sum``, ``tl.max``, ``tl.cdiv``, ``tl.zeros``, ...) are
``@triton.jit`` functions decorated when ``triton.language`` is first imported, in the mode
of that moment; the interpreter cannot call compiled-mode ones.  :func:`interpreted_library`
therefore swaps each of them for an interpreted twin while an interpreted kernel runs (and
puts them back after), so the interpreter works in a process that imported Triton normally
-- as PyTorch does.  Triton is imported before ``TRITON_INTERPRET`` is touched, so its
library always starts in the process's own mode.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from kiln.backends.base import BackendError

INTERPRET_ENV = "TRITON_INTERPRET"
_IMPORT_LOCK = threading.Lock()
_MODULES: dict[str, ModuleType] = {}


class TritonSourceError(BackendError):
    """A generated kernel module is not valid Python (a kiln bug); ``source_path`` keeps it."""

    def __init__(self, message: str, source_path: Path):
        super().__init__(message)
        self.source_path = source_path


def triton_version() -> str:
    try:
        import triton  # noqa: PLC0415
    except ImportError:
        return "missing"
    return str(triton.__version__)


def device_identity(interpret: bool, device: str = "cuda") -> str:
    """``interpreter`` or ``<device name> sm_<major><minor>``."""
    if interpret:
        return "interpreter"
    import torch  # noqa: PLC0415

    props = torch.cuda.get_device_properties(torch.device(device))
    return f"{props.name} sm_{props.major}{props.minor}"


class TritonToolchain:
    """See the module docstring."""

    name = "triton"
    artifact = "triton"
    source_suffix = "py"

    def __init__(self, interpret: bool, device: str = "cuda"):
        self.interpret = interpret
        self.device = device
        self._identity: str | None = None

    def identity(self) -> str:
        if self._identity is None:
            self._identity = f"triton {triton_version()} {device_identity(self.interpret, self.device)}"
        return self._identity

    def build(self, source: str, folder: Path) -> Path:
        path = Path(folder) / "kernels.py"
        path.write_text(source)
        try:
            compile(source, str(path), "exec")
        except SyntaxError as e:
            raise TritonSourceError(f"kiln bug: the generated Triton module does not parse ({e.msg}, line "
                                    f"{e.lineno}); the source is kept at {path}", path) from e
        artifact = Path(folder) / "kernels.triton"
        artifact.write_text(source)
        return artifact


def _import_triton() -> None:
    """Import Triton (and the parts it imports lazily at a first launch) in the process's mode."""
    import triton  # noqa: F401, PLC0415
    import triton.language  # noqa: F401, PLC0415

    with contextlib.suppress(ImportError):
        import triton.experimental.gluon  # noqa: F401, PLC0415


def import_kernels(path: Path, interpret: bool) -> ModuleType:
    """The module at ``path`` (module docstring)."""
    key = f"{os.fspath(path)}|{interpret}"
    _import_triton()
    with _IMPORT_LOCK:
        module = _MODULES.get(key)
        if module is not None:
            return module
        name = f"kiln_triton_{abs(hash(key)):x}"
        loader = importlib.machinery.SourceFileLoader(name, os.fspath(path))
        spec = importlib.util.spec_from_loader(name, loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        before = os.environ.get(INTERPRET_ENV)
        os.environ[INTERPRET_ENV] = "1" if interpret else "0"
        try:
            sys.modules[name] = module  # Triton looks functions' globals up through their module
            loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        finally:
            if before is None:
                os.environ.pop(INTERPRET_ENV, None)
            else:
                os.environ[INTERPRET_ENV] = before
        _MODULES[key] = module
        return module


_LIBRARY_LOCK = threading.RLock()
_TWINS: dict[int, object] = {}


@contextlib.contextmanager
def interpreted_library() -> Iterator[None]:
    """Triton's ``@triton.jit`` library functions replaced by interpreted twins while the
    block runs (module docstring; a no-op when they are interpreted already), the
    interpreter's integer-overflow checks off (each check costs more than the operation it
    guards; compiled kernels have none either), and every patch the interpreter leaves on
    ``triton.language`` undone afterwards."""
    import dataclasses  # noqa: PLC0415

    from triton.runtime import interpreter  # noqa: PLC0415
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415
    from triton.runtime.jit import JITFunction  # noqa: PLC0415

    with _LIBRARY_LOCK:
        swapped: list[tuple[ModuleType, str, object]] = []
        builder = getattr(interpreter, "interpreter_builder", None)
        options = getattr(builder, "options", None)
        snapshot = _language_snapshot()
        try:
            if options is not None and getattr(options, "sanitize_overflow", False):
                builder.options = dataclasses.replace(options, sanitize_overflow=False)
            for name, module in list(sys.modules.items()):
                if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
                    continue
                for attr, value in list(vars(module).items()):
                    if isinstance(value, JITFunction):
                        twin = _TWINS.get(id(value))
                        if twin is None:
                            twin = _TWINS[id(value)] = InterpretedFunction(value.fn)
                        swapped.append((module, attr, value))
                        setattr(module, attr, twin)
            yield
        finally:
            for module, attr, value in reversed(swapped):
                setattr(module, attr, value)
            if options is not None:
                builder.options = options
            _restore_language(snapshot)


def _language_objects() -> list[object]:
    """What the interpreter patches: ``triton.language`` and its ``core`` and ``math``
    modules, and the classes whose methods it replaces."""
    import triton.language as tl  # noqa: PLC0415

    objects: list[object] = [tl, tl.core, tl.math, tl.tensor, tl.dtype]
    for name in ("condition", "tensor_descriptor_base"):
        for owner in (tl, tl.core):
            value = getattr(owner, name, None)
            if isinstance(value, type) and value not in objects:
                objects.append(value)
    return objects


def _language_snapshot() -> list[tuple[object, dict]]:
    return [(obj, dict(vars(obj))) for obj in _language_objects()]


def _restore_language(snapshot: list[tuple[object, dict]]) -> None:
    """Undo every attribute change since ``snapshot``: device-function calls in Triton's
    interpreter patch the language for good, which would break later compiled kernels."""
    for obj, before in snapshot:
        now = vars(obj)
        for name in [n for n in now if n not in before]:
            with contextlib.suppress(AttributeError, TypeError):
                delattr(obj, name)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(obj, name, value)


_MISSING = object()


__all__ = ["INTERPRET_ENV", "interpreted_library", "TritonSourceError", "TritonToolchain", "device_identity", "import_kernels",
           "triton_version"]
