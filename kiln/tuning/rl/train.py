"""Training a pass-ordering agent with MaskablePPO (sb3-contrib), and exporting its policy.

::

    python -m kiln.tuning.rl.train --steps 60000 --cost runtime --seed 0 --out runs/rt
    kiln tune-passes --steps 60000 --cost runtime --out runs/rt     # train + evaluate + report

All environments of a run share one :class:`~kiln.passes.ordering.transitions.TransitionCache`,
so a pass runs once per (graph, action) however many episodes visit that graph.  A run is
reproducible from its seed (corpus order, environment draws, network initialization and
PPO's sampling are all seeded; torch is single-threaded during training).  Checkpoints of the
full agent go to ``<out>/checkpoints``; the exported numpy policy to ``<out>/policy.npz``.
Needs ``pip install kiln[rl]`` (gymnasium, stable-baselines3, sb3-contrib).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.passes.ordering.learned import PolicyNet
from kiln.passes.ordering.transitions import TransitionCache
from kiln.tuning.rl.corpus import FAMILIES, HELDOUT_FAMILIES, CorpusEntry, build_corpus
from kiln.tuning.rl.costs import COSTS

TRAIN_FAMILIES = tuple(f for f in FAMILIES if f not in HELDOUT_FAMILIES)


@dataclass
class TrainConfig:
    """Everything a training run depends on (saved beside its policy)."""

    steps: int = 60_000
    cost: str = "op_count"
    actions: str = "base"
    budget: int = 12
    history: int = 2
    observe_mask: bool = False
    """Observations without the mask let the policy run lazily (see ``learned.rollout``)."""
    machine: str = "cpu"
    families: tuple[str, ...] = TRAIN_FAMILIES
    size: str = "full"
    seed: int = 0
    n_envs: int = 4
    n_steps: int = 128
    batch_size: int = 128
    n_epochs: int = 4
    learning_rate: float = 3e-4
    ent_coef: float = 0.01
    gamma: float = 1.0
    net_arch: tuple[int, ...] = (64, 64)
    checkpoint_every: int = 20_000
    progress_bar: bool = False
    verify: bool = False
    """Verify every graph a pass produces (off for speed: the passes are tested separately)."""


@dataclass
class TrainResult:
    policy: PolicyNet
    model: Any = field(repr=False)
    seconds: float = 0.0
    steps_per_second: float = 0.0
    episode_returns: list[float] = field(default_factory=list)


def _require_rl():
    try:
        import gymnasium  # noqa: F401
        import sb3_contrib
        import stable_baselines3
    except ImportError as e:
        raise ImportError(
            f"training needs gymnasium, stable-baselines3 and sb3-contrib ({e}); "
            "install them with pip install 'kiln[rl]'"
        ) from e
    return sb3_contrib, stable_baselines3


def make_envs(corpus: Sequence[CorpusEntry], config: TrainConfig, cache: TransitionCache | None = None):
    """A ``DummyVecEnv`` of ``config.n_envs`` environments sharing one transition cache."""
    _require_rl()
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    from kiln.passes.ordering.actions import action_set
    from kiln.tuning.rl.env import PassOrderingEnv

    shared = cache if cache is not None else TransitionCache(action_set(config.actions), verify=config.verify)

    def factory(rank: int):
        def make():
            env = PassOrderingEnv(
                corpus,
                cost=config.cost,
                budget=config.budget,
                history=config.history,
                observe_mask=config.observe_mask,
                machine=config.machine,
                cache=shared,
            )
            env.reset(seed=config.seed * 1000 + rank)
            return Monitor(env)

        return make

    return DummyVecEnv([factory(i) for i in range(config.n_envs)])


def export_policy(model: Any, env: Any, config: TrainConfig, info: dict[str, Any] | None = None) -> PolicyNet:
    """The numpy :class:`PolicyNet` of a trained ``MaskablePPO`` model."""
    import torch

    base = env.envs[0].unwrapped
    hidden = []
    for layer in model.policy.mlp_extractor.policy_net:
        if isinstance(layer, torch.nn.Linear):
            hidden.append((layer.weight.detach().double().numpy(), layer.bias.detach().double().numpy()))
        elif not isinstance(layer, torch.nn.Tanh):
            raise TypeError(f"cannot export policy layer {layer!r}: only Linear and Tanh are supported")
    head = model.policy.action_net
    return PolicyNet(
        hidden,
        (head.weight.detach().double().numpy(), head.bias.detach().double().numpy()),
        tuple(a.name for a in base.actions),
        base.observation_spec.op_names,
        config.history,
        config.budget,
        config.cost,
        config.machine,
        config.observe_mask,
        dict(info or {}),
    )


def train(
    config: TrainConfig,
    corpus: Sequence[CorpusEntry] | None = None,
    out_dir: str | Path | None = None,
    cache: TransitionCache | None = None,
) -> TrainResult:
    """Train MaskablePPO on ``corpus`` (default: the training split of ``config.families``)."""
    sb3_contrib, _ = _require_rl()
    import torch
    from stable_baselines3.common.callbacks import CheckpointCallback

    corpus = (
        list(corpus) if corpus is not None else build_corpus(config.families, split="train", size=config.size)
    )
    if not corpus:
        raise ValueError("the training corpus is empty")
    torch.manual_seed(config.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small networks: one thread is faster and reproducible
    envs = make_envs(corpus, config, cache)
    model = sb3_contrib.MaskablePPO(
        "MlpPolicy",
        envs,
        n_steps=config.n_steps,
        batch_size=config.batch_size,
        n_epochs=config.n_epochs,
        learning_rate=config.learning_rate,
        ent_coef=config.ent_coef,
        gamma=config.gamma,
        seed=config.seed,
        policy_kwargs={"net_arch": {"pi": list(config.net_arch), "vf": list(config.net_arch)}},
        verbose=0,
    )
    callbacks = []
    if out_dir is not None:
        every = max(1, config.checkpoint_every // config.n_envs)
        callbacks.append(CheckpointCallback(every, str(Path(out_dir) / "checkpoints"), name_prefix="ppo"))
    start = time.perf_counter()
    try:
        model.learn(
            total_timesteps=config.steps, callback=callbacks or None, progress_bar=config.progress_bar
        )
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    returns = [float(r) for e in envs.envs for r in e.get_episode_rewards()]
    info = {
        "config": asdict(config),
        "seconds": round(seconds, 1),
        "corpus": [e.name for e in corpus],
        "final_mean_return": float(np.mean(returns[-200:])) if returns else None,
    }
    policy = export_policy(model, envs, config, info)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        policy.save(Path(out_dir) / "policy.npz")
        model.save(str(Path(out_dir) / "ppo_final"))
    return TrainResult(policy, model, seconds, config.steps / seconds if seconds else 0.0, returns)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None}
    if "families" in fields:
        fields["families"] = tuple(fields["families"].split(","))
    if "net_arch" in fields:
        fields["net_arch"] = tuple(int(x) for x in fields["net_arch"].split(","))
    return TrainConfig(**fields)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by this module's command line and ``kiln tune-passes``."""
    d = TrainConfig()
    parser.add_argument("--steps", type=int, default=d.steps, help="environment steps (default %(default)s)")
    parser.add_argument("--cost", default=d.cost, choices=COSTS)
    parser.add_argument("--actions", default=d.actions, help="action set: base or extended")
    parser.add_argument("--budget", type=int, default=d.budget, help="steps per episode")
    parser.add_argument("--machine", default=d.machine, help="machine model for --cost runtime: cpu or gpu")
    parser.add_argument(
        "--families",
        default=None,
        help=f"comma-separated training families (default: {','.join(TRAIN_FAMILIES)})",
    )
    parser.add_argument("--size", default=d.size, choices=("small", "full"))
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument(
        "--observe-mask",
        dest="observe_mask",
        action="store_true",
        default=False,
        help="put the action mask in observations (slower inference: every action is tried at every step)",
    )
    parser.add_argument("--n-envs", dest="n_envs", type=int, default=d.n_envs)
    parser.add_argument("--net-arch", dest="net_arch", default=None, help="hidden sizes, e.g. 64,64")
    parser.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=d.checkpoint_every)
    parser.add_argument(
        "--no-progress", dest="progress_bar", action="store_false", default=True, help="hide the progress bar"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kiln.tuning.rl.train", description="Train a MaskablePPO pass-ordering agent."
    )
    add_train_arguments(parser)
    parser.add_argument("--out", required=True, help="output folder (policy.npz, checkpoints)")
    args = parser.parse_args(argv)
    config = config_from_args(args)
    result = train(config, out_dir=args.out)
    print(
        f"trained {config.steps} steps in {result.seconds:.0f}s ({result.steps_per_second:.0f} steps/s); "
        f"policy written to {Path(args.out) / 'policy.npz'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
