"""Model-level schedules on CPU: kiln's checkpointing (remat) and tensor parallelism.

::

    python -m benchmarks.schedules remat        # one process: GPT-2 step, plain vs checkpointed blocks
    python -m benchmarks.schedules tp           # two gloo processes: tensor-parallel GPT-2 steps

``remat``: a GPT-2 training step compiled by ``kiln.schedule.compile_train`` (cpu backend),
without and with ``.checkpoint()`` on every block (which turns on kiln's ``remat`` pass):
the planned peak of the step's memory arena (``step.stats["planned_peak_bytes"]``) and the
step time (``best_time``, median of rounds).

``tp``: the same model with transformers' ``Conv1D`` layers replaced by equal
``nn.Linear`` layers, on 2 processes with one thread each:

* ``kiln TP``: the Megatron schedule of :func:`tensor_parallel` run eagerly;
* ``kiln TP + checkpoint + compile``: the same schedule with checkpointed blocks, compiled
  by ``kiln.schedule.compile_train`` as one graph (collectives as IR ops, remat on);
* ``torch TP``: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ``ColwiseParallel``/``RowwiseParallel`` on the same four linears per block, eager.
  (It splits the fused q/k/v projection as one matrix, not per q/k/v as the kiln schedule
  does, so its attention mixes heads: the same FLOPs and communication, for timing only.)

Each figure is the median step time of the ranks' ``best_time`` rounds, on whatever else
the machine runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from kiln.runtime.timing import best_time


def gpt2(layers: int, width: int, vocab: int = 512, positions: int = 256):
    import transformers
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def lm_loss(out, target):
    return nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    return ids, torch.roll(ids, -1, dims=1)


def to_linear(conv: nn.Module) -> nn.Linear:
    """A transformers ``Conv1D`` (weight ``[in, out]``) as the equal ``nn.Linear``."""
    fan_in, fan_out = conv.weight.shape
    lin = nn.Linear(fan_in, fan_out)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    return lin


def tensor_parallel(sch, world: int, *, checkpoint: bool = False):
    """The Megatron schedule on a GPT-2 whose projections are ``nn.Linear``."""
    for block in sch.find(r"transformer\.h\.\d+"):
        attn, mlp = block["attn"], block["mlp"]
        attn["c_attn"].shard("weight", 0, groups=3).shard("bias", 0, groups=3).sync("bwd_post", "all_reduce")
        attn.module.split_size //= world
        attn["c_proj"].shard("weight", 1).sync("fwd_post", "all_reduce")
        mlp["c_fc"].shard("weight", 0).shard("bias", 0).sync("bwd_post", "all_reduce")
        mlp["c_proj"].shard("weight", 1).sync("fwd_post", "all_reduce")
        if checkpoint:
            block.checkpoint()
    return sch


def linear_gpt2(args):
    from transformers.pytorch_utils import Conv1D
    model = gpt2(args.layers, args.width)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                setattr(parent, name, to_linear(child))
    return model


def eager_step(model, opt, ids, target):
    def step():
        loss = lm_loss(model(ids), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


# ---------------------------------------------------------------------------- remat
def run_remat(args) -> dict:
    import kiln
    ids, target = batch(args)
    results = {}
    for name, checkpoint in (("plain", False), ("checkpointed blocks", True)):
        sch = kiln.schedule(gpt2(args.layers, args.width))
        if checkpoint:
            for block in sch.find(r"transformer\.h\.\d+"):
                block.checkpoint()
        model, opt = sch.build(optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
        step = kiln.schedule.compile_train(model, lm_loss, opt, (ids, target))
        seconds = best_time(lambda: step(ids, target), repeat=args.repeat, warmup=1, statistic="median")
        results[name] = {"planned_peak_MiB": step.stats["planned_peak_bytes"] / 2**20,
                         "step_ms": seconds * 1e3, "remat": step.remat,
                         "recomputed_nodes": step.stats.get("recomputed_nodes", 0)}
    plain, ckpt = results["plain"], results["checkpointed blocks"]
    results["peak_reduction"] = 1 - ckpt["planned_peak_MiB"] / plain["planned_peak_MiB"]
    results["time_increase"] = ckpt["step_ms"] / plain["step_ms"] - 1
    for name, checkpoint in (("eager plain", False), ("eager checkpointed blocks", True)):
        sch = kiln.schedule(gpt2(args.layers, args.width))
        if checkpoint:
            for block in sch.find(r"transformer\.h\.\d+"):
                block.checkpoint()
        model, opt = sch.build(optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
        saved = _saved_bytes(model, ids, target)
        seconds = best_time(eager_step(model, opt, ids, target), repeat=args.repeat, statistic="median")
        results[name] = {"saved_for_backward_MiB": saved / 2**20, "step_ms": seconds * 1e3}
    return results


def _saved_bytes(model, ids, target) -> int:
    """Bytes autograd keeps for the backward (torch.utils.checkpoint keeps only block inputs)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(ids), target)
    loss.backward()
    model.zero_grad()
    return total


# ---------------------------------------------------------------------------- tensor parallel
def _tp_worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        import kiln
        ids, target = batch(args)
        times = {}
        model, opt = tensor_parallel(kiln.schedule(linear_gpt2(args)), world).build(
            optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
        times["kiln TP (eager)"] = best_time(eager_step(model, opt, ids, target), repeat=args.repeat,
                                             statistic="median")
        model, opt = tensor_parallel(kiln.schedule(linear_gpt2(args)), world, checkpoint=True).build(
            optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
        step = kiln.schedule.compile_train(model, lm_loss, opt, (ids, target))
        times["kiln TP + checkpoint + compile"] = best_time(lambda: step(ids, target), repeat=args.repeat,
                                                           statistic="median")
        peak = step.stats["planned_peak_bytes"] / 2**20
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world,))
        ref = linear_gpt2(args)
        plan = {}
        for i in range(args.layers):
            plan.update({f"transformer.h.{i}.attn.c_attn": ColwiseParallel(),
                         f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                         f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                         f"transformer.h.{i}.mlp.c_proj": RowwiseParallel()})
            ref.transformer.h[i].attn.split_size //= world
        parallelize_module(ref, mesh, plan)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-3)
        times["torch TP (eager)"] = best_time(eager_step(ref, ref_opt, ids, target), repeat=args.repeat,
                                              statistic="median")
        gathered = [None] * world
        dist.all_gather_object(gathered, times)
        if rank == 0:
            merged = {k: sorted(t[k] for t in gathered)[len(gathered) // 2] * 1e3 for k in times}
            with open(out_path, "w") as f:
                json.dump({"step_ms": merged, "compiled_planned_peak_MiB": peak}, f)
    finally:
        dist.destroy_process_group()


def run_tp(args) -> dict:
    import tempfile
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "tp.json")
        mp.spawn(_tp_worker, args=(2, port, args, out), nprocs=2, join=True)
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("remat", "tp"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (remat; tp uses 1 per rank)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run_remat(args) if args.what == "remat" else run_tp(args)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
