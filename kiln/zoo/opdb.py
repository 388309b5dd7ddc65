"""PyTorch's OpInfo database (``op_db``) as a sweep over kiln.

Every OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` with float32
sample inputs is run through kiln:

* each sample becomes a function of its tensor arguments (every non-tensor argument baked
  in), compiled with ``kiln.compile(fn, tensors, strict=True, backend=...)`` and compared
  with eager: floating-point outputs by the rule of :mod:`kiln.zoo.compare` (kiln's float32
  result against eager float64, within 1e-4 relative or within 10x of eager float32's own
  error), with an absolute floor of :data:`ATOL` per element for results that are zero;
  integer and bool outputs exactly;
* for differentiable ops, the gradients of ``(out * R).sum()`` with respect to every
  floating-point input, through ``torch.compile(fn, backend="kiln", options={"strict": True})``,
  against eager's, by the same rule.

Each op is then ``supported`` (every sample checked passes), ``refused`` (kiln raised
:class:`kiln.KilnError`, usually :class:`kiln.UnsupportedOpError`, whose message is kept),
``wrong`` (a result beyond tolerance, without an error) or ``foreign`` (any other exception).
An op whose only failures are refusals is ``refused`` even if some samples pass.

Run it with ``python -m kiln.zoo.opdb [--backend reference|cpu] [--ops a,b] [--markdown docs/ops.md]``.
The capture cache is turned off for the sweep (``KILN_CAPTURE_CACHE=0``, unless set): every
sample is a new function and caching would only cost time.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from kiln.zoo.compare import compare

STATUSES = ("supported", "refused", "wrong", "foreign")
ATOL = 1e-5
"""Absolute tolerance per element, for results whose exact value is (near) zero."""
MAX_SAMPLES = 3
MAX_GRAD_SAMPLES = 1
OP_BUDGET_S = 10.0
"""After this many seconds on one op no further samples of it are started."""

# Ops whose result is random: only the shapes and dtypes of their results can be compared.
RANDOM_OPS = {
    "bernoulli", "normal", "normal.number_mean", "normal.in_place", "uniform", "rand_like",
    "randn_like", "randint_like", "randint", "randn", "rand", "multinomial", "cauchy", "exponential",
    "geometric", "log_normal", "nn.functional.dropout", "nn.functional.dropout2d",
    "nn.functional.dropout3d", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.feature_alpha_dropout.without_train",
    "nn.functional.rrelu", "nn.functional.multi_head_attention_forward", "randperm", "empty",
    "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "torch.empty", "torch.empty_like", "torch.empty_strided",
}
# Ops whose eager gradient is itself wrong in the installed torch: their gradient is checked
# against an equivalent program in kiln's tests instead (named here), not against eager.
EAGER_GRADIENT_BUGS = {
    "as_strided_scatter": "torch 2.13's eager gradient with respect to self passes the cotangent at the "
                          "overwritten positions and zero elsewhere, the reverse of the true gradient; "
                          "kiln's is checked against clone + copy_ into an as_strided view "
                          "(tests/test_zoo_ops.py)",
}
# Ops whose result has no fixed values (uninitialized memory): only shapes are compared.
UNINITIALIZED_OPS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                     "empty_permuted"}


def op_key(info: Any) -> str:
    """``name`` or ``name.variant`` of an OpInfo."""
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def load_op_db() -> list[Any]:
    """The OpInfos of PyTorch's op database (imported lazily: the import takes seconds)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torch.testing._internal.common_methods_invocations import op_db
        except ImportError as e:
            raise ImportError(f"kiln.zoo.opdb needs PyTorch's test helpers, which import expecttest: "
                              f"pip install expecttest ({e})") from e
    return list(op_db)


# ------------------------------------------------------------------ results


@dataclass
class SampleResult:
    status: str
    message: str = ""
    what: str = "forward"


@dataclass
class OpResult:
    """One op's verdict on one backend."""

    op: str
    status: str
    message: str = ""
    samples: int = 0
    seconds: float = 0.0
    details: list[SampleResult] = field(default_factory=list)


def _first_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kiln_message(exc: BaseException) -> str:
    """The refusal text kept in the table: the reason, without the generic how-to-go-on."""
    from kiln.frontends.errors import UnsupportedOpError

    if isinstance(exc, UnsupportedOpError):
        reason = exc.reason or "the op is not supported by kiln"
        return _first_line(f"{exc.op}: {reason}")
    return _first_line(str(exc).split("\n")[0])


def _classify_exception(exc: BaseException) -> SampleResult:
    from kiln import KilnError

    if isinstance(exc, KilnError):
        return SampleResult("refused", _kiln_message(exc))
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 2)[-1]}:{tb[-1].lineno}" if tb else ""
    return SampleResult("foreign", _first_line(f"{type(exc).__name__}: {exc}{where}"))


# ------------------------------------------------------------------ samples


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


class SampleFunction:
    """One OpInfo sample as a function of its tensor arguments."""

    def __init__(self, info: Any, sample: Any):
        self.info = info
        self.structure = (sample.input, tuple(sample.args), dict(sample.kwargs))
        leaves, self.spec = pytree.tree_flatten(self.structure)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if _is_tensor(leaf)]
        self.leaves = leaves
        self.tensors = [leaves[i].detach().clone() for i in self.tensor_positions]
        self.output_process = getattr(sample, "output_process_fn_grad", None)

    @property
    def draws_random(self) -> bool:
        """The sample asks a deterministic op for random behaviour (``dropout_p > 0``): its
        values are compared by shape and dtype only, like a random op's."""
        p = self.structure[2].get("dropout_p", 0.0)
        return isinstance(p, (int, float)) and p > 0

    def call(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.leaves)
        for pos, t in zip(self.tensor_positions, tensors):
            leaves[pos] = t
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.info.op(inp, *args, **kwargs)

    def function(self) -> Callable[..., Any]:
        """A plain function with one named parameter per tensor (visible to torch.export)."""
        names = [f"t{i}" for i in range(len(self.tensors))]
        src = f"def {_py_name(op_key(self.info))}({', '.join(names)}):\n    return call({', '.join(names)})\n"
        scope: dict[str, Any] = {"call": self.call}
        exec(src, scope)  # noqa: S102 -- a generated signature, no user text
        return scope[_py_name(op_key(self.info))]


def _py_name(key: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", key)
    return f"op_{name}"


def _clone_inputs(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None,
                  requires_grad: bool = False) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        c = t.detach().clone()
        if dtype is not None and c.is_floating_point():
            c = c.to(dtype)
        if requires_grad and c.is_floating_point():
            c.requires_grad_(True)
        out.append(c)
    return out


def _outputs(out: Any) -> list[Any]:
    """The leaves of an op's result (tensors, numbers, bools, None)."""
    return pytree.tree_leaves(out)


# ------------------------------------------------------------------ comparison


def _same(actual: Any, eager32: Any, ref64: Any, exact_only: bool = False,
          shapes_only: bool = False) -> str | None:
    """``None`` when kiln's result matches eager's, else what differs."""
    got, want = _outputs(actual), _outputs(eager32)
    ref = _outputs(ref64) if ref64 is not None else None
    if len(got) != len(want):
        return f"{len(got)} results, eager has {len(want)}"
    if ref is not None and len(ref) != len(want):
        ref = None
    for i, (g, w) in enumerate(zip(got, want)):
        r = ref[i] if ref is not None else None
        problem = _same_leaf(g, w, r, shapes_only)
        if problem:
            return f"result {i}: {problem}"
    return None


def _same_leaf(g: Any, w: Any, r: Any, shapes_only: bool) -> str | None:
    if not _is_tensor(w):
        if _is_tensor(g):
            g = g.item() if g.numel() == 1 else g.tolist()
        if isinstance(w, float) and isinstance(g, (int, float)) and (
                math.isclose(g, w, rel_tol=1e-4, abs_tol=ATOL) or (math.isnan(g) and math.isnan(w))):
            return None
        return None if g == w else f"{g!r}, eager {w!r}"
    if not _is_tensor(g):
        return f"a {type(g).__name__}, eager a tensor"
    if tuple(g.shape) != tuple(w.shape):
        return f"shape {tuple(g.shape)}, eager {tuple(w.shape)}"
    if g.dtype != w.dtype:
        return f"dtype {g.dtype}, eager {w.dtype}"
    if shapes_only:
        return None
    if not (w.is_floating_point() or w.is_complex()):
        return None if torch.equal(g, w) else f"{w.dtype} values differ ({_mismatch(g, w)})"
    if r is None or not _is_tensor(r) or tuple(r.shape) != tuple(w.shape):
        r = w
    return _close(g, w, r)


def _mismatch(g: torch.Tensor, w: torch.Tensor) -> str:
    bad = (g != w).reshape(-1)
    n = int(bad.sum())
    return f"{n} of {bad.numel()} elements"


def _close(g: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> str | None:
    g64, w64, r64 = (t.detach().to(torch.float64) for t in (g, w, r))
    c = compare("out", g64, w64, r64)
    if c.ok:
        return None
    # Where float32 overflows or underflows (finite in float64, inf in float32, or the reverse),
    # eager float32 itself is the reference: the plain comparison with it, 1e-4 relative.
    if math.isfinite(c.vs_eager) and c.vs_eager <= 1e-4:
        return None
    # An absolute floor per element, for results that are zero or nearly so.
    from kiln.zoo.compare import diff

    n = max(1, g.numel())
    for ref in (r64, w64):
        d = diff(g64, ref)
        if math.isfinite(d) and d <= ATOL * math.sqrt(n):
            return None
    return f"relative error {c.error:.3g} (eager float32 {c.eager_error:.3g}, vs eager {c.vs_eager:.3g})"


# ------------------------------------------------------------------ running


def _eager64(sf: SampleFunction) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sf.call(*_clone_inputs(sf.tensors, torch.float64))
    except Exception:  # noqa: BLE001
        return None


def check_forward(sf: SampleFunction, backend: str, key: str) -> SampleResult:
    import kiln

    fn = sf.function()
    inputs = _clone_inputs(sf.tensors)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager = sf.call(*_clone_inputs(sf.tensors))
    except Exception as e:  # noqa: BLE001 (the sample itself fails in eager: nothing to check)
        return SampleResult("skip", f"eager fails: {_first_line(e)}")
    random = key in RANDOM_OPS or sf.info.name in RANDOM_OPS or sf.draws_random
    ref64 = None if random else _eager64(sf)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = kiln.compile(fn, tuple(inputs), strict=True, backend=backend)
            got = compiled(*_clone_inputs(sf.tensors))
    except Exception as e:  # noqa: BLE001
        return _classify_exception(e)
    problem = _same(got, eager, ref64, shapes_only=random)
    return SampleResult("wrong", problem) if problem else SampleResult("supported")


def _float_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in _outputs(out) if _is_tensor(t) and t.is_floating_point() and t.requires_grad]


def _grads(fn: Callable[..., Any], inputs: list[torch.Tensor], weights_seed: int) -> list[Any] | None:
    out = fn(*inputs)
    if not _float_outputs(out):
        return None
    gen = torch.Generator().manual_seed(weights_seed)
    loss = 0
    # one weight per floating output by position, whether or not it requires grad, so that
    # both sides weight each output alike even where they disagree on which require grad
    for o in _outputs(out):
        if not (_is_tensor(o) and o.is_floating_point()):
            continue
        w = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
        if o.requires_grad:
            loss = loss + (o * w).sum()
    diff_inputs = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(loss, diff_inputs, allow_unused=True)
    return [None if g is None else g.detach() for g in grads]


def check_gradient(sf: SampleFunction, backend: str = "reference") -> SampleResult:
    """Gradients through ``torch.compile(backend="kiln")`` against eager float32 and float64."""
    import torch._dynamo

    base = sf.info.name
    if base in EAGER_GRADIENT_BUGS:
        return SampleResult("skip", f"gradient not compared with eager: {EAGER_GRADIENT_BUGS[base]}", "gradient")
    fn = sf.function()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eager = _grads(sf.call, _clone_inputs(sf.tensors, requires_grad=True), 7)
    except Exception as e:  # noqa: BLE001
        return SampleResult("skip", f"eager gradient fails: {_first_line(e)}", "gradient")
    if not eager:
        return SampleResult("skip", "no differentiable output", "gradient")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref64 = _grads(sf.call, _clone_inputs(sf.tensors, torch.float64, requires_grad=True), 7)
    except Exception:  # noqa: BLE001
        ref64 = None
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(fn, backend="kiln", options={"strict": True, "backend": backend})
            got = _grads(compiled, _clone_inputs(sf.tensors, requires_grad=True), 7)
    except Exception as e:  # noqa: BLE001
        r = _classify_exception(_unwrap_dynamo(e))
        r.what = "gradient"
        return r
    finally:
        torch._dynamo.reset()
    if got is None or len(got) != len(eager):
        return SampleResult("wrong", "kiln's result has no gradient", "gradient")
    for i, (g, w) in enumerate(zip(got, eager)):
        r = ref64[i] if ref64 is not None and i < len(ref64) else None
        if w is None and g is None:
            continue
        if w is None or g is None:
            zero = (w if g is None else g)
            if bool((zero == 0).all()):
                continue
            return SampleResult("wrong", f"gradient {i}: {'missing' if g is None else 'unexpected'}",
                                "gradient")
        problem = _same_leaf(g, w, r, False)
        if problem:
            return SampleResult("wrong", f"gradient {i}: {problem}", "gradient")
    return SampleResult("supported", what="gradient")


def _unwrap_dynamo(e: BaseException) -> BaseException:
    """The kiln error behind a Dynamo ``BackendCompilerFailed`` (which wraps the backend's)."""
    seen = 0
    while seen < 8:
        inner = getattr(e, "inner_exception", None) or e.__cause__
        from kiln import KilnError

        if isinstance(e, KilnError) or inner is None:
            return e
        e = inner
        seen += 1
    return e


def _differentiable(info: Any) -> bool:
    return bool(getattr(info, "supports_autograd", False)) and \
        torch.float32 in info.supported_backward_dtypes("cpu")


def run_op(info: Any, backend: str, grads: bool | int = True, max_samples: int = MAX_SAMPLES,
           max_grad_samples: int = MAX_GRAD_SAMPLES, budget_s: float = OP_BUDGET_S) -> OpResult | None:
    """Check one OpInfo on ``backend``; ``None`` when it has no float32 samples."""
    key = op_key(info)
    start = time.perf_counter()
    try:
        if torch.float32 not in info.supported_dtypes("cpu"):
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = []
            for s in info.sample_inputs("cpu", torch.float32, requires_grad=False):
                samples.append(s)
                if len(samples) >= max_samples:
                    break
    except Exception as e:  # noqa: BLE001 (the database cannot make samples on this torch build)
        return OpResult(key, "skip", f"no samples: {_first_line(e)}")
    if not samples:
        return None
    results: list[SampleResult] = []
    for s in samples:
        results.append(check_forward(SampleFunction(info, s), backend, key))
        if time.perf_counter() - start > budget_s:
            break
    forward_ok = all(r.status in ("supported", "skip") for r in results)
    random = key in RANDOM_OPS or info.name in RANDOM_OPS
    if grads and forward_ok and not random and _differentiable(info):
        for s in [s for s in samples if not SampleFunction(info, s).draws_random][:max_grad_samples]:
            if time.perf_counter() - start > budget_s:
                break
            results.append(check_gradient(SampleFunction(info, s), backend))
    checked = [r for r in results if r.status != "skip"]
    seconds = time.perf_counter() - start
    if not checked:
        return OpResult(key, "skip", results[0].message if results else "", 0, seconds, results)
    for status in ("foreign", "wrong", "refused"):
        bad = [r for r in checked if r.status == status]
        if bad:
            what = "" if bad[0].what == "forward" else f"{bad[0].what}: "
            return OpResult(key, status, what + bad[0].message, len(checked), seconds, results)
    return OpResult(key, "supported", "", len(checked), seconds, results)


def sweep(backend: str = "reference", ops: Iterable[str] | None = None, grads: bool = True,
          max_samples: int = MAX_SAMPLES, progress: Callable[[OpResult], None] | None = None,
          infos: Sequence[Any] | None = None) -> list[OpResult]:
    """Run every OpInfo (or those named in ``ops``: names or ``name.variant`` keys), with
    the capture cache off unless ``KILN_CAPTURE_CACHE`` says otherwise (restored after)."""
    before = os.environ.get("KILN_CAPTURE_CACHE")
    os.environ.setdefault("KILN_CAPTURE_CACHE", "0")
    try:
        return _sweep(backend, ops, grads, max_samples, progress, infos)
    finally:
        if before is None:
            os.environ.pop("KILN_CAPTURE_CACHE", None)


def _sweep(backend: str, ops: Iterable[str] | None, grads: bool, max_samples: int,
           progress: Callable[[OpResult], None] | None, infos: Sequence[Any] | None) -> list[OpResult]:
    wanted = set(ops) if ops is not None else None
    results = []
    for info in infos if infos is not None else load_op_db():
        key = op_key(info)
        if wanted is not None and key not in wanted and info.name not in wanted:
            continue
        r = run_op(info, backend, grads=grads, max_samples=max_samples)
        if r is None or r.status == "skip":
            continue
        results.append(r)
        if progress is not None:
            progress(r)
    return results


def summary(results: Sequence[OpResult]) -> dict[str, int]:
    counts = Counter(r.status for r in results)
    return {"ops": len(results), **{s: counts.get(s, 0) for s in STATUSES}}


def summary_line(backend: str, results: Sequence[OpResult]) -> str:
    s = summary(results)
    pct = 100.0 * s["supported"] / s["ops"] if s["ops"] else 0.0
    return (f"{backend}: {s['ops']} ops with float32 samples: {s['supported']} supported ({pct:.1f}%), "
            f"{s['refused']} refused, {s['wrong']} wrong, {s['foreign']} foreign")


# ------------------------------------------------------------------ markdown

TABLE_BEGIN = "<!-- opdb table begin -->"
TABLE_END = "<!-- opdb table end -->"


def markdown_table(by_backend: dict[str, Sequence[OpResult]]) -> str:
    backends = list(by_backend)
    rows: dict[str, dict[str, OpResult]] = {}
    for b, results in by_backend.items():
        for r in results:
            rows.setdefault(r.op, {})[b] = r
    lines = ["Summary:", ""]
    lines += [f"- {summary_line(b, rs)}" for b, rs in by_backend.items()]
    lines += ["", "| op | " + " | ".join(backends) + " | reason |",
              "|---|" + "---|" * len(backends) + "---|"]
    for op in sorted(rows):
        cells = [rows[op][b].status if b in rows[op] else "" for b in backends]
        reasons = []
        for b in backends:
            r = rows[op].get(b)
            if r is not None and r.message and r.message not in reasons:
                reasons.append(r.message)
        reason = " / ".join(reasons).replace("|", "\\|")
        lines.append(f"| `{op}` | " + " | ".join(cells) + f" | {reason} |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str, by_backend: dict[str, Sequence[OpResult]]) -> None:
    """Replace the table between the markers of ``path`` (the whole file when it has none)."""
    table = markdown_table(by_backend)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = ""
    block = f"{TABLE_BEGIN}\n{table}{TABLE_END}"
    # the markers count only on lines of their own (prose may mention them)
    marked = re.compile(rf"^{re.escape(TABLE_BEGIN)}$.*?^{re.escape(TABLE_END)}$", re.DOTALL | re.MULTILINE)
    if marked.search(text):
        text = marked.sub(lambda _: block, text, count=1)
    else:
        text = text + ("\n" if text else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------ command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.zoo.opdb", description=__doc__.split("\n")[0])
    parser.add_argument("--backend", action="append", choices=["reference", "cpu"],
                        help="backend(s) to sweep (repeatable; default both)")
    parser.add_argument("--ops", help="comma-separated op names or name.variant keys")
    parser.add_argument("--samples", type=int, default=MAX_SAMPLES, help="samples per op")
    parser.add_argument("--no-grad", action="store_true", help="skip the gradient checks")
    parser.add_argument("--markdown", help="write the op table into this file (e.g. docs/ops.md)")
    parser.add_argument("--quiet", action="store_true", help="print only failures and the summary")
    opts = parser.parse_args(argv)
    backends = opts.backend or ["reference", "cpu"]
    ops = [o.strip() for o in opts.ops.split(",") if o.strip()] if opts.ops else None
    infos = load_op_db()
    by_backend: dict[str, list[OpResult]] = {}
    for backend in backends:
        def show(r: OpResult, backend: str = backend) -> None:
            if opts.quiet and r.status == "supported":
                return
            print(f"{backend:9} {r.status:9} {r.op:45} {r.seconds:5.1f}s  {r.message}", flush=True)

        start = time.perf_counter()
        by_backend[backend] = sweep(backend, ops, grads=not opts.no_grad, max_samples=opts.samples,
                                    progress=show, infos=infos)
        print(f"{summary_line(backend, by_backend[backend])} [{time.perf_counter() - start:.0f} s]",
              flush=True)
    if opts.markdown:
        write_markdown(opts.markdown, by_backend)
    bad = any(r.status in ("wrong", "foreign") for rs in by_backend.values() for r in rs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
