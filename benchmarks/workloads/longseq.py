"""Long sequences: :class:`~benchmarks.workloads.vision.LongViT` at 16K tokens on the CPU, its
peak memory with kiln's fused attention against eager PyTorch, and its sequence-parallel
schedule on two gloo processes.

::

    python -m benchmarks.workloads.longseq                  # 16384 tokens (a 1024x1024 image, 8x8 patches)
    python -m benchmarks.workloads.longseq --tokens 4096 --sequence-parallel

Every variant runs in a fresh interpreter (``--child``), so one variant's freed memory cannot
hide another's peak.  A child builds its model and inputs, compiles where it must, then
resets the kernel's peak-RSS counter (``/proc/self/clear_refs``; ``ru_maxrss`` where that is
refused) and makes the first call: **peak RSS growth** is the high-water mark of that call
above the resident size before it (arena, workspace and output allocation included).  The
time is :func:`kiln.runtime.timing.best_time` of later calls.

Variants, whole model (``model:``) and the attention op alone on random ``q, k, v``
``[1, heads, S, width/heads]`` (``attn:``):

* ``kiln``: ``kiln.compile(..., backend="cpu", strict=True)`` with ``KILN_NATIVE_KERNELS=1``,
  which makes the cpu backend's attention library call use kiln's tiled online-softmax kernel
  (:mod:`kiln.backends.cpu.attention`) instead of timing it against torch's SDPA;
* ``kiln-auto``: the same compile without that variable: the backend's
  :class:`~kiln.backends.cpu.standalone.KernelChooser` times both kernels at this shape and
  keeps the faster (the table's ``kernel`` column says which it kept);
* ``eager-sdpa``: the module in PyTorch, ``torch.nn.functional.scaled_dot_product_attention``;
* ``eager-naive``: the module with :class:`NaiveAttention`,
  ``softmax(q @ k^T * scale) @ v``, which materializes the ``S x S`` scores.

The ``S x S`` column is the float32 score matrix of all heads, ``batch * heads * S * S * 4``
bytes; ``ratio`` is peak growth over it.  A naive row runs at fewer tokens when the machine's
available memory could not hold three score matrices (the table says so).

:func:`sequence_parallel_rank` is the two-process check: LongViT's blocks as a
sequence-parallel region (each rank holds half the tokens; each :class:`SDPA` attention
exchanges ``q, k, v`` to the full sequence and half the heads), eagerly and compiled by kiln
per rank, against the one-process output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.workloads.vision import LongViT

PATCH = 8
MIB = 2 ** 20
MODEL_VARIANTS = ("kiln", "kiln-auto", "eager-sdpa", "eager-naive")
ATTENTION_VARIANTS = ("kiln", "eager-sdpa", "eager-naive")
KILN_KERNEL = "kiln fused attention"
TORCH_KERNEL = "torch.nn.functional.scaled_dot_product_attention"


class NaiveAttention(nn.Module):
    """``softmax(q @ k^T / sqrt(d)) @ v``, the whole score matrix at once."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return naive_attention(q, k, v)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) @ v


def image_size(tokens: int) -> int:
    """The image side giving ``tokens`` patches of :data:`PATCH` pixels (a square grid)."""
    grid = math.isqrt(tokens)
    if grid * grid != tokens:
        raise ValueError(f"LongViT needs a square token grid; {tokens} is not a square")
    return grid * PATCH


def make_model(tokens: int, width: int = 64, heads: int = 4, depth: int = 1, naive: bool = False) -> LongViT:
    """A seeded LongViT with ``tokens`` tokens (``naive``: :class:`NaiveAttention` blocks)."""
    torch.manual_seed(0)
    model = LongViT(image_size(tokens), PATCH, width=width, depth=depth, heads=heads).eval()
    if naive:
        for block in model.blocks:
            block.attn = NaiveAttention()
    return model


def make_images(tokens: int, batch: int = 1) -> torch.Tensor:
    side = image_size(tokens)
    return torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(1))


def score_bytes(tokens: int, heads: int, batch: int = 1) -> int:
    """Bytes of the float32 ``S x S`` scores of every head."""
    return batch * heads * tokens * tokens * 4


def kernel_scratch_bytes(tokens: int, head_dim: int, threads: int | None = None) -> int:
    """The per-call scratch of kiln's fused attention kernel for ``tokens`` keys: per thread
    the packed query tile, the packed keys of one head, the tile's accumulator, and the
    score and probability blocks and row statistics on the stack (the allocations of
    :data:`kiln.backends.cpu.attention.SOURCE`)."""
    from kiln.backends.cpu.attention import KEY_BLOCK, QUERY_TILE
    threads = threads or max(1, torch.get_num_threads())
    e = max(head_dim, 1)
    acc_width = (head_dim + 15) // 16 * 16
    floats = (QUERY_TILE * e + ((tokens + 15) // 16 + 1) * 16 * e + QUERY_TILE * acc_width + 16
              + 2 * 6 * KEY_BLOCK + 2 * QUERY_TILE)
    return threads * floats * 4


def attention_kernels(compiled: Any) -> list[str]:
    """Which attention implementation each ``scaled_dot_product_attention`` step of a
    cpu-compiled module runs: ``"kiln"`` (kiln's fused kernel) or ``"torch"`` (torch's SDPA)."""
    found = []
    for step in compiled.executable.plan.steps:
        label = getattr(step, "label", "")
        if "scaled_dot_product_attention" in label:
            found.append("kiln" if KILN_KERNEL in label else "torch" if TORCH_KERNEL in label else label)
    return found


# ---------------------------------------------------------------------------- memory


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_growth(call) -> tuple[Any, int, str]:
    """``call()``'s result, its peak resident-memory growth in bytes, and how it was read."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _status_kib("VmRSS")
        method = "VmHWM"
    except OSError:
        before = None
    if before is None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        method = "ru_maxrss"
    out = call()
    after = _status_kib("VmHWM") if method == "VmHWM" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out, max(0, after - before) * 1024, method


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------- one variant


def measure(kind: str, variant: str, tokens: int, width: int, heads: int, depth: int, repeat: int) -> dict:
    """Run one variant in this process (``--child``) and return its row."""
    from kiln.runtime.timing import best_time

    row: dict[str, Any] = {"kind": kind, "variant": variant, "tokens": tokens, "threads": torch.get_num_threads()}
    head_dim = width // heads
    with torch.inference_mode():
        if kind == "attn":
            g = torch.Generator().manual_seed(2)
            q, k, v = (torch.randn(1, heads, tokens, head_dim, generator=g) for _ in range(3))
            if variant == "kiln":
                from kiln.backends.cpu.attention import attention
                call = lambda: attention(q, k, v)  # noqa: E731
                row["kernel"] = "kiln"
            elif variant == "eager-sdpa":
                call = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
                row["kernel"] = "torch"
            else:
                call = lambda: naive_attention(q, k, v)  # noqa: E731
                row["kernel"] = "naive"
        else:
            model = make_model(tokens, width, heads, depth, naive=variant == "eager-naive")
            images = make_images(tokens)
            if variant.startswith("kiln"):
                import kiln
                start = datetime.datetime.now()
                compiled = kiln.compile(model, (images,), backend="cpu", strict=True)
                row["compile_s"] = (datetime.datetime.now() - start).total_seconds()
                kernels = attention_kernels(compiled)
                row["kernel"] = ",".join(sorted(set(kernels)))
                row["arena_bytes"] = int(compiled.executable.plan.arena_bytes)
                row["memory_plan"] = compiled.executable.info["memory"]
                row["scratch_bytes"] = kernel_scratch_bytes(tokens, head_dim) if "kiln" in kernels else 0
                call = lambda: compiled(images)  # noqa: E731
            else:
                row["kernel"] = "naive" if variant == "eager-naive" else "torch"
                call = lambda: model(images)  # noqa: E731
        if kind == "attn" and variant == "kiln":
            row["scratch_bytes"] = kernel_scratch_bytes(tokens, head_dim)
        _, row["peak_bytes"], row["peak_method"] = peak_growth(call)
        row["time_s"] = best_time(call, repeat=repeat, warmup=0)
    row["score_bytes"] = score_bytes(tokens, heads)
    return row


def run_child(kind: str, variant: str, tokens: int, args: argparse.Namespace) -> dict:
    """:func:`measure` in a fresh interpreter; ``variant == "kiln"`` forces kiln's kernel."""
    env = dict(os.environ)
    env.pop("KILN_NATIVE_KERNELS", None)
    if variant == "kiln":
        env["KILN_NATIVE_KERNELS"] = "1"
    command = [sys.executable, "-m", "benchmarks.workloads.longseq", "--child", f"{kind}:{variant}",
               "--tokens", str(tokens), "--width", str(args.width), "--heads", str(args.heads),
               "--depth", str(args.depth), "--repeat", str(args.repeat)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root)
    if done.returncode:
        return {"kind": kind, "variant": variant, "tokens": tokens, "error": done.stderr.strip()[-400:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def naive_tokens(tokens: int, heads: int, square: bool) -> int:
    """``tokens`` when three score matrices fit in the available memory, else the largest
    token count that fits (a square grid for the model)."""
    avail = available_bytes()
    if avail is None or 3 * score_bytes(tokens, heads) <= avail:
        return tokens
    fit = int(math.sqrt(avail / (3 * 4 * heads)))
    return (math.isqrt(fit) ** 2) if square else fit // 1024 * 1024


# ---------------------------------------------------------------------------- sequence parallel


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sequence_parallel_schedule(model: nn.Module, world: int, rank: int):
    """LongViT's blocks as a Ulysses region: the block stack's input is sliced along the
    tokens and its output gathered, every :class:`~benchmarks.workloads.vision.SDPA` inside
    is a sequence-parallel core attention, and the gradients of the blocks' parameters are
    summed over the ranks."""
    import kiln
    from .vision import SDPA
    sch = kiln.schedule(model, world_size=world, rank=rank)
    sch["blocks"].sequence_parallel(attention=SDPA)
    return sch


def sequence_parallel_rank(rank: int, world: int, port: int, tokens: int, batch: int, depth: int,
                           compile_too: bool, results: Any = None) -> dict:
    """One rank of the two-process check (the function ``torch.multiprocessing`` starts):
    the one-process output, the sequence-parallel output eagerly and compiled by kiln (cpu
    backend, kiln's attention kernel forced), their relative errors, the shapes the blocks
    and the attention saw (``attention_q``: what the attention module is given;
    ``compiled_attention_q``: the attention op's query after the exchange), and the
    compiled graph's collectives.  Raises on a mismatch
    above 1e-4; puts the report in ``results`` (a queue) when given."""
    import torch.distributed as dist
    os.environ["KILN_NATIVE_KERNELS"] = "1"
    torch.set_num_threads(1)  # one thread per rank: the ranks share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        import kiln
        from kiln.runtime.timing import best_time
        model = make_model(tokens, depth=depth)
        images = make_images(tokens, batch)
        with torch.inference_mode():
            want = model(images)
        weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
        (model(images) * weight).sum().backward()
        want_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        built = sequence_parallel_schedule(model, world, rank).build()
        seen: dict[str, tuple[int, ...]] = {}

        def record(name: str):
            def hook(module: nn.Module, inputs: tuple) -> None:
                seen.setdefault(name, tuple(inputs[0].shape))
            return hook
        hooks = [built.blocks[0].norm1.register_forward_pre_hook(record("block_input")),
                 built.blocks[0].attn.register_forward_pre_hook(record("attention_q"))]
        with torch.inference_mode():
            got = built(images)
        for h in hooks:
            h.remove()
        rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
        report: dict[str, Any] = {"rank": rank, "eager_rel": rel(got, want), "shapes": seen}
        (built(images) * weight).sum().backward()  # the blocks' gradients are summed over the ranks
        report["grad_rel"] = max(rel(p.grad, want_grads[name]) for name, p in built.named_parameters())
        built.zero_grad(set_to_none=True)
        if compile_too:
            compiled = kiln.compile(built, (images,), backend="cpu", strict=True)
            with torch.no_grad():
                report["compiled_rel"] = rel(compiled(images), want)
                report["time_s"] = best_time(lambda: compiled(images), repeat=2, warmup=0)
            hist = compiled.executable.graph.op_histogram()
            report["collectives"] = {op: hist.get(op, 0) for op in ("reduce_scatter", "all_to_all", "all_gather")}
            report["kernels"] = attention_kernels(compiled)
            report["shapes"]["compiled_attention_q"] = next(
                tuple(n.inputs[0].shape) for n in compiled.executable.graph.nodes
                if n.op_name == "scaled_dot_product_attention")
        worst = max(report["eager_rel"], report["grad_rel"], report.get("compiled_rel", 0.0))
        if worst > 1e-4:
            raise AssertionError(f"rank {rank}: sequence-parallel output differs from one process: {report}")
        if results is not None:
            results.put(report)
        dist.barrier()
        return report
    finally:
        dist.destroy_process_group()


def run_sequence_parallel(tokens: int, batch: int = 1, depth: int = 2, compile_too: bool = True,
                          world: int = 2) -> list[dict]:
    """:func:`sequence_parallel_rank` on ``world`` local gloo processes; the ranks' reports."""
    import multiprocessing

    import torch.multiprocessing as mp
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(sequence_parallel_rank, args=(world, free_port(), tokens, batch, depth, compile_too,
                                                     results), nprocs=world, join=True, start_method="spawn")
    reports = [results.get(timeout=10) for _ in range(world)]
    return sorted(reports, key=lambda r: r["rank"])


# ---------------------------------------------------------------------------- table


def table(rows: list[dict]) -> str:
    head = (f"| {'variant':<18} | {'tokens':>6} | {'kernel':<6} | {'time s':>7} | {'peak RSS growth MB':>18} "
            f"| {'S x S MB':>8} | {'ratio':>8} | {'planned arena MB':>16} | {'kernel scratch MB':>17} |")
    lines = [head, "|" + "|".join("-" * (len(c) + 0) for c in head.split("|")[1:-1]) + "|"]
    for r in rows:
        name = f"{r['kind']}: {r['variant']}"
        if "error" in r:
            lines.append(f"| {name:<18} | {r['tokens']:>6} | failed: {r['error'][-120:]}")
            continue
        ratio = r["peak_bytes"] / r["score_bytes"]
        shown = f"{ratio:.2f}x" if ratio >= 0.5 else f"1/{1 / ratio:.0f}" if ratio > 0 else "0"
        arena = f"{r['arena_bytes'] / MIB:.1f}" if "arena_bytes" in r else "-"
        scratch = f"{r['scratch_bytes'] / MIB:.2f}" if r.get("scratch_bytes") else "-"
        lines.append(f"| {name:<18} | {r['tokens']:>6} | {r['kernel']:<6} | {r['time_s']:>7.2f} "
                     f"| {r['peak_bytes'] / MIB:>18.1f} | {r['score_bytes'] / MIB:>8.0f} | {shown:>8} "
                     f"| {arena:>16} | {scratch:>17} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.workloads.longseq", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="sequence length (a square; default 16384)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2, help="best_time rounds per variant")
    p.add_argument("--threads", type=int, default=None, help="torch (and kiln kernel) threads (default: torch's)")
    p.add_argument("--naive-tokens", type=int, default=None,
                   help="tokens of the naive rows (default: --tokens when memory allows)")
    p.add_argument("--only", default=None, help="comma-separated kind:variant list, e.g. model:kiln,attn:kiln "
                   "('none': no table, with --sequence-parallel)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also run the 2-process gloo check at --sp-tokens")
    p.add_argument("--sp-tokens", type=int, default=4096)
    p.add_argument("--sp-batch", type=int, default=1, help="batch of the sequence-parallel check")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        kind, variant = args.child.split(":")
        print(json.dumps(measure(kind, variant, args.tokens, args.width, args.heads, args.depth, args.repeat)))
        return 0
    wanted = [("model", v) for v in MODEL_VARIANTS] + [("attn", v) for v in ATTENTION_VARIANTS]
    if args.only:
        wanted = [] if args.only == "none" else [tuple(item.split(":")) for item in args.only.split(",")]
    print(f"# LongViT width {args.width}, {args.heads} heads, depth {args.depth}, batch 1, float32, "
          f"{torch.get_num_threads()} threads, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    rows = []
    for kind, variant in wanted:
        tokens = args.tokens
        if variant == "eager-naive":
            tokens = args.naive_tokens or naive_tokens(args.tokens, args.heads, square=kind == "model")
        row = run_child(kind, variant, tokens, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if rows:
        print()
        print(table(rows))
    if args.sequence_parallel:
        reports = run_sequence_parallel(args.sp_tokens, batch=args.sp_batch)
        print()
        for r in reports:
            print(f"sequence parallel, {args.sp_tokens} tokens, batch {args.sp_batch}, depth 2, rank {r['rank']}: eager rel err {r['eager_rel']:.1e}, gradient rel err {r['grad_rel']:.1e}, "
                  f"compiled rel err {r.get('compiled_rel', float('nan')):.1e}, shapes {r['shapes']}, "
                  f"collectives {r.get('collectives')}, attention kernels {r.get('kernels')}, "
                  f"time {r.get('time_s', float('nan')):.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
