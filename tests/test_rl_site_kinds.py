"""The per-site action kinds besides fusion (kiln.tuning.rl.site_kinds): duplicate a producer,
a layout per conv/matmul, rematerialize a value; their environments and the cpu option
``nchw_convs``."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gymnasium")

import gymnasium  # noqa: E402
import torch  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402
from torch import nn  # noqa: E402

import kiln.tuning.rl  # noqa: E402,F401  (registers the environments)
from kiln.backends import get_backend  # noqa: E402
from kiln.passes.autodiff import grad_graph  # noqa: E402
from kiln.passes.fusion import Fuse  # noqa: E402
from kiln.passes.pipeline import default_pipeline  # noqa: E402
from kiln.passes.remat import recomputation_candidates, rematerialize  # noqa: E402
from kiln.tuning.rl import KIND_ENV_IDS  # noqa: E402
from kiln.tuning.rl.corpus import _capture, mlp, random_graph, small_cnn  # noqa: E402
from kiln.tuning.rl.site_env import BuildReward, liveness_peak  # noqa: E402
from kiln.tuning.rl.site_kinds import (  # noqa: E402
    DuplicateSites, DuplicateSitesEnv, LayoutSites, LayoutSitesEnv, RematSites, RematSitesEnv,
)
from kiln.tuning.rl.sites import SiteTimer, graph_arguments  # noqa: E402
from kiln.tuning.rl.zoo import MLP, ScalarLoss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Shared(nn.Module):
    """``tanh(x)`` read by two linear layers and a sum: a cheap producer with three readers."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        y = torch.tanh(x * 0.5)
        return torch.relu(self.a(y)) + torch.sigmoid(self.b(y)) + y.sum(-1, keepdim=True)


def shared_graph():
    torch.manual_seed(0)
    return _capture(Shared().eval(), (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),))


def training_mlp(fuse_batch: int = 256):
    torch.manual_seed(0)
    model = ScalarLoss(MLP(32, "gelu", 4)).eval()
    return grad_graph(_capture(model, (torch.randn(fuse_batch, 32, generator=torch.Generator().manual_seed(1)),))).graph


def random_graphs():
    return [random_graph(seed, size=16 + 2 * seed) for seed in (1, 4, 5)]


def assert_same_outputs(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


def count_reward(problem):
    """A reward without builds: the number of sites answered yes."""
    return lambda decisions: float(sum(problem.key(decisions)))


# ----------------------------------------------------------------------------- environments
@pytest.mark.parametrize("kind", ["duplicate", "layout", "remat"])
def test_check_env_passes_and_the_ids_are_registered(kind):
    if kind == "duplicate":
        env = DuplicateSitesEnv([shared_graph(), *random_graphs()], reward="kernels")
    elif kind == "layout":
        env = LayoutSitesEnv([small_cnn(), mlp(16, "relu")()], reward=count_reward)
    else:
        env = RematSitesEnv([training_mlp(16)], reward="memory", memory_weight=0.5)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert env.action_masks().tolist() == [True, True] and info["action_mask"].all()
    done, steps = False, 0
    while not done:
        assert env.observation_space.contains(obs)
        obs, reward, done, truncated, info = env.step(steps % 2)
        steps += 1
    assert steps == env.problem.default_sites and not env.action_masks()[1]
    made = gymnasium.make(KIND_ENV_IDS[kind][0], corpus=env.problems[:1], reward=env.reward_kind)
    obs, _ = made.reset(seed=0)
    assert obs.shape == env.observation_space.shape


# ----------------------------------------------------------------------------- duplicate
@pytest.mark.parametrize("graph", [shared_graph(), *random_graphs()], ids=lambda g: g.name)
def test_duplicate_all_no_is_the_default_pipeline_and_every_vector_computes_the_same(graph):
    sites = DuplicateSites(graph)
    assert sites.default_sites > 0
    assert str(sites.graph(())) == str(sites.default_build()[0])
    assert str(sites.graph((False,) * sites.default_sites)) == str(default_pipeline().run(graph).graph)
    every = sites.answers(lambda i: True)
    assert len(sites.duplicated(every).nodes) > len(sites.pre.nodes)  # the clones are there before the walk
    args = graph_arguments(sites.default_build()[0])
    cpu = get_backend("cpu")
    want = cpu.build(sites.default_build()[0])(args)
    for vector in (every, sites.answers(lambda i: i % 2 == 1)):
        assert_same_outputs(cpu.build(sites.graph(vector))(args), want)


def test_duplicating_the_shared_tanh_gives_each_reader_its_own_copy():
    sites = DuplicateSites(shared_graph())
    tanh = [i for i, n in enumerate(sites.nodes) if n.op_name == "tanh"]
    assert tanh, sites.sites
    g = sites.duplicated(sites.answers(lambda i: i in tanh))
    assert sum(n.op_name == "tanh" for n in g.nodes) == 3
    assert all(len(users) == 1 for v, users in g.users().items() if v.producer is not None
               and v.producer.op_name == "tanh")


# ----------------------------------------------------------------------------- layout
def test_layout_default_is_the_backends_default_and_both_layouts_compute_the_same():
    sites = LayoutSites(small_cnn())
    assert sites.kinds.count("conv") >= 2 and "matmul" in sites.kinds
    assert sites.options(()) == {} and sites.build(()) == sites.default_build()
    assert str(sites.default) == str(default_pipeline().run(sites.source).graph)
    cpu = get_backend("cpu")
    args = graph_arguments(sites.default)
    default = cpu.build(sites.default)
    want = default(args)
    labels = [getattr(s, "label", "") for s in default.plan.steps]
    assert not any(", NCHW]" in label for label in labels) and any("NCHW view" in label for label in labels)
    convs = sites.kinds.count("conv")
    for vector in (sites.answers(lambda i: True), sites.answers(lambda i: i % 2 == 0)):
        options = sites.options(vector)
        exe = cpu.build(*sites.build(vector))
        assert_same_outputs(exe(args), want)
        labels = [getattr(s, "label", "") for s in exe.plan.steps]
        nchw = len(options.get("nchw_convs", ()))
        assert sum(", NCHW]" in label for label in labels) == nchw
        if nchw == convs:
            assert not any("NCHW view" in label for label in labels)  # no channels-last value left


def test_layout_matmul_weights_in_place_compute_the_same():
    sites = LayoutSites(mlp(16, "relu")())
    assert set(sites.kinds) == {"matmul"} and len(sites.sites) >= 2
    options = sites.options(sites.answers(lambda i: True))
    assert set(options) == {"updated_params"} and set(options["updated_params"]) <= {v.name for v in sites.default.params}
    cpu = get_backend("cpu")
    args = graph_arguments(sites.default)
    assert_same_outputs(cpu.build(*sites.build(sites.answers(lambda i: True)))(args), cpu.build(sites.default)(args))


# ----------------------------------------------------------------------------- remat
def test_remat_all_no_is_the_default_pipeline_and_min_cut_is_the_remat_route():
    joint = training_mlp()
    sites = RematSites(joint)
    candidates, chosen = recomputation_candidates(sites.pre)
    assert sites.default_sites == len(candidates) > 0 and any(sites.min_cut) and not all(sites.min_cut)
    assert str(sites.graph(())) == str(default_pipeline().run(joint).graph)
    # what kiln.compile_train(..., remat=True) builds: the pipeline without fuse, remat, fuse
    assert str(sites.graph(sites.min_cut)) == str(Fuse().run(rematerialize(sites.pre)[0]).graph)
    assert sites.key(sites.min_cut) == sites.min_cut
    named, _ = rematerialize(sites.pre, recompute=sites.chosen(sites.min_cut))
    assert str(named) == str(rematerialize(sites.pre)[0])
    assert sites.build(sites.min_cut)[1]["updated_params"] == tuple(v.name for v in sites.pre.params)


def test_remat_vectors_give_the_same_loss_and_gradients():
    sites = RematSites(training_mlp())
    cpu = get_backend("cpu")
    graph, options = sites.default_build()
    args = graph_arguments(graph)
    want = cpu.build(graph, options)(args)
    rng = np.random.default_rng(0)
    for vector in (sites.min_cut, sites.answers(lambda i: True), sites.answers(lambda i: rng.random() < 0.5)):
        assert any(sites.key(vector))
        got = cpu.build(*sites.build(vector))(args)
        assert_same_outputs(got, want)


def test_remat_peak_memory_term_changes_with_the_decision():
    joint = training_mlp()
    unfused = RematSites(joint, fuse=False)
    every = unfused.answers(lambda i: True)
    # unfused, recomputing the GELU chains frees their results before the backward
    assert liveness_peak(unfused.graph(unfused.min_cut)) < liveness_peak(unfused.graph(()))
    reward = unfused.cheap_reward("memory", 2.0)
    assert reward(()) == 0.0 and reward(unfused.min_cut) > 0.0 and reward(every) > 0.0
    assert reward(unfused.min_cut) == pytest.approx(
        -2.0 * (liveness_peak(unfused.graph(unfused.min_cut)) / liveness_peak(unfused.graph(())) - 1))
    fused = RematSites(joint)
    assert liveness_peak(fused.graph(fused.min_cut)) != liveness_peak(fused.graph(()))
    # the cpu backend's planned peak (its memory plan), built but not timed
    arena = BuildReward(unfused, SiteTimer(repeat=1, round_s=1e-4), rounds=1, memory_weight=1.0, timed=False)
    assert arena(()) == 0.0
    assert arena(unfused.min_cut) > 0.0 and arena.memory[unfused.key(unfused.min_cut)] < 0.0


def test_a_policy_trains_on_another_kind_and_answers_every_site():
    pytest.importorskip("sb3_contrib")
    from kiln.tuning.rl.sites import policy_answers, train_policy

    sites = DuplicateSites(shared_graph())
    model = train_policy([sites], 64, reward="kernels", n_steps=32, env_type=DuplicateSitesEnv)
    vector = policy_answers(model, sites)
    assert len(vector) == sites.default_sites and sites.site(vector) is None
