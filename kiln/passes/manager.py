"""The pass manager: runs a pipeline of passes with verification, IR dumps and statistics.

A pipeline is a list of :class:`~kiln.passes.base.Pass` objects or its text form::

    PassManager("canonicalize,simplify,cse,dce")
    PassManager("fold{max_elements=1024},cse", fixpoint=True)

Pass names are looked up in the pass registry; options in braces are parsed to the types
of the pass's dataclass fields (ints, floats, bools ``true``/``false``, strings bare or
double-quoted, lists ``[1,2]``, ``none`` for optional fields).

Options of :class:`PassManager`:

* ``verify=True``: run :func:`kiln.ir.verify` on the input and after every pass.
* ``dump_dir=None``: write the IR text of the input (``00-input.kir``) and after every pass
  (``01-<pass>.kir``, ``02-<pass>.kir``, ...) into this folder.  When ``None``, the
  environment variable ``KILN_DUMP_IR=<dir>`` enables the dump.
* ``collect_stats=True``: record per pass wall time, node counts and op histograms
  before/after, and whether it changed the graph (:attr:`PassManager.stats`,
  :meth:`PassManager.report`).
* ``fixpoint=False`` / ``max_iterations=8``: repeat the whole pipeline until no pass
  changes the graph (at most ``max_iterations`` times).
* ``check_input_unchanged=False``: after each pass, check that it left its input graph as
  it was (passes are functional); a debugging aid used by the tests.

Failures (an exception inside a pass, or verification failing after it) raise
:class:`PassError` naming the pass and the passes that ran before it, chained to the
original exception.  The graph given to :meth:`PassManager.run` is never modified.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.ir import Graph, KilnError
from kiln.passes.base import _PASSES, Pass, PassResult, load_passes

DUMP_ENV_VAR = "KILN_DUMP_IR"


class PassError(KilnError):
    """A pass failed, or the IR it produced does not verify.

    Attributes: ``pass_name``, ``previous`` (specs of the passes that ran before it, in
    order) and ``graph`` (the input the failing pass was given).
    """

    def __init__(self, message: str, pass_name: str, previous: Sequence[str], graph: Graph | None):
        self.pass_name = pass_name
        self.previous = list(previous)
        self.graph = graph
        super().__init__(message)


class PipelineSyntaxError(KilnError, ValueError):
    """Malformed pipeline text, an unknown pass name or an unknown/ill-typed option."""


# ------------------------------------------------------------------------ pipeline text
def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside braces, brackets and double quotes."""
    parts, depth, quoted, cur = [], 0, False, []
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif not quoted and ch in "{[":
            depth += 1
        elif not quoted and ch in "}]":
            depth -= 1
            if depth < 0:
                raise PipelineSyntaxError(f"unbalanced {ch!r} in pipeline {text!r}")
        if ch == sep and depth == 0 and not quoted:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if depth != 0 or quoted:
        raise PipelineSyntaxError(f"unbalanced braces, brackets or quotes in pipeline {text!r}")
    parts.append("".join(cur))
    return parts


def _convert(text: str, hint: Any, where: str) -> Any:
    """Convert option text to the type ``hint`` (a resolved type annotation)."""
    text = text.strip()
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if text.lower() == "none" and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(text, arg, where)
            except PipelineSyntaxError as e:
                errors.append(str(e))
        raise PipelineSyntaxError(f"{where}: cannot read {text!r} as {hint}")
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        if not (text.startswith("[") and text.endswith("]")):
            raise PipelineSyntaxError(f"{where}: expected a list like [1,2], got {text!r}")
        inner = text[1:-1].strip()
        items = _split_top(inner) if inner else []
        elem = args[0] if args else str
        values = [_convert(item, elem, where) for item in items]
        return tuple(values) if origin is tuple or hint is tuple else values
    if hint is bool:
        if text.lower() in ("true", "1", "yes"):
            return True
        if text.lower() in ("false", "0", "no"):
            return False
        raise PipelineSyntaxError(f"{where}: expected true or false, got {text!r}")
    if hint in (int, float):
        try:
            return hint(text)
        except ValueError:
            raise PipelineSyntaxError(f"{where}: expected {hint.__name__}, got {text!r}") from None
    if hint is str:
        if len(text) >= 2 and text[0] == text[-1] == '"':
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                raise PipelineSyntaxError(f"{where}: bad quoted string {text!r}") from None
        return text
    raise PipelineSyntaxError(f"{where}: options of type {hint} cannot be given in pipeline text")


def _parse_one(item: str) -> Pass:
    item = item.strip()
    if not item:
        raise PipelineSyntaxError("empty pass name in pipeline (two commas in a row?)")
    name, _, rest = item.partition("{")
    name = name.strip()
    if rest and not rest.rstrip().endswith("}"):
        raise PipelineSyntaxError(f"pass {name!r}: options must be written as {name}{{key=value,...}}")
    load_passes()
    cls = _PASSES.get(name)
    if cls is None:
        raise PipelineSyntaxError(
            f"unknown pass {name!r}; registered passes: {', '.join(sorted(_PASSES)) or 'none'}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    options: dict[str, Any] = {}
    body = rest.rstrip()[:-1] if rest else ""
    for opt in (_split_top(body) if body.strip() else []):
        key, eq, value = opt.partition("=")
        key = key.strip()
        if not eq:
            raise PipelineSyntaxError(f"pass {name!r}: option {opt.strip()!r} is not key=value")
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise PipelineSyntaxError(f"pass {name!r} has no option {key!r}; its options: {known}")
        options[key] = _convert(value, hints[key], f"pass {name!r} option {key!r}")
    return cls(**options)


def parse_pipeline(text: str) -> list[Pass]:
    """Parse ``"canonicalize,cse,fuse{max_nodes=16}"`` into pass objects (empty text = [])."""
    if not text.strip():
        return []
    return [_parse_one(item) for item in _split_top(text)]


def pipeline_text(passes: Sequence[Pass]) -> str:
    """The text form of a list of passes (inverse of :func:`parse_pipeline`)."""
    return ",".join(p.spec() for p in passes)


# -------------------------------------------------------------------------------- stats
@dataclass(frozen=True)
class PassStats:
    """What one pass run did."""

    pass_spec: str
    iteration: int
    seconds: float
    nodes_before: int
    nodes_after: int
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    changed: bool

    def op_delta(self) -> dict[str, int]:
        """Per op kind: count after minus count before (only kinds that changed)."""
        kinds = set(self.ops_before) | set(self.ops_after)
        delta = {k: self.ops_after.get(k, 0) - self.ops_before.get(k, 0) for k in sorted(kinds)}
        return {k: d for k, d in delta.items() if d}


# ------------------------------------------------------------------------------ manager
def _verify(graph: Graph) -> None:
    from kiln.ir import verify

    verify(graph)


class PassManager:
    """Runs a pipeline of passes. See the module docstring for the options and guarantees.

    ``passes`` is pipeline text, or a list whose entries are pass objects (anything with
    ``run(graph)``, including another :class:`PassManager`) or pipeline text.
    """

    name = "pipeline"

    def __init__(self, passes: Sequence[Pass | str] | str, *, verify: bool = True,
                 dump_dir: str | os.PathLike | None = None, collect_stats: bool = True,
                 fixpoint: bool = False, max_iterations: int = 8,
                 check_input_unchanged: bool = False):
        if isinstance(passes, str):
            passes = [passes]
        self.passes: list[Pass] = []
        for entry in passes:
            self.passes.extend(parse_pipeline(entry) if isinstance(entry, str) else [entry])
        for p in self.passes:
            if not callable(getattr(p, "run", None)):
                raise TypeError(f"pipeline entry {p!r} has no run(graph) method")
        if max_iterations < 1:
            raise ValueError(f"max_iterations must be >= 1, got {max_iterations}")
        self.verify = verify
        self.dump_dir = dump_dir
        self.collect_stats = collect_stats
        self.fixpoint = fixpoint
        self.max_iterations = max_iterations
        self.check_input_unchanged = check_input_unchanged
        self.stats: list[PassStats] = []

    def spec(self) -> str:
        """The pipeline as text; ``PassManager(pm.spec())`` builds an equal pipeline."""
        return pipeline_text(self.passes)

    def __repr__(self) -> str:
        return f"PassManager({self.spec()!r})"

    def __call__(self, graph: Graph) -> PassResult:
        return self.run(graph)

    def run(self, graph: Graph) -> PassResult:
        """Run the pipeline on ``graph``; the result's ``changed`` is True if any pass changed it."""
        self.stats = []
        ran: list[str] = []
        dump = self._dump_folder()
        step = 0
        if dump is not None:
            (dump / "00-input.kir").write_text(str(graph) + "\n")
        if self.verify:
            self._check(graph, "<input>", ran, graph)
        current, changed_any = graph, False
        for iteration in range(self.max_iterations if self.fixpoint else 1):
            changed_now = False
            for p in self.passes:
                spec = _spec_of(p)
                result = self._run_one(p, spec, current, ran, iteration)
                ran.append(spec)
                step += 1
                if dump is not None:
                    (dump / f"{step:02d}-{_file_safe(spec)}.kir").write_text(str(result.graph) + "\n")
                changed_now |= result.changed
                current = result.graph
            changed_any |= changed_now
            if not changed_now:
                break
        return PassResult(current, changed_any)

    def _run_one(self, p: Any, spec: str, graph: Graph, ran: list[str], iteration: int) -> PassResult:
        before_text = str(graph) if self.check_input_unchanged else None
        ops_before = graph.op_histogram() if self.collect_stats else {}
        start = time.perf_counter()
        try:
            result = p.run(graph)
            if isinstance(result, Graph):  # tolerate plain Graph-returning callables
                result = PassResult(result, result is not graph)
        except Exception as e:
            raise PassError(f"pass {spec!r} failed{_after(ran)}: {type(e).__name__}: {e}",
                            spec, ran, graph) from e
        seconds = time.perf_counter() - start
        if before_text is not None and str(graph) != before_text:
            raise PassError(f"pass {spec!r} modified its input graph{_after(ran)}; passes must "
                            f"clone the graph and edit the clone", spec, ran, graph)
        if self.verify:
            self._check(result.graph, spec, ran, graph)
        if self.collect_stats:
            ops_after = result.graph.op_histogram()
            self.stats.append(PassStats(spec, iteration, seconds, sum(ops_before.values()),
                                        sum(ops_after.values()), ops_before, ops_after,
                                        result.changed))
        return result

    def _check(self, result: Graph, spec: str, ran: list[str], given: Graph) -> None:
        try:
            _verify(result)
        except Exception as e:
            what = "the input graph" if spec == "<input>" else f"the graph produced by pass {spec!r}"
            raise PassError(f"IR verification failed on {what}{_after(ran)}: {e}",
                            spec, ran, given) from e

    def _dump_folder(self) -> Path | None:
        target = self.dump_dir if self.dump_dir is not None else os.environ.get(DUMP_ENV_VAR)
        if not target:
            return None
        folder = Path(target)
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def report(self) -> str:
        """A table of :attr:`stats`: one row per pass run, with a total line."""
        if not self.stats:
            return "(no passes ran; stats are collected by run() when collect_stats=True)"
        width = max(len("total"), *(len(s.pass_spec) for s in self.stats))
        head = f"{'pass':<{width}}  {'iter':>4}  {'ms':>8}  {'nodes':>13}  changed  op changes"
        lines = [head, "-" * len(head)]
        for s in self.stats:
            delta = ", ".join(f"{k}{d:+d}" for k, d in s.op_delta().items())
            nodes = f"{s.nodes_before}->{s.nodes_after}"
            lines.append(f"{s.pass_spec:<{width}}  {s.iteration:>4}  {s.seconds * 1e3:>8.2f}  "
                         f"{nodes:>13}  {'yes' if s.changed else 'no':<7}  {delta}".rstrip())
        total = sum(s.seconds for s in self.stats)
        first, last = self.stats[0].nodes_before, self.stats[-1].nodes_after
        lines.append("-" * len(head))
        lines.append(f"{'total':<{width}}  {'':>4}  {total * 1e3:>8.2f}  {f'{first}->{last}':>13}")
        return "\n".join(lines)


def _spec_of(p: Any) -> str:
    spec = getattr(p, "spec", None)
    if callable(spec):
        return spec()
    return getattr(p, "name", None) or type(p).__name__


def _after(ran: Sequence[str]) -> str:
    return f" (after: {', '.join(ran)})" if ran else " (it was the first pass)"


def _file_safe(spec: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in spec)[:80]
