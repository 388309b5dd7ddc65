"""kiln.schedule in one process: the tree, each primitive's effect and its illegal uses,
build, verify, compile_train with checkpoints, and plan_microbatches against brute force.
The distributed runs are in tests/test_schedule_dist.py."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import kiln
from kiln.ir.errors import ScheduleError
from kiln.schedule import ScheduleMismatch, plan_microbatches, verify
from kiln.schedule.microbatch import group_cost


class Block(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth: int = 3, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def net(seed: int = 0, **kw) -> Net:
    torch.manual_seed(seed)
    return Net(**kw)


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))


# ------------------------------------------------------------------------------ the tree
def test_tree_paths_fold_module_list_indices_and_find():
    model = net()
    sch = kiln.schedule(model)
    assert sch["blocks.1.fc2"].module is not model.blocks[1].fc2  # the schedule works on a copy
    assert type(sch["blocks.1.fc2"].module) is nn.Linear and sch["blocks"]["1"]["fc2"].path == "blocks.1.fc2"
    assert [s.path for s in sch.find(nn.LayerNorm)] == ["blocks.0.norm", "blocks.1.norm", "blocks.2.norm"]
    assert [s.path for s in sch.find(r"blocks\.\d+\.fc1")] == ["blocks.0.fc1", "blocks.1.fc1", "blocks.2.fc1"]
    assert [s.path for s in sch["blocks.2"].find(lambda p, m: isinstance(m, nn.Linear))] == \
        ["blocks.2.fc1", "blocks.2.fc2"]
    assert len(list(sch.walk())) == len(list(model.modules()))
    with pytest.raises(ScheduleError, match=r"no submodule 'fc3' under 'blocks.0'; its children are \['norm'"):
        sch["blocks.0"]["fc3"]
    with pytest.raises(ScheduleError, match="pattern must be a module type, a regex string or a predicate"):
        sch.find(3)


# ------------------------------------------------------------------------------ replace
def test_replace_with_a_module_and_a_function_and_replace_all():
    sch = kiln.schedule(net())
    sch["blocks.0.fc1"].shard("weight", 0)  # dropped with the module it was recorded on
    sch["blocks.0"].replace(lambda x: 2 * x)
    assert "blocks.0.fc1" not in sch._records
    assert sch.replace_all(nn.GELU, lambda old: nn.Tanh()) == 2
    model = sch.build()
    want = net()
    want.blocks[0] = kiln.schedule.FunctionModule(lambda x: 2 * x)
    for b in want.blocks[1:]:
        b.act = nn.Tanh()
    torch.testing.assert_close(model(X), want(X))
    with pytest.raises(ScheduleError, match="the root cannot be replaced"):
        kiln.schedule(net()).replace(nn.Identity())


def test_replace_rejects_what_is_not_a_module_or_function_and_a_built_schedule():
    sch = kiln.schedule(net())
    with pytest.raises(ScheduleError, match="expects an nn.Module or a function, got int"):
        sch["head"].replace(3)
    sch.build()
    with pytest.raises(ScheduleError, match="already built"):
        sch["head"].replace(nn.Identity())


# ------------------------------------------------------------------------------ checkpoint
def _saved_bytes(model: nn.Module) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randn(64, 8, generator=torch.Generator().manual_seed(3))).sum().backward()
    return total


def test_checkpoint_saves_less_eagerly_and_gives_the_same_gradients():
    plain = kiln.schedule(net()).build()
    sch = kiln.schedule(net())
    for b in sch.find(r"blocks\.\d+"):
        b.checkpoint()
    ckpt = sch.build()
    assert ckpt.kiln_schedule.checkpointed == ["blocks.0", "blocks.1", "blocks.2"]
    assert _saved_bytes(ckpt) < 0.5 * _saved_bytes(plain)
    for p, q in zip(plain.parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert verify(sch, (X,)).ok
    with pytest.raises(ScheduleError, match="checkpoint its blocks"):
        kiln.schedule(net()).checkpoint()


def test_checkpoint_becomes_remat_under_compile_train():
    sch = kiln.schedule(net())
    sch["blocks.1"].checkpoint()
    model, opt = sch.build(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    target = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    step = kiln.schedule.compile_train(model, nn.functional.mse_loss, opt, (X, target), backend="reference")
    assert step.remat and step.stats["recomputed_nodes"] > 0
    ref = net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        want = nn.functional.mse_loss(ref(X), target)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(step(X, target), want.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ fuse
def test_fuse_compiles_the_region_with_kiln_and_trains(kiln_runs):
    sch = kiln.schedule(net())
    sch["blocks.1"].fuse(backend="reference")
    model = sch.build()
    out = model(X)
    (out * 3).sum().backward()
    assert len(model.blocks[1].kiln_fused) == 1 and kiln_runs  # one kiln region, and it ran
    want = net()
    (want(X) * 3).sum().backward()
    torch.testing.assert_close(out, want(X), rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
    with pytest.raises(ScheduleError, match="no forward to compile"):
        kiln.schedule(net())["blocks.0.act"].replace(nn.Module()).fuse()


# ------------------------------------------------------------------------------ shard
def test_shard_keeps_this_ranks_slice_of_the_full_weights():
    full = net()
    sch = kiln.schedule(net(), world_size=2, rank=1)
    sch["blocks.0.fc1"].shard("weight", 0).shard("bias", 0)
    sch["blocks.0.fc2"].shard("weight", 1).sync("fwd_post", "all_reduce")
    sch["embed"].shard("weight", 0, groups=2).shard("bias", 0, groups=2)
    model = sch.build()
    torch.testing.assert_close(model.blocks[0].fc1.weight, full.blocks[0].fc1.weight[16:])
    torch.testing.assert_close(model.blocks[0].fc2.weight, full.blocks[0].fc2.weight[:, 16:])
    torch.testing.assert_close(model.blocks[0].fc2.bias, full.blocks[0].fc2.bias)  # kept whole
    w = full.embed.weight  # two blocks of 8 rows, each split: rank 1 holds rows 4:8 and 12:16
    torch.testing.assert_close(model.embed.weight, torch.cat([w[4:8], w[12:16]]))
    assert model.blocks[0].fc1.out_features == 16
    assert model.kiln_schedule.shards == {"blocks.0.fc1.weight": (0, 1), "blocks.0.fc1.bias": (0, 1),
                                          "blocks.0.fc2.weight": (1, 1), "embed.weight": (0, 2),
                                          "embed.bias": (0, 2)}


@pytest.mark.parametrize("calls, match", [
    ([("blocks.0.fc1", "weight", 0, 3)], r"size 32 of shape \(32, 16\) does not divide into 1 group\(s\) x 3"),
    ([("blocks.0.fc1", "weight", 2, 2)], r"axis 2 is out of range for shape \(32, 16\)"),
    ([("blocks.0", "weight", 0, 2)], r"Block has no parameter 'weight' of its own"),
    ([("blocks.0.fc1", "weight", 0, 2), ("blocks.0.fc1", "weight", 1, 2)], "already sharded along axis 0"),
    ([("blocks.0.fc2", "weight", 1, 2), ("blocks.0.fc2", "bias", 0, 2)], "row-parallel .* keep the bias unsharded"),
    ([("blocks.0.fc2", "bias", 0, 2), ("blocks.0.fc2", "weight", 1, 2)], "row-parallel but its bias is sharded"),
])
def test_illegal_shards_raise_with_the_reason(calls, match):
    sch = kiln.schedule(net(), world_size=2)
    with pytest.raises(ScheduleError, match=match):
        for path, param, axis, world in calls:
            sch.root.world_size = world
            sch[path].shard(param, axis)


def test_build_rejects_unsharded_column_bias_and_a_row_bias_without_its_reduction():
    sch = kiln.schedule(net(), world_size=2)
    sch["blocks.0.fc1"].shard("weight", 0)
    with pytest.raises(ScheduleError, match=r"column-parallel blocks.0.fc1 .* add .shard\('bias', 0\)"):
        sch.build()
    sch = kiln.schedule(net(), world_size=2)
    sch["blocks.0.fc2"].shard("weight", 1)
    sch["blocks.0"].sync("fwd_post", "all_reduce")
    with pytest.raises(ScheduleError, match="row-parallel blocks.0.fc2 has a bias but no .sync"):
        sch.build()


# ------------------------------------------------------------------------------ sync
@pytest.mark.parametrize("setup, mode, op, kwargs, match", [
    ("column", "fwd_post", "all_reduce", {}, "column-parallel blocks.0.fc1 is partitioned"),
    ("row", "fwd_post", "all_gather", {}, "partial sum, not a slice; all_reduce it"),
    ("row", "fwd_post", "reduce_scatter", {"reduce": False}, "partial sum; all_reduce it"),
    (None, "fwd_post", "all_reduce", {}, "would multiply it by the world size"),
    (None, "bwd_post", "all_gather", {}, "only all_reduce can run on it"),
    (None, "bwd_pre", "all_reduce", {}, "mode must be one of"),
    (None, "fwd_post", "broadcast", {}, "op must be one of"),
    (None, "fwd_pre", "all_gather", {"axis": 1}, r"unknown argument\(s\) \['axis'\]; all_gather takes"),
    (None, "fwd_pre", "all_to_all", {"split_dim": 1}, "needs split_dim and concat_dim"),
])
def test_illegal_syncs_raise_with_the_reason(setup, mode, op, kwargs, match):
    sch = kiln.schedule(net(), world_size=2)
    path = "blocks.0.fc1" if setup != "row" else "blocks.0.fc2"
    if setup == "column":
        sch[path].shard("weight", 0).shard("bias", 0)
    elif setup == "row":
        sch[path].shard("weight", 1)
    with pytest.raises(ScheduleError, match=match):
        sch[path].sync(mode, op, **kwargs)


def test_syncs_run_the_collectives_single_process():
    # Without a process group the collectives simulate replicas of this process: an
    # all_gather of the output along features doubles the head's output width.
    sch = kiln.schedule(net(), world_size=2)
    sch["head"].sync("fwd_post", "all_gather", dim=-1)
    out = sch.build()(X)
    want = net()(X)
    torch.testing.assert_close(out, torch.cat([want, want], -1))


# ------------------------------------------------------------------- sequence parallel, pipeline
def test_sequence_parallel_and_pipeline_cut_illegal_uses():
    sch = kiln.schedule(net(), world_size=2)
    sch["blocks"].sequence_parallel()
    with pytest.raises(ScheduleError, match="already sequence parallel"):
        sch["blocks.0"].sequence_parallel()
    with pytest.raises(ScheduleError, match="found no attention module inside"):
        sch.build()
    with pytest.raises(ScheduleError, match="attention= takes module types"):
        kiln.schedule(net(), world_size=2)["blocks"].sequence_parallel(attention="attn")
    sch = kiln.schedule(net(), world_size=2)
    with pytest.raises(ScheduleError, match="not one"):
        sch["head"].cut_pipeline_stage()
    with pytest.raises(ScheduleError, match="the last block of blocks ends the stack"):
        sch["blocks.2"].cut_pipeline_stage()
    sch["blocks.0"].cut_pipeline_stage()
    sch["blocks.1"].cut_pipeline_stage()
    with pytest.raises(ScheduleError, match=r"2 cut\(s\) make 3 stages, but there are 2 ranks"):
        sch.build()


# ------------------------------------------------------------------------------ build, verify
def test_build_optimizer_forms():
    base = torch.optim.SGD(net().parameters(), lr=0.3, momentum=0.5)
    for form in (base, lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.5)):
        model, opt = kiln.schedule(net()).build(optimizer=form)
        assert opt.param_groups[0]["lr"] == 0.3 and opt.param_groups[0]["momentum"] == 0.5
        assert {id(p) for p in opt.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    with pytest.raises(ScheduleError, match="expects an optimizer, its class or a function"):
        kiln.schedule(net()).build(optimizer=3)


def test_verify_names_the_first_parameter_whose_gradient_differs():
    sch = kiln.schedule(net())
    sch["blocks.2.act"].replace(nn.Tanh())  # a wrong rewrite: the gradients from head.weight back change
    with pytest.raises(ScheduleMismatch, match="the output differs .* first parameter whose gradient differs is "
                                               "'head.weight'") as e:
        verify(sch, (X,))
    assert "head.bias" not in e.value.report.mismatched  # the loss is linear in the head's output
    report = verify(sch, (X,), raise_on_mismatch=False)
    assert not report.ok and report.mismatched[:2] == ["head.weight", "blocks.2.fc2.weight"]


# ------------------------------------------------------------------------------ micro-batches
def _brute_force(lengths, overhead, max_tokens, max_samples):
    best = float("inf")
    items = list(range(len(lengths)))

    def partitions(rest):
        if not rest:
            yield []
            return
        first, others = rest[0], rest[1:]
        for k in range(len(others) + 1):
            for chosen in itertools.combinations(others, k):
                left = [i for i in others if i not in chosen]
                for tail in partitions(left):
                    yield [[first, *chosen], *tail]
    for parts in partitions(items):
        ok = all((max_tokens is None or max(lengths[i] for i in p) * len(p) <= max_tokens)
                 and (max_samples is None or len(p) <= max_samples) for p in parts)
        if ok:
            best = min(best, sum(group_cost([lengths[i] for i in p], overhead) for p in parts))
    return best


def test_plan_microbatches_matches_brute_force():
    rng = random.Random(0)
    for trial in range(40):
        n = rng.randint(1, 7)
        lengths = [rng.randint(1, 12) for _ in range(n)]
        overhead = rng.choice([0, 1, 3, 10])
        max_tokens = rng.choice([None, 24, 40])
        max_samples = rng.choice([None, 2, 3])
        plan = plan_microbatches(lengths, overhead=overhead, max_tokens=max_tokens, max_samples=max_samples)
        assert sorted(i for g in plan.groups for i in g) == list(range(n))
        got = sum(group_cost([lengths[i] for i in g], overhead) for g in plan.groups)
        assert got == plan.cost == _brute_force(lengths, overhead, max_tokens, max_samples), (lengths, plan)


def test_plan_microbatches_groups_similar_lengths_and_rejects_bad_input():
    plan = plan_microbatches([10, 2, 9, 3, 10, 2], overhead=3)
    assert sorted(sorted(g) for g in plan.groups) == [[0, 2, 4], [1, 3, 5]] and plan.padding == 3
    assert plan_microbatches([5, 5, 5], overhead=0, max_samples=1).groups == [[0], [1], [2]]
    with pytest.raises(ScheduleError, match="exceeds max_tokens=8; raise max_tokens or truncate"):
        plan_microbatches([4, 9], max_tokens=8)
    with pytest.raises(ScheduleError, match="lengths must be positive"):
        plan_microbatches([4, 0])
