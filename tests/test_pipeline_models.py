"""The default pipeline and each of its passes on the shared test models, against eager."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

import kiln.ir as ir
from kiln.backends.reference import run_graph
from kiln.frontends.torch.capture import capture
from kiln.passes import DEFAULT_PIPELINE, PassManager, default_pipeline, parse_pipeline
from models import MODELS

MODEL_NAMES = ["mlp", "resnet18", "gpt2", "bert"]
REL_TOL = 1e-4
PIPELINE_PASSES = list(dict.fromkeys(p.spec() for p in parse_pipeline(DEFAULT_PIPELINE)))


@pytest.fixture(scope="module", params=MODEL_NAMES)
def model_case(request):
    builder, inputs_fn = MODELS[request.param]
    model = builder()
    args, kwargs = inputs_fn()
    captured = capture(model, args, kwargs)
    with torch.no_grad():
        expected = [t.detach().double().numpy() for t in pytree.tree_leaves(model(*args, **kwargs))]
    flat = pytree.tree_leaves((args, kwargs))
    inputs = [flat[i].detach().numpy() for i in captured.input_positions]
    params = [t.detach().numpy() for t in captured.params.values()]
    return request.param, captured.graph, inputs, params, expected


def _assert_matches_eager(name: str, graph: ir.Graph, inputs, params, expected) -> None:
    outputs = run_graph(graph, inputs, params)
    assert len(outputs) == len(expected)
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert got.shape == want.shape, f"{name} output {i}"
        scale = max(float(np.abs(want).max()), 1e-12)
        err = float(np.abs(got.astype(np.float64) - want).max()) / scale
        assert err <= REL_TOL, f"{name} output {i}: relative error {err:.2e}"


def _kernel_count(graph: ir.Graph) -> int | None:
    if importlib.util.find_spec("kiln.passes.fusion") is None:
        return None
    from kiln.passes.fusion import kernel_count

    return kernel_count(graph)


def test_default_pipeline_shrinks_or_keeps_and_matches_eager(model_case):
    name, graph, inputs, params, expected = model_case
    pm = default_pipeline(check_input_unchanged=True)
    result = pm.run(graph)
    before, after = len(graph.nodes), len(result.graph.nodes)
    kernels = _kernel_count(result.graph)
    print(f"\n{name}: {before} -> {after} nodes"
          + (f", {kernels} kernels" if kernels is not None else "") + "\n" + pm.report())
    assert after <= before
    _assert_matches_eager(name, result.graph, inputs, params, expected)
    again = default_pipeline().run(result.graph)
    assert not again.changed, f"{name}: the default pipeline is not at a fixpoint"


@pytest.mark.parametrize("pass_spec", PIPELINE_PASSES)
def test_each_pass_alone_matches_eager_and_is_idempotent(model_case, pass_spec):
    name, graph, inputs, params, expected = model_case
    result = PassManager(pass_spec, check_input_unchanged=True).run(graph)
    assert len(result.graph.nodes) <= len(graph.nodes)
    _assert_matches_eager(name, result.graph, inputs, params, expected)
    again = PassManager(pass_spec).run(result.graph)
    assert not again.changed, f"{pass_spec} changed {name} on its second run"
