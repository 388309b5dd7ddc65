"""The C toolchain of the cpu backend: find the compiler, name it, build shared objects.

:class:`CCompiler` is the host C compiler as a :class:`kiln.backends.common.toolchain.Toolchain`
(artifact ``"so"``, source suffix ``"c"``): one compiler and one set of flags, with an
:meth:`~CCompiler.identity` (its ``--version`` text, the flags, the machine and a digest of
the CPU, since ``-march=native`` code is CPU-specific) and a :meth:`~CCompiler.build` that
runs it.  The compiler is found once, by :func:`c_compiler` (``$CC``, else ``cc``, ``gcc``
or ``clang``).

Every graph becomes one translation unit compiled once with
``cc -O3 -march=native -mprefer-vector-width=512 -fopenmp -fno-math-errno -shared -fPIC`` (:data:`FLAGS`; the
toolchain :func:`cpu_compiler` returns).  Its identity and the kiln build identity (version
plus a hash of the code-generating sources) are part of the compile-cache key, so a new
compiler, new flags, another CPU or changed kiln code never reuse an old shared object.  The
loop-program runner (:mod:`.native`) uses the same class with its own flags.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kiln.backends.base import BackendError
from kiln.backends.common.toolchain import find_tool, sources_digest

FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno",
                          "-std=gnu11", "-shared", "-fPIC")
"""Flags of every compile (``-fno-math-errno`` lets math calls vectorize; results are the same).
GCC vectorizes for 256-bit registers by default even where the CPU has AVX-512; 512-bit
vectors measured faster here (the GPT-2 training step's elementwise and softmax kernels
10.3 -> 9.1 ms; inference within noise).  Without AVX-512 the preference changes nothing."""
LIBS: tuple[str, ...] = ("-lm",)
C_COMPILERS: tuple[str, ...] = ("cc", "gcc", "clang")
"""Programs tried, in order, when ``$CC`` names none."""

# Sources whose change changes generated code: hashed into the build identity.
_CODEGEN_PACKAGES = ("backends/cpu", "backends/common", "passes/lower.py", "passes/lowering", "ir/loops",
                     "ir/poly", "passes/schedule", "ir/ops")
_KILN_ROOT = Path(__file__).resolve().parents[2]


class CompileError(BackendError):
    """The C compiler rejected generated code (a kiln bug); carries the compiler output
    (``stderr``) and the path of the kept source (``source_path``)."""

    def __init__(self, message: str, stderr: str = "", source_path: str = ""):
        super().__init__(message)
        self.stderr = stderr
        self.source_path = source_path


def c_compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``, ``gcc`` or ``clang``; ``None`` without one."""
    return find_tool("CC", C_COMPILERS)


def find_compiler() -> str:
    """:func:`c_compiler`, raising :class:`BackendError` when there is none."""
    cc = c_compiler()
    if cc is None:
        raise BackendError("kiln backend 'cpu' needs a C compiler with OpenMP: set $CC or install gcc "
                           "(e.g. apt-get install gcc); the 'reference' backend runs without one")
    return cc


@dataclass(frozen=True)
class CCompiler:
    """The host C compiler ``cc`` with ``flags`` (compile and link, ``-shared -fPIC``
    included) and ``libs``, as a toolchain that builds shared objects.  ``notes`` are extra
    identity lines for whatever else changes the meaning of a build (the cpu backend's
    vector-math set)."""

    cc: str
    flags: tuple[str, ...]
    libs: tuple[str, ...] = LIBS
    notes: tuple[str, ...] = ()
    name: ClassVar[str] = "cc"
    artifact: ClassVar[str] = "so"
    source_suffix: ClassVar[str] = "c"

    def identity(self) -> str:
        """``cc --version``, the flags, the notes, the machine and the CPU digest."""
        return _identity(self.cc, self.flags + self.libs, self.notes)

    def build(self, source: str, folder: Path) -> Path:
        """Compile ``source`` into a shared object in ``folder``; returns its path.

        Raises :class:`CompileError` with the compiler's messages and the path of the kept
        source when compilation fails.
        """
        folder.mkdir(parents=True, exist_ok=True)
        fd, src_name = tempfile.mkstemp(prefix="kiln-", suffix=".c", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(source)
        out = Path(src_name).with_suffix(".so")
        cmd = [self.cc, *self.flags, src_name, "-o", str(out), *self.libs]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise CompileError(f"kiln backend 'cpu': the C compiler failed on generated code (a kiln bug; "
                               f"please report it with the source kept at {src_name}):\n{proc.stderr[-4000:]}",
                               proc.stderr, src_name)
        return out


@functools.lru_cache(maxsize=32)
def _identity(cc: str, flags: tuple[str, ...], notes: tuple[str, ...]) -> str:
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)
        version = proc.stdout.strip() or proc.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        raise BackendError(f"kiln backend 'cpu': cannot run the C compiler {cc!r}: {e}") from e
    return "\n".join([f"cc={cc}", version, "flags=" + " ".join(flags), *notes, f"machine={platform.machine()}",
                      f"cpu={_cpu_signature()}"])


def cpu_compiler(cc: str | None = None) -> CCompiler:
    """The toolchain of the cpu backend: ``cc`` (default :func:`find_compiler`) with
    :data:`FLAGS` and :func:`link_libraries`."""
    cc = cc or find_compiler()
    return CCompiler(cc, FLAGS, link_libraries(cc), ("vector-math=" + ",".join(vector_math(cc)),))


def compiler_identity(cc: str) -> str:
    """The identity of :func:`cpu_compiler` for ``cc``: what a cache key needs."""
    return cpu_compiler(cc).identity()


def _cpu_signature() -> str:
    """A digest of the CPU's model and feature flags (``-march=native`` code is CPU-specific)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
    except OSError:
        return platform.processor() or "unknown"
    return hashlib.sha256("".join(sorted(set(lines))).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def build_identity() -> str:
    """kiln's version plus a hash of the sources that generate code (so an edited kiln never
    loads a shared object built by an older one)."""
    files = []
    for rel in _CODEGEN_PACKAGES:
        path = _KILN_ROOT / rel
        files += path.rglob("*.py") if path.is_dir() else ([path] if path.exists() else [])
    try:
        version = importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        version = "source"
    return f"kiln {version} {sources_digest(files, _KILN_ROOT)}"


# Math functions with vector variants in glibc's libmvec: 2.35+ has all, 2.22+ the first five.
VECTOR_MATH_TIERS: tuple[tuple[str, ...], ...] = (
    ("exp", "log", "sin", "cos", "pow", "exp2", "log2", "log10", "tan", "tanh", "sinh", "cosh", "asin",
     "acos", "atan", "erf", "atan2"),
    ("exp", "log", "sin", "cos", "pow"),
)
_BINARY_MATH = ("pow", "atan2")


def vector_math_declarations(functions: tuple[str, ...]) -> str:
    """C declarations marking ``functions`` (float and double) ``omp declare simd``, so loops
    calling them vectorize through libmvec."""
    lines = []
    for fn in functions:
        for ctype, suffix in (("float", "f"), ("double", "")):
            params = f"{ctype}, {ctype}" if fn in _BINARY_MATH else ctype
            lines += ["#pragma omp declare simd notinbranch", f"{ctype} {fn}{suffix}({params});"]
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=8)
def vector_math(cc: str) -> tuple[str, ...]:
    """The math functions whose vector variants link (``-lmvec``) with ``cc``; () if none."""
    for tier in VECTOR_MATH_TIERS:
        calls = " + ".join(f"{fn}f(a[i], a[i])" if fn in _BINARY_MATH else f"{fn}f(a[i])" for fn in tier)
        dcalls = " + ".join(f"{fn}(d[i], d[i])" if fn in _BINARY_MATH else f"{fn}(d[i])" for fn in tier)
        probe = ("#include <math.h>\n" + vector_math_declarations(tier)
                 + "float a[64]; double d[64];\n"
                 "int main(void) {\n  float s = 0; double t = 0;\n"
                 f"  #pragma omp simd reduction(+:s, t)\n  for (int i = 0; i < 64; i++) {{ s += {calls}; t += {dcalls}; }}\n"
                 "  return (int)(s + t) == 12345;\n}\n")
        with tempfile.TemporaryDirectory(prefix="kiln-probe-") as d:
            src = Path(d) / "probe.c"
            src.write_text(probe)
            try:
                proc = subprocess.run([cc, *FLAGS[:-2], str(src), "-o", str(Path(d) / "probe"), "-lmvec", "-lm"],
                                      capture_output=True, text=True, timeout=60, check=False)
            except (OSError, subprocess.SubprocessError):
                return ()
            if proc.returncode == 0:
                return tier
    return ()


def link_libraries(cc: str) -> tuple[str, ...]:
    """Libraries to link: libmvec when vector math is available, and libm."""
    return ("-lmvec", *LIBS) if vector_math(cc) else LIBS


def compile_shared_object(source: str, folder: Path, cc: str | None = None) -> Path:
    """Compile ``source`` with :func:`cpu_compiler` into a shared object in ``folder``;
    returns its path (:meth:`CCompiler.build`)."""
    return cpu_compiler(cc).build(source, folder)


__all__ = ["C_COMPILERS", "FLAGS", "LIBS", "CCompiler", "CompileError", "build_identity", "c_compiler",
           "compile_shared_object", "compiler_identity", "cpu_compiler", "find_compiler", "link_libraries",
           "vector_math", "vector_math_declarations"]
