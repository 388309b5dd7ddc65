"""``kiln tune-passes``: train a pass-ordering agent, evaluate it against every baseline on
the training corpus and the held-out families, and write a report.

::

    kiln tune-passes --out runs/op_count --cost op_count --steps 60000
    kiln tune-passes --out runs/rt --cost runtime --actions extended --ship
    kiln tune-passes --out runs/eval --policy kiln/passes/ordering/policy.npz   # evaluate only

Writes ``<out>/policy.npz`` (the numpy policy), ``<out>/checkpoints/`` (MaskablePPO
checkpoints), ``<out>/report.md`` (summary and per-graph tables), ``<out>/report.json`` and
``<out>/report.png`` (the summary as a bar chart, when matplotlib is installed).  ``--ship``
also copies the policy to ``kiln/passes/ordering/policy.npz``, the one ``passes="learned"``
uses.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from kiln.passes.ordering.learned import SHIPPED_POLICY, PolicyNet
from kiln.passes.ordering.transitions import TransitionCache
from kiln.tuning.rl.corpus import build_corpus
from kiln.tuning.rl.costs import cost_model


def run(args: argparse.Namespace) -> int:
    from kiln.tuning.rl.baselines import search_fixed_order
    from kiln.tuning.rl.evaluate import evaluate
    from kiln.tuning.rl.train import config_from_args, train

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = config_from_args(args)
    start = time.perf_counter()
    corpus = build_corpus(size=config.size)
    training = [e for e in corpus if e.split == "train" and e.family in config.families]
    print(
        f"corpus: {len(training)} training graphs, {sum(e.split == 'heldout' for e in corpus)} held out "
        f"({time.perf_counter() - start:.0f}s)"
    )
    if args.policy:
        policy = PolicyNet.load(args.policy)
        print(f"policy: {args.policy} (cost {policy.cost}, {len(policy.actions)} actions)")
    else:
        result = train(config, training, out_dir=out)
        policy = result.policy
        print(
            f"trained {config.steps} steps in {result.seconds:.0f}s ({result.steps_per_second:.0f} steps/s)"
        )
    cache = TransitionCache(policy.action_set())
    fixed = search_fixed_order(
        [e.graph for e in training],
        cost_model(policy.cost, policy.machine),
        cache,
        policy.budget,
        iterations=args.search_iterations,
        seed=config.seed,
    )
    print("best fixed order on the training corpus: " + ",".join(cache.actions[a].name for a in fixed))
    evaluation = evaluate(
        [e for e in corpus if e.split == "heldout" or e in training],
        policy,
        fixed=fixed,
        cache=cache,
        seed=config.seed,
    )
    evaluation.meta["policy_info"] = policy.info
    report = evaluation.markdown()
    (out / "report.md").write_text(f"# Pass ordering report\n\n{report}\n")
    (out / "report.json").write_text(evaluation.to_json())
    try:
        evaluation.plot(out / "report.png")
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(evaluation.markdown(per_graph=False))
    if args.ship:
        shutil.copyfile(out / "policy.npz" if not args.policy else args.policy, SHIPPED_POLICY)
        print(f"shipped: {SHIPPED_POLICY}")
    print(f"report: {out / 'report.md'}")
    return 0


def build_parser(prog: str = "kiln tune-passes") -> argparse.ArgumentParser:
    from kiln.tuning.rl.train import add_train_arguments

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train a pass-ordering agent (MaskablePPO), "
        "evaluate it against the baselines and write a report.",
    )
    add_train_arguments(parser)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--policy", default=None, help="evaluate this policy.npz instead of training")
    parser.add_argument(
        "--search-iterations",
        dest="search_iterations",
        type=int,
        default=300,
        help="hill-climbing steps of the best-fixed-order baseline",
    )
    parser.add_argument("--ship", action="store_true", help="install the policy as kiln's shipped policy")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "kiln tune-passes") -> int:
    return run(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
