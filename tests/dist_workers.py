"""Workers of the distributed schedule tests: run on each rank of a gloo group.

:func:`spawn` starts ``world`` processes with ``torch.multiprocessing`` on a free local
port; each initializes a gloo process group (with a timeout, so a hung collective fails
instead of hanging), runs the named checks of :data:`CHECKS` and destroys the group.
A failing assertion in any rank fails the spawn with that rank's traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "kiln", "kiln.schedule", "transformers",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.vit.modeling_vit", __name__]
"""Imported once by the fork server; each rank is forked from it with these loaded (a fresh
interpreter per rank would import torch, kiln and transformers again: seconds each)."""


def spawn(checks: list[str], world: int = 2, timeout_s: int = 60) -> None:
    """Run ``checks`` on ``world`` ranks (``torch.multiprocessing`` processes started from a
    clean fork server, which has used no threads, so forking it is safe)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(_worker, args=(world, free_port(), checks, timeout_s), nprocs=world, join=True,
                       start_method="forkserver")


def _worker(rank: int, world: int, port: int, checks: list[str], timeout_s: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for name in checks:
            CHECKS[name](rank, world)
            dist.barrier()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ models
def gpt2(layers: int = 2, attn: str = "sdpa"):
    import transformers
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def vit():
    import transformers
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=64, image_size=12, patch_size=4, num_channels=3,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.ViTModel(cfg, add_pooling_layer=False).eval()


def gpt2_tensor_parallel(sch, world: int, *, wrong_bias: bool = False):
    """Megatron tensor parallelism on GPT-2: column-parallel c_attn/c_fc, row-parallel c_proj."""
    for block in sch.find(r"transformer\.h\.\d+"):
        attn, mlp = block["attn"], block["mlp"]
        attn["c_attn"].shard("weight", 1, groups=3).shard("bias", 0, groups=3).sync("bwd_post", "all_reduce")
        attn.module.split_size //= world
        attn["c_proj"].shard("weight", 0).sync("fwd_post", "all_reduce")
        mlp["c_fc"].shard("weight", 1).shard("bias", 0).sync("bwd_post", "all_reduce")
        mlp["c_proj"].shard("weight", 0).sync("fwd_post", "all_reduce")
    return sch


def vit_tensor_parallel(sch):
    for layer in sch.find(r"layers\.\d+"):
        attn, mlp = layer["attention"], layer["mlp"]
        attn.sync("bwd_post", "all_reduce")
        for name in ("q_proj", "k_proj", "v_proj"):
            attn[name].shard("weight", 0).shard("bias", 0)
        attn["o_proj"].shard("weight", 1).sync("fwd_post", "all_reduce")
        mlp.sync("bwd_post", "all_reduce")
        mlp["fc1"].shard("weight", 0).shard("bias", 0)
        mlp["fc2"].shard("weight", 1).sync("fwd_post", "all_reduce")
    return sch


def _ids(batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(1))


def _pixels() -> torch.Tensor:
    return torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------ checks
def check_tensor_parallel(rank: int, world: int, attentions: tuple[str, ...] = ("sdpa",)) -> None:
    import kiln
    for attn in attentions:
        sch = gpt2_tensor_parallel(kiln.schedule(gpt2(attn=attn)), world)
        report = kiln.schedule.verify(sch, (_ids(),))
        assert report.ok and not report.not_compared and len(report.grad_errors) > 10, report
        model = sch.build()
        assert model.transformer.h[0].attn.c_attn.weight.shape == (32, 96 // world)
    sch = vit_tensor_parallel(kiln.schedule(vit()))
    report = kiln.schedule.verify(sch, (_pixels(),))
    assert report.ok, report


def check_sequence_parallel(rank: int, world: int, attentions: tuple[str, ...] = ("sdpa",)) -> None:
    import kiln
    for attn in attentions:
        sch = kiln.schedule(gpt2(attn=attn))
        sch["transformer.h"].sequence_parallel(dim=1)
        report = kiln.schedule.verify(sch, (_ids(),))
        assert report.ok, report
        assert sch.build().kiln_schedule.grad_sync.reductions > 0
    sch = kiln.schedule(vit())
    sch["layers"].sequence_parallel(dim=1)
    assert kiln.schedule.verify(sch, (_pixels(),)).ok
    from kiln.ir.errors import ScheduleError
    sch = kiln.schedule(gpt2())
    sch["transformer.h"].sequence_parallel()
    try:  # raised on every rank before any communication
        sch.build()(_ids(seq=7))
    except ScheduleError as e:
        assert "has 7 positions, which 2 ranks cannot split evenly; pad" in str(e), str(e)
    else:
        raise AssertionError("a sequence of 7 split over 2 ranks was accepted")


def check_wrong_bias(rank: int, world: int) -> None:
    """A row-parallel bias added on every rank: verify names its parameter."""
    import kiln
    from kiln.schedule import ScheduleMismatch
    from torch import nn

    class RowLinear(nn.Module):  # adds its bias inside, before the reduction kiln cannot see into
        def __init__(self, fc: nn.Linear):
            super().__init__()
            self.weight, self.bias = fc.weight, fc.bias

        def forward(self, x):
            return nn.functional.linear(x, self.weight, self.bias)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())
    net[2] = RowLinear(net[2])
    sch = kiln.schedule(net)
    sch["0"].shard("weight", 0).shard("bias", 0).sync("bwd_post", "all_reduce")
    sch["2"].shard("weight", 1).sync("fwd_post", "all_reduce")
    try:
        kiln.schedule.verify(sch, (torch.randn(4, 8),))
    except ScheduleMismatch as e:
        assert "'2.bias'" in str(e), str(e)
        assert e.report.mismatched[0] == "2.bias"
    else:
        raise AssertionError("verify accepted a row-parallel bias added once per rank")
    good = kiln.schedule(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh()))
    good["0"].shard("weight", 0).shard("bias", 0).sync("bwd_post", "all_reduce")
    good["2"].shard("weight", 1).sync("fwd_post", "all_reduce")
    assert kiln.schedule.verify(good, (torch.randn(4, 8),)).ok


def _pipeline_losses(model, microbatches, steps: int, pipelined: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        if pipelined:
            losses.append(model.train_step(microbatches, _lm_loss, opt))
            continue
        total = 0.0
        for args, target in microbatches:
            loss = _lm_loss(model(*args), target) / len(microbatches)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _lm_loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def check_pipeline(rank: int, world: int) -> None:
    import kiln
    from kiln.schedule import plan_microbatches
    lengths = [3, 8, 5, 8, 4, 7]
    plan = plan_microbatches(lengths, overhead=4)
    g = torch.Generator().manual_seed(2)
    microbatches = []
    for group in plan.groups:
        seq = max(lengths[i] for i in group)
        ids = torch.randint(0, 64, (len(group), seq), generator=g)
        microbatches.append(((ids,), torch.roll(ids, -1, dims=1)))
    want = _pipeline_losses(gpt2(layers=4), microbatches, 3, pipelined=False)
    sch = kiln.schedule(gpt2(layers=4))
    sch["transformer.h.1"].cut_pipeline_stage()
    stage = sch.build()
    assert list(stage.owned) == ([0, 1] if rank == 0 else [2, 3])
    got = _pipeline_losses(stage, microbatches, 3, pipelined=True)
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)


def check_data_parallel(rank: int, world: int) -> None:
    from kiln.schedule import data_parallel
    from torch import nn
    torch.manual_seed(rank)  # different weights per rank: data_parallel broadcasts rank 0's
    net = data_parallel(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)), bucket_bytes=600)
    assert len(net.kiln_gradient_buckets.buckets) > 1
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    mine = x.chunk(world)[rank]
    (net(mine) ** 2).sum().backward()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    (ref(x) ** 2).sum().div(world).backward()
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), n


def check_compiled_collectives(rank: int, world: int) -> None:
    """A tensor-parallel GPT-2 step compiled by kiln as one graph, collectives as IR ops."""
    import kiln
    sch = gpt2_tensor_parallel(kiln.schedule(gpt2()), world)
    model, opt = sch.build(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref = gpt2()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = _ids()
    target = torch.roll(ids, -1, dims=1)
    step = kiln.schedule.compile_train(model, _lm_loss, opt, (ids, target))
    hist = step.graph.op_histogram()
    assert hist.get("all_reduce", 0) >= 8, hist
    for _ in range(2):
        loss = step(ids, target)
        want = _lm_loss(ref(ids), target)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item()), (loss.item(), want.item())


def check_compiled_mlp(rank: int, world: int, backends: tuple[str, ...] = ("cpu",)) -> None:
    """A tensor-parallel MLP step through kiln.schedule.compile_train (one graph)."""
    import kiln
    from torch import nn

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    target = torch.randn(4, 16, generator=torch.Generator().manual_seed(6))
    loss_fn = torch.nn.functional.mse_loss
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    steps = {}
    for backend in backends:
        sch = kiln.schedule(net())
        sch["0"].shard("weight", 0).shard("bias", 0).sync("bwd_post", "all_reduce")
        sch["2"].shard("weight", 1).sync("fwd_post", "all_reduce")
        model, opt = sch.build(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
        steps[backend] = (kiln.schedule.compile_train(model, loss_fn, opt, (x, target), backend=backend), model)
        reductions = [n.attrs["fwd"] for n in steps[backend][0].graph.nodes if n.op_name == "all_reduce"]
        assert sorted(reductions) == [False, True], reductions  # f (the input needs no gradient), g
    for _ in range(3):
        want = loss_fn(ref(x), target)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for backend, (step, model) in steps.items():
            got = step(x, target).item()
            assert abs(got - want.item()) <= 1e-5 * abs(want.item()), (backend, got, want.item())
    first = steps[backends[0]][1][0].weight.detach().contiguous()
    parts = [torch.empty_like(first) for _ in range(world)]
    dist.all_gather(parts, first)
    torch.testing.assert_close(torch.cat(parts), ref[0].weight.detach(), rtol=1e-5, atol=1e-6)


def check_eager_attention(rank: int, world: int) -> None:
    check_tensor_parallel(rank, world, ("eager",))
    check_sequence_parallel(rank, world, ("eager",))


CHECKS = {
    "eager_attention": check_eager_attention,
    "compiled_mlp": check_compiled_mlp,
    "compiled_mlp_reference": lambda rank, world: check_compiled_mlp(rank, world, ("reference",)),
    "tensor_parallel": check_tensor_parallel,
    "sequence_parallel": check_sequence_parallel,
    "wrong_bias": check_wrong_bias,
    "pipeline": check_pipeline,
    "data_parallel": check_data_parallel,
    "compiled_collectives": check_compiled_collectives,
}
