"""PolyBench-style kernels (C files next to this one), their small test sizes and inputs."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

import kiln.loops as kl
from kiln.ir.loops.interp import buffer_shape

HERE = Path(__file__).parent

# Small sizes: brute force enumerates every instance pair, and the test suite must stay fast.
PARAMS: dict[str, dict[str, int | float]] = {
    "gemm": dict(NI=4, NJ=5, NK=3, alpha=1.5, beta=1.2),
    "2mm": dict(NI=3, NJ=4, NK=3, NL=4, alpha=1.5, beta=1.2),
    "atax": dict(M=4, N=5),
    "bicg": dict(M=5, N=4),
    "mvt": dict(N=5),
    "syrk": dict(N=5, M=3, alpha=1.5, beta=1.2),
    "trmm": dict(M=5, N=4, alpha=1.5),
    "lu": dict(N=5),
    "cholesky": dict(N=5),
    "jacobi-1d": dict(T=3, N=8),
    "jacobi-2d": dict(T=2, N=6),
    "seidel-2d": dict(T=2, N=6),
    "heat-3d": dict(T=2, N=5),
    "fdtd-2d": dict(TMAX=2, NX=4, NY=5),
    "floyd-warshall": dict(N=5),
    "conv2d": dict(H=6, W=7),
    "prefix-sum": dict(N=4, M=6),
    "blur": dict(N=7),
}
KERNELS = tuple(PARAMS)


def source(name: str) -> str:
    return (HERE / f"{name}.c").read_text()


@lru_cache(maxsize=None)
def load(name: str) -> kl.Program:
    ident = name.replace("-", "_")
    return kl.from_c(source(name), name=ident if not ident[0].isdigit() else "k" + ident)


def sizes(program: kl.Program, params: dict) -> dict[str, int]:
    return {p.name: int(params[p.name]) for p in program.params if p.dtype.is_integer}


def inputs(name: str, program: kl.Program, params: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random arrays for every global buffer; well-conditioned matrices for lu and cholesky."""
    rng = np.random.default_rng(seed)
    s = sizes(program, params)
    out = {b.name: rng.random(buffer_shape(program, b.name, s)).astype(b.dtype.numpy)
           for b in program.buffers if b.scope == "global"}
    if name in ("lu", "cholesky"):
        a = out["A"]
        out["A"] = a @ a.T + a.shape[0] * np.eye(a.shape[0])
    return out
