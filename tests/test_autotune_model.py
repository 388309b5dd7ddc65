"""Autotuning at the model level (records applied when the cpu backend builds a kernel), the
cost model, and the ``kiln/ScheduleKernel-v0`` environment with legality as its mask."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("islpy")

import kiln  # noqa: E402
import kiln.loops as kl  # noqa: E402
from kiln.backends.common.records import Record, RecordStore, machine_key, structural_key  # noqa: E402
from kiln.tuning.autotune.costmodel import CostModel, rank_correlation  # noqa: E402
from kiln.tuning.autotune.model import tune_model  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Softmax(-1)).eval()


def test_tuned_records_are_replayed_by_the_next_cpu_build(tmp_path, one_torch_thread):
    model, x = _model(), torch.randn(16, 32)
    before = kiln.compile(model, (x,), backend="cpu", cache_dir=str(tmp_path), threads=2)
    result = tune_model(model, (x,), budget_s=4, cache_dir=str(tmp_path), threads=2, min_kernel_s=1, workers=1)
    assert result.results, result.summary()
    tuned = list(result.results.values())
    for r in tuned:
        assert r.schedule.verify()
    # one kernel gets a schedule no default strategy makes (the fastest record wins)
    program = tuned[0].program
    s = kl.Schedule(program)
    s.unroll(s.loops()[-1], 3)
    RecordStore(tmp_path).add(Record(structural_key(program), machine_key(2), s.trace, 1e-9, 1e-6))
    after = kiln.compile(model, (x,), backend="cpu", cache_dir=str(tmp_path), threads=2)
    assert not after.executable.info["cache_hit"]  # the records are part of the build's cache key
    traces = list(after.executable.info["schedules"].values())
    assert s.trace in traces and s.trace not in before.executable.info["schedules"].values()
    store = RecordStore(tmp_path)
    for r in tuned[1:]:
        assert store.lookup(r.key, machine_key(2)).trace in traces
    torch.testing.assert_close(after(x), model(x), rtol=1e-5, atol=1e-6)
    again = tune_model(model, (x,), budget_s=2, cache_dir=str(tmp_path), threads=2, min_kernel_s=1, workers=1)
    assert set(result.results) <= {k for k, why in again.skipped.items() if why == "has a record"}


def test_tune_model_refuses_a_non_positive_budget():
    with pytest.raises(ValueError, match="budget must be positive"):
        tune_model(_model(), (torch.randn(2, 32),), budget_s=0)


# ----------------------------------------------------------------------------- cost model
def test_rank_correlation_is_spearmans_rho():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    a, b = rng.random(40), rng.random(40)
    b[:5] = b[5]  # ties
    assert rank_correlation(a, b) == pytest.approx(scipy_stats.spearmanr(a, b).statistic)
    assert rank_correlation([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="equal length"):
        rank_correlation([1, 2], [1])


def test_cost_model_ranks_held_out_rows():
    rng = np.random.default_rng(1)
    X = rng.random((200, 6))
    y = 2 * X[:, 0] - X[:, 1] + 0.05 * rng.standard_normal(200)
    model = CostModel().fit(X[:150], y[:150])
    assert rank_correlation(model.predict_speedup(X[150:]), y[150:]) > 0.8
    assert np.all(np.argsort(model.predict(X[150:])) == np.argsort(-model.predict_speedup(X[150:])))
    with pytest.raises(RuntimeError, match="fit it first"):
        CostModel().predict([[0.0] * 6])


# ----------------------------------------------------------------------------- the environment
def test_schedule_env_passes_gymnasiums_checker_and_masks_illegal_steps():
    gym = pytest.importorskip("gymnasium")
    from gymnasium.utils.env_checker import check_env

    import kiln.tuning.autotune as at

    env = gym.make(at.ENV_ID).unwrapped
    check_env(env)
    obs, info = env.reset(seed=0, options={"index": 0})  # the matmul: k carries its reduction
    assert env.observation_space.contains(obs)
    mask = env.action_masks()
    assert mask[-1] and mask.sum() > 1
    for index, (slot, kind) in enumerate(env.actions[:-1]):
        steps = env._step_of(slot, kind)
        if steps is None:
            assert not mask[index]
            continue
        trial = env.schedule.copy()
        try:
            for s in steps:
                trial.apply(s["primitive"], **s["args"])
            legal = True
        except (kl.IllegalTransformError, kl.ScheduleError):
            legal = False
        assert legal == bool(mask[index]), (slot, kind)
    k = env.schedule.loops().index("k")
    assert not mask[env.actions.index((k, "parallel"))]
    obs, reward, terminated, truncated, info = env.step(env.actions.index((0, "parallel")))
    assert reward == 0.0 and not terminated and env.schedule.verify()
    before = env.schedule.trace[:]
    obs, reward, *_ = env.step(env.actions.index((k, "parallel")))  # masked: nothing changes
    assert reward < 0 and env.schedule.trace == before


def test_episodes_can_start_from_the_default_schedule():
    """``start="default"``: an episode begins with kiln's default schedule replayed (checked),
    stopping at once is the default's own time (reward 0), and the mask is still exactly
    the legal steps from there."""
    pytest.importorskip("gymnasium")
    from gymnasium.utils.env_checker import check_env

    from kiln.backends.cpu.schedules import strategy_schedule
    from kiln.tuning.autotune.env import ScheduleKernelEnv

    env = ScheduleKernelEnv(max_steps=3, threads=2, start="default")
    check_env(env)
    env.reset(seed=0, options={"index": 0})
    static, _, kind = env.kernels[0]
    assert env.schedule.trace == strategy_schedule(static, kind, threads=2).trace and env.schedule.trace
    assert env.schedule.verify()
    _, reward, terminated, *_ = env.step(len(env.actions) - 1)
    assert terminated and reward == 0.0
    with pytest.raises(ValueError, match="start must be"):
        ScheduleKernelEnv(start="somewhere")


def test_loop_features_see_the_stride_and_the_reduction_of_each_loop():
    """mvt's second nest reads ``A[j][i]`` along ``j``: strided there, unit-stride along
    ``i``; both nests carry their reduction on ``j``.  Interchanging the second nest swaps
    what its loops see -- what the policy's per-slot observation tells it."""
    from kiln.tuning.autotune.features import LOOP_FEATURE_NAMES, loop_features

    mvt = kl.from_c("for (i = 0; i < N; i++) for (j = 0; j < N; j++) x1[i] = x1[i] + A[i][j] * y1[j];"
                    " for (i = 0; i < N; i++) for (j = 0; j < N; j++) x2[i] = x2[i] + A[j][i] * y2[j];")
    f = {name: dict(zip(LOOP_FEATURE_NAMES, v)) for name, v in loop_features(mvt).items()}
    i1, j1, i2, j2 = (loop.name for loop in mvt.loops())
    assert f[j1]["log_strided"] == 0 and f[j1]["log_unit"] > 0 and f[j1]["reduction"] == 1
    assert f[j2]["log_strided"] > 0 and f[j2]["reduction"] == 1
    assert f[i2]["log_unit"] > f[j2]["log_unit"] and f[i1]["reduction"] == 0
    s = kl.Schedule(mvt)
    s.interchange(i2, j2)
    g = {name: dict(zip(LOOP_FEATURE_NAMES, v)) for name, v in loop_features(s.program()).items()}
    inner = [loop.name for loop in s.program().loops()][-1]
    assert g[inner]["log_strided"] == 0 and g[inner]["reduction"] == 0


def test_policy_rollouts_measure_each_distinct_final_schedule():
    """``rollouts`` runs a policy's episodes on one kernel and keeps the fastest: a policy that
    always stops gives the default schedule, measured once however many episodes it runs."""
    pytest.importorskip("gymnasium")
    from kiln.backends.cpu.schedules import strategy_schedule
    from kiln.tuning.autotune.env import ScheduleKernelEnv

    env = ScheduleKernelEnv(max_steps=3, threads=1, start="default", repeat=1)
    seen = []

    def stop(obs, mask, deterministic):
        seen.append(deterministic)
        assert mask[-1] and obs.shape == env.observation_space.shape
        return len(env.actions) - 1

    r = env.rollouts(stop, 1, samples=3, remeasure=1)
    static, _, kind = env.kernels[1]
    assert seen == [True, False, False] and r["measurements"] == 1
    assert r["trace"] == strategy_schedule(static, kind, threads=1).trace and r["speedup"] > 0


def test_a_policy_cloned_from_a_greedy_demonstration_prefers_the_measured_best_step():
    """The greedy demonstration measures every legal step; ``clone`` fits the policy's scores
    to those gains, so the slot policy's choice in that state is the step measured fastest
    (``stop`` if none gained), and the demonstration's own steps were all legal."""
    pytest.importorskip("gymnasium")
    sb3_contrib = pytest.importorskip("sb3_contrib")
    from kiln.tuning.autotune.env import ScheduleKernelEnv, default_kernels
    from kiln.tuning.autotune.imitation import clone, greedy_demonstration
    from kiln.tuning.autotune.policy import SlotPolicy

    rows = [k for k in default_kernels() if k[2] == "reduction"]
    env = ScheduleKernelEnv([(rows[0][0], {"N": 32, "M": 128}, "reduction")], max_steps=2, threads=1,
                            start="default", repeat=1)
    demo = greedy_demonstration(env, 0, min_gain=1.0)
    assert demo.measurements >= len(demo.gains[0]) - 1 > 0
    assert all(mask[a] for mask, a in zip(demo.masks, demo.actions))
    assert demo.actions[-1] == len(env.actions) - 1 or len(demo.actions) == env.max_steps
    agent = sb3_contrib.MaskablePPO(SlotPolicy, env, n_steps=8, batch_size=8, seed=0, verbose=0)
    assert clone(agent, [demo], epochs=400) < 0.05
    first = demo.gains[0]
    action, _ = agent.predict(demo.observations[0], action_masks=demo.masks[0], deterministic=True)
    assert int(action) == max(first, key=first.get)


def test_dagger_labels_the_states_the_policy_itself_reaches():
    """``dagger`` runs the fitted policy and labels the states it visits with measured gains:
    the new episodes take the policy's own actions (legal ones), and they are fitted too."""
    pytest.importorskip("gymnasium")
    sb3_contrib = pytest.importorskip("sb3_contrib")
    from kiln.tuning.autotune.env import ScheduleKernelEnv, default_kernels
    from kiln.tuning.autotune.imitation import dagger, measured_episode
    from kiln.tuning.autotune.policy import SlotPolicy

    rows = [k for k in default_kernels() if k[2] == "reduction"]
    env = ScheduleKernelEnv([(rows[0][0], {"N": 32, "M": 128}, "reduction")], max_steps=2, threads=1,
                            start="default", repeat=1)
    first_legal = measured_episode(env, 0, lambda obs, mask, gains: int(np.flatnonzero(mask)[0]))
    assert first_legal.actions[0] == int(np.flatnonzero(first_legal.masks[0])[0])
    agent = sb3_contrib.MaskablePPO(SlotPolicy, env, n_steps=8, batch_size=8, seed=0, verbose=0)
    data = dagger(env, agent, [first_legal], epochs=50)
    assert len(data) == 2 and data[0] is first_legal
    mine = data[1]
    assert all(mask[a] for mask, a in zip(mine.masks, mine.actions))
    assert all(set(g) == set(np.flatnonzero(mask)) for g, mask in zip(mine.gains, mine.masks))


def test_slot_policy_refuses_an_observation_of_another_layout():
    pytest.importorskip("sb3_contrib")
    from kiln.tuning.autotune.policy import SlotScorer

    with pytest.raises(ValueError, match="not ScheduleKernelEnv's layout"):
        SlotScorer(10)


@pytest.mark.slow
def test_maskable_ppo_trains_on_the_environment():
    pytest.importorskip("gymnasium")
    sb3_contrib = pytest.importorskip("sb3_contrib")
    from kiln.tuning.autotune.env import ScheduleKernelEnv

    env = ScheduleKernelEnv(max_steps=3)
    agent = sb3_contrib.MaskablePPO("MlpPolicy", env, n_steps=12, batch_size=12, n_epochs=1, seed=0, verbose=0)
    agent.learn(total_timesteps=12)
    obs, _ = env.reset(seed=1)
    action, _ = agent.predict(obs, action_masks=env.action_masks(), deterministic=True)
    assert env.action_masks()[int(action)]


def test_kiln_tune_cli_parses_a_model_and_a_budget():
    from kiln.compiler.cli import build_parser, main

    args = build_parser().parse_args(["tune", "gpt2-s128-b1", "--budget", "600"])
    assert (args.model, args.budget) == ("gpt2-s128-b1", 600.0)
    assert build_parser().parse_args(["tune", "--trials", "8"]).budget is None  # MetaSchedule, as before
    with pytest.raises(SystemExit, match="needs a model and a positive budget"):
        main(["tune", "--budget", "5"])
    with pytest.raises(SystemExit, match="unknown model 'no-such-model'"):
        main(["tune", "no-such-model", "--budget", "5"])
