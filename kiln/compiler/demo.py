"""``python -m kiln`` / ``kiln-demo``: compile two small built-in models and report.

For each model (an MLP and a GPT-2-style transformer block, both defined here, seeded
random weights) it compiles with :func:`kiln.compile`, checks the result against PyTorch
eager (max absolute and relative error) and times both (median over ``--runs`` calls).
The default backend is the native ``cpu`` backend (generated C with OpenMP and library
GEMMs); ``--backend reference`` runs the numpy reference executor, which is built to be
obviously correct, not fast.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kiln.backends import DEFAULT_BACKEND, available_backends
from kiln.runtime.timing import best_time


class DemoMLP(nn.Module):
    """256 -> 512 -> 512 -> 10 with GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(256, 512)
        self.fc2 = nn.Linear(512, 512)
        self.head = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(self.fc1(x))
        x = nn.functional.gelu(self.fc2(x))
        return self.head(x)


class DemoBlock(nn.Module):
    """One pre-norm GPT-2 block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, dim: int = 128, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        attn = scores.softmax(dim=-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def _models() -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    mlp = DemoMLP().eval()
    block = DemoBlock().eval()
    gen = torch.Generator().manual_seed(1)
    return [
        ("mlp", mlp, (torch.randn(32, 256, generator=gen),)),
        ("transformer block", block, (torch.randn(2, 32, 128, generator=gen),)),
    ]


def _median_ms(fn: Callable[[], Any], runs: int) -> float:
    """The median of ``runs`` timed calls after one warm-up call, in milliseconds."""
    return best_time(fn, repeat=runs, warmup=1, statistic="median") * 1e3


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    diff = (got.double() - want.double()).abs().max().item()
    return diff, diff / max(want.double().abs().max().item(), 1e-30)


def run(backend: str = DEFAULT_BACKEND, runs: int = 20, out: Any = None) -> list[dict[str, Any]]:
    """Compile, check and time the demo models; print the table to ``out``; return its rows."""
    import kiln

    out = out or sys.stdout
    rows = []
    for name, model, args in _models():
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", kiln.KilnFallbackWarning)
            compiled = kiln.compile(model, args, backend=backend)
        compile_s = time.perf_counter() - start
        with torch.no_grad():
            want = model(*args)
            abs_err, rel_err = _errors(compiled(*args), want)
            eager_ms = _median_ms(lambda: model(*args), runs)
        kiln_ms = _median_ms(lambda: compiled(*args), runs)
        stats = compiled.stats
        rows.append({"model": name, "nodes": stats["nodes"], "abs_err": abs_err, "rel_err": rel_err,
                     "eager_ms": eager_ms, "kiln_ms": kiln_ms, "compile_s": compile_s,
                     "torch_ops": sum(stats["fallback_ops"].values()), "warnings": len(caught)})
    _print_table(rows, backend, runs, out)
    return rows


def _print_table(rows: Sequence[dict[str, Any]], backend: str, runs: int, out: Any) -> None:
    import kiln

    print(f"kiln {kiln.__version__}: backend '{backend}' vs PyTorch {torch.__version__} eager, "
          f"float32, CPU, median of {runs} runs", file=out)
    header = (f"{'model':<18} {'kiln nodes':>10} {'max abs err':>12} {'max rel err':>12} "
              f"{'eager ms':>9} {'kiln ms':>9}  kiln vs eager")
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        ratio = r["kiln_ms"] / max(r["eager_ms"], 1e-9)
        speed = f"{ratio:.1f}x slower" if ratio >= 1 else f"{1 / ratio:.1f}x faster"
        print(f"{r['model']:<18} {r['nodes']:>10} {r['abs_err']:>12.2e} {r['rel_err']:>12.2e} "
              f"{r['eager_ms']:>9.2f} {r['kiln_ms']:>9.2f}  {speed}", file=out)
    fallback = [r["model"] for r in rows if r["torch_ops"]]
    if fallback:
        print(f"Ops kiln does not support ran in PyTorch for: {', '.join(fallback)}.", file=out)
    if backend == "reference":
        print("The 'reference' backend runs each op with numpy to define what is correct; it is "
              "not built for speed and is expected to be slower than eager.", file=out)
    print(f"Backends available: {', '.join(available_backends())}.", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (``python -m kiln``, ``kiln-demo``)."""
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=DEFAULT_BACKEND, choices=available_backends())
    parser.add_argument("--runs", type=int, default=20, help="timed calls per model (median)")
    args = parser.parse_args(argv)
    # torch.export deep-copies pytree specs and trips torch's own LeafSpec deprecation notice.
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec")
    rows = run(args.backend, max(1, args.runs))
    worst = max(r["rel_err"] for r in rows)
    if worst > 1e-4:
        print(f"FAILED: relative error {worst:.2e} exceeds 1e-4", file=sys.stderr)
        return 1
    return 0
