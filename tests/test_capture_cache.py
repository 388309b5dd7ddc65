"""The capture cache: a warm kiln.compile skips torch.export and the passes, gives the same
graphs and outputs, binds the live model, and misses whenever what decides the trace changes."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
from kiln.frontends.torch.fingerprint import model_fingerprint
from kiln.runtime import cache as cache_mod

from models import MODELS


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KILN_CAPTURE_CACHE", raising=False)
    monkeypatch.delenv("KILN_DUMP_IR", raising=False)
    return tmp_path


def compile_ref(model, args, **kwargs):
    return kiln.compile(model, args, backend="reference", **kwargs)


def states(compiled) -> tuple[str, str]:
    return compiled.stats["capture_cache"], compiled.stats["passes_cache"]


def forbid_export(monkeypatch: pytest.MonkeyPatch) -> None:
    def export(*_, **__):
        raise AssertionError("a capture-cache hit must not trace the model")

    monkeypatch.setattr(torch.export, "export", export)


class Scaled(nn.Module):
    def __init__(self, features: int = 8, scale: float = 2.0):
        super().__init__()
        self.lin = nn.Linear(features, features)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


def seeded(make, seed: int = 0):
    torch.manual_seed(seed)
    return make().eval()


def test_hit_skips_export_and_passes_and_gives_identical_outputs(cache_dir, monkeypatch):
    model, x = seeded(Scaled), torch.randn(4, 8)
    first = compile_ref(model, (x,))
    assert states(first) == ("miss", "miss")
    forbid_export(monkeypatch)
    second = compile_ref(model, (x,))
    assert states(second) == ("hit", "hit")
    assert str(second.graph) == str(first.graph)
    assert [n.loc for n in second.graph.nodes] == [n.loc for n in first.graph.nodes]
    assert torch.equal(second(x), first(x))
    torch.testing.assert_close(second(x), model(x), rtol=1e-4, atol=1e-6)


def test_hit_binds_the_live_model(cache_dir, monkeypatch):
    x = torch.randn(4, 8)
    compile_ref(seeded(Scaled, 0), (x,))
    forbid_export(monkeypatch)
    other = seeded(Scaled, 1)  # same class and shapes, other weights: a hit on other's tensors
    compiled = compile_ref(other, (x,))
    assert states(compiled)[0] == "hit"
    torch.testing.assert_close(compiled(x), other(x), rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        other.lin.weight.mul_(-1)
    torch.testing.assert_close(compiled(x), other(x), rtol=1e-4, atol=1e-6)


def closing_over(op):
    class Binary(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return op(x, x.flip(0))

    return Binary


# name: (changed model, its example input); the base is seeded(Scaled) on randn(4, 8)
VARIANTS = {
    "attribute": (lambda: seeded(lambda: Scaled(scale=3.0)), (4, 8)),
    "param_shape": (lambda: seeded(lambda: Scaled(features=6)), (4, 6)),
    "input_shape": (lambda: seeded(Scaled), (5, 8)),
    "training_flag": (lambda: seeded(Scaled).train(), (4, 8)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_what_decides_the_trace_changes_the_key(cache_dir, variant):
    base = compile_ref(seeded(Scaled), (torch.randn(4, 8),))
    assert states(base)[0] == "miss"
    make, shape = VARIANTS[variant]
    model, x = make(), torch.randn(*shape)
    compiled = compile_ref(model, (x,))
    assert states(compiled)[0] == "miss"
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-6)


def test_classes_differing_only_in_their_closure_miss(cache_dir):
    x = torch.randn(3, 4)
    for op in (torch.add, torch.mul, torch.maximum):
        model = closing_over(op)()
        compiled = compile_ref(model, (x,))
        assert states(compiled)[0] == "miss", op
        torch.testing.assert_close(compiled(x), op(x, x.flip(0)))


def test_functions_differing_only_in_their_code_miss(cache_dir):
    x = torch.randn(3, 4)
    functions = [lambda a: a + 1, lambda a: a * 3]  # one source line, one qualified name
    for fn in functions:
        compiled = compile_ref(fn, (x,))
        assert states(compiled)[0] == "miss"
        torch.testing.assert_close(compiled(x), fn(x))


def test_transformers_model_hits_and_a_config_value_misses(cache_dir, monkeypatch):
    builder, inputs = MODELS["gpt2"]  # tied input/output embeddings
    model, ((ids,), _) = builder(), inputs()
    assert states(compile_ref(model, (ids,)))[0] == "miss"
    with monkeypatch.context() as patch:
        forbid_export(patch)
        warm = compile_ref(model, (ids,))
    assert states(warm) == ("hit", "hit")
    with torch.no_grad():
        torch.testing.assert_close(warm(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(**{**model.config.to_dict(), "layer_norm_epsilon": 0.5})
    torch.manual_seed(0)
    changed = GPT2LMHeadModel(config).eval()
    compiled = compile_ref(changed, (ids,))
    assert states(compiled)[0] == "miss"
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, changed(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("damage", ["truncate", "edit_body", "missing_param"])
def test_a_damaged_entry_is_a_miss_and_is_rebuilt(cache_dir, damage):
    model, x = seeded(Scaled), torch.randn(4, 8)
    compile_ref(model, (x,))
    (entry,) = cache_dir.glob("*.capture.json")
    text = entry.read_text()
    if damage == "truncate":
        entry.write_text(text[: len(text) // 2])
    elif damage == "edit_body":
        entry.write_text(text.replace("relu", "tanh"))
    else:  # a well-formed entry naming a parameter the model does not have
        document = json.loads(text)
        body = json.loads(document["body"])
        body["param_targets"] = {name: "no.such.param" for name in body["param_targets"]}
        document["body"] = json.dumps(body, sort_keys=True)
        document["sha256"] = cache_mod.digest(document["body"])
        entry.write_text(json.dumps(document))
    corrupt = cache_mod.DOCUMENT_COUNTERS["corrupt"]
    rebuilt = compile_ref(model, (x,))
    assert states(rebuilt)[0] == "miss"
    assert cache_mod.DOCUMENT_COUNTERS["corrupt"] == corrupt + (damage != "missing_param")
    torch.testing.assert_close(rebuilt(x), model(x), rtol=1e-4, atol=1e-6)
    assert states(compile_ref(model, (x,)))[0] == "hit"


def test_cache_off_switches(cache_dir, monkeypatch):
    model, x = seeded(Scaled), torch.randn(4, 8)
    off = kiln.compile(model, (x,), backend="cpu", cache=False, cache_dir=str(cache_dir / "c"))
    assert states(off) == ("off", "off")
    assert not (cache_dir / "c").exists()
    torch.testing.assert_close(off(x), model(x), rtol=1e-4, atol=1e-6)
    monkeypatch.setenv("KILN_CAPTURE_CACHE", "0")
    assert states(compile_ref(model, (x,))) == ("off", "off")
    assert not list(cache_dir.glob("*.capture.json"))


def test_models_the_fingerprint_cannot_see_are_always_traced(cache_dir):
    model, x = seeded(Scaled), torch.randn(4, 8)
    model.lin.register_forward_hook(lambda module, args, out: out * 2)
    for _ in range(2):
        compiled = compile_ref(model, (x,))
        assert states(compiled)[0] == "uncacheable"
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-6)


def test_only_describable_pipelines_are_cached(cache_dir):
    model, x = seeded(Scaled), torch.randn(4, 8)
    assert states(compile_ref(model, (x,), passes="cse,dce"))[1] == "miss"
    assert states(compile_ref(model, (x,), passes="cse,dce"))[1] == "hit"

    class Identity:
        def run(self, graph):
            return graph

    assert states(compile_ref(model, (x,), passes=Identity())) == ("hit", "off")


FINGERPRINT_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}]
from models import MODELS
from kiln.frontends.torch.fingerprint import model_fingerprint
builder, inputs = MODELS["gpt2"]
args, kwargs = inputs()
print(model_fingerprint(builder(), args, kwargs))
"""


def test_fingerprint_is_the_same_in_another_process():
    builder, inputs = MODELS["gpt2"]
    args, kwargs = inputs()
    here = model_fingerprint(builder(), args, kwargs)
    assert here is not None
    script = FINGERPRINT_SCRIPT.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         check=True, cwd=Path(__file__).parent.parent)
    assert out.stdout.strip().splitlines()[-1] == here


# ------------------------------------------------------------------ what the code reads
# Each case yields programs that differ only in what their code reads -- globals, closure
# cells, defaults, module attributes, called functions' globals -- changing the state
# between yields.  Every compile must give the eager answer of the program as it is then;
# the first program compiled twice must hit, so the cache is not simply off.
OP = torch.sin
SCALE = 2.0
FLAG = True
CONST = torch.arange(4.0)
CONFIG = types.SimpleNamespace(negate=False, power=2)
OPS = types.ModuleType("kiln_test_ops")
OPS.act = torch.sin


def uses_op(t):
    return OP(t)


def scaled(t):
    return t * SCALE


def calls_scaled(t):
    return scaled(t) + 1


def flagged(t):
    return t.exp() if FLAG else t.tanh()


def adds_const(t):
    return t + CONST


def configured(t):
    out = t ** CONFIG.power
    return -out if CONFIG.negate else out


def through_module_attribute(t):
    return OPS.act(t)


def helper(t):
    return t.sin()


def calls_helper(t):
    return helper(t) * 2


def _cos_body(t):
    return t.cos()


def reads_environment(t):
    return t.exp() if os.environ.get("KILN_TEST_BRANCH") == "exp" else t.sin()


class CallsGlobal(nn.Module):
    def forward(self, t):
        return calls_scaled(t).relu()


class CallsMethod(nn.Module):
    def forward(self, t):
        return self.branch(t) * 3

    def branch(self, t):
        return OP(t)


class Activation:
    def __init__(self, op):
        self.op = op

    def __call__(self, t):
        return self.op(t) + 1

    def apply(self, t):
        return self.op(t) - 1


def case_loop_over_a_global():  # the lambda reads the module global OP
    global OP
    for op in (torch.sin, torch.cos, torch.tanh):
        OP = op
        yield lambda t: OP(t)  # noqa: B023 -- reads the global as it is at the call
    OP = torch.sin


def case_global_rebinding():  # one function object; the global it reads is rebound
    global OP
    for op in (torch.sin, torch.cos):
        OP = op
        yield uses_op
    OP = torch.sin


def closing(o):
    return lambda t: o(t)


def case_lambda_in_a_loop():  # closure cells
    for op in (torch.sin, torch.cos, torch.exp):
        yield closing(op)


def case_closure():
    def make(k):
        def f(t):
            return t * k
        return f

    for k in (2.0, 3.0):
        yield make(k)


def case_default_argument():
    for op in (torch.sin, torch.cos):
        def f(t, act=op):
            return act(t)
        yield f


def weighted(t, op, w):
    return op(t) * w


def case_partial():
    for op, w in ((torch.sin, 2.0), (torch.sin, 3.0), (torch.cos, 3.0)):
        yield functools.partial(weighted, op=op, w=w)


def case_global_of_a_called_function():
    global SCALE
    for value in (2.0, 5.0):
        SCALE = value
        yield calls_scaled
    SCALE = 2.0


def case_module_forward_calls_a_global_function():
    global SCALE
    model = CallsGlobal()
    for value in (2.0, -1.0):
        SCALE = value
        yield model
    SCALE = 2.0


def case_method_reads_a_global():
    global OP
    for op in (torch.sin, torch.cos):
        OP = op
        yield CallsMethod()
    OP = torch.sin


def case_helper_edited():  # the helper's code is replaced in place
    original = helper.__code__
    try:
        yield calls_helper
        helper.__code__ = _cos_body.__code__
        yield calls_helper
    finally:
        helper.__code__ = original


def case_global_tensor_changed_in_place():
    yield adds_const
    CONST.mul_(-3)
    try:
        yield adds_const
    finally:
        CONST.div_(-3)


def case_global_config_flag():
    global FLAG
    for value in (True, False):
        FLAG = value
        yield flagged
    FLAG = True


def case_config_object_attribute():
    yield configured
    CONFIG.negate, CONFIG.power = True, 3
    try:
        yield configured
    finally:
        CONFIG.negate, CONFIG.power = False, 2


def case_module_attribute():  # torch.sin vs torch.cos behind a module's attribute
    for op in (torch.sin, torch.cos):
        OPS.act = op
        yield through_module_attribute
    OPS.act = torch.sin


def case_bound_method():
    for op in (torch.sin, torch.cos):
        yield Activation(op).apply


class HoldsCallable(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.act = act

    def forward(self, t):
        return self.act(t)


def case_callable_object():  # an object with __call__, whose state is a function
    for op in (torch.sin, torch.cos):
        yield HoldsCallable(Activation(op))


def case_environment_variable():
    old = os.environ.get("KILN_TEST_BRANCH")
    try:
        for branch in ("sin", "exp"):
            os.environ["KILN_TEST_BRANCH"] = branch
            yield reads_environment
    finally:
        if old is None:
            os.environ.pop("KILN_TEST_BRANCH", None)
        else:
            os.environ["KILN_TEST_BRANCH"] = old


READ_CASES = {name[len("case_"):]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


@pytest.mark.parametrize("case", list(READ_CASES))
def test_what_the_code_reads_decides_the_key(cache_dir, case):
    x = torch.randn(4)
    for i, program in enumerate(READ_CASES[case]()):
        if isinstance(program, nn.Module):
            program.eval()
        compiled = compile_ref(program, (x,), strict=True)
        assert states(compiled)[0] == ("miss" if i == 0 else states(compiled)[0])
        assert states(compiled)[0] != "uncacheable", case
        torch.testing.assert_close(compiled(x), program(x), rtol=1e-5, atol=1e-6, msg=f"{case} #{i}")
        if i == 0:  # the same program, unchanged: a hit
            again = compile_ref(program, (x,), strict=True)
            assert states(again)[0] == "hit", case
            torch.testing.assert_close(again(x), program(x), rtol=1e-5, atol=1e-6)


def test_the_first_example_in_one_process(cache_dir):
    x = torch.randn(5)
    results = []
    for op in (torch.sin, torch.cos):
        f = lambda t: op(t)  # noqa: B023 -- the closure cell holds the loop's op
        results.append(kiln.compile(f, (x,), backend="reference", strict=True)(x))
    torch.testing.assert_close(results[0], torch.sin(x))
    torch.testing.assert_close(results[1], torch.cos(x))


def test_what_cannot_be_described_is_uncacheable(cache_dir):
    x = torch.randn(4)
    opaque = types.SimpleNamespace(lock_free=object.__new__(type("Opaque", (), {"__slots__": ()})))

    def reads_opaque(t):
        return t + 1 if opaque.lock_free else t

    compiled = compile_ref(reads_opaque, (x,))
    assert states(compiled)[0] == "uncacheable"
    torch.testing.assert_close(compiled(x), x + 1)
    from kiln.frontends.torch.fingerprint import uncacheable_reason

    assert "Opaque" in uncacheable_reason(kiln.compiler.api.as_module(reads_opaque), (x,))


def test_cache_switch_is_independent_of_the_backend(cache_dir):
    model, x = seeded(Scaled), torch.randn(4, 8)
    assert states(compile_ref(model, (x,), cache=False)) == ("off", "off")
    assert not list(cache_dir.glob("*.capture.json"))
    folder = cache_dir / "elsewhere"
    assert states(compile_ref(model, (x,), cache_dir=str(folder)))[0] == "miss"
    assert list(folder.glob("*.capture.json"))
    assert states(compile_ref(model, (x,), cache_dir=str(folder)))[0] == "hit"
    # capture_cache=False: the capture cache off, the cpu backend's compile cache still on
    off = kiln.compile(model, (x,), backend="cpu", capture_cache=False)
    assert states(off) == ("off", "off")
    torch.testing.assert_close(off(x), model(x), rtol=1e-4, atol=1e-6)


# ------------------------------------------------- the cache switch is kiln's, not a backend's
def test_cache_switch_reaches_only_a_backend_that_has_a_cache():
    from kiln.backends import get_backend
    from kiln.frontends.options import CacheSwitch

    switch, rest = CacheSwitch.split({"cache": False, "cache_dir": "/tmp/k", "float64": True})
    assert switch == CacheSwitch(False, "/tmp/k") and rest == {"float64": True}
    assert switch.for_backend(get_backend("reference"), rest) == {"float64": True}
    assert switch.for_backend(get_backend("cpu"), {}) == {"cache": False, "cache_dir": "/tmp/k"}


def test_capture_cache_opens_from_the_switch_alone(cache_dir, monkeypatch):
    from kiln.frontends.torch.capture_cache import CaptureCache

    assert CaptureCache.open().enabled and not CaptureCache.open(False).enabled
    assert CaptureCache.open(directory=str(cache_dir / "d")).documents.directory == cache_dir / "d"
    monkeypatch.setenv("KILN_CAPTURE_CACHE", "0")
    assert not CaptureCache.open(True).enabled


def test_compile_train_accepts_the_cache_switch_with_the_reference_backend(cache_dir):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    step = kiln.compile_train(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), 0.1),
                              (x, y), backend="reference", cache=False, cache_dir=str(cache_dir / "t"))
    loss = step(x, y)
    assert torch.isfinite(torch.as_tensor(loss)).all()
    assert not (cache_dir / "t").exists()


def test_torch_compile_accepts_the_cache_switch_with_the_reference_backend(cache_dir):
    import torch._dynamo

    torch._dynamo.reset()
    model, x = seeded(Scaled), torch.randn(4, 8)
    fast = torch.compile(model, backend="kiln", dynamic=False,
                         options={"backend": "reference", "cache": False, "strict": True})
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_source_identity_covers_the_frontends(tmp_path, monkeypatch):
    """Capture code lives in kiln/frontends: changing it must change the passes-cache key."""
    from kiln.frontends.torch import fingerprint

    for rel in ("__init__.py", "ir/a.py", "passes/b.py", "frontends/torch/c.py", "compiler/d.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    monkeypatch.setattr(fingerprint, "_KILN_ROOT", tmp_path)

    def identity() -> str:
        fingerprint.kiln_source_identity.cache_clear()
        return fingerprint.kiln_source_identity()

    try:
        first = identity()
        (tmp_path / "frontends/torch/c.py").write_text("x = 2\n")
        assert identity() != first
        changed = identity()
        (tmp_path / "__init__.py").write_text('__version__ = "9"\n')  # the version lives here
        assert identity() != changed
    finally:
        fingerprint.kiln_source_identity.cache_clear()
