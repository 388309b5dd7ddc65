"""torch.compile(backend="kiln"): registration, options, fallback, eager paths, models."""

from __future__ import annotations

import importlib.metadata
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn
from torch.utils import _pytree as pytree

import kiln
from kiln.frontends.torch.dynamo import kiln_backend

from models import MODELS

REL_TOL = 1e-4


def assert_matches_eager(got, want) -> None:
    """Same output structure (container types, ModelOutput type and keys) and values."""
    assert type(got) is type(want)
    if hasattr(want, "keys"):
        assert list(got.keys()) == list(want.keys())
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"output {i}: {g.dtype}{tuple(g.shape)}"
        scale = max(w.double().abs().max().item(), 1e-12)
        err = (g.double() - w.double()).abs().max().item() / scale
        assert err <= REL_TOL, f"output {i}: relative error {err:.2e}"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()




class Recorder:
    """A Dynamo backend that delegates to kiln and keeps what kiln built."""

    def __init__(self, **options):
        self.options = options
        self.compiled = []

    def __call__(self, gm, example_inputs, **kwargs):
        fn = kiln_backend(gm, example_inputs, options=self.options)
        self.compiled.append(fn)
        return fn


@torch.library.custom_op("kiln_dynamo_test::roll_last", mutates_args=())
def roll_last(x: torch.Tensor) -> torch.Tensor:
    """An op kiln can never know: it is defined by this test file."""
    return torch.roll(x, 1, dims=-1)


@roll_last.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class WithUnsupportedOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> dict:
        h = torch.relu(self.a(x))
        h = roll_last(h) * 2  # the unsupported line
        return {"y": self.b(h).softmax(-1), "h": (h,)}


def fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, kiln.KilnFallbackWarning)]


# ------------------------------------------------------------------ models


@pytest.mark.parametrize("name", list(MODELS))
def test_models_match_eager_with_structure(name, kiln_runs):
    builder, inputs_fn = MODELS[name]
    model = builder()
    args, kwargs = inputs_fn()
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        expected = model(*args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(*args, **kwargs)
    assert fallback_warnings(caught) == []
    assert kiln_runs, "kiln did not run"
    assert_matches_eager(got, expected)


def test_params_are_graph_params_and_updates_are_seen(kiln_runs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.GELU(), nn.Linear(5, 3)).eval()
    x = torch.randn(4, 6)
    recorder = Recorder()
    compiled = torch.compile(model, backend=recorder)
    with torch.no_grad():
        assert_matches_eager(compiled(x), model(x))
        (graph,) = recorder.compiled[0].graphs
        assert len(graph.inputs) == 1
        assert len(graph.params) == 8  # 3 x (weight, bias) + 2 batch-norm statistics
        model[0].weight.mul_(-2.0)
        assert_matches_eager(compiled(x), model(x))
    assert len(kiln_runs) == 2


def test_options_pick_backend_and_its_options(kiln_runs):
    model = MODELS["mlp"][0]()
    x = MODELS["mlp"][1]()[0][0]
    compiled = torch.compile(model, backend="kiln", options={"backend": "reference", "float64": True})
    with torch.no_grad():
        assert_matches_eager(compiled(x), model(x))
    assert kiln_runs
    torch._dynamo.reset()
    bad = torch.compile(model, backend="kiln", options={"fast": True})
    with torch.no_grad(), pytest.raises(Exception, match=r"has no option\(s\) fast"):
        bad(x)


# ------------------------------------------------------------------ registration


def test_entry_point_is_registered():
    points = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert "kiln" in points.names, "install the dev tree with `pip install -e .`"
    assert points["kiln"].value == "kiln.frontends.torch.dynamo:kiln_backend"
    assert "kiln" in torch._dynamo.list_backends()


# ------------------------------------------------------------------ fallback


def test_unsupported_op_falls_back_with_one_warning(kiln_runs):
    torch.manual_seed(0)
    model, x = WithUnsupportedOp().eval(), torch.randn(3, 8)
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x)
        compiled(x)
        expected = model(x)
    messages = fallback_warnings(caught)
    assert len(messages) == 1
    assert "kiln_dynamo_test.roll_last.default x1" in messages[0]
    assert "test_dynamo.py" in messages[0] and "roll_last(h) * 2" in messages[0]
    assert len(kiln_runs) == 4  # two kiln partitions, called twice
    assert_matches_eager(got, expected)


def test_unsupported_op_strict_raises():
    torch.manual_seed(0)
    model, x = WithUnsupportedOp().eval(), torch.randn(3, 8)
    compiled = torch.compile(model, backend="kiln", options={"strict": True})
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(x)
    # Dynamo wraps backend errors; kiln's error is the inner one.
    inner = info.value.inner_exception
    assert isinstance(inner, kiln.UnsupportedOpError)
    assert inner.op == "kiln_dynamo_test.roll_last.default"
    assert "test_dynamo.py" in inner.source


# ------------------------------------------------------------------ eager paths


def test_graph_needing_grad_runs_kiln_forward_and_backward(kiln_runs):
    model = MODELS["mlp"][0]()
    x = MODELS["mlp"][1]()[0][0]
    compiled = torch.compile(model, backend="kiln")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(x)
    assert not fallback_warnings(caught)
    assert any(name.endswith(".forward") for name in kiln_runs)
    assert got.requires_grad
    got.sum().backward()
    assert any(name.endswith(".backward") for name in kiln_runs)
    assert model.fc1.weight.grad is not None
    torch.testing.assert_close(got, model(x))


def test_dynamic_shapes_compile_in_kiln_once(kiln_runs):
    fn = torch.compile(lambda a: a.relu() * 2, backend="kiln", dynamic=True)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (5, 9, 12):
            x = torch.randn(rows, 3)
            torch.testing.assert_close(fn(x), x.relu() * 2)
    assert not fallback_warnings(caught)
    assert len(kiln_runs) == 3 and len(set(kiln_runs)) == 1  # one kiln graph ran at every size
