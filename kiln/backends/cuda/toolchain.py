"""The nvcc toolchain of the cuda backend: find nvcc, name it, build shared objects.

:class:`NvccCompiler` implements :class:`kiln.backends.common.toolchain.Toolchain`: it
builds one CUDA translation unit (``.cu``, kernels and host wrappers) with
``nvcc -O3 -arch=sm_90 -shared -Xcompiler -fPIC`` into a shared object (artifact
``cuda_so``) that :mod:`ctypes` loads; the CUDA runtime is linked statically (nvcc's
default), so the object needs nothing beyond the driver.  Its :meth:`~NvccCompiler.identity`
(``nvcc --version``, the flags, the target architecture) keys the compile cache, so another
nvcc, other flags or another GPU architecture never reuse an artifact.

nvcc is found by :func:`find_nvcc`: ``$NVCC``, else ``nvcc`` on ``PATH``, else
``$CUDA_HOME/bin/nvcc``, ``/usr/local/cuda/bin/nvcc`` or the ``nvidia-cuda-nvcc`` wheel's
(``site-packages/nvidia/cuda_nvcc/bin`` or ``.../nvidia/cu13/bin``).
:meth:`~NvccCompiler.check` compiles device code only (``nvcc -arch=... -c``): what the
tests run where no GPU is present.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kiln.backends.base import BackendError
from kiln.backends.common.toolchain import find_tool

DEFAULT_ARCH = "sm_90"
"""The architecture built for when no GPU says otherwise (the H100/H200 generation)."""
FLAGS: tuple[str, ...] = ("-O3", "-shared", "-Xcompiler", "-fPIC", "-diag-suppress", "177,550")
"""Flags of every build besides ``-arch`` (warnings 177/550: unused generated variables)."""


class NvccError(BackendError):
    """nvcc rejected generated code (a kiln bug); carries nvcc's output (``stderr``) and the
    path of the kept source (``source_path``)."""

    def __init__(self, message: str, stderr: str = "", source_path: str = ""):
        super().__init__(message)
        self.stderr = stderr
        self.source_path = source_path


def _candidates() -> list[str]:
    out = ["nvcc"]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        out.append(str(Path(home) / "bin" / "nvcc"))
    out.append("/usr/local/cuda/bin/nvcc")
    for site in sys.path:  # the nvidia-cuda-nvcc wheels (CUDA 12 and 13 layouts)
        if site.endswith("site-packages"):
            out += [str(Path(site) / "nvidia" / sub / "bin" / "nvcc") for sub in ("cuda_nvcc", "cu13")]
    return out


def find_nvcc() -> str | None:
    """nvcc (see the module docstring), or ``None`` when there is none."""
    return find_tool("NVCC", _candidates())


def require_nvcc() -> str:
    """:func:`find_nvcc`, raising :class:`BackendError` that says how to go on without one."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BackendError("kiln backend 'cuda' needs nvcc (the CUDA toolkit) to build kernels: install it, "
                           "set $NVCC or $CUDA_HOME, or pass emulate=True to run the kernels on the host")
    return nvcc


def device_arch() -> str:
    """``sm_XY`` of the current CUDA device, else :data:`DEFAULT_ARCH`."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - no usable device: the default target
        pass
    return DEFAULT_ARCH


@dataclass(frozen=True)
class NvccCompiler:
    """nvcc at ``nvcc`` building for ``arch`` with ``flags``, as a toolchain (module docstring)."""

    nvcc: str
    arch: str = DEFAULT_ARCH
    flags: tuple[str, ...] = FLAGS
    name: ClassVar[str] = "nvcc"
    artifact: ClassVar[str] = "cuda_so"
    source_suffix: ClassVar[str] = "cu"

    def identity(self) -> str:
        """``nvcc --version``, the flags and the architecture."""
        return f"{_version(self.nvcc)}\nflags={' '.join(self.flags)}\narch={self.arch}"

    def build(self, source: str, folder: Path) -> Path:
        """Compile ``source`` into a shared object in ``folder``; its path.  Raises
        :class:`NvccError` with nvcc's messages and the kept source when nvcc fails."""
        src = _write(source, folder)
        out = src.with_suffix(".so")
        self._run([self.nvcc, *self.flags, f"-arch={self.arch}", str(src), "-o", str(out)], src)
        return out

    def check(self, source: str, folder: Path | None = None) -> Path:
        """Compile ``source`` to an object file only (``nvcc -arch=... -c``): proves it builds
        without a GPU or a link step.  Returns the object's path."""
        folder = Path(folder or tempfile.mkdtemp(prefix="kiln-nvcc-"))
        src = _write(source, folder)
        out = src.with_suffix(".o")
        self._run([self.nvcc, f"-arch={self.arch}", "-diag-suppress", "177,550", "-c", str(src), "-o", str(out)], src)
        return out

    def _run(self, cmd: list[str], src: Path) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise NvccError(f"kiln backend 'cuda': nvcc failed on generated code (a kiln bug; please report it "
                            f"with the source kept at {src}):\n{proc.stderr[-4000:]}", proc.stderr, str(src))


def _write(source: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="kiln-", suffix=".cu", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    return Path(name)


@functools.lru_cache(maxsize=8)
def _version(nvcc: str) -> str:
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        raise BackendError(f"kiln backend 'cuda': cannot run nvcc {nvcc!r}: {e}") from e
    return f"nvcc={nvcc}\n" + (proc.stdout.strip() or proc.stderr.strip())


def nvcc_compiler(arch: str | None = None, nvcc: str | None = None) -> NvccCompiler:
    """The toolchain of the cuda backend: ``nvcc`` (default :func:`require_nvcc`) building for
    ``arch`` (default :func:`device_arch`)."""
    return NvccCompiler(nvcc or require_nvcc(), arch or device_arch())


__all__ = ["DEFAULT_ARCH", "FLAGS", "NvccCompiler", "NvccError", "device_arch", "find_nvcc", "nvcc_compiler",
           "require_nvcc"]
