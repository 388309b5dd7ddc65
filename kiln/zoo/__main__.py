"""``python -m kiln.zoo``: run the model-zoo sweep (``kiln zoo`` is the same command)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

TABLE_BEGIN = "<!-- zoo-table:begin -->"
TABLE_END = "<!-- zoo-table:end -->"


def build_parser(prog: str = "python -m kiln.zoo") -> argparse.ArgumentParser:
    from .run import CHECKS

    parser = argparse.ArgumentParser(prog=prog, description="Run the kiln model zoo against PyTorch eager: "
                                     "inference, torch.compile, gradients, compile_train, fallback ops.")
    parser.add_argument("--models", help="comma-separated entry names (default: all; --list shows them)")
    parser.add_argument("--fast", action="store_true", help="only the CI subset (kiln.zoo.models.FAST)")
    parser.add_argument("--checks", help=f"comma-separated checks (default: all of {','.join(CHECKS)})")
    parser.add_argument("--skip-train", action="store_true", help="skip the compile_train check")
    parser.add_argument("--backend", default="cpu", help="kiln backend (default: cpu)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per model (default: 600)")
    parser.add_argument("--markdown", type=Path, help="write the table here; a file holding the markers "
                        f"{TABLE_BEGIN} ... {TABLE_END} gets only that part replaced")
    parser.add_argument("--json", type=Path, help="write every result (all checks, messages) as JSON")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for the eager references (default: 1)")
    return parser


def write_markdown(path: Path, table: str) -> None:
    """Replace the marked part of ``path`` with ``table`` (or write ``table`` as the file)."""
    block = f"{TABLE_BEGIN}\n{table}\n{TABLE_END}"
    if path.is_file():
        text = path.read_text()
        lines = text.split("\n")
        # markers count only on lines of their own, so prose may name them
        if TABLE_BEGIN in lines and TABLE_END in lines[lines.index(TABLE_BEGIN):]:
            begin = lines.index(TABLE_BEGIN)
            end = begin + lines[begin:].index(TABLE_END)
            path.write_text("\n".join(lines[:begin] + [block] + lines[end + 1:]))
            return
    path.write_text(block + "\n")


def main(argv: Sequence[str] | None = None, prog: str = "python -m kiln.zoo") -> int:
    """Run the sweep; the exit status is 0 when every model passes every check it ran."""
    args = build_parser(prog).parse_args(argv)
    import torch

    from .models import FAST, ZOO
    from .run import CHECKS, markdown_table, run_zoo, summary

    if args.list:
        for entry in ZOO.values():
            print(f"{entry.name:22} {entry.family:16} {entry.kind:16} {', '.join(entry.features)}")
        return 0
    names = args.models.split(",") if args.models else (list(FAST) if args.fast else None)
    if names is not None:
        unknown = [n for n in names if n not in ZOO]
        if unknown:
            print(f"{prog}: no zoo entry {', '.join(unknown)}; known: {', '.join(ZOO)}", file=sys.stderr)
            return 2
    checks = args.checks.split(",") if args.checks else list(CHECKS)
    bad = [c for c in checks if c not in CHECKS]
    if bad:
        print(f"{prog}: unknown check {', '.join(bad)}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    if args.skip_train:
        checks = [c for c in checks if c != "train"]
    torch.set_num_threads(max(1, args.threads))
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    warnings.filterwarnings("ignore", module="transformers")

    def progress(result) -> None:
        line = f"{result.name:22} {result.status:6} {result.seconds:6.1f}s"
        if result.first_error:
            line += f"  {result.first_error[:160]}"
        print(line, file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_zoo(names, checks, backend=args.backend, timeout=args.timeout, progress=progress)
    table = markdown_table(results)
    print(table)
    print()
    print(summary(results))
    if args.markdown:
        write_markdown(args.markdown, table)
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1, default=str))
    return 0 if all(r.status == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
