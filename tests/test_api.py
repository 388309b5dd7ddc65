"""kiln.compile / kiln.capture, the compiled module, the backend registry, the runtime helpers."""

from __future__ import annotations

import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import kiln
from kiln.backends import BackendError, available_backends, get_backend
from kiln.compiler import demo
from kiln.ir import Graph
from kiln.runtime import CompiledModule, InputMismatchError, from_numpy, to_numpy

from models import MODELS

REL_TOL = 1e-4


# ----------------------------------------------------------------- helpers


def assert_matches_eager(got, want) -> None:
    """Same output structure (container types, ModelOutput type and keys) and values."""
    assert type(got) is type(want)
    if hasattr(want, "keys"):
        assert list(got.keys()) == list(want.keys())
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert isinstance(g, torch.Tensor), f"output {i} is {type(g).__name__}"
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}: {g.dtype}{tuple(g.shape)}"
        scale = max(w.double().abs().max().item(), 1e-12)
        err = (g.double() - w.double()).abs().max().item() / scale
        assert err <= REL_TOL, f"output {i}: relative error {err:.2e}"


@torch.library.custom_op("kiln_test::roll_last", mutates_args=())
def roll_last(x: torch.Tensor) -> torch.Tensor:
    """An op kiln can never know: it is defined by this test file."""
    return torch.roll(x, 1, dims=-1)


@roll_last.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class WithUnsupportedOp(nn.Module):
    """Linear -> relu -> (custom op) -> linear -> softmax, returning a dict with a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.relu(self.a(x))
        h = roll_last(h) * 2  # the unsupported line
        return {"y": self.b(h).softmax(-1), "h": (h,)}


def small_unsupported_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return WithUnsupportedOp().eval(), torch.randn(3, 8)


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, kiln.KilnFallbackWarning)]


# --------------------------------------------------------------- models


@pytest.fixture(scope="module", params=list(MODELS))
def compiled_case(request):
    builder, inputs_fn = MODELS[request.param]
    model = builder()
    args, kwargs = inputs_fn()
    compiled = kiln.compile(model, args, backend="reference", example_kwargs=kwargs)
    with torch.no_grad():
        expected = model(*args, **kwargs)
    return request.param, model, args, kwargs, compiled, expected


def test_models_match_eager_with_structure(compiled_case):
    _, _, args, kwargs, compiled, expected = compiled_case
    assert isinstance(compiled, CompiledModule)
    assert compiled.stats["fallback_ops"] == {}
    assert_matches_eager(compiled(*args, **kwargs), expected)
    assert isinstance(compiled.graph, Graph) and compiled.stats["calls"] >= 1


def test_default_pipeline_runs_on_compile(compiled_case):
    # kiln.compile runs kiln.passes.default_pipeline(): the graph it built is fused.
    name, model, args, kwargs, compiled, _ = compiled_case
    captured = kiln.capture(model, args, kwargs)
    assert "fused" in compiled.graph.op_histogram(), name
    assert len(compiled.graph.nodes) < len(captured.nodes), name


def test_function_compiles():
    def attention_scores(q, k, scale=0.5):
        s = (q @ k.transpose(-1, -2)) * scale
        return s.softmax(-1), {"max": s.amax(-1)}

    q, k = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    compiled = kiln.compile(attention_scores, (q, k), example_kwargs={"scale": 0.25})
    assert [v.name for v in compiled.graph.inputs] == ["q", "k"]
    assert_matches_eager(compiled(q, k, scale=0.25), attention_scores(q, k, scale=0.25))
    with pytest.raises(InputMismatchError, match=r"input 2 \('scale'\) was 0\.25 at compile time"):
        compiled(q, k, scale=0.5)


@pytest.mark.parametrize("fn, args, kwargs", [
    (torch.exp, (torch.randn(3, 17) * 20,), {}),
    (torch.nn.functional.gelu, (torch.randn(4, 5),), {"approximate": "tanh"}),
    (torch.add, (torch.randn(2, 3), torch.randn(2, 3)), {"alpha": 2.5}),
], ids=["torch.exp", "F.gelu", "torch.add"])
def test_builtin_function_compiles(fn, args, kwargs):
    # builtins have no signature torch.export could read; kiln forwards them through one
    compiled = kiln.compile(fn, args, example_kwargs=kwargs)
    assert_matches_eager(compiled(*args, **kwargs), fn(*args, **kwargs))
    assert compiled.graph.op_histogram(), fn


# --------------------------------------------------------------- inputs


@pytest.fixture(scope="module")
def compiled_gpt2_like():
    """A function with an int64 input, like a token-id model, compiled once."""
    def embed(input_ids, table):
        return table[input_ids].sum(-1)

    ids, table = torch.randint(0, 10, (1, 16)), torch.randn(10, 4)
    return kiln.compile(embed, (ids, table)), ids, table


@pytest.mark.parametrize("bad_args, pattern", [
    (lambda ids, t: (ids.to(torch.int32), t),
     r"kiln: input 0 \('input_ids'\) expects i64\[1, 16\] but got torch\.int32 tensor of shape "
     r"\(1, 16\); recompile with new example_inputs or pass a matching tensor"),
    (lambda ids, t: (ids[0], t), r"input 0 \('input_ids'\) expects i64\[1, 16\] but got torch\.int64 "
                                 r"tensor of shape \(16,\)"),
    (lambda ids, t: (ids, t[:5]), r"input 1 \('table'\) expects f32\[10, 4\] but got .* shape \(5, 4\)"),
    (lambda ids, t: (ids, t.tolist()),
     r"input 1 \('table'\) expects f32\[10, 4\] but got a nest structured as \[\[\*"),
    (lambda ids, t: (ids, 3), r"input 1 \('table'\) expects f32\[10, 4\] but got int 3"),
    (lambda ids, t: (ids,), r"expects 2 positional input\(s\) \(input_ids, table\) but got 1"),
    (lambda ids, t: (ids, t, t), r"expects 2 positional input\(s\) .* but got 3"),
])
def test_wrong_inputs_are_rejected_before_running(compiled_gpt2_like, bad_args, pattern):
    compiled, ids, table = compiled_gpt2_like
    calls = compiled.stats["calls"]
    with pytest.raises(InputMismatchError, match=pattern):
        compiled(*bad_args(ids, table))
    assert compiled.stats["calls"] == calls
    assert isinstance(InputMismatchError("x"), kiln.KilnError)


def test_unexpected_keyword_is_rejected(compiled_gpt2_like):
    compiled, ids, table = compiled_gpt2_like
    pattern = r"keyword arguments \[\] but is called with \['mask'\]"
    with pytest.raises(InputMismatchError, match=pattern):
        compiled(ids, table, mask=ids)


# --------------------------------------------------------------- params


def test_inplace_weight_update_is_seen():
    model = MODELS["mlp"][0]()
    x = MODELS["mlp"][1]()[0][0]
    compiled = kiln.compile(model, (x,))
    with torch.no_grad():
        model.fc1.weight.mul_(-0.5)
        model.fc3.bias.add_(1.0)
        expected = model(x)
    assert_matches_eager(compiled(x), expected)


def test_inplace_weight_update_is_seen_with_fallback():
    model, x = small_unsupported_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kiln.KilnFallbackWarning)
        compiled = kiln.compile(model, (x,))
    with torch.no_grad():
        model.b.weight.mul_(3.0)
        expected = model(x)
    assert_matches_eager(compiled(x), expected)


# ----------------------------------------------------------- unsupported ops


def test_unsupported_op_strict_raises_naming_op_and_line():
    model, x = small_unsupported_model()
    with pytest.raises(kiln.UnsupportedOpError, match=r"kiln_test\.roll_last") as info:
        kiln.compile(model, (x,), strict=True)
    assert info.value.op == "kiln_test.roll_last.default"
    assert "test_api.py" in info.value.source and "roll_last(h)" in info.value.source


def test_unsupported_op_falls_back_with_one_warning():
    model, x = small_unsupported_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = kiln.compile(model, (x,), passes=None)  # unfused, so the kiln ops are visible
        out = compiled(x)
        compiled(x)
    messages = fallback_warnings(caught)
    assert len(messages) == 1
    assert "kiln_test.roll_last.default x1" in messages[0]
    assert "test_api.py" in messages[0] and "roll_last(h) * 2" in messages[0]
    assert compiled.stats["fallback_ops"] == {"kiln_test.roll_last.default": 1}
    # linear+relu before the custom op and mul+linear+softmax after it run in kiln
    assert len(compiled.graphs) == 2
    assert {"matmul", "relu", "softmax"} <= set(compiled.stats["ops"])
    with pytest.raises(kiln.KilnError, match=r"split into 2 kiln graphs .* use \.graphs"):
        _ = compiled.graph
    with torch.no_grad():
        assert_matches_eager(out, model(x))


def test_capture_returns_graph_and_is_strict():
    model = MODELS["mlp"][0]()
    x = MODELS["mlp"][1]()[0][0]
    graph = kiln.capture(model, (x,))
    assert isinstance(graph, Graph)
    assert {v.name for v in graph.params} >= {"fc1.weight", "fc3.bias"}
    model, x = small_unsupported_model()
    with pytest.raises(kiln.UnsupportedOpError, match="roll_last"):
        kiln.capture(model, (x,))


# ----------------------------------------------------------- backends, passes


def test_backend_registry_errors_are_clear():
    assert "reference" in available_backends()
    with pytest.raises(BackendError, match=r"unknown kiln backend 'nope'; known backends: .*reference"):
        get_backend("nope")
    model = MODELS["mlp"][0]()
    x = MODELS["mlp"][1]()[0][0]
    with pytest.raises(BackendError, match=r"has no option\(s\) fast; .*float64=False"):
        kiln.compile(model, (x,), backend="reference", fast=True)


def test_reference_float64_option_keeps_dtypes():
    x = torch.randn(4, 6)
    compiled = kiln.compile(lambda a: (a.exp() * 3).sum(-1), (x,), backend="reference", float64=True)
    out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (x.exp() * 3).sum(-1), rtol=1e-5, atol=1e-5)


def test_passes_object_is_applied():
    seen: list[str] = []

    class CountingPass:
        def run(self, graph: Graph):
            seen.append(graph.name)
            return type("Result", (), {"graph": graph, "changed": False})()

    x = torch.randn(3, 3)
    compiled = kiln.compile(lambda a: a.relu() + 1, (x,), passes=CountingPass())
    assert len(seen) == 1
    torch.testing.assert_close(compiled(x), x.relu() + 1)
    piped = kiln.compile(lambda a: (a * 1.0).relu() + (a * 1.0).relu(), (x,), passes="cse,dce")
    torch.testing.assert_close(piped(x), x.relu() * 2)
    with pytest.raises(TypeError, match="passes must be"):
        kiln.compile(lambda a: a + 1, (x,), passes=42)


# ----------------------------------------------------------- runtime helpers


def test_tensor_numpy_conversion_is_zero_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    a = to_numpy(t.t())  # a strided view, no copy
    a[0, 1] = 100.0
    assert t[1, 0].item() == 100.0
    b = torch.randn(5).to(torch.bfloat16)
    nb = to_numpy(b)
    assert nb.dtype == np.dtype(ml_dtypes.bfloat16)
    assert torch.equal(from_numpy(nb), b)
    arr = np.ones(3, dtype=np.float32)
    assert from_numpy(arr).data_ptr() == arr.ctypes.data
    frozen = np.ones(3, dtype=np.float32)
    frozen.setflags(write=False)
    assert from_numpy(frozen).data_ptr() != frozen.ctypes.data  # copied, never writable through


def test_import_is_cheap():
    code = ("import sys, kiln; heavy = ('transformers', 'torch._dynamo');"
            "print(','.join(m for m in heavy if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
    assert kiln.__version__
    assert {"compile", "capture", "UnsupportedOpError", "KilnError"} <= set(kiln.__all__)


def test_demo_prints_an_honest_table(capsys):
    rows = demo.run(runs=2)
    text = capsys.readouterr().out
    assert "max rel err" in text and "eager ms" in text
    # every row states its ratio against eager in words, whichever way it goes
    assert text.count(" slower") + text.count(" faster") >= 2
    assert {r["model"] for r in rows} == {"mlp", "transformer block", "conv net", "moe router"}
    assert all(r["rel_err"] <= REL_TOL for r in rows)
