"""JAX workloads: ``jax.jit`` (XLA on the CPU) beside ``kiln.jax.jit``.

``python -m benchmarks.jax_bench`` runs three models written in ``jax.numpy`` / ``jax.lax``
-- an MLP, a transformer block (causal self-attention, layer norm, GELU) and a small CNN --
forward, on 2 threads (``--threads``), and prints a markdown table: the median time per call
of each system, the ratio ``jax / kiln`` (> 1: kiln is faster) and its geometric mean.

Both systems are compiled and checked against each other first (max relative error of the
outputs).  Timing is interleaved: ``--rounds`` rounds, in each of which every system takes
one turn of ``--repeat`` calls, timed one call at a time with
:func:`kiln.tuning.measure.best_time` (median); per system the round with the lowest median
is kept.  The models are also the ones ``tests/test_jax_models.py`` checks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


# ------------------------------------------------------------------------------ models
def mlp(params: dict[str, Any], x: Any) -> Any:
    """Three dense layers, GELU between them."""
    import jax

    h = x
    for i in range(len(params) // 2):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < len(params) // 2 - 1:
            h = jax.nn.gelu(h)
    return h


def layer_norm(x: Any, scale: Any, bias: Any, eps: float = 1e-5) -> Any:
    import jax.numpy as jnp

    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * (1.0 / jnp.sqrt(var + eps)) * scale + bias


def transformer_block(params: dict[str, Any], x: Any, heads: int = 4) -> Any:
    """A pre-norm GPT block: causal multi-head self-attention, then a GELU MLP."""
    import jax
    import jax.numpy as jnp

    b, t, d = x.shape
    h = layer_norm(x, params["ln1_g"], params["ln1_b"])
    qkv = h @ params["w_qkv"] + params["b_qkv"]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q, k, v = (z.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for z in (q, k, v))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, -1e9)
    attn = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bhkd->bhqd", attn, v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + out @ params["w_o"] + params["b_o"]
    h = layer_norm(x, params["ln2_g"], params["ln2_b"])
    h = jax.nn.gelu(h @ params["w_fc"] + params["b_fc"], approximate=False)
    return x + h @ params["w_proj"] + params["b_proj"]


def cnn(params: dict[str, Any], x: Any) -> Any:
    """Two 3x3 convolutions (the second strided), ReLU, global average pooling, a dense head."""
    import jax
    from jax import lax

    dims = ("NHWC", "HWIO", "NHWC")
    h = lax.conv_general_dilated(x, params["c1"], (1, 1), "SAME", dimension_numbers=dims)
    h = jax.nn.relu(h + params["c1_b"])
    h = lax.conv_general_dilated(h, params["c2"], (2, 2), "SAME", dimension_numbers=dims)
    h = jax.nn.relu(h + params["c2_b"])
    return h.mean(axis=(1, 2)) @ params["fc"] + params["fc_b"]


def _normal(rng: np.random.Generator, shape: Sequence[int], scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mlp_setup(rng: np.random.Generator, batch: int = 64, sizes: Sequence[int] = (256, 512, 512, 10)):
    params = {}
    for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"w{i}"] = _normal(rng, (m, n), 1 / math.sqrt(m))
        params[f"b{i}"] = _normal(rng, (n,), 0.1)
    return params, _normal(rng, (batch, sizes[0]), 1.0)


def transformer_setup(rng: np.random.Generator, batch: int = 2, seq: int = 64, d: int = 128):
    s = 1 / math.sqrt(d)
    params = {
        "ln1_g": 1 + _normal(rng, (d,), 0.1), "ln1_b": _normal(rng, (d,), 0.1),
        "w_qkv": _normal(rng, (d, 3 * d), s), "b_qkv": _normal(rng, (3 * d,), 0.1),
        "w_o": _normal(rng, (d, d), s), "b_o": _normal(rng, (d,), 0.1),
        "ln2_g": 1 + _normal(rng, (d,), 0.1), "ln2_b": _normal(rng, (d,), 0.1),
        "w_fc": _normal(rng, (d, 4 * d), s), "b_fc": _normal(rng, (4 * d,), 0.1),
        "w_proj": _normal(rng, (4 * d, d), 1 / math.sqrt(4 * d)), "b_proj": _normal(rng, (d,), 0.1),
    }
    return params, _normal(rng, (batch, seq, d), 1.0)


def cnn_setup(rng: np.random.Generator, batch: int = 8, size: int = 32, channels: Sequence[int] = (3, 16, 32),
              classes: int = 10):
    c0, c1, c2 = channels
    params = {
        "c1": _normal(rng, (3, 3, c0, c1), 1 / math.sqrt(9 * c0)), "c1_b": _normal(rng, (c1,), 0.1),
        "c2": _normal(rng, (3, 3, c1, c2), 1 / math.sqrt(9 * c1)), "c2_b": _normal(rng, (c2,), 0.1),
        "fc": _normal(rng, (c2, classes), 1 / math.sqrt(c2)), "fc_b": _normal(rng, (classes,), 0.1),
    }
    return params, _normal(rng, (batch, size, size, c0), 1.0)


WORKLOADS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "mlp": (mlp, mlp_setup),
    "transformer-block": (transformer_block, transformer_setup),
    "cnn": (cnn, cnn_setup),
}
"""name -> (model function ``f(params, x)``, setup ``(rng, **sizes) -> (params, x)``)."""


# ------------------------------------------------------------------------------ timing
def _max_rel_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def bench(names: Sequence[str], rounds: int, repeat: int, backend: str) -> list[dict[str, Any]]:
    import jax

    import kiln.jax
    from kiln.tuning.measure import best_time

    rows = []
    for name in names:
        fn, setup = WORKLOADS[name]
        params, x = setup(np.random.default_rng(0))
        params = jax.tree_util.tree_map(jax.numpy.asarray, params)
        x = jax.numpy.asarray(x)
        systems: dict[str, Callable[[], Any]] = {}
        xla = jax.jit(fn)
        ours = kiln.jax.jit(fn, backend=backend)
        want = xla(params, x).block_until_ready()
        error = _max_rel_error(ours(params, x), want)
        systems["jax.jit"] = lambda: xla(params, x).block_until_ready()
        systems["kiln.jax.jit"] = lambda: ours(params, x)
        best = {s: math.inf for s in systems}
        for r in range(rounds):
            order = list(systems)[r % len(systems):] + list(systems)[:r % len(systems)]
            for system in order:
                median = best_time(systems[system], repeat=repeat, warmup=2, statistic="median")
                best[system] = min(best[system], median)
        rows.append({"workload": name, "jax_ms": best["jax.jit"] * 1e3,
                     "kiln_ms": best["kiln.jax.jit"] * 1e3,
                     "ratio": best["jax.jit"] / best["kiln.jax.jit"], "error": error})
    return rows


def table(rows: Sequence[dict[str, Any]], threads: int) -> str:
    lines = [f"| workload ({threads} threads) | jax.jit (XLA) ms | kiln.jax.jit ms | jax / kiln | max rel. error |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['workload']} | {row['jax_ms']:.3f} | {row['kiln_ms']:.3f} | "
                     f"{row['ratio']:.2f}x | {row['error']:.1e} |")
    geomean = math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows))
    lines.append(f"| geomean | | | {geomean:.2f}x | |")
    return "\n".join(lines)


def _restart_with_threads(threads: int, argv: Sequence[str]) -> None:
    """Re-run in a process whose BLAS, OpenMP and XLA thread counts are ``threads`` (they are
    read once, when the libraries load)."""
    env = dict(os.environ)
    env.update({name: str(threads) for name in THREAD_VARIABLES})
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=true "
                        f"intra_op_parallelism_threads={threads}").strip()
    env["KILN_JAX_BENCH_THREADS"] = str(threads)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.jax_bench", *argv], env)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.jax_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per turn")
    parser.add_argument("--backend", default="cpu", help="kiln backend")
    args = parser.parse_args(argv)
    if os.environ.get("KILN_JAX_BENCH_THREADS") != str(args.threads):
        _restart_with_threads(args.threads, argv)
    import torch

    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    print(table(bench(names, args.rounds, args.repeat, args.backend), args.threads))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
