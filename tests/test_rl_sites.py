"""The per-site fusion environment ``kiln/FusionSites-v0`` (kiln.tuning.rl.sites) and the
``decide`` hook of ``kiln.passes.fusion.partition`` it drives."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gymnasium")

import gymnasium  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402

import kiln.tuning.rl  # noqa: E402,F401  (registers the environments)
from kiln.backends import get_backend  # noqa: E402
from kiln.ir import parse  # noqa: E402
from kiln.passes.fusion import Fuse, _Partition, _producers, fuse_groups, partition  # noqa: E402
from kiln.tuning.rl import SITES_ENV_ID  # noqa: E402
from kiln.tuning.rl.corpus import random_graph  # noqa: E402
from kiln.tuning.rl.sites import (  # noqa: E402
    MERGE, SITE_FEATURES, FusionSites, FusionSitesEnv, MeasuredReward, SiteTimer, graph_arguments,
)

BLOCK = """
graph @block(%x: f32[8, 16], %w: f32[16, 16], %b: f32[16]) {
  %0: f32[8, 16] = matmul(%x, %w)
  %1: f32[8, 16] = add(%0, %b)
  %2: f32[8, 16] = relu(%1)
  %3: f32[8, 16] = mul(%2, %x)
  %4: f32[8] = sum(%3) {dims=[1]}
  %5: f32[8, 1] = reshape(%4) {shape=[8, 1]}
  %6: f32[8, 16] = sub(%3, %5)
  %7: f32[8, 16] = exp(%6)
  %8: f32[8, 16] = tanh(%3)
  %9: f32[8, 16] = add(%7, %8)
  return %9
}"""


def graphs():
    return [parse(BLOCK), *(random_graph(seed, size=16 + 2 * seed) for seed in (1, 3, 6))]


def names(groups):
    return [[n.outputs[0].name for n in g] for g in groups]


def walk(sites: FusionSites, policy) -> list[bool]:
    """Answer every site of ``sites`` with ``policy(index)``; the decision vector."""
    decisions: list[bool] = []
    while sites.site(decisions) is not None:
        decisions.append(bool(policy(len(decisions))))
    return decisions


# ----------------------------------------------------------------------------- the fusion hook
@pytest.mark.parametrize("graph", graphs(), ids=lambda g: g.name)
def test_decide_default_and_always_true_are_todays_partition(graph):
    sites = FusionSites(graph)
    today = names(partition(sites.pre))
    assert names(partition(sites.pre, decide=lambda p, c: True)) == today
    assert names(sites.groups(())) == today
    assert str(sites.graph(())) == str(sites.default_graph())
    assert str(Fuse().run(sites.pre).graph) == str(fuse_groups(sites.pre, partition(sites.pre)))


@pytest.mark.parametrize("graph", graphs(), ids=lambda g: g.name)
def test_none_merge_gives_no_fused_group(graph):
    sites = FusionSites(graph)
    assert sites.default_sites > 0
    assert partition(sites.pre, decide=lambda p, c: False) == []
    none = walk(sites, lambda i: False)
    assert sites.groups(none) == []
    assert not any(n.op_name == "fused" for n in sites.graph(none).nodes)


def test_decide_is_asked_only_at_legal_sites():
    sites = FusionSites(parse(BLOCK))
    asked = []
    part = _Partition(sites.pre, 32, "greedy")

    def decide(p, c):  # mirror the walk on a partition of our own: every question is a legal merge
        assert part.can_merge(p, c)
        asked.append((p, c))
        part.merge(p, c)
        return True

    partition(sites.pre, decide=decide)
    assert len(asked) == sites.default_sites > 0
    # a merge site is never two nodes already in one group, and the producer feeds the consumer
    assert all(p in _producers(c) for p, c in asked)


# ----------------------------------------------------------------------------- the environment
def test_check_env_passes():
    env = FusionSitesEnv(graphs(), reward="kernels")
    check_env(env, skip_render_check=True)
    made = gymnasium.make(SITES_ENV_ID, corpus=graphs()[:1], reward="kernels")
    obs, info = made.reset(seed=0)
    assert obs.shape == (len(SITE_FEATURES),) and info["action_mask"].all()


def test_episode_walks_the_sites_and_masks_allow_only_legal_merges():
    env = FusionSitesEnv(graphs(), reward="kernels")
    rng = np.random.default_rng(0)
    for index in range(len(env.problems)):
        obs, info = env.reset(options={"index": index})
        sites = env.problem
        done = False
        steps = 0
        while not done:
            assert env.observation_space.contains(obs)
            mask = env.action_masks()
            assert mask.tolist() == [True, True]
            site = env.current
            # replay the decisions so far on a partition of our own: the offered merge is legal
            part = _Partition(sites.pre, sites.max_nodes, sites.strategy)
            answers = iter(env.decisions)
            stop = {}

            def decide(p, c, part=part, answers=answers, stop=stop):
                if "at" in stop:
                    return False
                answer = next(answers, None)
                if answer is None:
                    stop["at"] = (p, c, part.can_merge(p, c))
                    return False
                if answer:
                    part.merge(p, c)
                return answer

            partition(sites.pre, decide=decide)
            assert stop["at"] == (site.producer, site.consumer, True)
            obs, reward, done, truncated, info = env.step(int(rng.integers(2)))
            steps += 1
            assert not truncated
        assert steps == len(env.decisions) == len(sites.key(env.decisions))
        assert not env.action_masks()[MERGE]


@pytest.mark.parametrize("graph", graphs()[:2], ids=lambda g: g.name)
def test_every_decision_vector_runs_and_matches_the_reference(graph):
    sites = FusionSites(graph)
    rng = np.random.default_rng(1)
    vectors = [(), walk(sites, lambda i: False), walk(sites, lambda i: rng.random() < 0.5),
               walk(sites, lambda i: i % 2 == 0)]
    args = graph_arguments(sites.default_graph())
    expected = get_backend("reference").build(graph)(args)
    cpu = get_backend("cpu")
    for decisions in vectors:
        out = cpu.build(sites.graph(decisions))(args)
        assert len(out) == len(expected)
        for a, b in zip(out, expected):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


def test_measured_reward_is_cached_by_the_consulted_decisions():
    sites = FusionSites(parse(BLOCK))
    reward = MeasuredReward(sites, SiteTimer(repeat=1, round_s=1e-4), rounds=1)
    none = walk(sites, lambda i: False)
    first = reward(none)
    assert np.isfinite(first) and first > -1.0
    builds = reward.timer.builds
    assert reward(none + [True, True]) == first  # answers past the walk are not consulted
    assert reward.timer.builds == builds
    assert reward(()) == reward([True] * sites.default_sites)


def test_answers_and_a_trained_policy_give_full_decision_vectors():
    pytest.importorskip("sb3_contrib")
    from kiln.tuning.rl.sites import policy_answers, train_policy

    sites = FusionSites(parse(BLOCK))
    every_other = sites.answers(lambda site: site.index % 2 == 0)
    assert sites.site(every_other) is None and every_other == sites.key(every_other)
    model = train_policy([sites], 64, reward="kernels", n_steps=32)
    vector = policy_answers(model, sites)
    assert sites.site(vector) is None and len(vector) >= 1
