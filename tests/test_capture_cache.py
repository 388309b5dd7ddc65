"""The capture cache: a warm kiln.compile skips torch.export and the passes, gives the same
graphs and outputs, binds the live model, and misses whenever what decides the trace changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
from kiln.compiler.fingerprint import model_fingerprint
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
from kiln.compiler.fingerprint import model_fingerprint
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
