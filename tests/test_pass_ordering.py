"""Pass ordering: the gymnasium environment, costs, the extra passes, baselines, training and
the learned pipeline (``kiln.passes.ordering``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import kiln
import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.passes import PassManager, learned_pipeline
from kiln.passes.ordering import action_set, op_count
from kiln.tuning.rl import ENV_ID
from kiln.tuning.rl.baselines import (
    default_fixpoint,
    greedy,
    random_rollout,
    random_search,
    search_fixed_order,
)
from kiln.tuning.rl.corpus import FAMILIES, HELDOUT_FAMILIES, build_corpus, load_graph, random_graph
from kiln.passes.ordering.cost import estimate_runtime, get_cost, random_arguments
from kiln.passes.decompose import Decompose
from kiln.passes.ordering.episode import CostModel
from kiln.passes.recompute import Recompute
from kiln.passes.ordering.transitions import TransitionCache
from models import MODELS

gym = pytest.importorskip("gymnasium")
from kiln.tuning.rl.env import PassOrderingEnv  # after the gymnasium check

REL_TOL = 1e-4


@pytest.fixture(scope="module")
def small_corpus():
    """One MLP, a 1-layer GPT-2, the small CNN, an MLP training graph and random graphs."""
    entries = build_corpus(["mlp", "gpt2", "cnn", "training"], size="small")
    return entries + [e for e in build_corpus(["random"])[:4]]


def _assert_close(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{what}: output {i} shape"
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        scale = max(float(np.abs(b64).max()), 1e-12)
        err = float(np.abs(a64 - b64).max()) / scale
        assert err <= REL_TOL, f"{what}: output {i} relative error {err:.2e}"


# ----------------------------------------------------------------------------- environment
def test_check_env_passes():
    from gymnasium.utils.env_checker import check_env

    env = gym.make(ENV_ID, budget=6)
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert info["action_mask"][-1], "stop is always allowed"


def test_observation_layout_is_documented():
    env = PassOrderingEnv(actions="extended")
    obs, _ = env.reset(seed=1)
    names = env.observation_spec.names()
    assert len(names) == obs.shape[0] == env.observation_spec.size
    mask = env.action_masks()
    start = names.index("mask:0")
    np.testing.assert_array_equal(obs[start : start + len(mask)], mask.astype(np.float32))
    hist = obs[: len(env.observation_spec.op_names) + 1]
    assert abs(hist.sum() - 1.0) < 1e-5  # shares of the top-level nodes


def _walk(env: PassOrderingEnv, seed: int, steps: int = 40) -> list[tuple]:
    """A seeded random walk over valid actions; returns everything observable."""
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    record = [(obs.tobytes(), info["graph"])]
    for _ in range(steps):
        action = int(rng.choice(np.flatnonzero(env.action_masks())))
        obs, reward, terminated, truncated, info = env.step(action)
        record.append((obs.tobytes(), reward, terminated, truncated, info["cost"]))
        if terminated or truncated:
            obs, info = env.reset()
            record.append((obs.tobytes(), info["graph"]))
    return record


def test_episodes_are_reproducible_from_a_seed(small_corpus):
    first = _walk(PassOrderingEnv(small_corpus, budget=6), seed=3)
    second = _walk(PassOrderingEnv(small_corpus, budget=6), seed=3)
    other = _walk(PassOrderingEnv(small_corpus, budget=6), seed=4)
    assert first == second
    assert first != other


def test_masked_actions_never_change_the_graph(small_corpus):
    env = PassOrderingEnv(small_corpus, actions="extended", budget=8)
    rng = np.random.default_rng(0)
    checked = 0
    for episode in range(6):
        env.reset(seed=episode)
        done = False
        while not done:
            mask = env.action_masks()
            text = str(env.graph)
            for action in np.flatnonzero(~mask):
                result = env.actions[action].pass_.run(env.graph).graph
                assert str(result) == text, f"masked {env.actions[action].name} changed the graph"
                checked += 1
            masked = np.flatnonzero(~mask)
            if len(masked):  # taking a masked action is a no-op with reward 0
                cost = env.episode.cost
                _, reward, _, _, info = env.step(int(rng.choice(masked)))
                assert reward == 0 and not info["changed"] and str(env.graph) == text and info["cost"] == cost
                if env.episode.finished:
                    break
            valid = np.flatnonzero(mask[:-1])
            if not len(valid):
                break
            _, _, terminated, truncated, _ = env.step(int(rng.choice(valid)))
            done = terminated or truncated
    assert checked > 50


def test_any_action_sequence_keeps_graphs_verified_and_equal(small_corpus):
    actions = action_set("extended")
    cache = TransitionCache(actions, verify=True)
    rng = np.random.default_rng(0)
    for entry in small_corpus:
        inputs, params = random_arguments(entry.graph, seed=1)
        want = run_graph(entry.graph, inputs, params)
        for trial in range(3):
            key = cache.intern(entry.graph)
            for action in rng.integers(0, len(actions) - 1, size=10):  # masks ignored on purpose
                key = cache.apply(key, int(action))
            graph = cache.graph(key)
            ir.verify(graph)
            _assert_close(run_graph(graph, inputs, params), want, f"{entry.name} trial {trial}")
    assert not cache.failures, cache.failures


def test_mlp_graph_after_actions_matches_eager():
    builder, inputs_fn = MODELS["mlp"]
    model = builder()
    args, kwargs = inputs_fn()
    captured = kiln.frontends.torch.capture.capture(model, args, kwargs)
    with torch.no_grad():
        expected = [t.numpy() for t in pytree.tree_leaves(model(*args, **kwargs))]
    params = [t.detach().numpy() for t in captured.params.values()]
    inputs = [a.numpy() for a in args]
    for order in (
        "fuse,canonicalize,decompose,recompute,composites,fuse{max_nodes=4}",
        "decompose,recompute,cse,fuse{strategy=elementwise-only},fuse",
    ):
        graph = PassManager(order).run(captured.graph).graph
        _assert_close(run_graph(graph, inputs, params), expected, order)


# ----------------------------------------------------------------------------- costs and passes
def test_costs_count_fused_bodies_and_reward_fusion():
    g = random_graph(2)
    fused = PassManager("fold,cse,dce,fuse").run(g).graph
    assert any(n.op_name == "fused" for n in fused.nodes)
    assert op_count(fused) > len(fused.nodes)  # bodies are counted
    assert estimate_runtime(fused) < estimate_runtime(PassManager("fold,cse,dce").run(g).graph)
    assert get_cost("kernel_count")(fused) < get_cost("kernel_count")(g)
    with pytest.raises(ValueError, match="unknown cost 'ops'"):
        get_cost("ops")


def test_decompose_round_trips_through_composites(small_corpus):
    gpt2 = next(e.graph for e in small_corpus if e.family == "gpt2")
    decomposed = Decompose().run(gpt2).graph
    assert op_count(decomposed) > op_count(gpt2)
    assert not {"layer_norm", "gelu"} & set(decomposed.op_histogram())
    assert not Decompose().run(decomposed).changed
    recomposed = PassManager("canonicalize,composites").run(decomposed).graph
    assert recomposed.op_histogram().get("layer_norm") == gpt2.op_histogram().get("layer_norm")
    inputs, params = random_arguments(gpt2)
    _assert_close(run_graph(decomposed, inputs, params), run_graph(gpt2, inputs, params), "decompose")
    with pytest.raises(ValueError, match="unknown op"):
        Decompose(ops="conv")


def test_recompute_copies_shared_cheap_producers():
    g = ir.parse("""
graph @main(%x: f32[4, 8]) {
  %0: f32[4, 8] = tanh(%x)
  %1: f32[4, 8] = exp(%0)
  %2: f32[4, 8] = sigmoid(%0)
  %3: f32[4, 1] = sum(%0) {dims=[1], keepdim=true}
  return %1, %2, %3
}""")
    result = Recompute().run(g)
    assert result.changed and result.graph.op_histogram()["tanh"] == 3
    assert not Recompute().run(result.graph).changed
    assert str(PassManager("cse").run(result.graph).graph) == str(PassManager("cse").run(g).graph)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    _assert_close(run_graph(result.graph, [x], []), run_graph(g, [x], []), "recompute")


# ----------------------------------------------------------------------------- corpus, baselines
def test_corpus_split_and_disk_cache(tmp_path):
    assert set(HELDOUT_FAMILIES) <= set(FAMILIES)
    entries = build_corpus(["random", "opt"], split="train")
    assert entries and all(e.split == "train" and e.family == "random" for e in entries)
    calls = []

    def builder():
        calls.append(1)
        return random_graph(5)

    first = load_graph("r5", builder, tmp_path)
    second = load_graph("r5", builder, tmp_path)
    assert str(first) == str(second) and len(calls) == 1
    assert list(tmp_path.rglob("r5.kir"))


def test_baselines_share_cost_and_cache(small_corpus):
    cache = TransitionCache(action_set("base"))
    cost = CostModel("op_count")
    graphs = [e.graph for e in small_corpus[-4:]]
    order = search_fixed_order(graphs, cost, cache, length=8, iterations=20)
    assert 0 < len(order) <= 8
    for graph in graphs:
        default = default_fixpoint(graph, cost, cache)
        for outcome in (
            greedy(graph, cost, cache, 8),
            random_search(graph, cost, cache, 8, seed=1),
            random_rollout(graph, cost, cache, 8, seed=1),
        ):
            assert outcome.cost <= outcome.initial_cost and outcome.applications > 0
        assert default.cost < default.initial_cost


# ----------------------------------------------------------------------------- learned pipeline
@pytest.mark.parametrize("name", list(MODELS))
def test_learned_pipeline_compiles_test_models(name):
    builder, inputs_fn = MODELS[name]
    model = builder()
    args, kwargs = inputs_fn()
    with torch.no_grad():
        expected = [t.numpy() for t in pytree.tree_leaves(model(*args, **kwargs))]
    compiled = kiln.compile(model, args, passes="learned", example_kwargs=kwargs)
    with torch.no_grad():
        got = [t.numpy() for t in pytree.tree_leaves(compiled(*args, **kwargs))]
    _assert_close(got, expected, name)


def test_learned_pipeline_is_deterministic_and_never_worse_than_default(small_corpus):
    pipeline = learned_pipeline()
    cost = CostModel(pipeline.policy.cost, pipeline.policy.machine)
    for entry in small_corpus:
        first = pipeline.run(entry.graph)
        trace = pipeline.last.trace
        second = pipeline.run(entry.graph)
        assert str(first.graph) == str(second.graph) and pipeline.last.trace == trace
        assert cost.fn(first.graph) <= pipeline.last.default_cost


# ----------------------------------------------------------------------------- training
def test_short_training_beats_the_random_policy():
    pytest.importorskip("sb3_contrib")
    from kiln.passes.ordering.learned import rollout
    from kiln.tuning.rl.train import TrainConfig, train

    corpus = [random_graph(seed, size=18) for seed in range(4)]
    config = TrainConfig(steps=3072, budget=8, n_envs=4, n_steps=128, batch_size=128, seed=0)
    result = train(config, [_entry(g) for g in corpus])
    policy = result.policy
    cache = TransitionCache(policy.action_set())
    cost = CostModel(policy.cost)
    learned = np.mean([rollout(policy, g, cache, cost).cost / cost(cache, cache.intern(g)) for g in corpus])
    rand = np.mean(
        [random_rollout(g, cost, cache, config.budget, seed=s).improvement for g in corpus for s in range(10)]
    )
    print(
        f"\nlearned keeps {learned:.3f} of the cost; random policy removes {rand:.3f}; "
        f"{result.steps_per_second:.0f} env steps/s"
    )
    assert 1 - learned > rand + 0.05


def _entry(graph: ir.Graph):
    from kiln.tuning.rl.corpus import CorpusEntry

    return CorpusEntry(graph.name, "random", "train", graph)


def test_random_variances_are_positive_inside_fused_bodies_too():
    """A batch norm folded into a fused convolution (or a training step's running-variance
    update) reads its variance through a fused body: random arguments must still make it
    positive, or every timed build computes NaN and no output comparison means anything."""
    from kiln.passes.fusion import fuse_groups, partition

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    graph = kiln.capture(net, (torch.randn(1, 3, 8, 8),))
    fused = fuse_groups(graph, partition(graph))
    assert not any(n.op_name == "batch_norm" for n in fused.nodes)  # only inside a fused body
    for g in (graph, fused):
        _, params = random_arguments(g, seed=0)
        var = [p for v, p in zip(g.params, params) if v.name.endswith("running_var")]
        assert var and all((p >= 0.5).all() for p in var)
