"""GEMM calls from generated C: matrix products through the BLAS libraries already loaded.

A ``matmul`` whose operands are (batched) matrices with one unit stride each is a
:class:`GemmSpec`: sizes, BLAS transpose flags and leading dimensions, batch strides (all
read from the operands' predicted layouts, so transposed weight views such as ``x @ W.T``
of ``nn.Linear`` are read in place) and the BLAS *provider*.  :func:`gemm_function` prints
a C function calling the provider's Fortran ``sgemm``/``dgemm`` through function pointers
that the backend sets once after loading the shared object (``kiln_set_blas``).  The
generated kernel then runs the GEMM and its fused epilogue in one native call.

Providers are the BLAS libraries torch and numpy bring along (:func:`blas_providers`),
found by symbol: ``mkl`` (``sgemm_`` of ``libtorch_cpu``, 32-bit indices) and ``openblas``
(``scipy_sgemm_64_`` of numpy's bundled OpenBLAS, 64-bit indices); and ``kiln``, kiln's own
float32 GEMM (:mod:`.microgemm`, B read from 16-column panels; weights are packed once).
bfloat16 GEMMs have one provider, kiln's bf16 GEMM (B in pair panels), where the CPU has
AVX-512 BF16 or AVX2; elsewhere a bf16 matmul is no GEMM kernel here (a library call, torch's).
Which is fastest depends on the CPU and the shape (on AMD Zen 2, kiln's GEMM runs the
GEMMs of transformers ~1.5x faster than MKL; on one thread OpenBLAS beats MKL by ~30%,
MKL won on matrix-vector shapes until kiln's GEMM had its few-rows path, and on an AMD EPYC
with AVX-512 loses there by 2-5x), so :class:`GemmTuner` times the candidates once per
GEMM shape and machine and remembers the choice in ``gemm.json`` of the compile cache
folder; GEMMs under :data:`TUNE_MIN_FLOPS` use MKL without timing, except products of at
most :data:`GEMV_MAX_M` rows, timed from :data:`GEMV_TUNE_MIN_FLOPS`.  With several threads only MKL is used: it
shares the OpenMP thread pool of kiln's kernels, while OpenBLAS's own spinning pool fights
them for the cores.  For a transposed weight (``x @ W.T`` of
``nn.Linear``) the tuner also times reading a contiguous copy of ``W.T`` (``packed_b``):
OpenBLAS runs such GEMMs ~15% faster untransposed.

Row-major ``C[M,N] = A[M,K] @ B[K,N]`` is column-major ``C^T = B^T A^T``: the call is
``gemm(tB, tA, N, M, K, 1, B, ldb, A, lda, 0, C, N)``.  A batch whose right operand is
shared and whose left operand's rows are evenly spaced becomes one GEMM with ``M * batch``
rows.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from kiln.backends.common.choices import ChoiceStore
from kiln.ir.types import DType, broadcast_shapes
from kiln.runtime.timing import best_time

from .microgemm import SOURCE as _MICRO_SOURCE
from .microgemm import MicroGemm, packed_shape

_MICRO_VERSION = hashlib.sha256(_MICRO_SOURCE.encode()).hexdigest()[:12]
"""A digest of kiln's GEMM source, part of every stored choice's key: a changed kernel is timed again."""

_CTYPE = {DType.float32: "float", DType.float64: "double"}
_KILN_CTYPE = {DType.bfloat16: "unsigned short"}
"""Dtypes only kiln's own GEMM runs (no BLAS routine): their C element type (the bits)."""
PROVIDERS = ("mkl", "openblas")
"""BLAS providers (see :func:`blas_providers`)."""
KILN_PROVIDER = "kiln"
"""kiln's own float32 GEMM (:mod:`.microgemm`), a provider beside the BLAS libraries."""
_INDEX = {"mkl": ("int", ctypes.c_int), "openblas": ("long", ctypes.c_long)}
TUNE_MIN_FLOPS = 4e6
"""GEMMs with fewer flops use MKL without timing (its small-shape paths are the faster)."""
GEMV_MAX_M, GEMV_TUNE_MIN_FLOPS = 4, 2e5
"""Products of at most ``GEMV_MAX_M`` rows are bound by reading B and timed from
``GEMV_TUNE_MIN_FLOPS`` (kiln's GEMV path against MKL's: a classifier head's ``1 x 576 @
576 x 1024`` took 45 us on MKL and 22 on kiln on a 2-vCPU AMD EPYC)."""
PARALLEL_BATCH_MAX_FLOPS = 16e6
"""With several threads, a batch of GEMMs with at most this many flops each (attention's
``(heads, seq, d) @ (heads, d, seq)``) runs its entries in parallel, one thread each: a
small GEMM split between threads spends much of its time synchronizing them (measured on
the 2-layer GPT-2 training step: 128x128x64 GEMMs at 120-200 GFLOP/s split)."""


def blas_prelude() -> str:
    """Declarations every translation unit with a GEMM kernel starts with."""
    lines = []
    for provider in PROVIDERS:
        index = _INDEX[provider][0]
        for prefix, ctype in (("s", "float"), ("d", "double")):
            lines.append(f"typedef void (*kiln_{prefix}gemm_{provider}_fn)(const char *, const char *, "
                         f"const {index} *, const {index} *, const {index} *, const {ctype} *, const {ctype} *, "
                         f"const {index} *, const {ctype} *, const {index} *, const {ctype} *, {ctype} *, "
                         f"const {index} *);")
            lines.append(f"static kiln_{prefix}gemm_{provider}_fn kiln_{prefix}gemm_{provider};")
    lines.append("void kiln_set_blas(long provider, void *sgemm, void *dgemm) {")
    for i, provider in enumerate(PROVIDERS):
        lines.append(f"  if (provider == {i}) {{ kiln_sgemm_{provider} = (kiln_sgemm_{provider}_fn)sgemm; "
                     f"kiln_dgemm_{provider} = (kiln_dgemm_{provider}_fn)dgemm; }}")
    lines.append("}")
    lines.append("typedef int (*kiln_mgemm_fn)(long, long, long, const float *, long, long, const float *, long, "
                 "long, int, float *, long);")
    lines.append("static kiln_mgemm_fn kiln_mgemm;")
    lines.append("void kiln_set_mgemm(void *f) { kiln_mgemm = (kiln_mgemm_fn)f; }")
    lines.append("typedef int (*kiln_mgemm_bf16_fn)(long, long, long, const unsigned short *, long, long, "
                 "const unsigned short *, long, long, int, unsigned short *, long);")
    lines.append("static kiln_mgemm_bf16_fn kiln_mgemm_bf16;")
    lines.append("void kiln_set_mgemm_bf16(void *f) { kiln_mgemm_bf16 = (kiln_mgemm_bf16_fn)f; }")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Operand:
    """One matrix operand in the column-major call: BLAS ``trans`` flag and leading dim."""

    trans: str
    ld: int


@dataclass(frozen=True)
class GemmSpec:
    """``C[batch..., M, N] = A[batch..., M, K] @ B[batch..., K, N]`` (see module docstring).

    ``batch`` are the output batch sizes; ``a_strides``/``b_strides`` the element strides of
    the operands along them (0 where an operand is broadcast); C is contiguous."""

    dtype: DType
    m: int
    n: int
    k: int
    a: Operand
    b: Operand
    batch: tuple[int, ...] = ()
    a_strides: tuple[int, ...] = ()
    b_strides: tuple[int, ...] = ()
    provider: str = "mkl"
    packed_b: bool = False
    """B is read from a prepared copy of the (transposed) weight that the runtime keeps up
    to date (a :class:`kiln.runtime.call_plan.PackStep` of :mod:`.packing`)."""
    m_expr: str = ""
    """For a graph with symbolic sizes: M as a C expression of the kernel's size table ``S``
    (``S[0] * S[1]``), read at each call; ``m`` is then its value at the build's sample
    sizes (what the tuner times)."""
    parallel_batch: bool = False
    """The threads split the batch entries, each GEMM running on one thread (BLAS and kiln's
    GEMM inside an OpenMP region use one thread), instead of every small GEMM being split
    (:data:`PARALLEL_BATCH_MAX_FLOPS`)."""

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * math.prod(self.batch)


def _matrix(rows: int, cols: int, s_rows: int, s_cols: int, row_major: str, col_major: str) -> Operand | None:
    """The operand of a ``rows x cols`` matrix with strides ``(s_rows, s_cols)``."""
    if cols == 1 or s_cols == 1:
        ld = s_rows if rows > 1 else max(cols, 1)
        if ld >= max(cols, 1):
            return Operand(row_major, ld)
    if rows == 1 or s_rows == 1:
        ld = s_cols if cols > 1 else max(rows, 1)
        if ld >= max(rows, 1):
            return Operand(col_major, ld)
    return None


def gemm_spec(a: torch.Tensor, b: torch.Tensor, dtype: DType) -> GemmSpec | None:
    """The GEMM computing ``torch.matmul(a, b)`` for meta tensors ``a`` and ``b`` with their
    predicted strides (offsets are applied by the caller), or ``None`` when it is not one:
    an operand is 1-d or has no unit stride, or the dtype has no GEMM here (BLAS or kiln's)."""
    if (dtype not in _CTYPE and dtype not in _KILN_CTYPE) or a.dim() < 2 or b.dim() < 2:
        return None
    m, k = a.shape[-2:]
    k2, n = b.shape[-2:]
    if k != k2:
        return None
    a_op = _matrix(m, k, a.stride(-2), a.stride(-1), "N", "T")
    b_op = _matrix(k, n, b.stride(-2), b.stride(-1), "N", "T")
    if a_op is None or b_op is None:
        return None
    batch = tuple(broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])))
    spec = GemmSpec(dtype, m, n, k, a_op, b_op, batch, _batch_strides(a, batch), _batch_strides(b, batch))
    return _merge_batch(spec)


def _batch_strides(t: torch.Tensor, batch: tuple[int, ...]) -> tuple[int, ...]:
    lead = len(batch) - (t.dim() - 2)
    out = []
    for i in range(len(batch)):
        j = i - lead
        out.append(0 if j < 0 or t.shape[j] == 1 else t.stride(j))
    return tuple(out)


def _merge_batch(spec: GemmSpec) -> GemmSpec:
    """One GEMM over ``M * batch`` rows when B is shared and A's rows are evenly spaced."""
    if not spec.batch or any(spec.b_strides) or spec.a.trans != "N":
        return spec
    expected = spec.m * spec.a.ld
    for size, stride in zip(reversed(spec.batch), reversed(spec.a_strides)):
        if size != 1 and stride != expected:
            return spec
        expected *= size
    rows = spec.m * math.prod(spec.batch)
    ld = spec.a.ld if rows > 1 else max(spec.k, 1)
    return GemmSpec(spec.dtype, rows, spec.n, spec.k, Operand("N", ld), spec.b, provider=spec.provider)


def gemm_function(name: str, spec: GemmSpec) -> str:
    """``static void name(const T *A, const T *B, T *C)`` running ``spec`` (with a symbolic
    M, ``m_expr``, a fourth parameter ``const long *S``: the kernel's size table)."""
    ctype = _CTYPE.get(spec.dtype) or _KILN_CTYPE[spec.dtype]
    if spec.provider != KILN_PROVIDER and spec.dtype not in _CTYPE:
        raise ValueError(f"a {spec.dtype.short} GEMM has no BLAS routine; only kiln's GEMM runs it")
    if spec.m_expr and spec.batch:
        raise ValueError("a GEMM with a symbolic M has no batch loop")
    size_param = ", const long *S" if spec.m_expr else ""
    m_text = f"({spec.m_expr})" if spec.m_expr else f"{spec.m}L"
    lines = [f"static void {name}(const {ctype} *A, const {ctype} *B, {ctype} *C{size_param}) {{"]
    if spec.provider == KILN_PROVIDER:
        am, ak = (spec.a.ld, 1) if spec.a.trans == "N" else (1, spec.a.ld)
        bk, bn = (0, 0) if spec.packed_b else (spec.b.ld, 1) if spec.b.trans == "N" else (1, spec.b.ld)
        routine = "kiln_mgemm" if spec.dtype == DType.float32 else "kiln_mgemm_bf16"
        call = (f"{routine}({m_text}, {spec.n}L, {spec.k}L, A + a_off, {am}L, {ak}L, B + b_off, {bk}L, {bn}L, "
                f"{int(spec.packed_b)}, C + c_off, {max(spec.n, 1)}L);")
    else:
        index = _INDEX[spec.provider][0]
        routine = f"kiln_{'s' if spec.dtype == DType.float32 else 'd'}gemm_{spec.provider}"
        n_text = f"({index}){m_text}" if spec.m_expr else f"{spec.m}"
        lines += [(f"  const {index} m = {spec.n}, n = {n_text}, k = {spec.k}, lda = {spec.b.ld}, "
                   f"ldb = {spec.a.ld}, ldc = {max(spec.n, 1)};"),
                  f"  const {ctype} one = 1, zero = 0;"]
        call = (f"{routine}(\"{spec.b.trans}\", \"{spec.a.trans}\", &m, &n, &k, &one, B + b_off, &lda, "
                "A + a_off, &ldb, &zero, C + c_off, &ldc);")
    if (spec.m == 0 and not spec.m_expr) or spec.n == 0:
        lines.append("  (void)A; (void)B; (void)C;")
    elif not spec.batch:
        lines.append("  const long a_off = 0, b_off = 0, c_off = 0;")
        lines.append(f"  {call}")
    else:
        if spec.parallel_batch:
            lines.append("  #pragma omp parallel for schedule(static)")
        lines.append(f"  for (long t = 0; t < {math.prod(spec.batch)}L; t++) {{")
        lines.append("    long r = t, a_off = 0, b_off = 0;")
        for size, sa, sb in reversed(list(zip(spec.batch, spec.a_strides, spec.b_strides))):
            lines.append(f"    a_off += (r % {size}) * {sa}L; b_off += (r % {size}) * {sb}L; r /= {size};")
        lines.append(f"    const long c_off = t * {spec.m * spec.n}L;")
        lines.append(f"    {call}")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ providers
@dataclass(frozen=True)
class BlasProvider:
    """A loaded BLAS: the addresses of its ``sgemm``/``dgemm`` and how to set its threads."""

    name: str
    sgemm: int
    dgemm: int
    set_threads: object | None = None


@functools.lru_cache(maxsize=1)
def blas_providers() -> dict[str, BlasProvider]:
    """The BLAS providers found in this process (see the module docstring); may be empty."""
    found: dict[str, BlasProvider] = {}
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    mkl = _symbols(torch_lib, "sgemm_", "dgemm_")
    if mkl is not None:
        found["mkl"] = BlasProvider("mkl", *mkl)
    numpy_libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas64_*.so")
    for path in sorted(glob.glob(numpy_libs)):
        symbols = _symbols(path, "scipy_sgemm_64_", "scipy_dgemm_64_")
        if symbols is not None:
            lib = ctypes.CDLL(path)
            set_threads = getattr(lib, "scipy_openblas_set_num_threads64_", None)
            found["openblas"] = BlasProvider("openblas", *symbols, set_threads)
            break
    return found


def _symbols(path: str, sgemm: str, dgemm: str) -> tuple[int, int] | None:
    if not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
        s = ctypes.cast(getattr(lib, sgemm), ctypes.c_void_p).value
        d = ctypes.cast(getattr(lib, dgemm), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return (int(s), int(d)) if s and d else None


def set_blas_threads(threads: int) -> None:
    """Make the providers that run their own thread pools (OpenBLAS) use ``threads``, as
    torch's (MKL's OpenMP) pool does; numpy shares that OpenBLAS, so it follows too."""
    for provider in blas_providers().values():
        if provider.set_threads is not None:
            provider.set_threads(ctypes.c_int(max(1, threads)))


def blas_symbols() -> tuple[int, int] | None:
    """``(sgemm, dgemm)`` of the default provider (MKL), or ``None`` without any BLAS."""
    providers = blas_providers()
    first = providers.get("mkl") or next(iter(providers.values()), None)
    return None if first is None else (first.sgemm, first.dgemm)


# ------------------------------------------------------------------------------ tuning
class GemmTuner:
    """Choose a provider per GEMM shape by timing each once (see the module docstring).

    Choices persist in ``path`` (JSON, keyed by ``machine``, threads and the shape); with
    ``path=None`` they last as long as the tuner.  ``micro`` is kiln's own GEMM library
    (:func:`kiln.backends.cpu.microgemm.library`), a candidate for float32 when given, and
    the only one for bfloat16 (when its bf16 GEMM is available)."""

    def __init__(self, path: Path | None, machine: str, threads: int, micro: MicroGemm | None = None):
        self.machine = machine
        self.threads = threads
        self.micro = micro
        self.timed = 0
        self._store = ChoiceStore(path, lambda v: v.split("+")[0] in (*PROVIDERS, KILN_PROVIDER), ".gemm.")

    def candidates(self, spec: GemmSpec, packable: bool = False) -> dict[str, GemmSpec]:
        """Every way to run ``spec`` here, by name (``provider`` or ``provider+packed``);
        ``packable``: B is a weight (a 2-d argument), which may be read from a packed copy."""
        providers = blas_providers()
        names = [name for name in PROVIDERS if name in providers] if spec.dtype in _CTYPE else []
        if self.threads > 1 and "mkl" in names:
            # OpenBLAS keeps its own spinning thread pool; next to the OpenMP pool that
            # kiln's kernels and MKL share it makes the cores fight (measured: 2-5x slower
            # models on 2 cores), so several threads mean MKL only.
            names = ["mkl"]
        found = {name: replace(spec, provider=name) for name in names}
        if packable and spec.b.trans == "T":  # BLAS reads a contiguous copy of a transposed weight
            packed = replace(spec, b=Operand("N", max(spec.n, 1)), packed_b=True)
            found.update({f"{name}+packed": replace(packed, provider=name) for name in names})
        if self.micro is not None and (spec.dtype == DType.float32
                                       or (spec.dtype == DType.bfloat16 and self.micro.bf16 is not None)):
            found[KILN_PROVIDER] = replace(spec, provider=KILN_PROVIDER, packed_b=packable)
        return found

    def supports(self, dtype: DType) -> bool:
        """Whether GEMMs of ``dtype`` have a provider here."""
        if dtype in _CTYPE:
            return bool(blas_providers()) or (self.micro is not None and dtype == DType.float32)
        return dtype == DType.bfloat16 and self.micro is not None and self.micro.bf16 is not None

    def choose(self, spec: GemmSpec, packable: bool = False) -> GemmSpec | None:
        """``spec`` with its provider set (and ``packed_b`` when B, a weight if ``packable``, is
        read from a packed copy), the fastest of :meth:`candidates` for its shape; a batch of
        small GEMMs split between the threads by entry (:data:`PARALLEL_BATCH_MAX_FLOPS`).
        ``None`` when no provider runs GEMMs of its dtype here (:meth:`supports`)."""
        if not self.supports(spec.dtype):
            return None
        chosen = self._provider(spec, packable)
        entries = math.prod(spec.batch)
        if self.threads > 1 and entries > 1 and not spec.m_expr and spec.flops / entries <= PARALLEL_BATCH_MAX_FLOPS:
            chosen = replace(chosen, parallel_batch=True)
        return chosen

    def _provider(self, spec: GemmSpec, packable: bool) -> GemmSpec:
        candidates = self.candidates(spec, packable)
        if not candidates:
            raise ValueError("kiln GEMM: no BLAS library and no kiln GEMM for this dtype")
        default = next(iter(candidates))
        floor = GEMV_TUNE_MIN_FLOPS if isinstance(spec.m, int) and spec.m <= GEMV_MAX_M else TUNE_MIN_FLOPS
        if spec.flops < floor or len(candidates) == 1:
            return candidates[default]
        fields = asdict(replace(spec, provider="", batch=(), a_strides=(), b_strides=()))
        key = (f"v2|{self.machine}|threads={self.threads}|packable={packable}|kiln={_MICRO_VERSION}|"
               f"{json.dumps(fields, sort_keys=True, default=str)}")
        known = self._store.get(key)
        if known in candidates:
            return candidates[known]
        set_blas_threads(self.threads)
        runs = {name: self._runner(c) for name, c in candidates.items()}
        best = _fastest(runs)
        self.timed += 1
        self._store.put(key, best)
        return candidates[best]

    def _runner(self, spec: GemmSpec) -> Callable[[], None]:
        if spec.provider == KILN_PROVIDER:
            assert self.micro is not None
            return _micro_runner(spec, self.micro)
        return _blas_runner(spec, blas_providers()[spec.provider])


TUNE_SECONDS = 0.25
"""About how long the timed rounds of one GEMM shape may take (at least one round runs)."""


def _fastest(runs: dict[str, Callable[[], None]], rounds: int = 5) -> str:
    """The name of the fastest call: each is warmed up (and timed), then all are timed in
    turn for up to ``rounds`` rounds (fewer for big GEMMs, about :data:`TUNE_SECONDS` in all)
    and the best time of each counts (interleaving makes a disturbance by other processes hit
    every candidate alike).  Each timing is one :func:`kiln.runtime.timing.best_time` call."""
    def once(run: Callable[[], None]) -> float:
        return best_time(run, repeat=1, warmup=0)

    best = {name: once(run) for name, run in runs.items()}
    rounds = max(1, min(rounds, int(TUNE_SECONDS / max(sum(best.values()), 1e-9))))
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = min(best[name], once(run))
    return min(best, key=best.__getitem__)


def _operands(spec: GemmSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Timing operands: A (``M x K``) and B (``K x N``) in ``spec``'s layouts, filled with ones
    (a GEMM's speed does not depend on the values; random data of big GEMMs is slow to make)."""
    a = torch.ones(spec.m, spec.a.ld, dtype=dtype)[:, :spec.k] if spec.a.trans == "N" \
        else torch.ones(spec.k, spec.a.ld, dtype=dtype)[:, :spec.m].T
    b = torch.ones(spec.k, spec.b.ld, dtype=dtype)[:, :spec.n] if spec.b.trans == "N" \
        else torch.ones(spec.n, spec.b.ld, dtype=dtype)[:, :spec.k].T
    return a, b


def _micro_runner(spec: GemmSpec, micro: MicroGemm) -> Callable[[], None]:
    """One GEMM of ``spec``'s shape (one batch entry) with kiln's GEMM."""
    a, b = _operands(spec, torch.float32)
    c = torch.empty(spec.m, spec.n)
    if spec.packed_b:
        b = torch.ones(packed_shape(spec.k, spec.n))

    def run() -> None:
        micro.gemm(spec.m, spec.n, spec.k, a.data_ptr(), a.stride(0), a.stride(1), b.data_ptr(),
                   0 if spec.packed_b else b.stride(0), 0 if spec.packed_b else b.stride(1), spec.packed_b,
                   c.data_ptr(), max(spec.n, 1))
    return run


def _blas_runner(spec: GemmSpec, provider: BlasProvider) -> Callable[[], None]:
    """One GEMM of ``spec``'s shape (one batch entry) with ``provider``."""
    index_c = _INDEX[provider.name][1]
    scalar = ctypes.c_float if spec.dtype == DType.float32 else ctypes.c_double
    pointer = ctypes.POINTER(index_c)
    fn = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, pointer, pointer, pointer, ctypes.c_void_p,
                          ctypes.c_void_p, pointer, ctypes.c_void_p, pointer, ctypes.c_void_p, ctypes.c_void_p,
                          pointer)(provider.sgemm if spec.dtype == DType.float32 else provider.dgemm)
    a, b = _operands(spec, torch.float32 if spec.dtype == DType.float32 else torch.float64)
    c = torch.empty(max(spec.m * spec.n, 1), dtype=a.dtype)
    m, n, k = index_c(spec.n), index_c(spec.m), index_c(spec.k)
    lda, ldb, ldc = index_c(spec.b.ld), index_c(spec.a.ld), index_c(max(spec.n, 1))
    one, zero = scalar(1), scalar(0)

    def run() -> None:
        fn(spec.b.trans.encode(), spec.a.trans.encode(), m, n, k, ctypes.addressof(one), b.data_ptr(), lda,
           a.data_ptr(), ldb, ctypes.addressof(zero), c.data_ptr(), ldc)

    return run


def size_c_expr(e, order: dict[str, int]) -> str:
    """The C text of a loop-IR integer expression of size parameters (``size_<n>``, read from
    the size table ``S`` at ``order[n]``), sums, products and floor divisions by constants."""
    from kiln.ir.loops.expr import SIZE_PREFIX, Binary, Const, Var  # noqa: PLC0415

    if isinstance(e, Const):
        return f"{int(e.value)}L"
    if isinstance(e, Var) and e.name.startswith(SIZE_PREFIX):
        return f"S[{order[e.name[len(SIZE_PREFIX):]]}]"
    if isinstance(e, Binary) and e.op in ("+", "*"):
        return f"({size_c_expr(e.lhs, order)} {e.op} {size_c_expr(e.rhs, order)})"
    if isinstance(e, Binary) and e.op == "floordiv" and isinstance(e.rhs, Const) and int(e.rhs.value) > 0:
        return f"({size_c_expr(e.lhs, order)} / {size_c_expr(e.rhs, order)})"  # sizes are positive
    raise ValueError(f"size expression {e} has no C form here")


__all__ = ["GEMV_MAX_M", "GEMV_TUNE_MIN_FLOPS", "KILN_PROVIDER", "PARALLEL_BATCH_MAX_FLOPS", "PROVIDERS", "TUNE_MIN_FLOPS", "TUNE_SECONDS", "BlasProvider",
           "GemmSpec", "GemmTuner", "Operand", "blas_prelude",
           "blas_providers", "blas_symbols", "gemm_function", "gemm_spec", "set_blas_threads"]
