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
